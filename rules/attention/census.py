"""No attention is missed in silence: once the pipeline is done, every Softmax still in the
graph that is an attention's gets a ``fuse-attention`` remark.

A Softmax over the last axis whose scores come from a MatMul product of two computed operands
(through at most :data:`SCORE_STEPS` scale, bias, mask, clamp, cast, soft-capping, sink or
layout nodes, or generated element-wise kernels of such ops) and whose probabilities are the
left operand of a MatMul is an attention.  When
``fuse-attention`` fused it, it is gone; when it refused it, that refusal names this Softmax
(its ``softmax`` argument).  Otherwise the rule never looked at it — its heads are not merged
by a Transpose after P·V, or its scores are not spelled the way stage 1 reads them — and
:func:`census` files the missed remark under ``fuse-attention``: stage ``1 (core)``, the scores
tensor, code ``unrecognized-layout`` and what was found instead.  It runs once, on the finished
graph (``graphopt.opt.rewrite.manager.FINAL_CHECKS``), only where fuse-attention ran.
"""

from __future__ import annotations

from graphopt.opt.graph.domains import GENERATED as FUSED_DOMAIN
from graphopt.opt.graph.ir import Constant, ModelIR, Node, Tensor
from graphopt.opt.rewrite.context import PassContext
from graphopt.opt.rewrite.manager import FINAL_CHECKS

RULE = "fuse-attention"
#: the rules that respell an attention for fuse-attention: their refusals and reverted
#: firings speak for it
UNFOLD = (
    "unfold-3d-attention",
    "unfold-3d-softmax",
    "unpack-folded-heads",
    "unsplit-spatial-merge",
    "unregroup-score-terms",
    "channel-first-attention",
    "fold-window-heads",
    "merge-context-term",
)
CORE = "1 (core)"
#: nodes between the scores' MatMul and the Softmax that the census follows back
SCORE_STEPS = 16
#: ops a score transform may be made of: scale, bias, mask, clamp (Max with the lowest
#: value), cast, soft-capping, a sink logit concatenated and the row maximum subtracted
#: (GPT-OSS), layout and banding (Longformer's chunks: Pad, Slice, ScatterND)
SCORE_OPS = frozenset(
    {
        *("Add", "Sub", "Mul", "Div", "Neg", "Where", "Cast", "Tanh", "Clip", "Max", "Min"),
        *("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Concat", "Slice", "Pad"),
        "ScatterND",
    }
)
#: nodes between the probabilities and the P·V MatMul that the census follows
PROB_STEPS = 10
#: ops that may stand between the probabilities and the P·V MatMul (a sink's column sliced
#: off, a head mask, banded probabilities padded back into chunks, the probabilities of
#: local and global keys split apart: PEGASUS-X)
PROB_OPS = frozenset(
    {"Where", "Cast", "Dropout", "Reshape", "Identity", "Slice", "Split", "Transpose", "Pad"}
    | {"Mul"}
)
MATMULS = frozenset({"MatMul", "FusedMatMul", "Einsum"})


def scores_matmul(softmax: Node) -> tuple[Node, list[str]] | None:
    """The MatMul whose product the Softmax's scores are, and the ops on the way, else None."""
    frontier: list[tuple[Tensor, list[str]]] = [(softmax.inputs[0], [])]
    seen: set[int] = set()
    for _ in range(SCORE_STEPS + 1):
        nxt = []
        for t, path in frontier:
            if isinstance(t, Constant) or not t.inputs or id(t) in seen:
                continue
            seen.add(id(t))
            p = t.inputs[0]
            if p.op in MATMULS and _computed_operands(p):
                return p, path
            if p.op in SCORE_OPS and not p.domain:
                nxt += [(i, [p.op, *path]) for i in p.inputs[:3] if i is not None and i.name]
            elif p.domain == FUSED_DOMAIN:  # a generated element-wise chain: every input
                nxt += [(i, [p.op, *path]) for i in p.inputs if i is not None and i.name]
        frontier = nxt
    return None


def _computed_operands(mm: Node) -> bool:
    """Whether two operands of the product are computed (q·kᵀ), not one a weight (logits): a
    constant of rank 3 or more is learned queries folded over the batch or heads, not a weight."""
    ops = [t for t in mm.inputs if t is not None]
    weights = [t for t in ops if isinstance(t, Constant) and len(t.shape or ()) < 3]
    return len(ops) - len(weights) >= 2


def pv_matmul(softmax: Node) -> Node | None:
    """The MatMul that reads the probabilities as its left operand (through PROB_OPS)."""
    frontier = [softmax.outputs[0]]
    for _ in range(PROB_STEPS):
        nxt = []
        for t in frontier:
            for r in t.outputs:
                if r.op in MATMULS and r.inputs and r.inputs[0] is t:
                    return r
                if (r.op in PROB_OPS and not r.domain) or r.domain == FUSED_DOMAIN:
                    nxt += r.outputs
        frontier = nxt
    return None


def _last_axis(softmax: Node) -> bool:
    axis = softmax.attrs.get("axis", -1)
    shape = softmax.inputs[0].shape
    return axis == -1 or (shape is not None and axis == len(shape) - 1)


def _merge(pv: Node) -> str:
    """What follows P·V (fuse-attention roots at a Transpose that merges the heads)."""
    readers = [r.op for r in pv.outputs[0].outputs if r.op != "Shape"]
    return ", ".join(readers) or "a graph output"


def census(ir: ModelIR, cx: PassContext) -> None:
    """File a missed ``fuse-attention`` remark for every attention Softmax of the main graph
    that the rule neither fused nor refused."""
    refusals = [m for r in (RULE, *UNFOLD) for m in cx.misses.get(r, ())]
    said = {m.args.get("softmax") for m in refusals}
    # a fusion a safety net reverted has its own remark (slower-on-target, parity-failure)
    said |= {n.name for r in (RULE, *UNFOLD) for ns in cx.withheld.get(r, ()) for n in ns}
    for node in ir.graph.nodes:
        if node.op != "Softmax" or node.domain or node.name in said or not _last_axis(node):
            continue
        found = scores_matmul(node)
        pv = pv_matmul(node) if found is not None else None
        if pv is None:
            continue  # not an attention
        qk, path = found
        steps = " → ".join(path) if path else "nothing"
        sink = _sink(node)
        why = (
            f"the scores get a sink column before the Softmax (Concat of '{sink.name}' on the "
            "last axis) that is sliced off after it: a learned logit per head, read back "
            "from the P·V and head-merging Transpose, which this attention does not have"
            if sink is not None
            else "not the P·V and head-merging Transpose fuse-attention reads an attention "
            "back from"
        )
        cx.remark(
            "missed",
            "attention-census",
            RULE,
            "unrecognized-layout",
            [node.name],
            f"stage {CORE}: the Softmax '{node.name}' over the product of {qk.op} '{qk.name}' "
            f"(then {steps}) feeds {pv.op} '{pv.name}', which is followed by {_merge(pv)}: " + why,
            stage=CORE,
            tensor=node.inputs[0].name,
            softmax=node.name,
        )


def _sink(softmax: Node) -> Tensor | None:
    """The sink column of attention sinks (GPT-OSS): the Softmax's scores are
    ``Concat([scores, sink], -1)`` (the row maximum perhaps subtracted first), the sink one
    column wide; None otherwise."""
    z = softmax.inputs[0]
    sub = z.inputs[0] if z.inputs and z.inputs[0].op == "Sub" else None
    if sub is not None:
        z = sub.inputs[0]
    cat = z.inputs[0] if z.inputs and z.inputs[0].op == "Concat" else None
    if cat is None or len(cat.inputs) != 2 or cat.attrs.get("axis") not in (-1, 3):
        return None
    sink = cat.inputs[1]
    last = sink.shape[-1] if sink.shape else None
    if isinstance(last, int) and last != 1:
        return None
    p = softmax.outputs[0]  # its column is sliced off the probabilities (through Casts)
    while len(p.outputs) == 1 and p.outputs[0].op == "Cast":
        p = p.outputs[0].outputs[0]
    return sink if any(r.op == "Slice" for r in p.outputs) else None


FINAL_CHECKS[RULE] = census

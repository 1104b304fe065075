"""Spellings of the context P·V that fuse-attention reads once rewritten, exactly.

DiffLlama (differential attention, transformers 5) multiplies one Softmax by the two halves of
its value heads and concatenates the merged contexts::

    Concat(Transpose(P·V₁, (0,2,1,3)), Transpose(P·V₂, (0,2,1,3)), axis=-1)

``concat-shared-contexts`` writes it ``Transpose(P·Concat(V₁, V₂, axis=-1), (0,2,1,3))``: each
element is the same dot product of the same row of P with the same column of a value, so it
is exact, and ``fuse-attention`` then reads one attention with a value head twice as wide (the
differential subtraction and the per-head norm after it stay as the model computes them).

Nyströmformer adds a depthwise convolution of the values to the context before the heads
merge, ``Transpose(P·V + conv(V), (0,2,1,3))``; ``merge-context-term`` writes it
``Transpose(P·V, perm) + Transpose(conv(V), perm)`` (an element-wise op commutes with a
permutation of both operands: exact), and the attention is the merged P·V.  It fires only
where a kernel and the cost bound would take the attention (else the refusal is said here).

Qwen2.5-VL's vision tower attends within windows: the sequence is split, each window is an
attention, and the contexts are concatenated along the sequence before one merge,
``Transpose(Concat(P₁·V₁, …, axis=2), (0,2,1,3))``; ``split-window-contexts`` writes it
``Concat(Transpose(P₁·V₁, perm), …, axis=1)`` (a permutation of a concatenation is the
concatenation of the permuted parts along the permuted axis: exact), so each window's
attention has its own merge.
"""

from __future__ import annotations

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import rank
from graphopt.opt.graph.ir import Node, Tensor, dtype_of
from graphopt.opt.rewrite.engine import Match, NoMatch, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from ..activation import inputs, no_match, producer, scalar
from .core import MERGE_LAYOUTS, nan_guard, scores_folded, sink_gate
from .unfold3d import check_pays, require_attention_kernel, static_dim


def _context(t: Tensor) -> tuple[Node | None, Node] | None:
    """(the Transpose or None, the MatMul P·V) computing ``t``, each read only on that path."""
    tr = producer(t, "Transpose")
    mm = producer(inputs(tr)[0] if tr is not None else t, "MatMul")
    if mm is None or len(mm.outputs[0].outputs) != 1 or (tr is not None and len(t.outputs) != 1):
        return None
    if softmax_of(inputs(mm)[0]) is None:
        return None
    return tr, mm


def softmax_of(p: Tensor) -> Node | None:
    """The Softmax computing the probabilities ``p``, also through the NaN guard of SDPA
    exports (``Where(IsNaN(P), 0, P)``); else None."""
    guard = nan_guard(p)
    return producer(inputs(guard[0])[2] if guard is not None else p, "Softmax")


@register_rule
class ConcatSharedContexts(Rule):
    name = "concat-shared-contexts"
    pattern = Op("Concat", "concat")
    phase = "attention"
    priority = 1  # before fuse-attention reads the context
    summary = "Concat(P·V₁, P·V₂) on the last axis → P·Concat(V₁, V₂) (one attention)"

    def match(self, node, cx):
        parts = [_context(t) for t in inputs(node)]
        r = rank(node.outputs[0])
        if len(parts) < 2 or any(p is None for p in parts) or r is None:
            raise no_match()
        if node.attrs.get("axis") not in (-1, r - 1):
            raise no_match()
        perms = {tuple(tr.attrs.get("perm", ())) if tr is not None else None for tr, _ in parts}
        perm = next(iter(perms))
        if len(perms) != 1 or (perm is not None and perm[-1] != r - 1):
            raise no_match()  # the same merge, keeping the last axis last
        probs = {id(inputs(mm)[0]) for _, mm in parts}
        values = [inputs(mm)[1] for _, mm in parts]
        if len(probs) != 1 or any(rank(v) != r for v in values):
            raise no_match()
        dims = current_dims()
        lead = {tuple(dims.key(v, i) for i in range(r - 1)) for v in values}
        if len(lead) != 1 or len({dtype_of(v) for v in values}) != 1:
            raise no_match()  # the values broadcast alike
        bound = {"concat": node}
        for i, (tr, mm) in enumerate(parts):
            bound[f"mm{i}"] = mm
            if tr is not None:
                bound[f"tr{i}"] = tr
        m = Match(node, bound)
        m.stash(probs=inputs(parts[0][1])[0], values=values, perm=perm, axis=r - 1)
        return m

    def rewrite(self, m, b):
        name = m.root.name or "Concat"
        v = b.op("Concat", m.values, {"axis": m.axis}, name=f"{name}/values")
        v.dtype, v.shape = dtype_of(m.values[0]), _joined(m.values)
        ctx = b.op("MatMul", [m.probs, v], name=f"{name}/context")
        ctx.dtype = dtype_of(m.root.outputs[0])
        p, vs = m.probs.shape, v.shape
        if p is not None and vs is not None and len(p) == len(vs):
            ctx.shape = [*p[:-1], vs[-1]]
        if m.perm is None:
            ctx.shape = m.root.outputs[0].shape
            return [ctx]
        out = m.root.outputs[0]
        return [b.op("Transpose", [ctx], {"perm": list(m.perm)}, like=out, name=f"{name}/merge")]


@register_rule
class SplitWindowContexts(Rule):
    name = "split-window-contexts"
    pattern = Op("Transpose", "merge")
    phase = "attention"
    priority = 1  # before fuse-attention reads the contexts
    summary = "merge(Concat(P₁·V₁, P₂·V₂) on the sequence) → Concat(merge(P₁·V₁), merge(P₂·V₂))"

    def match(self, node, cx):
        perm = tuple(node.attrs.get("perm", ()))
        cat = producer(inputs(node)[0], "Concat")
        if perm not in MERGE_LAYOUTS or cat is None or len(cat.outputs[0].outputs) != 1:
            raise no_match()
        if len(inputs(cat)) < 2 or cat.attrs.get("axis") not in (2, -2):
            raise no_match()  # windows of the sequence of [B,N,S,H] contexts
        for t in inputs(cat):
            found = _context(t)
            if found is None or found[0] is not None or rank(t) != 4:
                raise no_match()
        m = Match(node, {"merge": node, "concat": cat})
        m.stash(parts=inputs(cat), perm=list(perm), axis=perm.index(2))
        return m

    def rewrite(self, m, b):
        name = m.root.name or "Transpose"
        merged = []
        for i, t in enumerate(m.parts):
            y = b.op("Transpose", [t], {"perm": m.perm}, name=f"{name}/window{i}")
            y.dtype = dtype_of(t)
            if t.shape is not None:
                y.shape = [t.shape[p] for p in m.perm]
            merged.append(y)
        out = m.root.outputs[0]
        return [b.op("Concat", merged, {"axis": m.axis}, like=out, name=f"{name}/windows")]


def _joined(values: list[Tensor]) -> list | None:
    """The shape of ``values`` concatenated on the last axis (its width None where one is
    not static)."""
    shapes = [v.shape for v in values]
    if any(s is None for s in shapes):
        return None
    widths = [s[-1] for s in shapes]
    width = sum(widths) if all(isinstance(w, int) for w in widths) else None
    return [*shapes[0][:-1], width]


#: element-wise ops that commute with a permutation of both operands
_ELEMENTWISE = ("Add", "Sub", "Mul", "Div")


@register_rule
class MergeContextTerm(Rule):
    name = "merge-context-term"
    pattern = Op("Transpose", "merge")
    phase = "attention"
    priority = 1  # before fuse-attention reads the context
    summary = "Transpose(P·V + t) → Transpose(P·V) + Transpose(t) (the merged P·V fuses)"

    def match(self, node, cx):
        perm = tuple(node.attrs.get("perm", ()))
        op = producer(inputs(node)[0], _ELEMENTWISE)
        if perm not in MERGE_LAYOUTS or op is None or len(op.outputs[0].outputs) != 1:
            raise no_match()
        if sink_gate(inputs(node)[0]) is not None:
            raise no_match()  # attention sinks as a gate: fuse-attention reads them
        ins = inputs(op)
        found = [i for i, t in enumerate(ins) if _context(t) is not None and _context(t)[0] is None]
        if not found:
            raise no_match()
        at = found[0]  # both: P times a value plus P times something else, refused below
        ctx, other = ins[at], ins[1 - at]
        if rank(ctx) != 4 or not (rank(other) == 4 or scalar(other) is not None):
            raise no_match()
        if dtype_of(other) != dtype_of(ctx):
            raise no_match()
        mm = producer(ctx, "MatMul")
        sm = softmax_of(inputs(mm)[0])
        if scores_folded(inputs(sm)[0]):
            raise no_match()  # a FusedMatMul fold took the scores after this rule refused
        probs = inputs(mm)[0]
        others = [r.name for r in probs.outputs if r is not mm and r.op != "Shape"]
        guard = nan_guard(probs)
        if guard is not None:  # the guard's own IsNaN and Where read P too
            others += [r.name for r in sm.outputs[0].outputs if r not in guard]
        if others:
            raise NoMatch(
                "shared-intermediate",
                f"stage 1 (core): the probabilities '{probs.name}' are also read by "
                f"{', '.join(others)}, outside P·V (a term computed from P itself, as NeZHa's "
                "value-side relative positions P·Rᵥ): no attention kernel returns P",
                softmax=sm.name,
                stage="1 (core)",
                tensor=probs.name,
            )
        require_attention_kernel(cx, ctx, sm)
        check_pays(cx, sm, static_dim(sm.outputs[0], -1), sm.outputs[0])
        m = Match(node, {"merge": node, "op": op})
        m.stash(ctx=ctx, other=other, at=at, perm=list(perm))
        return m

    def rewrite(self, m, b):
        name, out = m.root.name or "Transpose", m.root.outputs[0]
        parts = []
        for role, t in (("context", m.ctx), ("term", m.other)):
            if rank(t) != 4:  # a scalar: the same under any permutation
                parts.append(t)
                continue
            p = b.op("Transpose", [t], {"perm": m.perm}, name=f"{name}/{role}")
            p.dtype = dtype_of(t)
            if t.shape is not None and len(t.shape) == 4:
                p.shape = [t.shape[i] for i in m.perm]
            parts.append(p)
        ins = parts if m.at == 0 else parts[::-1]
        return [b.op(m.op.op, ins, like=out, name=f"{name}/merged_{m.op.op.lower()}")]

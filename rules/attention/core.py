"""Stage 1 (core): the scaled-dot-product core, read back from the heads' merge.

::

    scores = MatMul(Q·c_q, Kᵀ·c_k) [÷ c | · c]                        scale = c_q·c_k·c
    capped = scores | tanh(scores ÷ cap) · cap                  (logit soft-capping, Gemma 2)
    z      = capped [+ bias …] | Where(cond, capped [+ bias …], −big) [+ bias …]
             [→ Swin's window regroup: Reshape(Reshape(z, [b,nW,N,S,T]) + W, [B,N,S,T])]
    P      = Softmax(z) [→ Where(IsNaN(P), 0, P)]        (SDPA exports of transformers ≥ 4.48)
             [→ Where(cond, 0, P)]   (XSoftmax: DeBERTa, SEW-D; cond the mask Where's, [B,1,S,T])
             | Slice(Softmax(Concat([z, sink]) [− ReduceMax]), 0:−1)   (attention sinks, GPT-OSS)
    ctx    = MatMul(P, V) [· Unsqueeze(Sigmoid(ReduceLogSumExp(z) [− sink]), −1)]
             (the same sinks as a gate on the context, Granite's sliding-window decoders)
             [→ Reshape to itself]
    out    = Transpose(ctx, (0,2,1,3) | (2,0,1,3))                       the rule's root

Batch and heads may be folded into one axis around the Softmax (bmm-style exports: Bloom,
DeBERTa): ``z = Reshape(s3 [+ term3 …], [B,N,S,T])``, ``P3 = Reshape(P, [B·N,S,T])``,
``ctx = Reshape(MatMul(P3, V3), [B,N,S,H])``, with ``s3`` the scaled ``MatMul(Q3, K3ᵀ)`` and
each of Q3, K3, V3 a Reshape of [B,N,·,H] heads to [B·N,·,H] (:class:`FoldedHeads`); the core
then names the 4-D heads, and the [B·N,…] terms are unfolded into the bias.

:func:`match_core` returns a typed :class:`Core` or raises: silently (``structure``) when there
is no Softmax between two MatMuls, else a missed ``unrecognized-layout`` that names stage 1 and
the tensor whose spelling is unknown.  The additive terms are kept in order; which of them are
masks the later stages decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphopt.opt.graph.dims import arith, rank, shape_elements
from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.domains import MS, norm_domain
from graphopt.opt.graph.ir import Node, Tensor, constant_value
from graphopt.opt.rewrite.engine import NoMatch

from ..activation import inputs, no_match, producer, scalar

MERGE_LAYOUTS = {(0, 2, 1, 3): "bsd", (2, 0, 1, 3): "sbd"}
#: the "perm" of a context that no Transpose merges: it stays [B,N,S,H], read per head
PER_HEAD = (0, 1, 2, 3)
_LAYOUTS = {**MERGE_LAYOUTS, PER_HEAD: "bnsh"}
#: what a scale multiplies, never is
_SCALED = ("MatMul", "Transpose", "Reshape", "Gather", "Squeeze")
_MAX_TERMS = 4  # additive bias terms between the scores and the Softmax


@dataclass
class Factor:
    """One constant factor of the attention scale: ``value`` multiplies, or divides."""

    value: Tensor
    divides: bool
    node: Node


@dataclass
class FoldedHeads:
    """Batch and heads folded into one axis around the Softmax: the Reshapes of the scores to
    [B,N,S,T] and of the probabilities back to [B·N,S,T] (None where P·V is per head: the
    scores alone are folded, GPT-NeoX's ``baddbmm``), and the additive terms of the folded
    scores (innermost first).  ``k_plain``: the key found is K [B,N,T,H], not Kᵀ."""

    probs: Node | None
    scores: Node | None = None
    terms: list[Tensor] = field(default_factory=list)
    term_adds: list[Node] = field(default_factory=list)
    k_plain: bool = False


@dataclass
class SoftCap:
    """Logit soft-capping ``Mul(Tanh(Div(s, cap) | Mul(s, 1/cap)), cap)`` of the scaled scores."""

    cap: float
    nodes: list[Node]  # consumers first: the outer Mul, the Tanh, the inner Div or Mul


@dataclass
class Sink:
    """Attention sinks (GPT-OSS): a learned logit per head concatenated to every row of the
    scores, the row maximum perhaps subtracted, and its column sliced off the probabilities —
    ``exp(sᵢ) / (Σ exp(sⱼ) + exp(sinkₙ))``, GroupQueryAttention's ``head_sink``.  A sink
    computed per query row (Inkling 2: a projection of the token, [B,N,S,1]) is ``column``."""

    values: np.ndarray | None  # one logit per head, or one for all; None for a column
    nodes: list[Node]  # consumers first: the Slice, [the Sub, the ReduceMax,] the Concat
    gate: bool = False  # spelled as a gate on P·V: the Mul, Unsqueeze, Sigmoid, Sub, LSE
    column: Tensor | None = None  # the computed sink logits [B|1,N|1,S,1] of every row


@dataclass
class WindowRegroup:
    """Swin's ``merge(split(z) + mask [+ mask …])`` around the per-window masks ``masks``
    (Swin v2 adds its mask twice); ``adds`` consumers first."""

    split: Node
    adds: list[Node]
    merge: Node
    masks: list[Tensor]


@dataclass
class Core:
    """The recognized core; every node in ``nodes()`` belongs to the fusion."""

    root: Node  # the Transpose merging the heads (the P·V MatMul of a context read per head)
    out_layout: str  # "bsd" | "sbd" | "bnsh"
    pv: Node
    softmax: Node
    qk: Node
    q: Tensor  # operands of Q·Kᵀ and P·V with the scale stripped: [B,N,S,H], [B,N,H,T], [B,N,T,H]
    kt: Tensor
    v: Tensor
    scores: Tensor  # Q·Kᵀ
    probs: Tensor  # Softmax output
    ctx: Tensor  # P·V
    factors: list[Factor] = field(default_factory=list)
    terms: list[Tensor] = field(default_factory=list)  # additive bias terms, innermost first
    term_adds: list[Node] = field(default_factory=list)
    where: Node | None = None  # Where(cond, scores, fill) masking, or Where(cond, fill, scores)
    inner_adds: list[Node] = field(default_factory=list)  # the Adds of terms under the Where
    where_fills_true: bool = False  # the second spelling: the fill where ``cond`` holds
    window: WindowRegroup | None = None
    softcap: SoftCap | None = None
    mask_mul: Node | None = None  # the scores times a 0/1 mask (with an additive fill)
    sink: Sink | None = None
    fold: FoldedHeads | None = None
    nan_guard: tuple[Node, Node] | None = None  # (Where, IsNaN)
    row_guard: Node | None = None  # Where(cond, 0, P): rows the mask masks wholly made 0
    mid_reshape: Node | None = None
    clamp: Node | None = None  # Max(masked scores, lowest float): absorbed, see unclamped

    def nodes(self) -> list[Node]:
        """The core's nodes, consumers first."""
        found = [self.root]
        found += [self.mid_reshape] if self.mid_reshape is not None else []
        gate = self.sink is not None and self.sink.gate
        found += self.sink.nodes if gate else []
        found += [self.pv] + (list(self.nan_guard) if self.nan_guard else [])
        found += [self.fold.probs] if self.fold is not None and self.fold.probs else []
        found += self.sink.nodes[:1] if self.sink is not None and not gate else []
        found += [self.row_guard] if self.row_guard is not None else []
        found += [self.softmax]
        found += self.sink.nodes[1:] if self.sink is not None and not gate else []
        if self.window is not None:
            found += [self.window.merge, *self.window.adds, self.window.split]
        found += [self.clamp] if self.clamp is not None else []
        found += self.term_adds[::-1] + ([self.where] if self.where is not None else [])
        found += self.inner_adds[::-1]
        if self.fold is not None:
            found += [self.fold.scores] if self.fold.scores is not None else []
            found += self.fold.term_adds[::-1]
        found += [self.mask_mul] if self.mask_mul is not None else []
        found += self.softcap.nodes if self.softcap is not None else []
        return found + [f.node for f in self.factors] + [self.qk]


def unrecognized(stage: str, message: str, softmax: Node, tensor: Tensor | None) -> NoMatch:
    """A missed remark for an attention whose spelling is not known, naming its stage, its
    tensor and its Softmax (rules of later phases look refusals up by the Softmax)."""
    return NoMatch(
        "unrecognized-layout",
        f"stage {stage}: {message}",
        stage=stage,
        tensor=tensor.name if tensor is not None else None,
        softmax=softmax.name,
    )


def match_core(root: Node) -> Core:
    """Stage 1 from the heads' merging Transpose ``root`` (or the P·V MatMul itself, for a
    context read per head: layout ``bnsh``)."""
    if root.op == "MatMul":
        perm, ctx, mid, gate, pv = PER_HEAD, root.outputs[0], None, None, root
    else:
        perm = tuple(root.attrs.get("perm", ()))
        ctx = inputs(root)[0]
        mid = producer(ctx, "Reshape")
        out = inputs(mid)[0] if mid is not None else ctx
        gate = sink_gate(out)
        pv = producer(gate[0] if gate is not None else out, "MatMul")
    if pv is None:
        raise no_match()
    probs, v = inputs(pv)
    guard = nan_guard(probs)
    p = inputs(guard[0])[2] if guard else probs
    row_guard, p = _row_guard(p)
    sliced = _sink_slice(p)
    p = inputs(sliced)[0] if sliced is not None else p
    sm, fold = producer(p, "Softmax"), None
    if sm is None:  # batch and heads folded around the Softmax: P3 = Reshape(P [B,N,S,T])
        unfold = producer(p, "Reshape")
        p4 = inputs(unfold)[0] if unfold is not None else None
        if row_guard is None:
            row_guard, p4 = _row_guard(p4)
        sm = producer(p4, "Softmax")
        if sm is None or rank(p) != 3 or rank(sm.outputs[0]) != 4:
            raise no_match()
        fold = FoldedHeads(unfold)
    # Softmax between two MatMuls: attention; an unknown spelling from here on is a missed remark
    if perm not in _LAYOUTS or rank(ctx) not in (None, 4):
        raise no_match()  # not a head merge: e.g. a channel attention over [B, C, HW]
    z = inputs(sm)[0]
    if fold is None and rank(sm.outputs[0]) == 3:
        raise no_match()  # a Softmax over folded scores: unfold-3d-softmax unfolds it first
    if scores_folded(z):
        raise no_match()  # a FusedMatMul fold took it after this rule refused it
    core = Core(
        root=root,
        out_layout=_LAYOUTS[perm],
        pv=pv,
        softmax=sm,
        qk=pv,  # set by _peel_scores, with q, kt and scores
        q=z,
        kt=z,
        v=v,
        scores=z,
        probs=sm.outputs[0],
        ctx=pv.outputs[0],
        nan_guard=guard,
        row_guard=row_guard,
        mid_reshape=mid,
        fold=fold,
    )
    if sliced is not None:
        z = _peel_sink(core, sliced, z)
    elif gate is not None:
        _take_gate(core, gate, z)
    _peel_scores(core, z)
    if row_guard is not None:
        _check_row_guard(core)
    if core.fold is not None:
        _unfold_heads(core)
    return core


def _sink_slice(p: Tensor) -> Node | None:
    """``Slice(P, 0, −1)`` on the last axis of 4-D probabilities (a sink's column cut off)."""
    sl = producer(p, "Slice")
    if sl is None or rank(p) not in (None, 4) or len(inputs(sl)) < 4:
        return None
    vals = [constant_value(t) for t in inputs(sl)[1:5]]
    if any(v is None or v.size != 1 for v in vals[:3]):
        return None
    steps = vals[3] if len(vals) > 3 else None
    if int(vals[0].item()) != 0 or int(vals[1].item()) != -1 or int(vals[2].item()) not in (-1, 3):
        return None
    return sl if steps is None or (steps.size == 1 and int(steps.item()) == 1) else None


def _peel_sink(core: Core, sliced: Node, z: Tensor) -> Tensor:
    """Fill ``core.sink`` from the Softmax input ``z`` = ``Concat([scores, sink], −1)``, the row
    maximum perhaps subtracted first; returns the scores.  The sink column is a constant with
    one value per head or one for all, broadcast to [B,N,S,1] (by an Expand)."""
    nodes = [sliced]
    sub = producer(z, "Sub")
    if sub is not None and _row_max(inputs(sub)[1], inputs(sub)[0]) is not None:
        nodes += [sub, producer(inputs(sub)[1], "ReduceMax")]
        z = inputs(sub)[0]
    cat = producer(z, "Concat")
    if cat is None or len(inputs(cat)) != 2 or cat.attrs.get("axis") not in (-1, 3):
        raise unrecognized(
            "1 (core)",
            f"the probabilities' last column is sliced off, but the Softmax input '{z.name}' is "
            "not the scores with a sink column concatenated",
            core.softmax,
            z,
        )
    col = inputs(cat)[1]
    while (ex := producer(col, "Expand")) is not None:
        col = inputs(ex)[0]
    heads = _per_head_logits(constant_value(col))
    if heads is not None:
        core.sink = Sink(heads, nodes + [cat])
        return inputs(cat)[0]
    column = inputs(cat)[1]
    shape = column.shape
    if constant_value(column) is not None or shape is None or len(shape) != 4 or shape[3] != 1:
        raise unrecognized(
            "1 (core)",
            f"the sink column '{column.name}' concatenated to the scores is neither a "
            "constant logit per head [1,N,1,1] nor a computed column [B,N,S,1]",
            core.softmax,
            column,
        )
    core.sink = Sink(None, nodes + [cat], column=column)
    return inputs(cat)[0]


def sink_gate(out: Tensor) -> tuple[Tensor, list[Node], Tensor, Tensor] | None:
    """Sinks spelled as a gate on the context (Granite's sliding-window attention):
    ``(P·V) · Unsqueeze(Sigmoid(ReduceLogSumExp(z) − sink), −1)``, Casts allowed — the same
    ``exp(sᵢ) / (Σ exp(sⱼ) + exp(sinkₙ))``, since ``sigmoid(lse − c) = Σ eˢ / (Σ eˢ + eᶜ)``.
    (P·V, the gate's nodes consumers first, the LSE's input, the sink — None where a zero
    sink's Sub was folded away) or None."""
    mul = producer(out, "Mul")
    if mul is None:
        return None
    for pv_out, g in (inputs(mul), inputs(mul)[::-1]):
        nodes = [mul]
        t = g
        for op in ("Cast", "Unsqueeze", "Sigmoid", "Cast", "Sub"):
            node = producer(t, op)
            if node is None and op in ("Cast", "Sub"):  # a zero sink's Sub folded away
                continue
            if node is None or (op == "Unsqueeze" and not _on_last_axis(node)):
                break
            nodes.append(node)
            t = inputs(node)[0]
        else:
            lse = producer(t, "ReduceLogSumExp")
            if lse is not None and _on_last_axis(lse) and not lse.attrs.get("keepdims", 1):
                sub = nodes[-1] if nodes[-1].op == "Sub" else None
                return pv_out, nodes + [lse], inputs(lse)[0], inputs(sub)[1] if sub else None
    return None


def _on_last_axis(node: Node) -> bool:
    """Whether a reduction or Unsqueeze of 4-D scores names only their last axis (axes an
    attribute or an input)."""
    ins = inputs(node)
    axes = constant_value(ins[1]) if len(ins) > 1 else node.attrs.get("axes")
    return axes is not None and list(np.asarray(axes).reshape(-1)) in ([-1], [3])


def _take_gate(core: Core, gate: tuple, z: Tensor) -> None:
    """Fill ``core.sink`` from a gate on P·V (:func:`sink_gate`) over the Softmax's input."""
    _, nodes, lse_in, sink = gate
    values = constant_value(sink) if sink is not None else np.zeros(1, np.float32)
    heads = None
    if lse_in is z and values is not None and values.ndim <= 3:
        v = values.reshape((1,) * (3 - values.ndim) + values.shape)  # against [B,N,S]
        if np.all(v == v[:1, :, :1]):
            heads = np.ascontiguousarray(v[0, :, 0])
    if heads is None:
        at = sink if sink is not None else lse_in
        raise unrecognized(
            "1 (core)",
            f"the context is gated by Sigmoid(ReduceLogSumExp − sink) at '{at.name}', but not "
            "of the Softmax's own scores with a constant logit per head [1,N,1]",
            core.softmax,
            at,
        )
    core.sink = Sink(heads, nodes, gate=True)


def _per_head_logits(values: np.ndarray | None) -> np.ndarray | None:
    """The logits [N] (or [1]) of a constant sink column [B|1, N|1, S|1, 1] (perhaps already
    expanded by a fold) that is the same in every batch row and query row, else None."""
    if values is None or values.ndim > 4 or (values.ndim and values.shape[-1] != 1):
        return None
    v = values.reshape((1,) * (4 - values.ndim) + values.shape)
    if not np.all(v == v[:1, :, :1, :]):
        return None
    return np.ascontiguousarray(v[0, :, 0, 0])


def _row_max(m: Tensor, z: Tensor) -> Node | None:
    """``ReduceMax(z)`` over the last axis, dims kept (axes an attribute or an input)."""
    rm = producer(m, "ReduceMax")
    if rm is None or inputs(rm)[0] is not z or not rm.attrs.get("keepdims", 1):
        return None
    return rm if _on_last_axis(rm) else None


def unfolded(t: Tensor | None) -> Tensor | None:
    """``x`` [B,N,L,H] when ``t`` = Reshape(x, [B·N,L,H]) (the last two dims kept, so the
    first is batch × heads in row-major order), else None."""
    rs = producer(t, "Reshape")
    x = inputs(rs)[0] if rs is not None else None
    if x is None or rank(x) != 4 or rank(t) != 3 or not keeps_last_two(rs):
        return None
    return x


def keeps_last_two(rs: Node) -> bool:
    """Whether the Reshape ``rs`` between 4-D and 3-D provably keeps the last two dims (so it
    only folds, or unfolds, the first two), read from its output's dims or its target."""
    x, y = inputs(rs)[0], rs.outputs[0]
    dims = current_dims()
    want = [dims.key(x, rank(x) - 2), dims.key(x, rank(x) - 1)]
    if [dims.key(y, rank(y) - 2), dims.key(y, rank(y) - 1)] == want:
        return True
    elems = shape_elements(inputs(rs)[1], dims)
    if elems is None or len(elems) != rank(y):
        return False
    if elems[-1] == ("int", -1) and elems[-2] == want[0]:  # [lead…, L, -1]: as below
        elems = elems[:-1] + [want[1]]
        return _lead_exact(x, elems, dims)
    if elems[-1] != want[1]:
        return False
    if elems[-2] == want[0]:
        return True
    # [lead…, -1, H]: the -1 is the kept dim when the leading dims fold or unfold exactly
    if elems[-2] != ("int", -1):
        return False
    return _lead_exact(x, elems, dims)


def _lead_exact(x: Tensor, elems: list, dims) -> bool:
    """Whether the leading elements of a Reshape target fold (4-D ``x`` to [B·N,·,·]) or
    unfold (3-D ``x`` to [B,N,·,·]) ``x``'s leading dims exactly, so that one -1 among the
    last two is the dim kept."""
    if rank(x) == 4:  # fold: [B·N, ·, ·]
        b, n = dims.key(x, 0), dims.key(x, 1)
        return elems[0] in (arith("Mul", b, n), arith("Mul", n, b))
    return dims.key(x, 0) in (arith("Mul", elems[0], elems[1]), arith("Mul", elems[1], elems[0]))


def pinned(rs: Node, want: list[set]) -> bool:
    """Whether each axis of the Reshape ``rs``'s output is provably in ``want`` (its dims or
    its target's elements), at most one left as -1."""
    dims = current_dims()
    y = rs.outputs[0]
    elems = shape_elements(inputs(rs)[1], dims)
    if rank(y) != len(want) or (elems is not None and len(elems) != len(want)):
        return False
    free = 0
    for i, w in enumerate(want):
        seen = {dims.key(y, i)} | ({elems[i]} if elems is not None else set())
        if seen & w:
            continue
        if elems is None or elems[i] != ("int", -1):
            return False
        free += 1
    return free <= 1


def _unfold_heads(core: Core) -> None:
    """Q, Kᵀ (or K) and V of a folded core as the [B,N,·,·] heads they were folded from (V as
    it is where P·V is per head)."""
    per_head_pv = core.fold.probs is None
    if core.fold.scores is None:  # Q·Kᵀ per head already: V alone is folded
        _unfold_values(core)
        return
    q4, v4 = unfolded(core.q), core.v if per_head_pv else unfolded(core.v)
    kt4 = unfolded(core.kt)
    tr = producer(core.kt, "Transpose")
    k4 = None
    if kt4 is None and tr is not None and tuple(tr.attrs.get("perm", ())) == (0, 2, 1):
        k4 = unfolded(inputs(tr)[0])
    for name, t, found in (("Q", core.q, q4), ("Kᵀ", core.kt, kt4 or k4), ("V", core.v, v4)):
        if found is None:
            raise unrecognized(
                "1 (core)",
                f"batch and heads are folded into one axis around the scores, but {name} "
                f"'{t.name}' is not a Reshape of [B,N,·,H] heads to [B·N,·,H]",
                core.softmax,
                t,
            )
    core.q, core.v = q4, v4
    core.kt = kt4 if kt4 is not None else k4
    core.fold.k_plain = kt4 is None
    # the scores [B·N,S,T] unfold to [B,N,S,T] and the probabilities fold back: each axis of
    # the Reshape's output pinned to those of the heads (one may be -1: the count pins it)
    dims = current_dims()
    b, n, s, _ = (dims.key(q4, i) for i in range(4))
    t = dims.key(core.kt, 2 if core.fold.k_plain else 3)
    s3 = inputs(core.fold.scores)[0]
    unfold = [{b}, {n}, {s, dims.key(s3, 1)}, {t, dims.key(s3, 2)}]
    fold = [{arith("Mul", b, n)}, {s}, {t}]
    checks = [(core.fold.scores, unfold)] + ([] if per_head_pv else [(core.fold.probs, fold)])
    for rs, want in checks:
        _check_fold_reshape(core, rs, want)


def _check_fold_reshape(core: Core, rs: Node, want: list[set]) -> None:
    """The refusal unless the Reshape ``rs`` that folds or unfolds batch and heads provably
    keeps the last two dims (or pins each axis to ``want``)."""
    if not (keeps_last_two(rs) or pinned(rs, want)):
        raise unrecognized(
            "1 (core)",
            f"'{rs.outputs[0].name}' does not provably keep the last two dims of "
            f"'{inputs(rs)[0].name}' when batch and heads are folded",
            core.softmax,
            rs.outputs[0],
        )


def _unfold_values(core: Core) -> None:
    """Per-head scores, probabilities folded to [B·N,S,T] for a folded V [B·N,T,H]: V as the
    [B,N,T,H] heads it was folded from, and the fold of the probabilities proven."""
    v4 = unfolded(core.v)
    if v4 is None or rank(core.q) != 4:
        raise unrecognized(
            "1 (core)",
            f"the probabilities are folded to [B·N,S,T] after per-head scores, but V "
            f"'{core.v.name}' is not a Reshape of [B,N,T,H] heads to [B·N,T,H]",
            core.softmax,
            core.v,
        )
    core.v = v4
    dims = current_dims()
    b, n, s, _ = (dims.key(core.q, i) for i in range(4))
    _check_fold_reshape(core, core.fold.probs, [{arith("Mul", b, n)}, {s}, {dims.key(v4, 2)}])


def peel_terms(z: Tensor) -> tuple[Tensor, list[Tensor], list[Node]]:
    """(scores, terms, Adds) of ``z`` = scores + term [+ term …], innermost first."""
    terms, adds = [], []
    for _ in range(_MAX_TERMS):
        add = producer(z, "Add")
        if add is None:
            break
        a0, a1 = inputs(add)
        side = 0 if is_scores(a0) else 1 if is_scores(a1) else None
        if side is None:
            break
        z, term = (a0, a1) if side == 0 else (a1, a0)
        adds.append(add)
        terms.append(term)
    return z, terms[::-1], adds[::-1]


#: a clamp at or below this (``torch.max(scores, finfo.min)``) changes no score but −inf
CLAMP_FLOOR = -1e30


def unclamped(z: Tensor) -> tuple[Tensor, Node | None]:
    """``z`` = Max(s, c) with a scalar ``c`` ≤ :data:`CLAMP_FLOOR` (XGLM, older OPT): (s, the
    Max), else (z, None).  Such a clamp keeps every finite score and turns −inf into the lowest
    float: the Softmax is the same unless a whole row is −inf, which the clamp makes uniform;
    the masks of the models that clamp are built from the lowest float, never −inf."""
    mx = producer(z, "Max")
    if mx is None or len(mx.inputs) != 2:
        return z, None
    for i in (0, 1):
        c = scalar(inputs(mx)[1 - i])
        if c is not None and c <= CLAMP_FLOOR:
            return inputs(mx)[i], mx
    return z, None


def nan_guard(p: Tensor) -> tuple[Node, Node] | None:
    """``Where(IsNaN(P), 0, P)``: (Where, IsNaN), or None."""
    guard = producer(p, "Where")
    if guard is None:
        return None
    cond, zero, inner = inputs(guard)
    isnan = producer(cond, "IsNaN")
    if isnan is None or inputs(isnan)[0] is not inner or scalar(zero) != 0.0:
        return None
    return guard, isnan


def _row_guard(p: Tensor | None) -> tuple[Node | None, Tensor | None]:
    """``Where(cond, 0, P)`` or ``Where(cond, P, 0)`` over Softmax probabilities (DeBERTa's
    XSoftmax, SEW-D): the guard and P; else (None, ``p``)."""
    w = producer(p, "Where")
    if w is None:
        return None, p
    _, a, c = inputs(w)
    for zero, probs in ((a, c), (c, a)):
        if scalar(zero) == 0.0 and producer(probs, "Softmax") is not None:
            return w, probs
    return None, p


def _check_row_guard(core: Core) -> None:
    """The guard zeroes exactly what the mask Where fills: the same condition, the same side,
    a fill low enough that the masked probabilities are 0 already, and a condition shared by
    the heads ([B,1,S,T]).  Then it changes only the rows the mask masks wholly (the Softmax
    of a row of fills is uniform; the guard makes it 0), which the lowering zeroes in the
    fused output.  Else a missed remark."""
    guard, where = core.row_guard, core.where
    cond = inputs(guard)[0]
    zero_when_true = scalar(inputs(guard)[1]) == 0.0
    fill = None
    if where is not None:
        fill = scalar(inputs(where)[1] if core.where_fills_true else inputs(where)[2])
    shape = cond.shape
    heads_shared = shape is not None and len(shape) == 4 and shape[1] == 1
    if (
        where is None
        or inputs(where)[0] is not cond
        or zero_when_true != core.where_fills_true
        or fill is None
        or fill > MASK_FILL
        or not heads_shared
    ):
        raise unrecognized(
            "1 (core)",
            f"the probabilities are zeroed by '{guard.name}' where '{cond.name}' holds, which "
            "is not where the scores' mask Where fills them (the same condition, shared by the "
            f"heads as [B,1,S,T], with a fill ≤ {MASK_FILL:g})",
            core.softmax,
            cond,
        )


def _peel_scores(core: Core, z: Tensor) -> None:
    """Fill the window regroup, bias terms, Where mask, scale and Q·Kᵀ of ``core`` from the
    Softmax input ``z``."""
    core.window = _window_regroup(z)
    if core.window is not None:
        z = inputs(core.window.split)[0]
    z, core.clamp = unclamped(z)
    z, core.terms, core.term_adds = peel_terms(z)
    where = producer(z, "Where")
    if where is not None and is_scores(inputs(where)[1]):
        core.where, z = where, inputs(where)[1]
    elif where is not None and is_scores(inputs(where)[2]):  # masked_fill(cond, fill)
        core.where, core.where_fills_true, z = where, True, inputs(where)[2]
    if core.where is not None:  # terms added before the mask (MPT's ALiBi): a fill ≤ −1e4
        z, inner, inner_adds = peel_terms(z)  # drowns them where it masks
        core.terms, core.inner_adds = inner + core.terms, inner_adds
    fold = producer(z, "Reshape")
    if core.fold is None and fold is not None and rank(inputs(fold)[0]) == 3 and rank(z) == 4:
        core.fold = FoldedHeads(None)  # the scores computed over folded heads, P·V per head
    if core.fold is not None and (fold is None or rank(inputs(fold)[0]) != 3) and rank(z) == 4:
        pass  # the scores per head already (unfold-3d-scores), the probabilities folded
    elif core.fold is not None:
        if fold is None or rank(inputs(fold)[0]) != 3 or rank(z) != 4:
            raise unrecognized(
                "1 (core)",
                f"the probabilities are folded to [B·N,S,T] after the Softmax, but its scores "
                f"'{z.name}' are not the [B·N,S,T] scores reshaped to [B,N,S,T]",
                core.softmax,
                z,
            )
        core.fold.scores = fold
        z, core.fold.terms, core.fold.term_adds = peel_terms(inputs(fold)[0])
    z, core.mask_mul = mask_multiplied(z)
    if core.mask_mul is not None:
        _check_mask_fill(core)
    core.softcap = soft_cap(z)
    if core.softcap is not None:
        z = inputs(core.softcap.nodes[-1])[0]
    scores, factors = strip_scale(z)
    mm = producer(scores, "MatMul")
    if mm is None:
        raise unrecognized(
            "1 (core)",
            f"the Softmax input '{inputs(core.softmax)[0].name}' is not a scaled, masked MatMul "
            f"of Q and Kᵀ (it is built from '{z.name}')",
            core.softmax,
            z,
        )
    q, fq = _own_scale(inputs(mm)[0], mm)
    kt, fk = _own_scale(inputs(mm)[1], mm)
    core.qk, core.scores, core.q, core.kt = mm, scores, q, kt
    core.factors = factors + fq + fk


def _own_scale(t: Tensor, mm: Node) -> tuple[Tensor, list[Factor]]:
    """``strip_scale`` of an operand of Q·Kᵀ, unless the scaled operand is read elsewhere too
    (DeBERTa's query, divided once for the scores and its relative-position terms): then the
    scale stays in front of the kernel, which takes the operand as it is."""
    u, factors = strip_scale(t)
    if factors and any(
        r is not mm and r.op != "Shape" and not _keys_of_another(r, t, mm) for r in t.outputs
    ):
        return t, []
    return u, factors


def _keys_of_another(r: Node, kt: Tensor, mm: Node) -> bool:
    """``kt`` is the Kᵀ of ``mm`` and of ``r``, another attention's Q·Kᵀ (the memory's keys of a
    decoder whose cloned layers CSE merged): each strips the scale alone."""
    ins = inputs(r)
    return (
        r.op == "MatMul"
        and len(ins) == 2
        and ins[1] is kt
        and inputs(mm)[1] is kt
        and any(c.op in ("Softmax", "Add", "Where", "Mul", "Div") for c in r.outputs[0].outputs)
    )


def mask_multiplied(t: Tensor | None) -> tuple[Tensor | None, Node | None]:
    """``t`` = ``s · m`` with ``m`` zeros and ones (OpenAI GPT's causal ``w · b + −1e4 · (1 − b)``,
    ``b`` a constant or a constant sliced to the sequence): (s, the Mul); else (t, None)."""
    mul = producer(t, "Mul")
    if mul is None:
        return t, None
    for s, m in (inputs(mul), inputs(mul)[::-1]):
        if _zero_one(m) is not None:
            return s, mul
    return t, None


def _zero_one(t: Tensor, depth: int = 4) -> np.ndarray | None:
    """The constant of zeros and ones (at least 2-D, more than one element) that ``t`` is, or
    is sliced from: slicing keeps every element 0 or 1; else None."""
    v = constant_value(t)
    if v is not None:
        ok = v.ndim >= 2 and v.size > 1 and np.all((v == 0) | (v == 1))
        return v if ok else None
    src = producer(t, "Slice")
    return _zero_one(inputs(src)[0], depth - 1) if src is not None and depth > 0 else None


#: an additive fill at or below this is exp-underflow in fp32 beside any score a model makes
#: (|s| ≪ 1e4): ``s · 0 + fill`` and ``s + fill`` weigh nothing alike after the Softmax
MASK_FILL = -1e4


def _check_mask_fill(core: Core) -> None:
    """The scores are multiplied by a 0/1 mask ``m``: exact as an additive bias only when a
    term adds 0 where ``m`` keeps the score and ≤ −1e4 where it zeroes it (a constant, or
    ``(1 − m) · fill`` of the same ``m``); then the Mul goes and that term masks alone."""
    m = next(i for i in inputs(core.mask_mul) if _zero_one(i) is not None)
    mv = constant_value(m)
    for t in core.terms:
        if _fills_where_zero(t, m):
            return
        c = constant_value(t)
        if c is None or mv is None:
            continue
        try:
            cb, mb = np.broadcast_arrays(c, mv)
        except ValueError:
            continue
        if np.all(cb[mb == 1] == 0) and np.all(cb[mb == 0] <= MASK_FILL):
            return
    raise unrecognized(
        "1 (core)",
        f"the scores are multiplied by the 0/1 mask '{m.name}' with no term that fills "
        f"≤ {MASK_FILL:g} where it zeroes them and 0 elsewhere",
        core.softmax,
        core.mask_mul.outputs[0],
    )


def _fills_where_zero(t: Tensor, m: Tensor) -> bool:
    """``t`` = ``(1 − m) · fill`` (either order) with a scalar ``fill`` ≤ −1e4."""
    mul = producer(t, "Mul")
    if mul is None:
        return False
    for x, k in (inputs(mul), inputs(mul)[::-1]):
        fill, sub = scalar(k), producer(x, "Sub")
        if fill is None or fill > MASK_FILL or sub is None:
            continue
        one, mm = inputs(sub)
        if mm is m and scalar(one) == 1:
            return True
    return False


def soft_cap(t: Tensor | None) -> SoftCap | None:
    """``t`` = ``tanh(s / cap) · cap`` (the inner step a Div by ``cap`` or a Mul by ``1/cap``,
    both positive scalar constants, within fp32 rounding of each other), else None."""
    outer = producer(t, "Mul")
    if outer is None:
        return None
    for th, c in (inputs(outer), inputs(outer)[::-1]):
        tanh = producer(th, "Tanh")
        cap = scalar(c)
        inner = producer(inputs(tanh)[0], ("Div", "Mul")) if tanh is not None else None
        if inner is None or cap is None or cap <= 0 or len(th.outputs) != 1:
            continue
        a, b = inputs(inner)
        if inner.op == "Mul" and scalar(a) is not None and scalar(b) is None:
            a, b = b, a
        d = scalar(b)
        if d is None or d <= 0:
            continue
        inv = d if inner.op == "Div" else 1.0 / d
        if abs(inv - cap) <= 1e-6 * cap:
            return SoftCap(float(cap), [outer, tanh, inner])
    return None


def strip_scale(t: Tensor | None) -> tuple[Tensor | None, list[Factor]]:
    """``t`` = ``u · c`` or ``u / c`` (at most one): (u, [factor])."""
    node = producer(t, ("Mul", "Div"))
    if node is None:
        return t, []
    ins = inputs(node)
    if node.op == "Div":
        if constant_value(ins[1]) is None and rank(ins[1]) not in (None, 0, 1):
            return t, []  # a computed per-row divisor: a norm (cosine attention), not a scale
        return ins[0], [Factor(ins[1], True, node)]
    for u, c in ((ins[0], ins[1]), (ins[1], ins[0])):
        scaled = producer(u, _SCALED) is not None or _rotated(u)
        if constant_value(c) is None and rank(c) not in (None, 0, 1):
            continue  # a computed per-row factor: a norm (an RMSNorm spelled out), not a scale
        if scaled and producer(c, _SCALED[1:]) is None:
            return u, [Factor(c, False, node)]
    return t, []


def past_empty_concat(t: Tensor | None) -> tuple[Tensor | None, list[Node]]:
    """``t`` = Concat(u, e) along the last axis with ``e`` provably empty there (Phi-3's
    partial-rotary spelling with nothing passed through): (u, [Concat]); else (t, [])."""
    cat = producer(t, "Concat")
    if cat is None or len(inputs(cat)) != 2 or cat.attrs.get("axis") not in (-1, 3):
        return t, []
    u, e = inputs(cat)
    if rank(u) != 4 or current_dims().key(e, 3) != ("int", 0):
        return t, []
    split = producer(e, "Split")  # of the rotated heads: the fusion's when only e is read
    return u, [cat] + ([split] if split is not None else [])


def _rotated(u: Tensor | None) -> bool:
    """``u`` is rotated heads: RotaryEmbedding, or Concat(rotated, pass-through) along the
    head axis (partial rotary)."""
    if rotary_of(past_empty_concat(u)[0]) is not None:
        return True
    cat = producer(u, "Concat")
    return (
        cat is not None
        and cat.attrs.get("axis") in (-1, 3)
        and rotary_of(inputs(cat)[0]) is not None
    )


def rotary_of(t: Tensor | None) -> Node | None:
    """The ``RotaryEmbedding`` (ONNX or com.microsoft) computing ``t``, or None."""
    return producer(t, "RotaryEmbedding") or producer(t, "RotaryEmbedding", MS)


def is_scores(t: Tensor | None, depth: int = _MAX_TERMS) -> bool:
    """Q·Kᵀ, possibly scaled, masked by a Where or biased: a MatMul whose right operand is a
    transposed tensor, reached through at most ``depth`` Adds."""
    where = producer(t, "Where")
    if where is not None:
        t = inputs(where)[2] if constant_value(inputs(where)[1]) is not None else inputs(where)[1]
    cap = soft_cap(t)
    if cap is not None:
        t = inputs(cap.nodes[-1])[0]
    fold = producer(t, "Reshape")
    if fold is not None and rank(t) == 4 and rank(inputs(fold)[0]) == 3:
        t = inputs(fold)[0]  # [B·N,S,T] scores unfolded to [B,N,S,T]
    t = mask_multiplied(t)[0]
    mm = producer(strip_scale(t)[0], "MatMul")
    if mm is not None:
        right = strip_scale(inputs(mm)[1])[0]
        return producer(right, ("Transpose", "Reshape")) is not None
    add = producer(t, "Add")
    return add is not None and depth > 0 and any(is_scores(a, depth - 1) for a in inputs(add))


def _window_regroup(z: Tensor) -> WindowRegroup | None:
    """``z`` = Reshape(Add(Reshape(z0, 5-D), M5) [+ M5' …], 4-D) with ``z0`` the (biased)
    scores."""
    merge = producer(z, "Reshape")
    if merge is None or rank(z) != 4:
        return None
    t, adds, masks = inputs(merge)[0], [], []
    for _ in range(_MAX_TERMS):
        add = producer(t, "Add")
        if add is None:
            return None
        for s_t, m_t in (inputs(add), inputs(add)[::-1]):
            split = producer(s_t, "Reshape")
            if split is not None and rank(s_t) == 5 and is_scores(inputs(split)[0]):
                return WindowRegroup(split, [*adds, add], merge, [*masks, m_t])
        inner = [s for s in inputs(add) if producer(s, "Add") is not None and rank(s) == 5]
        if len(inner) != 1:
            return None
        adds.append(add)
        masks.append(inputs(add)[1] if inputs(add)[0] is inner[0] else inputs(add)[0])
        t = inner[0]
    return None


def scores_folded(t: Tensor) -> bool:
    """Whether the scores reaching a Softmax come from a com.microsoft.FusedMatMul (a fold of
    the linear phase, after this rule refused the attention)."""
    for _ in range(7):
        node = t.inputs[0] if t.inputs else None
        if node is None:
            return False
        if node.op == "FusedMatMul" and norm_domain(node.domain) == MS:
            return True
        if node.op not in ("Add", "Where", "Mul", "Div", "Reshape", "Tanh"):
            return False
        if node.op == "Where":
            t = inputs(node)[2] if constant_value(inputs(node)[1]) is not None else inputs(node)[1]
        else:
            t = inputs(node)[0]
    return False

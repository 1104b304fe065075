"""Attention computed over folded batch × heads from the split to the merge, made per head.

torch's ``F.multi_head_attention_forward`` when it returns the attention weights (the default of
``nn.MultiheadAttention``, and WavLM, DETR, …) never has a [B,N,·,·] tensor::

    q3  = Transpose(Reshape(xq [T,B,E], [T,B·N,H]), (1,0,2))        [B·N,T,H] (· scale)
    kᵀ3 = Transpose(Reshape(xk [S,B,E], [S,B·N,H]), (1,2,0))        [B·N,H,S]
    v3  = Transpose(Reshape(xv [S,B,E], [S,B·N,H]), (1,0,2))        [B·N,S,H]
    out = Transpose(MatMul(Softmax(q3·kᵀ3 [+ bias3 …]), v3), (1,0,2))   [T,B·N,H]

``unfold-3d-attention`` rewrites it into the folded spelling that ``fuse-attention`` reads
(:class:`.core.FoldedHeads`): q3, k3 and v3 each pass through their [B,N,·,H] heads (two
Reshapes, an identity together), the Softmax runs on the scores unfolded to [B,N,T,S], and P·V
is unfolded to [B,N,T,H] and merged by ``Transpose(2,0,1,3)`` and a Reshape back to
[T,B·N,H].  Row-major, the B·N axis of ``Reshape(x [T,B,E], [T,·,H])`` is ``b·N + n`` with
N = E/H, so each unfold is exact.  It fires only where the three splits say so, with one N,
and the target has an attention kernel; where fuse-attention then refuses, the per-head form
stays (the same numbers).

The bmm spelling of batch-first exports (transformers' eager BART, Marian, Whisper and CLIP
before 4.4x, Stable Diffusion's ``einsum('b i d, b j d -> b i j')`` over ``(b h) n d``) folds
batch and heads after a per-head split and unfolds them before the merge, but normalizes the
folded scores::

    q3 = Reshape(Transpose(Reshape(x, [B,T,N,H]), (0,2,1,3)), [B·N,T,H])   (k3, v3 alike)
    P3 = Softmax(q3·k3ᵀ [ → Reshape to [B,N,T,S] + mask → Reshape back])   [B·N,T,S]
    out = Reshape(MatMul(P3, v3), [B,N,T,H]) → Transpose (0,2,1,3)

``unfold-3d-softmax`` runs that Softmax on the [B,N,T,S] scores (the masked 4-D sum when there
is one) and folds the probabilities back: the folded spelling again.  The dynamo exporter's
batch-1 form keeps the query per head and multiplies it by a Kᵀ folded to [N,H,T], which
MatMul broadcasts as [1,N,H,T]; ``unfold-broadcast-key`` writes that Kᵀ per head first.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import arith, rank, shape_elements
from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.ir import Node, Tensor, constant_value, dtype_of
from graphopt.opt.rewrite.engine import Builder, Match, NoMatch, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from ..activation import MS, float_type, inputs, no_match, producer, scalar
from .core import keeps_last_two, peel_terms, pinned, soft_cap, strip_scale, unclamped, unfolded
from .heads import transpose_of
from .masks import check_where_fill


def _split3(t: Tensor | None, perm: tuple[int, ...]) -> tuple[Node, Node, int, int] | None:
    """(Transpose, Reshape, N, H) when ``t`` = ``Transpose(Reshape(x [L,B,E], [L,B·N,H]),
    perm)`` with E and H static and N = E/H, else None."""
    tr = transpose_of(t, perm)
    rs = producer(inputs(tr)[0], "Reshape") if tr is not None else None
    if rs is None or rank(inputs(rs)[0]) != 3 or rank(rs.outputs[0]) != 3:
        return None
    dims = current_dims()
    x, y = inputs(rs)[0], rs.outputs[0]
    e, h = dims.key(x, 2), dims.key(y, 2)
    if e[0] != "int" or h[0] != "int" or h[1] <= 0 or e[1] % h[1]:
        return None
    n = ("int", e[1] // h[1])
    # the Reshape only splits E into heads: it keeps L first, or makes B·N second (then the
    # element count keeps L)
    bn = {arith("Mul", dims.key(x, 1), n), arith("Mul", n, dims.key(x, 1))}
    elems = shape_elements(inputs(rs)[1], dims) or [None, None]
    copy = {("int", 0)} if not rs.attrs.get("allowzero", 0) else set()
    keeps_l = dims.key(x, 0) in {dims.key(y, 0), elems[0]} or elems[0] in copy
    if not keeps_l and not {dims.key(y, 1), elems[1]} & bn:
        return None
    return tr, rs, n[1], h[1]


def _learned_query(t: Tensor | None, k: tuple[Node | None, Node, int, int] | None) -> tuple | None:
    """(None, None, N, H) when ``t`` is a constant [B·N,T,H] query with the sequence-first key's
    heads, head size and batch (learned queries of a pooling head, folded with a static batch),
    else None."""
    value = constant_value(t)
    if k is None or k[0] is None or value is None or value.ndim != 3:
        return None
    n, h = k[2], k[3]
    batch = current_dims().key(inputs(k[1])[0], 1)
    if value.shape[2] != h or value.shape[0] % n or batch != ("int", value.shape[0] // n):
        return None
    return None, None, n, h


def _key_split(t: Tensor | None) -> tuple[tuple[Node | None, Node, int, int] | None, list[Node]]:
    """The key's split (:func:`_split3`) under Kᵀ3 = ``Transpose(·, (1,2,0))``, or its two steps
    ``Transpose(Transpose(·, (1,0,2)), (0,2,1))``; and those Transposes.  Else its heads folded
    from [B,N,S,H] (:func:`_folded_split`) under ``Transpose(·, (0,2,1))``, no Transpose to
    rewrite."""
    found = _split3(t, (1, 2, 0))
    if found is not None:
        return found, [found[0]]
    flip = transpose_of(t, (0, 2, 1))
    inner = _split3(inputs(flip)[0], (1, 0, 2)) if flip is not None else None
    if inner is not None:
        return inner, [flip, inner[0]]
    folded = _folded_split(inputs(flip)[0]) if flip is not None else None
    return folded, []


def _folded_split(t: Tensor | None) -> tuple[None, Node, int, int] | None:
    """(None, Reshape, N, H) when ``t`` [B·N,L,H] is a Reshape of [B,N,L,H] heads with N and H
    static: fairseq's (FSMT's) keys and values, viewed per head before they are folded, beside a
    query folded sequence-first.  Row-major, both number the folded axis ``b·N + n``."""
    n = folded_heads(t)
    h = current_dims().key(t, 2) if n is not None else None
    if h is None or h[0] != "int" or h[1] <= 0:
        return None
    return None, producer(t, "Reshape"), n, h[1]


def _keys_of(split: tuple[Node | None, Node, int, int]) -> tuple[Tensor, int]:
    """The tensor the keys were split from and its key axis: [S,B,E] (axis 0) under a
    sequence-first split, [B,N,S,H] (axis 2) under folded heads."""
    src = inputs(split[1])[0]
    return src, 0 if split[0] is not None else 2


def scaled_operand(mm: Node, i: int) -> tuple[Node, int, Tensor]:
    """The node reading the ``i``-th operand of ``mm`` (a scale Mul/Div, or ``mm``), the
    input index there, and the operand with its scale stripped."""
    u, factors = strip_scale(inputs(mm)[i])
    if not factors:
        return mm, i, inputs(mm)[i]
    node = factors[0].node
    return node, inputs(node).index(u), u


def check_scores_mask(sm: Node) -> None:
    """fuse-attention's refusal of the Where masking the scores under ``sm`` (through bias
    terms and the Reshapes that unfold them for it), asked before the graph is changed: a
    fill that cannot become a bias leaves the attention as the model wrote it."""
    z = inputs(sm)[0]
    for _ in range(3):
        z = peel_terms(unclamped(z)[0])[0]
        where = producer(z, "Where")
        if where is not None:
            _, a, c = inputs(where)
            fill, kept = (a, c) if scalar(a) is not None else (c, a)
            if scalar(fill) is not None:
                check_where_fill(fill, sm.name)
            z = kept
        rs = producer(z, "Reshape")
        if rs is None:
            return
        z = inputs(rs)[0]


def qk_matmul(z: Tensor) -> Node | None:
    """The Q·Kᵀ MatMul under the Softmax input ``z``: through bias terms, a Where mask,
    soft-capping, one scale, and the Reshapes that unfold the scores for a mask and fold them
    back."""
    for _ in range(3):
        z = peel_terms(unclamped(z)[0])[0]
        where = producer(z, "Where")
        if where is not None:
            on = (
                inputs(where)[2]
                if producer(inputs(where)[1], "MatMul") is None
                else inputs(where)[1]
            )
            z = on
        cap = soft_cap(z)
        if cap is not None:
            z = inputs(cap.nodes[-1])[0]
        s = strip_scale(z)[0]
        mm = producer(s, "MatMul")
        if mm is not None:
            return mm
        rs = producer(s, "Reshape")
        if rs is None or rank(inputs(rs)[0]) not in (3, 4):
            return None
        z = inputs(rs)[0]
    return None


@register_rule
class UnfoldThreeDimAttention(Rule):
    name = "unfold-3d-attention"
    pattern = Op("Transpose", "ctx")
    phase = "attention"
    priority = 1  # before fuse-attention at the same Transpose
    exclusive = False  # its own checks: the probabilities feed P·V only
    summary = "attention over [B·N,T,H] (nn.MultiheadAttention with weights) → its per-head form"

    def match(self, node, cx):
        if tuple(node.attrs.get("perm", ())) != (1, 0, 2) or cx.ir.opset < 13:
            raise no_match()
        pv = producer(inputs(node)[0], "MatMul")
        sm = producer(inputs(pv)[0], "Softmax") if pv is not None else None
        if sm is None or rank(sm.outputs[0]) != 3 or sm.attrs.get("axis", -1) not in (-1, 2):
            raise no_match()
        if len(sm.outputs[0].outputs) != 1 or cx.ir.is_graph_output(sm.outputs[0]):
            raise no_match()  # the weights are read (averaged over heads, returned)
        qk = qk_matmul(inputs(sm)[0])
        if qk is None:
            raise no_match()
        q_at, k_at = scaled_operand(qk, 0), scaled_operand(qk, 1)
        k, k_transposes = _key_split(k_at[2])
        q = _split3(q_at[2], (1, 0, 2)) or _learned_query(q_at[2], k)
        v = _split3(inputs(pv)[1], (1, 0, 2)) or _folded_split(inputs(pv)[1])
        if q is None or k is None or v is None or not q[2] == k[2] == v[2] or q[3] != k[3]:
            raise no_match()
        keys, axis = _keys_of(k)
        require_attention_kernel(cx, keys, sm)  # nothing would fuse it: leave it as it is
        check_pays(cx, sm, static_dim(keys, axis), keys)
        check_scores_mask(sm)
        kts = {f"kt{i}": t for i, t in enumerate(k_transposes)}
        dims = current_dims()
        w4 = _masked_sum(sm, qk, ({dims.key(q_at[2], 1)}, {dims.key(keys, axis)}))
        fold = {"fold": producer(inputs(sm)[0], "Reshape")} if w4 is not None else {}
        m = Match(node, {"root": node, "pv": pv, "softmax": sm, **kts, **fold})
        m.stash(q_at=q_at, k_at=k_at, k_split=k, heads=q[2], v_head=v[3], unfolded=w4)
        return m

    def rewrite(self, m, b):
        n = m.heads
        pv, sm, root = m.bindings["pv"], m.bindings["softmax"], m.root
        q_reader, qi, q3 = m.q_at
        q_reader.inputs[qi] = _through_heads(b, q3, n)
        if m.k_split[0] is not None:  # split sequence-first: through its heads (folded: as is)
            self._key_through_heads(b, m, q3)
        pv.inputs[1] = _through_heads(b, inputs(pv)[1], n)
        z3 = inputs(sm)[0]
        if m.unfolded is not None:  # the masked [B,N,S,T] sum the exporter folded for it
            z4, tail = m.unfolded, _tail(b, m.unfolded, 2)
        else:
            tail = _tail(b, z3)
            z4 = _unfold(b, z3, n, tail, "scores")
        p4 = b.op("Softmax", [z4], {"axis": -1}, like=z4, name=f"{sm.name}/heads")
        pv.inputs[0] = _fold(b, p4, tail, sm.outputs[0])
        ctx4 = _unfold(b, pv.outputs[0], n, _tail(b, pv.outputs[0]), "ctx")
        tbnh = b.op("Transpose", [ctx4], {"perm": [2, 0, 1, 3]}, name=f"{root.name}/merge")
        tbnh.dtype = dtype_of(ctx4)
        if ctx4.shape is not None:
            tbnh.shape = [ctx4.shape[i] for i in (2, 0, 1, 3)]
        target = b.const(np.array([0, -1, m.v_head], dtype=np.int64), "merge_heads")
        out = b.op("Reshape", [tbnh, target], like=root.outputs[0], name=f"{root.name}/merged")
        return [out]

    @staticmethod
    def _key_through_heads(b: Builder, m: Match, q3: Tensor) -> None:
        """Kᵀ3 read from [B·N,S,H] keys that pass through their heads."""
        k_reader, ki, _ = m.k_at
        split, name = m.k_split[1].outputs[0], m.root.name
        k3 = b.op("Transpose", [split], {"perm": [1, 0, 2]}, name=f"{name}/k")
        k3.dtype = dtype_of(q3)
        if split.shape is not None:
            k3.shape = [split.shape[1], split.shape[0], split.shape[2]]
        kb = _through_heads(b, k3, m.heads)
        kt = b.op("Transpose", [kb], {"perm": [0, 2, 1]}, name=f"{name}/kt")
        kt.dtype = dtype_of(q3)
        if kb.shape is not None:
            kt.shape = [kb.shape[0], kb.shape[2], kb.shape[1]]
        k_reader.inputs[ki] = kt


def has_attention_kernel(cx, t: Tensor) -> bool:
    """Whether the target has a kernel fuse-attention lowers to, for ``t``'s element type."""
    kernels = [("MultiHeadAttention", MS, 1), ("Attention", "", cx.ir.opset)]
    return any(cx.target.has_kernel(op, d, v, float_type(t)) for op, d, v in kernels)


def require_attention_kernel(cx, t: Tensor, sm: Node) -> None:
    """A respelling is refused, naming the Softmax, where no kernel would take the attention:
    the census then says why it stays (no kernel), not that its spelling is unknown."""
    if not has_attention_kernel(cx, t):
        raise NoMatch(
            "no-kernel",
            f"stage 3 (lower): target {cx.target.name} has neither MultiHeadAttention nor "
            f"the ONNX Attention op (opset {cx.ir.opset}) for {float_type(t)}: the attention "
            "stays as the model wrote it",
            softmax=sm.name,
            stage="3 (lower)",
            tensor=t.name,
        )


def static_dim(t: Tensor | None, axis: int):
    """The static size of ``t``'s axis, else None."""
    shape = t.shape if t is not None else None
    d = shape[axis] if shape is not None and len(shape) > axis else None
    return int(d) if isinstance(d, (int, np.integer)) else None


def check_pays(cx, sm: Node, keys: int | None, keys_src: Tensor) -> None:
    """fuse-attention's cost bound, asked before the graph is changed: a biased attention over
    a static key count below the target's bound stays as it is (the same refusal, named
    here; a bias is any term, mask or Where between the scores and the Softmax, also one the
    exporter added to the unfolded [B,N,S,T] scores)."""
    bound, why = cx.target.slower_below.get("MultiHeadAttention", (0, ""))
    z = inputs(sm)[0]
    rs = producer(z, "Reshape")
    biased = any(
        bool(peel_terms(t)[1]) or producer(t, "Where") is not None
        for t in [z] + ([inputs(rs)[0]] if rs is not None else [])
    )
    if biased and keys is not None and keys < bound:
        raise NoMatch(
            "slower-on-target",
            f"stage 3 (lower): MultiHeadAttention over {keys} keys with an attention_bias is "
            f"slower than the unfused attention on target {cx.target.name} below {bound} keys: "
            f"{why}",
            keys=keys,
            bound=bound,
            softmax=sm.name,
            stage="3 (lower)",
            tensor=keys_src.name,
        )


def _tail(b: Builder, t: Tensor, start: int = 1) -> Tensor:
    """``Shape(t)[start:]``, the last two dims of a 3-D (or, from 2, a 4-D) tensor."""
    out = b.op("Shape", [t], {"start": start}, name=f"{b.anchor}/tail")
    out.dtype, out.shape = np.dtype(np.int64), [2]
    return out


def _unfold(b: Builder, t: Tensor, heads: int, tail: Tensor, role: str) -> Tensor:
    """``t`` [B·N,L,M] as [B,N,L,M] (``tail`` = [L,M])."""
    lead = b.const(np.array([-1, heads], dtype=np.int64), "unfold_heads")
    target = b.op("Concat", [lead, tail], {"axis": 0}, name=f"{b.anchor}/{role}_target")
    target.dtype, target.shape = np.dtype(np.int64), [4]
    out = b.op("Reshape", [t, target], name=f"{b.anchor}/{role}_heads")
    out.dtype = dtype_of(t)
    if t.shape is not None:
        lead = t.shape[0] // heads if isinstance(t.shape[0], int) else None
        out.shape = [lead, heads, *t.shape[1:]]
    return out


def _fold(b: Builder, t4: Tensor, tail: Tensor, like: Tensor) -> Tensor:
    """``t4`` [B,N,L,M] as [B·N,L,M] (``tail`` = [L,M])."""
    lead = b.const(np.array([-1], dtype=np.int64), "fold_heads")
    target = b.op("Concat", [lead, tail], {"axis": 0}, name=f"{b.anchor}/fold_target")
    target.dtype, target.shape = np.dtype(np.int64), [3]
    return b.op("Reshape", [t4, target], like=like, name=f"{b.anchor}/fold_heads")


def _through_heads(b: Builder, t: Tensor, heads: int) -> Tensor:
    """``t`` [B·N,L,H] through its heads [B,N,L,H] and back (an identity the attention rule
    reads as folded heads)."""
    tail = _tail(b, t)
    return _fold(b, _unfold(b, t, heads, tail, "split"), tail, t)


def folded_heads(t: Tensor | None) -> int | None:
    """N when ``t`` [B·N,L,H] is a Reshape of [B,N,L,H] heads with N static, else None."""
    x = unfolded(t)
    return _static_heads(x) if x is not None else None


def _query_heads(q: Tensor, qk: Node) -> tuple[Tensor | None, int | None]:
    """(the query's [B,N,S,H] heads, N): unfolded from a folded [B·N,S,H] ``q``, or ``q``
    itself when it is already per head, with a batch of 1 and a static N (the dynamo
    exporter's batch-1 bmm: a 4-D query times a folded 3-D Kᵀ, broadcast as [1,N,H,T])."""
    if rank(q) == 3:
        return unfolded(q), folded_heads(q)
    dims = current_dims()
    if rank(q) != 4 or rank(qk.outputs[0]) != 4 or dims.key(q, 0) != ("int", 1):
        return None, None
    n = _static_heads(q)
    return (q, n) if n is not None else (None, None)


def _static_heads(t: Tensor) -> int | None:
    """N of per-head [B,N,·,·] ``t`` when static."""
    n = current_dims().key(t, 1)
    return n[1] if n[0] == "int" and n[1] > 0 else None


def _keeps_scores_rows(rs: Node, s3: Tensor, seqs: tuple[set, set]) -> bool:
    """Whether the Reshape ``rs`` folding the masked [B,N,S,T] sum back to 3-D provably yields
    the last two dims of the folded scores ``s3`` = Q3·K3ᵀ, S and T (``seqs``: what else they
    are known as, the heads' sequence axes; the sum has the scores' shape: no exporter writes
    a mask that broadcasts the scores larger)."""
    dims = current_dims()
    y = rs.outputs[0]
    elems = shape_elements(inputs(rs)[1], dims) or []
    if rank(y) != 3:
        return False
    for i, known in zip((1, 2), seqs):
        seen = {dims.key(y, i)} | ({elems[i]} if len(elems) == 3 else set())
        if not seen & (known | {dims.key(s3, i)}):
            return False
    return True


def _masked_sum(softmax: Node, qk: Node, seqs: tuple[set, set]) -> Tensor | None:
    """The [B,N,S,T] sum the exporter unfolded the folded scores to (for a mask) and folded
    back for the Softmax, when that fold provably keeps the scores' rows; else None."""
    rs = producer(inputs(softmax)[0], "Reshape")
    w4 = inputs(rs)[0] if rs is not None else None
    if w4 is None or rank(w4) != 4:
        return None
    return w4 if keeps_last_two(rs) or _keeps_scores_rows(rs, qk.outputs[0], seqs) else None


def folded_pv(softmax: Node, cx) -> Node:
    """The P·V MatMul that alone reads the probabilities of a Softmax over the last axis of
    folded [B·N,S,T] scores; else no match."""
    p = softmax.outputs[0]
    if rank(p) != 3 or softmax.attrs.get("axis", -1) not in (-1, 2) or cx.ir.opset < 13:
        raise no_match()
    pv = p.outputs[0] if len(p.outputs) == 1 and not cx.ir.is_graph_output(p) else None
    if pv is None or pv.op != "MatMul" or inputs(pv)[0] is not p:
        raise no_match()
    return pv


@register_rule
class UnfoldFoldedSoftmax(Rule):
    name = "unfold-3d-softmax"
    pattern = Op("Softmax", "scores")
    phase = "attention"
    exclusive = False  # its own checks: the probabilities feed P·V only
    summary = "a Softmax over folded [B·N,T,S] scores between folded heads → over [B,N,T,S]"

    def match(self, node, cx):
        pv = folded_pv(node, cx)
        merge = [r for r in pv.outputs[0].outputs if r.op != "Shape"]
        if len(merge) != 1 or merge[0].op != "Reshape" or rank(merge[0].outputs[0]) != 4:
            raise no_match()  # P·V is not unfolded to [B,N,S,H] for the heads' merge
        qk = qk_matmul(inputs(node)[0])
        if qk is None:
            raise no_match()
        kt = scaled_operand(qk, 1)[2]
        flip = transpose_of(kt, (0, 2, 1))
        q3 = scaled_operand(qk, 0)[2]
        q4, nq = _query_heads(q3, qk)
        per_head_kt = q4 is q3 and rank(kt) == 4  # unfold-broadcast-key's [1,N,H,T]
        heads = {
            nq,
            _static_heads(kt)
            if per_head_kt
            else folded_heads(inputs(flip)[0])
            if flip is not None
            else folded_heads(kt),
            folded_heads(inputs(pv)[1]),
        }
        if len(heads) != 1 or None in heads:
            raise no_match()
        require_attention_kernel(cx, q3, node)
        # K [B,N,T,H] or Kᵀ
        k4 = kt if per_head_kt else unfolded(inputs(flip)[0] if flip is not None else kt)
        check_pays(cx, node, static_dim(k4, 2 if flip is not None else 3), k4)
        check_scores_mask(node)
        dims = current_dims()
        seqs = ({dims.key(q4, 2)}, {dims.key(k4, 2 if flip is not None else 3)})
        w4 = _masked_sum(node, qk, seqs)
        if q4 is q3 and w4 is None:
            raise no_match()  # per-head scores: only the exporter's fold of them
        rs = producer(inputs(node)[0], "Reshape")
        m = Match(node, {"softmax": node, **({"fold": rs} if w4 is not None else {})})
        m.stash(heads=heads.pop(), unfolded=w4)
        return m

    def rewrite(self, m, b):
        sm = m.root
        z3 = inputs(sm)[0]
        if m.unfolded is not None:  # the masked [B,N,S,T] sum the exporter folded for it
            z4, tail = m.unfolded, _tail(b, m.unfolded, 2)
        else:
            tail = _tail(b, z3)
            z4 = _unfold(b, z3, m.heads, tail, "scores")
        p4 = b.op("Softmax", [z4], {"axis": -1}, like=z4, name=f"{sm.name}/heads")
        return [_fold(b, p4, tail, sm.outputs[0])]


def _scaled(b: Builder, t: Tensor, factors: list, like: Tensor) -> Tensor:
    """``t`` times (or divided by) each of ``factors``, as the model had it."""
    for f in factors:
        op = "Div" if f.divides else "Mul"
        t = b.op(op, [t, f.value], like=like, name=f"{f.node.name}/heads")
    return t


def _reaches_softmax(t: Tensor, steps: int = 4, folded: bool = False) -> bool:
    """Whether ``t`` reaches a Softmax over 4-D scores through at most ``steps`` bias Adds,
    Where masks or casts (``folded``: or over the scores folded to 3-D by a Reshape)."""
    frontier = [t]
    passes = (
        ("Add", "Where", "Cast", "Sub", "Reshape") if folded else ("Add", "Where", "Cast", "Sub")
    )
    for _ in range(steps + 1):
        nxt = []
        for x in frontier:
            for r in x.outputs:
                if r.op == "Softmax" and rank(r.outputs[0]) in ((3, 4) if folded else (4,)):
                    return True
                if r.op in passes:
                    nxt += r.outputs
        frontier = nxt
    return False


@register_rule
class UnfoldFoldedScores(Rule):
    """GPT-NeoX-Japanese (a baddbmm spelling): the heads folded for Q·Kᵀ alone, the scores
    unfolded for the mask and the Softmax, P·V per head::

        z = Reshape(MatMul(Reshape(q4, [B·N,S,H]), Transpose(Reshape(k4, [B·N,T,H]), (0,2,1)))
                    [· c], [B,N,S,T])

    is ``MatMul(q4, Transpose(k4, (0,1,3,2))) [· c]``: the same products, per head."""

    name = "unfold-3d-scores"
    pattern = Op("Reshape", "unfold")
    phase = "attention"
    priority = 1  # before fuse-attention reads the scores
    exclusive = False  # its own checks: the folded product feeds this Reshape only
    summary = "Q·Kᵀ over folded [B·N,S,H] heads, unfolded to [B,N,S,T] → per head"

    def match(self, node, cx):
        y, x = node.outputs[0], inputs(node)[0]
        if rank(y) != 4 or rank(x) != 3 or len(x.outputs) != 1 or not _reaches_softmax(y):
            raise no_match()
        s, factors = strip_scale(x)
        mm = producer(s, "MatMul")
        if mm is None or len(s.outputs) != 1:
            raise no_match()
        (q3, qf), (kt3, kf) = strip_scale(inputs(mm)[0]), strip_scale(inputs(mm)[1])
        q4, flip = unfolded(q3), transpose_of(kt3, (0, 2, 1))
        k4 = unfolded(inputs(flip)[0]) if flip is not None else None
        kt4 = unfolded(kt3) if flip is None else None
        if q4 is None or (k4 is None and kt4 is None):
            raise no_match()
        dims = current_dims()
        kh = k4 if k4 is not None else kt4
        if [dims.key(kh, i) for i in (0, 1)] != [dims.key(q4, i) for i in (0, 1)]:
            raise no_match()  # not the query's batch and heads, folded the same way
        t = dims.key(k4, 2) if k4 is not None else dims.key(kt4, 3)
        want = [{dims.key(q4, 0)}, {dims.key(q4, 1)}, {dims.key(q4, 2)}, {t}]
        if not pinned(node, want):
            raise no_match()
        m = Match(node, {"unfold": node})
        m.stash(q4=q4, k4=k4, kt4=kt4, factors=(qf, kf, factors), mm=mm)
        return m

    def rewrite(self, m, b):
        qf, kf, factors = m.factors
        y = m.root.outputs[0]
        q = _scaled(b, m.q4, qf, m.q4)
        if m.k4 is not None:
            kt = b.op("Transpose", [m.k4], {"perm": [0, 1, 3, 2]}, name=f"{m.root.name}/kt")
            kt.dtype = dtype_of(m.k4)
            if m.k4.shape is not None:
                kt.shape = [m.k4.shape[i] for i in (0, 1, 3, 2)]
        else:
            kt = m.kt4
        kt = _scaled(b, kt, kf, kt)
        scores = b.op("MatMul", [q, kt], like=y, name=f"{m.mm.name}/heads")
        return [_scaled(b, scores, factors, y)]


@register_rule
class UnfoldThreeDimKey(Rule):
    """The dynamo exporter's Kᵀ through 3-D when the key is a 5-D tensor whose two middle axes
    are the heads (HF's repeat_kv, ``Expand(Unsqueeze(k, 2), [B,Nkv,rep,T,H])``, its Reshape to
    [B,N,T,H] folded into the 3-D one)::

        kᵀ = Reshape(Transpose(Reshape(y [B,a,b,T,H], [B·a·b,T,H]), (0,2,1)), [B,a·b,H,T])

    is ``Transpose(Reshape(y, [B,a·b,T,H]), (0,1,3,2))``: the same elements, the key 4-D."""

    name = "unfold-3d-key"
    pattern = Op("Reshape", "outer")
    phase = "attention"
    priority = 1  # before fuse-attention reads the key
    exclusive = False  # its own checks: the folded key feeds this Reshape only
    summary = "Kᵀ folded through [B·N,T,H] from a 5-D key → its 4-D transpose"

    def match(self, node, cx):
        flip = transpose_of(inputs(node)[0], (0, 2, 1))
        inner = producer(inputs(flip)[0], "Reshape") if flip is not None else None
        y = inputs(inner)[0] if inner is not None else None
        if y is None or rank(y) != 5 or rank(node.outputs[0]) != 4:
            raise no_match()
        if len(flip.outputs[0].outputs) != 1 or len(inner.outputs[0].outputs) != 1:
            raise no_match()
        if not _scores_key(node.outputs[0]):
            raise no_match()
        dims = current_dims()
        b, n1, n2, t, h = (dims.key(y, i) for i in range(5))
        heads = {arith("Mul", n1, n2), arith("Mul", n2, n1)}
        folded = {arith("Mul", b, x) for x in heads} | {arith("Mul", x, b) for x in heads}
        if not pinned(inner, [folded, {t}, {h}]) or not pinned(node, [{b}, heads, {h}, {t}]):
            raise no_match()
        m = Match(node, {"outer": node})
        m.stash(y=y)
        return m

    def rewrite(self, m, b):
        y, kt = m.y, m.root.outputs[0]
        lead = b.op("Shape", [y], {"end": 1}, name=f"{m.root.name}/batch")
        tail = b.op("Shape", [y], {"start": 3}, name=f"{m.root.name}/tail")
        for s, n in ((lead, 1), (tail, 2)):
            s.dtype, s.shape = np.dtype(np.int64), [n]
        heads = b.const(np.array([-1], dtype=np.int64), "heads")
        target = b.op("Concat", [lead, heads, tail], {"axis": 0}, name=f"{m.root.name}/target")
        target.dtype, target.shape = np.dtype(np.int64), [4]
        k4 = b.op("Reshape", [y, target], name=f"{m.root.name}/k4")
        k4.dtype = dtype_of(y)
        if kt.shape is not None:
            k4.shape = [kt.shape[i] for i in (0, 1, 3, 2)]
        return [b.op("Transpose", [k4], {"perm": [0, 1, 3, 2]}, like=kt, name=m.root.name)]


@register_rule
class UnfoldBroadcastKey(Rule):
    """The dynamo exporter's batch-1 bmm (Table Transformer's DETR-era attention): a 4-D query
    [1,N,S,H] times a Kᵀ folded to 3-D, which MatMul broadcasts as [1,N,H,T]::

        kᵀ = Transpose(Reshape(k4 [1,N,T,H], [N,T,H]), (0,2,1))

    is ``Transpose(k4, (0,1,3,2))`` for that product: the same elements, the key per head."""

    name = "unfold-broadcast-key"
    pattern = Op("Transpose", "flip")
    phase = "attention"
    priority = 1  # before fuse-attention reads the key
    exclusive = False  # its own checks: the folded key feeds this Transpose only
    summary = "a batch-1 Kᵀ folded to [N,H,T] against a 4-D query → its 4-D transpose"

    def match(self, node, cx):
        if tuple(node.attrs.get("perm", ())) != (0, 2, 1):
            raise no_match()
        k3 = inputs(node)[0]
        k4 = unfolded(k3)
        if k4 is None or len(k3.outputs) != 1 or current_dims().key(k4, 0) != ("int", 1):
            raise no_match()
        if not _scores_key(node.outputs[0], query_rank=4):
            raise no_match()
        m = Match(node, {"flip": node})
        m.stash(k4=k4)
        return m

    def rewrite(self, m, b):
        kt = b.op("Transpose", [m.k4], {"perm": [0, 1, 3, 2]}, name=m.root.name)
        kt.dtype = dtype_of(m.k4)
        if m.k4.shape is not None:
            kt.shape = [m.k4.shape[i] for i in (0, 1, 3, 2)]
        return [kt]


def _scores_key(kt: Tensor, query_rank: int | None = None) -> bool:
    """``kt`` (scaled or not) is the right operand of a Q·Kᵀ that reaches a Softmax; with
    ``query_rank``, of a query of that rank, and nothing else reads it."""
    if query_rank is not None and len(kt.outputs) != 1:
        return False
    for r in kt.outputs:
        if r.op in ("Mul", "Div") and r.inputs[0] is kt:
            return _scores_key(r.outputs[0], query_rank)
        folded = query_rank is not None
        if r.op == "MatMul" and r.inputs[1] is kt and _reaches_softmax(r.outputs[0], 4, folded):
            return query_rank is None or rank(r.inputs[0]) == query_rank
    return False

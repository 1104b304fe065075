"""Folded attention over one packed projection with a spatial merge, made readable per head.

SAM's and ViTDet's image encoders (transformers' ``SamVisionAttention``, windowed or global)
fold batch and heads after unpacking q, k and v, and unfold P·V into the image's rows and
columns::

    x5  = Transpose(Reshape(qkv, [B,S,3,N,H]), (2,0,3,1,4))                 [3,B,N,S,H]
    q3, k3, v3 = Squeeze(Split(Reshape(x5, [3,B·N,S,H]), axis 0), 0)       [B·N,S,H] each
    P3  = Softmax(q3·c · k3ᵀ + rel3)        (rel3: the decomposed relative positions, any term)
    out = Transpose(Reshape(MatMul(P3, v3), [B,N,h,w,H]), (0,2,3,1,4))     [B,h,w,N,H]

ViTDet (and the original segment-anything code) adds the relative positions to the scores regrouped
to [B·N,h,w,h,w] and regroups the sum back; ``unregroup-score-terms`` adds the terms,
regrouped back, to the scores instead (the same sums: every score gets its own bias when the
terms broadcast to that shape together, as ``rel_h[..., None] + rel_w[..., None, :]`` do).

``unpack-folded-heads`` gives each of q3, k3, v3 as ``Reshape(Gather(x5, i), [-1,S,H])``: the
part of the packed heads, then folded.  Row-major, folding axes 1 and 2 of x5 and taking a
part of axis 0 commute, so this is exact.  ``unsplit-spatial-merge`` writes the merge as
``Reshape(Transpose(Reshape(P·V, [B,N,S,H]), (0,2,1,3)), [B,h,w,N,H])``, exact when h·w = S and
the last element is H (or -1 with B provable): the same element order.  Together they give
the bmm spelling ``unfold-3d-softmax`` and ``fuse-attention`` read (the packed split, folded
heads, the relative positions as a folded term of the bias).
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import arith, rank, shape_elements
from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.ir import Node, Tensor, constant_value, dtype_of
from graphopt.opt.rewrite.engine import Builder, Match, NoMatch, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from ..activation import inputs, no_match, producer
from .core import pinned, strip_scale, unfolded
from .heads import part_index, squeezed_axis0, transpose_of
from .unfold3d import (
    check_pays,
    folded_heads,
    folded_pv,
    has_attention_kernel,
    qk_matmul,
    scaled_operand,
    static_dim,
)

_PERM_PACKED = (2, 0, 3, 1, 4)
_PERM_SPATIAL = (0, 2, 3, 1, 4)


def packed_fold(t: Tensor | None) -> tuple[Tensor, int] | None:
    """(x5, i) when ``t`` [B·N,S,H] is part i of ``Reshape(x5 [3,B,N,S,H], [3,B·N,S,H])``,
    taken by ``Squeeze(Split(·, axis 0), 0)`` or ``Gather(·, i, axis 0)``, and x5 is the
    packed heads' ``Transpose(·, (2,0,3,1,4))``; else None."""
    if rank(t) != 3:
        return None
    node = producer(t, ("Squeeze", "Gather"))
    if node is None:
        return None
    if node.op == "Gather":
        idx = constant_value(inputs(node)[1])
        if node.attrs.get("axis", 0) != 0 or idx is None or idx.ndim or idx.dtype.kind not in "iu":
            return None
        folded, index = inputs(node)[0], int(idx)
    else:
        split = producer(inputs(node)[0], "Split")
        if not squeezed_axis0(node) or split is None or split.attrs.get("axis", 0) != 0:
            return None
        folded, index = inputs(split)[0], part_index(split, inputs(node)[0])
    rs = producer(folded, "Reshape")
    x5 = inputs(rs)[0] if rs is not None else None
    if index is None or x5 is None or transpose_of(x5, _PERM_PACKED) is None:
        return None
    if rank(x5) != 5 or rank(folded) != 4:
        return None
    dims = current_dims()
    b, n = dims.key(x5, 1), dims.key(x5, 2)
    want = [{dims.key(x5, 0)}, {arith("Mul", b, n), arith("Mul", n, b)}]
    want += [{dims.key(x5, 3)}, {dims.key(x5, 4)}]
    count = dims.key(x5, 0)
    if not pinned(rs, want) or count[0] != "int" or not 0 <= index < count[1]:
        return None
    return x5, index


def _unpacked(b: Builder, x5: Tensor, index: int, like: Tensor) -> Tensor:
    """``Reshape(Gather(x5, index), [-1, S, H])``: the part [B,N,S,H], folded to [B·N,S,H]."""
    part = b.op(
        "Gather",
        [x5, b.const(np.array(index, dtype=np.int64), "part")],
        {"axis": 0},
        name=f"{b.anchor}/part{index}",
    )
    part.dtype = dtype_of(x5)
    if x5.shape is not None:
        part.shape = list(x5.shape[1:])
    tail = b.op("Shape", [part], {"start": 2}, name=f"{b.anchor}/part{index}_tail")
    tail.dtype, tail.shape = np.dtype(np.int64), [2]
    lead = b.const(np.array([-1], dtype=np.int64), "fold_heads")
    target = b.op("Concat", [lead, tail], {"axis": 0}, name=f"{b.anchor}/part{index}_target")
    target.dtype, target.shape = np.dtype(np.int64), [3]
    return b.op("Reshape", [part, target], like=like, name=f"{b.anchor}/part{index}_folded")


def _keys(t: Tensor) -> int | None:
    """The static key count of a folded key or value [B·N,T,H], else None."""
    key = current_dims().key(t, 1)
    return key[1] if key[0] == "int" else static_dim(t, 1)


def _packing(x5: Tensor) -> Node:
    """The Reshape of the projection to [B,S,3,N,H] under the packed heads ``x5``."""
    return producer(inputs(transpose_of(x5, _PERM_PACKED))[0], "Reshape")


def _flat_width(rs: Node) -> int | None:
    """The last element of [B,S,·] under which the packing Reshape ``rs`` can read a
    projection of rank > 3 (SAM's [B,h,w,3D]) as [B,S,3D] instead: -1, or 3·N·H when its
    target's B or S is -1; None when it is 3-D already or neither can be said."""
    if rank(inputs(rs)[0]) in (None, 3):
        return None
    elems = shape_elements(inputs(rs)[1], current_dims())
    if elems is None or len(elems) != 5:
        return None
    if ("int", -1) not in elems[:2]:
        return -1
    rest = [e[1] if e[0] == "int" and e[1] > 0 else None for e in elems[2:]]
    return None if None in rest else int(np.prod(rest))


def _flattened(b: Builder, rs: Node) -> Tensor:
    """``Reshape(x, [B, S, -1 | 3·N·H])`` from the packing Reshape's target [B,S,3,N,H]: the
    same values, the [B,S,3D] projection the kernel takes (the packing Reshape then reads
    it)."""
    x, target5 = inputs(rs)
    ends = [b.const(np.array([v], np.int64), f"bs{v}") for v in (0, 2)]
    lead = b.op("Slice", [target5, *ends], name=f"{rs.name}/bs")
    lead.dtype, lead.shape = np.dtype(np.int64), [2]
    rest = b.const(np.array([_flat_width(rs)], np.int64), "rest")
    target = b.op("Concat", [lead, rest], {"axis": 0}, name=f"{rs.name}/bsd_target")
    target.dtype, target.shape = np.dtype(np.int64), [3]
    zero = {"allowzero": rs.attrs.get("allowzero", 0)}
    flat = b.op("Reshape", [x, target], zero, name=f"{rs.name}/bsd")
    flat.dtype = dtype_of(x)
    if x.shape is not None and rs.outputs[0].shape is not None:
        y = rs.outputs[0].shape
        flat.shape = [y[0], y[1], None]
    return flat


@register_rule
class UnpackFoldedHeads(Rule):
    name = "unpack-folded-heads"
    pattern = Op("Softmax", "scores")
    phase = "attention"
    priority = 1  # before unfold-3d-softmax at the same Softmax
    exclusive = False  # changes only how q, k and v are read: the same values
    summary = "q/k/v unbound from folded packed heads [3,B·N,S,H] → each its part, then folded"

    def match(self, node, cx):
        pv = folded_pv(node, cx)
        qk = qk_matmul(inputs(node)[0])
        if qk is None:
            raise no_match()
        q_reader, qi, q3 = scaled_operand(qk, 0)
        kt = scaled_operand(qk, 1)[2]
        flip = transpose_of(kt, (0, 2, 1))
        if flip is None:
            raise no_match()
        reads = [(q_reader, qi, q3), (flip, 0, inputs(flip)[0]), (pv, 1, inputs(pv)[1])]
        found = [packed_fold(t) for _, _, t in reads]
        if all(f is None for f in found):
            raise no_match()
        if any(f is None and folded_heads(t) is None for f, (_, _, t) in zip(found, reads)):
            raise no_match()  # one of them is not folded heads: nothing would read it
        if not has_attention_kernel(cx, q3):
            raise no_match()
        k3 = inputs(flip)[0]
        check_pays(cx, node, _keys(k3), k3)
        m = Match(node, {"softmax": node})
        m.stash(parts=[(r, i, t, f) for (r, i, t), f in zip(reads, found) if f is not None])
        splits = {id(s): s for s in (_packing(f[0]) for f in found if f is not None)}
        m.stash(flatten=[s for s in splits.values() if _flat_width(s) is not None])
        return m

    def rewrite(self, m, b):
        for rs in m.flatten:
            rs.inputs[0] = _flattened(b, rs)
        for reader, i, t, (x5, index) in m.parts:
            reader.inputs[i] = _unpacked(b, x5, index, t)
        sm = m.root  # the anchor, made again: its scores now read the unpacked parts
        return [b.op("Softmax", inputs(sm), dict(sm.attrs), like=sm.outputs[0], name=sm.name)]


def _spatial_merge(target: Tensor, ctx: Tensor, heads: int, batch: set) -> list | None:
    """The elements [B,N,h,w,H] of the Reshape ``target`` unfolding P·V ``ctx`` [B·N,S,H] when
    N = ``heads``, h·w = S, and one of B and H is -1 or both are provable (B: one of
    ``batch``, what the value's heads say B is), else None."""
    dims = current_dims()
    elems = shape_elements(target, dims)
    if elems is None or len(elems) != 5 or elems[1] != ("int", heads):
        return None
    e0, _, e2, e3, e4 = elems
    if any(e[0] == "int" and e[1] <= 0 for e in (e2, e3)) or e0 == ("int", 0):
        return None
    s, h = dims.key(ctx, 1), dims.key(ctx, 2)
    if s not in (arith("Mul", e2, e3), arith("Mul", e3, e2)):
        return None
    if e0 == ("int", -1):  # B inferred: exact when the last is H
        return elems if e4 == h else None
    bn = dims.key(ctx, 0)
    proven = e0 in batch or bn in (arith("Mul", e0, elems[1]), arith("Mul", elems[1], e0))
    if e4 != h and not (e4 == ("int", -1) and proven):
        return None
    return elems


@register_rule
class UnsplitSpatialMerge(Rule):
    name = "unsplit-spatial-merge"
    pattern = Op("Transpose", "merge")
    phase = "attention"
    priority = 1  # before fuse-attention at the same Transpose
    exclusive = False  # the same values, in the same order
    summary = "P·V [B·N,S,H] merged as [B,N,h,w,H] → (0,2,3,1,4) → as [B,N,S,H] → (0,2,1,3)"

    def match(self, node, cx):
        if tuple(node.attrs.get("perm", ())) != _PERM_SPATIAL:
            raise no_match()
        rs = producer(inputs(node)[0], "Reshape")
        pv = producer(inputs(rs)[0], "MatMul") if rs is not None else None
        if pv is None or rank(pv.outputs[0]) != 3:
            raise no_match()
        sm = producer(inputs(pv)[0], "Softmax")
        if sm is None or [r for r in rs.outputs[0].outputs if r.op != "Shape"] != [node]:
            raise no_match()
        if qk_matmul(inputs(sm)[0]) is None:
            raise no_match()  # not scores fuse-attention reads (a FusedMatMul took them)
        v4 = unfolded(inputs(pv)[1])
        found = packed_fold(inputs(pv)[1])
        dims = current_dims()
        if v4 is not None:
            n, batch = dims.key(v4, 1), {dims.key(v4, 0)}
        elif found is not None:
            n, batch = dims.key(found[0], 2), {dims.key(found[0], 1)}
        else:
            raise no_match()
        heads = n[1] if n[0] == "int" and n[1] > 0 else None
        if heads is None or _spatial_merge(inputs(rs)[1], pv.outputs[0], heads, batch) is None:
            raise no_match()
        try:  # said by unpack-folded-heads at the Softmax
            check_pays(cx, sm, _keys(inputs(pv)[1]), inputs(pv)[1])
        except NoMatch:
            raise no_match() from None
        m = Match(node, {"merge": node, "unfold": rs, "softmax": sm})  # the Softmax: kept
        m.stash(pv=pv, heads=heads)
        return m

    def rewrite(self, m, b):
        ctx, root = m.pv.outputs[0], m.root
        target5 = inputs(m.bindings["unfold"])[1]
        lead = b.op(
            "Slice",
            [target5, b.const(np.array([0], np.int64), "lead0"), b.const(np.array([2], np.int64))],
            name=f"{root.name}/lead",
        )
        lead.dtype, lead.shape = np.dtype(np.int64), [2]
        tail = b.op("Shape", [ctx], {"start": 1}, name=f"{root.name}/tail")
        tail.dtype, tail.shape = np.dtype(np.int64), [2]
        target4 = b.op("Concat", [lead, tail], {"axis": 0}, name=f"{root.name}/heads_target")
        target4.dtype, target4.shape = np.dtype(np.int64), [4]
        heads = b.op("Reshape", [ctx, target4], name=f"{root.name}/heads")
        heads.dtype = dtype_of(ctx)
        if ctx.shape is not None:
            lead = ctx.shape[0] // m.heads if isinstance(ctx.shape[0], int) else None
            heads.shape = [lead, m.heads, *ctx.shape[1:]]
        merged = b.op("Transpose", [heads], {"perm": [0, 2, 1, 3]}, name=f"{root.name}/bsnh")
        merged.dtype = dtype_of(ctx)
        if heads.shape is not None:
            merged.shape = [heads.shape[i] for i in (0, 2, 1, 3)]
        order = b.const(np.array(_PERM_SPATIAL, dtype=np.int64), "spatial_order")
        target = b.op("Gather", [target5, order], {"axis": 0}, name=f"{root.name}/target")
        target.dtype, target.shape = np.dtype(np.int64), [5]
        zero = {"allowzero": m.bindings["unfold"].attrs.get("allowzero", 0)}
        out = b.op("Reshape", [merged, target], zero, like=root.outputs[0], name=f"{root.name}/hw")
        return [out]


def _regrouped_terms(z: Tensor) -> tuple[Node, list[Tensor]] | None:
    """(the Reshape regrouping the scores, the terms) when ``z`` = ``Reshape(s) + t [+ t …]``
    with ``s`` Q·Kᵀ (scaled or not) and each term of no higher rank, else None."""
    terms = []
    while (add := producer(z, "Add")) is not None and len(terms) < 4:
        a0, a1 = inputs(add)
        spine = 0 if producer(a0, ("Add", "Reshape")) is not None and not _term_like(a0) else 1
        z, term = (a0, a1) if spine == 0 else (a1, a0)
        terms.append(term)
    r1 = producer(z, "Reshape")
    s = inputs(r1)[0] if r1 is not None else None
    if not terms or s is None or producer(strip_scale(s)[0], "MatMul") is None:
        return None
    if len(z.outputs) != 1 or any(rank(t) is None or rank(t) > rank(z) for t in terms):
        return None
    return r1, terms[::-1]


def _term_like(t: Tensor) -> bool:
    """Whether ``t`` is an Unsqueeze'd or broadcast term rather than the regrouped scores."""
    return producer(t, ("Unsqueeze", "Expand")) is not None


def _provably_full(terms: list[Tensor], z: Tensor) -> bool:
    """Whether the terms broadcast together to ``z``'s shape, axis by axis (so that their sum,
    regrouped back, is one bias per score): a static size some term has, or a symbolic one
    (the batch) where some term's is symbolic too: a broadcast term has 1 there, statically.
    Should a symbolic one be 1 at run time after all, the Reshape back fails: never a wrong
    number."""
    dims = current_dims()
    r = rank(z)
    for ax in range(r):
        want = dims.key(z, ax)
        if want == ("int", 1):
            continue
        keys = {dims.key(t, ax - (r - rank(t))) for t in terms if ax - (r - rank(t)) >= 0}
        if want not in keys and (want[0] == "int" or all(k[0] == "int" for k in keys)):
            return False
    return True


@register_rule
class UnregroupScoreTerms(Rule):
    name = "unregroup-score-terms"
    pattern = Op("Reshape", "back")
    phase = "attention"
    priority = 1  # before fuse-attention and the unfolding rules read the Softmax
    exclusive = False  # the same sums, element by element
    summary = "terms added to the scores regrouped (ViTDet's [B·N,h,w,h,w]) → regrouped back"

    def match(self, node, cx):
        y = node.outputs[0]
        readers = [r for r in y.outputs if r.op != "Shape"]
        if len(readers) != 1 or readers[0].op != "Softmax" or cx.ir.is_graph_output(y):
            raise no_match()
        found = _regrouped_terms(inputs(node)[0])
        if found is None:
            raise no_match()
        r1, terms = found
        s = inputs(r1)[0]
        dims = current_dims()
        if rank(s) != rank(y) or not pinned(node, [{dims.key(s, i)} for i in range(rank(s))]):
            raise no_match()
        if not _provably_full(terms, r1.outputs[0]):
            raise no_match()  # a term broadcast over some axis: not one bias per score
        keys = dims.key(s, rank(s) - 1)
        bound = cx.target.slower_below.get("MultiHeadAttention", (0, ""))[0]
        if keys[0] == "int" and keys[1] < bound:
            raise no_match()  # biased and too short: said where the attention is read
        adds, t = [], inputs(node)[0]
        while t is not r1.outputs[0]:
            adds.append(producer(t, "Add"))
            t = next(i for i in inputs(adds[-1]) if i not in terms)
        bound = {"back": node, "regroup": r1, "softmax": readers[0]}  # the Softmax: kept
        bound |= {f"add{i}": a for i, a in enumerate(adds)}
        m = Match(node, bound)
        m.stash(scores=s, terms=terms)
        return m

    def rewrite(self, m, b):
        bias = m.terms[0]
        for t in m.terms[1:]:
            bias = b.op("Add", [bias, t], name=f"{m.root.name}/terms")
            bias.dtype = dtype_of(m.scores)
        back = b.op("Shape", [m.scores], name=f"{m.root.name}/scores_shape")
        bias = b.op("Reshape", [bias, back], like=m.scores, name=f"{m.root.name}/bias")
        return [b.op("Add", [m.scores, bias], like=m.root.outputs[0], name=f"{m.root.name}/sum")]

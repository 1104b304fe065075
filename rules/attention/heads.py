"""Stage 2 (lift): how q, k and v are split into heads, and how many heads there are.

Each exporter spelling of ``x [B,S,D] → [B,N,S,H]`` (``[B,N,H,T]`` for Kᵀ) is one function that
returns a typed :class:`HeadSplit` or None:

* batch-first: ``Transpose(Reshape(x, [B,S,N,H]), (0,2,1,3))``; Kᵀ with ``(0,2,3,1)``, or
  ``(0,2,1,3)`` then ``(0,1,3,2)``, or dynamo's 3-D ``Reshape(Transpose(Reshape(y, [-1,T,H]),
  (0,2,1)), [B,N,H,T])``;
* sequence-first (torch.nn.MultiheadAttention): ``Reshape(Transpose(Reshape(x [S,B,D],
  [S,-1,H]), (1,0,2)), [B,N,S,H])``;
* packed (timm ViT, Swin, DeiT): ``Gather(Transpose(Reshape(x, [B,S,3,N,H]), (2,0,3,1,4)), i)``.

:func:`head_count` then reads ``(N, H)`` from the Reshape targets (constants or shape glue).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphopt.opt.graph.dims import Dims, Key, arith, rank, shape_elements
from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.ir import Constant, Node, Tensor, Variable, constant_value

from ..activation import inputs, producer, scalar
from .core import past_empty_concat, rotary_of

PERM_BNSH = (0, 2, 1, 3)
PERM_BNHS = (0, 2, 3, 1)
_PERM_PACKED = (2, 0, 3, 1, 4)
_SWAP_LAST = (0, 1, 3, 2)


@dataclass
class HeadSplit:
    """``x`` [B,S,D] (or [S,B,D]) split into heads by ``reshape``; ``nodes`` are the other nodes
    of the split, consumers first."""

    x: Tensor
    reshape: Node | None  # None for "bnsh": ``x`` is already split
    layout: str  # "bsd" | "sbd" | "packed" | "bnsh" | "bsnh" | "bnht"
    nodes: list[Node] = field(default_factory=list)
    index: int | None = None  # packed: which of q, k, v
    merge: Node | None = None  # sequence-first: the Reshape that unfolds batch × heads
    rotary: Node | None = None  # a RotaryEmbedding over the [B,N,S,H] heads, redone on ``x``
    source: HeadSplit | None = None  # "bnsh" per-head math: the split the walk ended at
    kept: bool = False  # "bnsh" query: the per-head tensor, given to the kernel as [B,S,N·H]


def transpose_of(t: Tensor | None, perm: tuple[int, ...]) -> Node | None:
    """The Transpose with permutation ``perm`` computing ``t``, or None."""
    node = producer(t, "Transpose")
    if node is None or tuple(node.attrs.get("perm", ())) != perm:
        return None
    return node


def split_heads(t: Tensor | None, perm: tuple[int, ...]) -> HeadSplit | None:
    """The head split computing ``t`` (Q or V with ``PERM_BNSH``, Kᵀ with ``PERM_BNHS``)."""
    tr = transpose_of(t, perm)
    chain = [tr] if tr is not None else []
    if tr is None and perm == PERM_BNHS:  # K as (0,2,1,3) then (0,1,3,2), or dynamo's 3-D Kᵀ
        outer = transpose_of(t, _SWAP_LAST)
        inner = transpose_of(inputs(outer)[0], PERM_BNSH) if outer is not None else None
        chain = [outer, inner] if inner is not None else []
        three_d = _k_through_3d(t) if inner is None else None
        if three_d is not None and rank(three_d[1]) == 5:  # the unbound part, squeeze folded
            return _packed_part_of(three_d[1], three_d[0])
        squeeze = producer(three_d[1], "Squeeze") if three_d is not None else None
        if squeeze is not None and squeezed_axis0(squeeze):  # the unbound part
            return _packed_part_of(inputs(squeeze)[0], [*three_d[0], squeeze])
        if three_d is not None and transpose_of(three_d[1], PERM_BNSH) is not None:
            chain = three_d[0] + [transpose_of(three_d[1], PERM_BNSH)]
        tr = chain[-1] if chain else None
    if tr is None:
        return _split_sbd(t, perm) or _split_packed(t, perm)
    rs = producer(inputs(tr)[0], "Reshape")
    if rs is None:
        return None
    return HeadSplit(inputs(rs)[0], rs, "bsd", chain)


def rotated_split(t: Tensor | None) -> HeadSplit | None:
    """Q as ``RotaryEmbedding(heads)`` [→ Concat with an empty pass-through] over a batch-first
    head split (decoders rotate the heads
    [B,N,S,H] after the split): the split, the rotary among its nodes, to be redone on the
    [B,S,D] source with ``num_heads`` (the same per-head rotation)."""
    t, empty = past_empty_concat(t)
    rot = rotary_of(t)
    if rot is None or rank(inputs(rot)[0]) not in (None, 4):
        return None
    split = split_heads(inputs(rot)[0], PERM_BNSH)
    if split is None or split.layout != "bsd":
        return None
    split.nodes[:0] = [*empty, rot]
    split.rotary = rot
    return split


#: per-head ops: the output has the layout of input 0, each head computed from its own head
_PER_HEAD_UNARY = ("Neg", "Clip", "Cast", "Identity", "Sqrt", "Reciprocal", "Abs", "Exp", "Tanh")
_PER_HEAD_NORMS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")
_PER_HEAD_BINARY = ("Add", "Sub", "Mul", "Div", "Pow")
_PER_HEAD_REDUCE = ("ReduceMean", "ReduceSum", "ReduceL2")
_WALK_DEPTH = 24


def per_head_split(t: Tensor | None) -> HeadSplit | None:
    """A query [B,N,S,H] computed head by head from a head split: the walk back from ``t``
    passes only per-head ops — RotaryEmbedding (ONNX or com.microsoft), norms over the last
    (head) axis (LayerNormalization, SimplifiedLayerNormalization, RMSNormalization, or their
    ReduceMean/Pow/Sqrt/Div spelling), element-wise ops whose other operand does not carry the
    heads (scale Muls, cos/sin, a norm's weight), Clip, and Slice/Split/Concat along the head
    axis (partial rotary: a rotated slice and the pass-through one concatenated back; any
    step, and the pair axis of interleaved rotary stacked, unbound or refolded), a fused
    rotary over the merged heads, one Split of the heads put back in order by a Concat (a
    norm per head) — before or after the heads' Transpose, and every path ends at the same
    split.  The per-head tensor stays as the model computes it; the kernel takes it back as
    [B,S,N·H]."""
    if rank(t) != 4:
        return None
    found: dict[int, object] = {}
    root = _walk_heads(t, True, _WALK_DEPTH, found)
    if not isinstance(root, HeadSplit):
        return None
    return HeadSplit(t, None, "bnsh", [], source=root, kept=True)


def per_head_key(kt: Tensor | None) -> HeadSplit | None:
    """Kᵀ as ``Transpose(k, (0,2,3,1))`` of a key [B,T,N,H] computed head by head before the
    heads' Transpose (an encoder's rotary or q/k norm, with the two Transposes fused into
    one; or anything else [B,T,N,H]: Conditional DETR's per-head Concat of content and
    position parts): ``k`` kept as it is, layout "bsnh"; the kernel takes it back as
    [B,T,N·H]."""
    tr = transpose_of(kt, PERM_BNHS)
    k = inputs(tr)[0] if tr is not None else None
    if rank(k) != 4:
        return None
    root = _walk_heads(k, False, _WALK_DEPTH, {})
    if not isinstance(root, HeadSplit):  # any [B,T,N,H] key: attention per head is the same
        return HeadSplit(k, None, "bsnh", [tr], kept=True)
    return HeadSplit(k, None, "bsnh", [tr], source=root, kept=True)


def transposed_key(kt: Tensor | None, q: Tensor) -> HeadSplit | None:
    """Kᵀ [B,N,H,T] transposed into place from any other order, with the query's batch and
    heads (XLNet's sequence-first ``Transpose(k [T,B,N,H], (1,2,3,0))``): kept as it is,
    layout "bnht"; the kernel takes it back as [B,T,N·H].  Attention per (b, n) is the
    kernel's whatever order the key was computed in."""
    tr = producer(kt, "Transpose")
    if tr is None or rank(kt) != 4 or rank(q) != 4:
        return None
    dims = current_dims()
    if any(dims.key(kt, i) != dims.key(q, i) for i in (0, 1)):
        return None
    return HeadSplit(kt, None, "bnht", [], kept=True)


def _walk_heads(t: Tensor | None, bnsh: bool, depth: int, memo: dict) -> object:
    """The head split ``t`` is computed from per head (a :class:`HeadSplit`), None where ``t``
    does not carry the heads (a side operand), or False where it does but not per head."""
    key = (id(t), bnsh)
    if key not in memo:
        memo[key] = False  # cycle guard
        memo[key] = _walk_heads_node(t, bnsh, depth, memo)
    return memo[key]


def _walk_heads_node(t: Tensor | None, bnsh: bool, depth: int, memo: dict) -> object:
    if t is None or isinstance(t, Constant) or constant_value(t) is not None:
        return None
    if bnsh:
        split = split_heads(t, PERM_BNSH)
        if split is not None and split.layout == "bsd":
            return split
    elif (rs := producer(t, "Reshape")) is not None and (rank(inputs(rs)[0]) == 3 or rank(t) == 4):
        if _same_dims(rs):
            return _walk_heads(inputs(rs)[0], bnsh, depth - 1, memo)
        if (merged := _merged_rotary(rs)) is not None:
            inner = _walk_heads(merged, bnsh, depth - 1, memo)
            if isinstance(inner, HeadSplit):
                return inner
        if _keeps_leading(rs):  # GPT-J's interleaved rotary: [B,S,N,H/2,2] flattened back
            inner = _walk_heads(inputs(rs)[0], bnsh, depth - 1, memo)
            if isinstance(inner, HeadSplit) or (inner is None and _one_head(t)):
                return inner  # the split, or cos/sin repeated for every head
        # [B,S,N,H] from the projection [B,S,D], or from a fused projection's head groups
        # [B,S,G,r,H] (Falcon's query_key_value): where it came from does not matter, the
        # kept tensor's own N and H are what the kernel is given
        return HeadSplit(inputs(rs)[0], rs, "bsd")  # its Transpose is on the walked path
    elif (part := _packed_part(t)) is not None:
        return part
    node = t.inputs[0] if isinstance(t, Variable) and t.inputs else None
    if node is None or depth == 0:
        return None  # a graph input or too far: not the heads
    ins = inputs(node)
    if node.op == "Transpose" and bnsh:
        perm = tuple(node.attrs.get("perm", ()))
        if perm != PERM_BNSH:
            return False
        inner = _walk_heads(ins[0], False, depth - 1, memo)
        if isinstance(inner, HeadSplit) and inner.layout == "bsd" and not inner.nodes:
            return HeadSplit(inner.x, inner.reshape, "bsd", [node])
        return False if inner is not None else None
    if node.op == "Concat" and (split := _regathered(node, bnsh, depth)) is not None:
        return _walk_heads(inputs(split)[0], bnsh, depth - 1, memo)
    heads_in = _head_inputs(node, ins, bnsh)
    if heads_in is None:
        return None  # not a per-head op: ``t`` is a side operand
    roots = [_walk_heads(i, bnsh, depth - 1, memo) for i in heads_in]
    splits = [r for r in roots if r is not None]
    if not splits or any(r is False for r in splits):
        return False if splits else None
    if any(s.reshape is not splits[0].reshape for s in splits):
        return False
    if node.op in _PER_HEAD_BINARY:  # a side operand must not carry other heads
        for i in ins:
            if i is not None and _walk_heads(i, bnsh, depth - 1, memo) is None:
                if rank(i) is None or rank(i) > rank(t):
                    return False
    return splits[0]


#: the axis of q/k/v in a packed [B,S,3,N,H] (ModernBERT) or [B,S,N,3,H] (Persimmon, Bloom)
_PACKED_AXES = (2, -3, 3, -2)


def _packed_part(t: Tensor | None) -> HeadSplit | None:
    """[B,S,N,H] as one part of a packed projection before the heads' Transpose: ModernBERT's
    ``Squeeze(Split(Reshape(x, [B,S,3,N,H]), axis=2), axis=2)``, or a Gather on that axis, or
    the same on axis 3 of ``[B,S,N,3,H]`` (q, k and v interleaved per head)."""
    if rank(t) != 4:
        return None
    node = producer(t, ("Squeeze", "Gather"))
    if node is None:
        return None
    ins = inputs(node)
    if node.op == "Squeeze":
        axes = constant_value(ins[1]) if len(ins) > 1 else node.attrs.get("axes")
        axes = list(np.asarray(axes).reshape(-1)) if axes is not None else None
        if axes is None or len(axes) != 1 or axes[0] not in _PACKED_AXES:
            return None
        node = producer(ins[0], "Split")
        if node is None or node.attrs.get("axis", 0) % 5 != axes[0] % 5:  # of [B,S,·,·,H]
            return None
    elif scalar(ins[1]) is None or constant_value(ins[1]).ndim:
        return None
    if node.attrs.get("axis", 0) not in _PACKED_AXES:
        return None
    rs = producer(inputs(node)[0], "Reshape")
    if rs is None or rank(rs.outputs[0]) != 5 or rank(inputs(rs)[0]) != 3:
        return None
    return HeadSplit(inputs(rs)[0], rs, "bsd")


def _same_dims(reshape: Node) -> bool:
    """Whether a Reshape of a rank-4 tensor provably keeps every dim (Falcon's
    ``transpose(1, 2).reshape(B, N, S, H)`` after the heads' Transpose)."""
    x, out = inputs(reshape)[0], reshape.outputs[0]
    if rank(x) != 4 or rank(out) != 4:
        return False
    dims = current_dims()
    elems = shape_elements(inputs(reshape)[1], dims)
    if elems is None or len(elems) != 4:
        return False
    copy = _copy_key(reshape)
    want = [dims.key(x, i) for i in range(4)]
    free = [i for i, e in enumerate(elems) if e == ("int", -1)]
    if len(free) > 1:
        return False
    return all(e in (*copy, w) for i, (e, w) in enumerate(zip(elems, want)) if i not in free)


def _head_inputs(node: Node, ins: list[Tensor | None], bnsh: bool = True) -> list[Tensor] | None:
    """The inputs of ``node`` that may carry the heads when it is a per-head op, else None."""
    op = node.op
    if op == "Reshape" and bnsh and _same_dims(node):
        return [ins[0]]
    if (
        not bnsh
        and rank(ins[0]) == 4
        and (
            (op == "Slice" and _slices_axis(node, ins, 2))
            or (op == "Split" and node.attrs.get("axis", 0) in (2, -2))
            or (op == "Gather" and node.attrs.get("axis", 0) in (2, -2) and _head_list(ins[1]))
        )
    ):
        return [ins[0]]  # [B,S,N,H] before the heads' Transpose: some of the heads
    if op == "RotaryEmbedding" or op in _PER_HEAD_UNARY:
        if op == "Clip" and any(scalar(i) is None for i in ins[1:] if i is not None):
            return None
        return [ins[0]]
    if op in _PER_HEAD_NORMS:
        return [ins[0]] if node.attrs.get("axis", -1) in (-1, 3) else None
    if op in _PER_HEAD_BINARY:
        if op == "Pow" and scalar(ins[1]) is None:
            return None
        return [i for i in ins if i is not None]
    if op in _PER_HEAD_REDUCE:
        axes = constant_value(ins[1]) if len(ins) > 1 and ins[1] is not None else None
        axes = node.attrs.get("axes") if axes is None else list(np.asarray(axes).reshape(-1))
        keep = node.attrs.get("keepdims", 1)
        return [ins[0]] if keep and axes is not None and list(axes) in ([-1], [3]) else None
    if op in ("Slice", "Split", "Concat") and _last_axis_only(node, ins):
        return [i for i in (ins if op == "Concat" else ins[:1]) if i is not None]
    if op in ("Unsqueeze", "Squeeze") and _last_axes(node, ins, op == "Unsqueeze"):
        return [ins[0]]  # interleaved rotary: a pair axis stacked, or one unbound
    if op == "Gather" and rank(ins[0]) == 5 and node.attrs.get("axis", 0) in (-1, 4):
        return [ins[0]] if scalar(ins[1]) is not None else None
    if op == "Reshape" and _keeps_leading(node):
        return [ins[0]]
    return None


def _last_axes(node: Node, ins: list[Tensor | None], unsqueeze: bool) -> bool:
    """An Unsqueeze that appends a last axis to a rank-4 tensor, or a Squeeze of the last
    axis of a rank-5 one: each head's values stay in that head."""
    axes = constant_value(ins[1]) if len(ins) > 1 and ins[1] is not None else None
    axes = node.attrs.get("axes") if axes is None else axes
    if axes is None:
        return False
    axes = [int(a) for a in np.asarray(axes).reshape(-1)]
    return rank(ins[0]) == (4 if unsqueeze else 5) and axes in ([-1], [4])


def _keeps_leading(reshape: Node) -> bool:
    """Whether a Reshape between rank 4 and 5 provably keeps the leading three dims (batch,
    sequence and heads in either order) and only refolds the last ones: ``[..., H] →
    [..., H/2, 2]`` and back."""
    x, out = inputs(reshape)[0], reshape.outputs[0]
    if {rank(x), rank(out)} != {4, 5}:
        return False
    dims = current_dims()
    elems = shape_elements(inputs(reshape)[1], dims)
    if elems is None or len(elems) != rank(out):
        return False
    copy = _copy_key(reshape)
    if any(elems[i] not in (*copy, dims.key(x, i)) for i in range(3)):
        return False
    tail = elems[3:]
    return sum(e == ("int", -1) for e in tail) <= 1 and all(
        e[0] == "int" and (e[1] > 0 or e[1] == -1) for e in tail
    )


def _regathered(concat: Node, bnsh: bool, depth: int) -> Node | None:
    """The Split whose parts along the heads axis ``concat`` puts back in order, each part
    computed from its own heads (StableLM's ``cat([norm_i(h_i) for h_i in split(q, 1, 1)],
    1)``: a LayerNorm with its own weights per head), or None."""
    axis = 1 if bnsh else 2
    if rank(concat.outputs[0]) != 4 or concat.attrs.get("axis") not in (axis, axis - 4):
        return None
    parts = [_split_part(i, bnsh, depth) for i in inputs(concat)]
    split = parts[0][0] if parts and parts[0] is not None else None
    if split is None or split.attrs.get("axis", 0) not in (axis, axis - 4):
        return None
    if parts != [(split, k) for k in range(len(split.outputs))]:
        return None
    return split


def _merged_rotary(split: Node) -> Tensor | None:
    """``t`` [B,S,N,R] when ``split`` is ``Reshape(RotaryEmbedding(Reshape(t, [B,S,N·R]),
    num_heads=N), [B,S,N,R])``: a fused rotary over the merged heads, each head rotated on
    its own (the rotary fusion's spelling of a rotation before the heads' Transpose)."""
    rot = rotary_of(inputs(split)[0])
    if rot is None or rank(inputs(split)[0]) not in (None, 3) or not rot.attrs.get("num_heads"):
        return None
    merge = producer(inputs(rot)[0], "Reshape")
    t = inputs(merge)[0] if merge is not None else None
    if rank(t) != 4 or rank(split.outputs[0]) != 4:
        return None
    dims = current_dims()
    heads = int(rot.attrs["num_heads"])
    same = all(dims.key(t, i) == dims.key(split.outputs[0], i) for i in range(4))
    return t if same and dims.key(t, 2) == ("int", heads) else None


def _one_head(t: Tensor) -> bool:
    """Whether [B,S,N,H] ``t`` has one head, statically: broadcast over the heads."""
    return t.shape is not None and len(t.shape) == 4 and t.shape[2] == 1


def _split_part(t: Tensor | None, bnsh: bool, depth: int) -> tuple[Node, int] | None:
    """(Split, output index) that ``t`` is computed from through per-head ops with one input
    carrying the heads, or None."""
    for _ in range(depth):
        node = t.inputs[0] if isinstance(t, Variable) and t.inputs else None
        if node is None:
            return None
        if node.op == "Split":
            return node, [o.name for o in node.outputs].index(t.name)
        ins = inputs(node)
        heads = [i for i in (_head_inputs(node, ins, bnsh) or []) if constant_value(i) is None]
        if node.op in _PER_HEAD_BINARY:
            axis = 1 if bnsh else 2
            heads = [i for i in heads if rank(i) == 4 and i.shape and i.shape[axis] != 1]
        if len(heads) != 1:
            return None
        t = heads[0]
    return None


def _head_list(indices: Tensor | None) -> bool:
    """Constant 1-D indices (Falcon's ``fused_qkv[..., [-2], :]``: the rank is kept)."""
    value = constant_value(indices)
    return value is not None and value.ndim == 1


def _slices_axis(node: Node, ins: list[Tensor | None], axis: int) -> bool:
    """Whether the Slice ``node`` of a rank-4 (or, for the last axis, rank-5) tensor cuts
    only ``axis`` (step 1; any step on the last axis: interleaved rotary's ``x[..., ::2]``)."""
    r = rank(ins[0]) or 4
    axes = constant_value(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    steps = constant_value(ins[4]) if len(ins) > 4 and ins[4] is not None else None
    last = axis == r - 1
    if axes is None or (not last and steps is not None and np.any(np.asarray(steps) != 1)):
        return False
    if r != 4 and not last:
        return False
    return list(np.asarray(axes).reshape(-1)) in ([axis - r], [axis])


def _last_axis_only(node: Node, ins: list[Tensor | None]) -> bool:
    last = (rank(ins[0]) or 4) - 1
    if last not in (3, 4):
        return False
    if node.op == "Slice":
        return _slices_axis(node, ins, last)
    return node.attrs.get("axis", 0 if node.op == "Split" else None) in (-1, last)


def already_split(t_in: Tensor | None, perm: tuple[int, ...]) -> HeadSplit | None:
    """K or V given as [B,N,T,H] (a KV cache: ``Concat(past, new)``, also a graph output, or a
    cache input used as it is): V itself, Kᵀ as ``Transpose(K, (0,1,3,2))`` or dynamo's 3-D
    transpose.  The kernel takes such a key and value as they are."""
    t, chain = _untranspose_k(t_in, perm)
    if t is None and perm == PERM_BNHS and (three_d := _k_through_3d(t_in)) is not None:
        chain, t = three_d
    if t is None or rank(t) != 4:
        return None
    return HeadSplit(t, None, "bnsh", chain)


def _untranspose_k(t: Tensor | None, perm: tuple[int, ...]) -> tuple[Tensor | None, list[Node]]:
    """For Kᵀ: the K under its final (0,1,3,2) Transpose, and that node."""
    if perm != PERM_BNHS:
        return t, []
    outer = transpose_of(t, _SWAP_LAST)
    return (inputs(outer)[0], [outer]) if outer is not None else (None, [])


def _split_packed(t: Tensor | None, perm: tuple[int, ...]) -> HeadSplit | None:
    """``Gather(Transpose(Reshape(x, [B,S,3,N,H]), (2,0,3,1,4)), i)`` [→ (0,1,3,2) for K], or
    the part as ``Squeeze(Split(·, axis 0), 0)`` (``unbind``: timm's ``qkv.unbind(0)``)."""
    t, chain = _untranspose_k(t, perm)
    part = producer(t, ("Gather", "Squeeze"))
    if part is not None and part.op == "Squeeze":
        if not squeezed_axis0(part):
            return None
        return _packed_part_of(inputs(part)[0], chain + [part])
    if part is None or int(part.attrs.get("axis", 0)) != 0:
        return None
    index = scalar(inputs(part)[1])
    tr = transpose_of(inputs(part)[0], _PERM_PACKED)
    rs = producer(inputs(tr)[0], "Reshape") if tr is not None else None
    if rs is None or index not in (0.0, 1.0, 2.0) or constant_value(inputs(part)[1]).ndim:
        return None
    return HeadSplit(inputs(rs)[0], rs, "packed", chain + [part, tr], index=int(index))


def _packed_part_of(t: Tensor | None, chain: list[Node]) -> HeadSplit | None:
    """``t`` [1,B,N,S,H] as part i of ``Split(Transpose(Reshape(x, [B,S,3,N,H]), (2,0,3,1,4)),
    axis 0)`` (q, k or v of a packed projection, not yet squeezed)."""
    split = producer(t, "Split")
    if split is None or split.attrs.get("axis", 0) != 0 or rank(t) != 5:
        return None
    index = part_index(split, t)
    tr = transpose_of(inputs(split)[0], _PERM_PACKED)
    rs = producer(inputs(tr)[0], "Reshape") if tr is not None else None
    if rs is None or index not in (0, 1, 2):
        return None
    return HeadSplit(inputs(rs)[0], rs, "packed", chain + [split, tr], index=index)


def part_index(node: Node, t: Tensor) -> int | None:
    """The index along axis 0 of the one-element part ``t`` that ``node`` (a Split) gives, or
    None when its sizes are unknown or that part is not one element."""
    k = list(node.outputs).index(t)
    ins = inputs(node)
    sizes = constant_value(ins[1]) if len(ins) > 1 else node.attrs.get("split")
    if sizes is None:
        whole = current_dims().key(ins[0], 0)
        return k if whole == ("int", len(node.outputs)) else None
    sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
    return sum(sizes[:k]) if len(sizes) == len(node.outputs) and sizes[k] == 1 else None


def squeezed_axis0(node: Node) -> bool:
    """``node`` (a Squeeze) removes axis 0 alone."""
    ins = inputs(node)
    axes = constant_value(ins[1]) if len(ins) > 1 else node.attrs.get("axes")
    return axes is not None and [int(a) for a in np.asarray(axes).reshape(-1)] == [0]


def _split_sbd(t: Tensor | None, perm: tuple[int, ...]) -> HeadSplit | None:
    """``Reshape(Transpose(Reshape(x, [S,-1,H]), (1,0,2)), [B,N,S,H])`` [→ (0,1,3,2) for K];
    or, for K, dynamo's 3-D Kᵀ ``Reshape(Transpose(Reshape(x, [S,-1,H]), (1,2,0)), [B,N,H,T])``
    (``nn.MultiheadAttention``; the (1,2,0) also as (1,0,2) then (0,2,1))."""
    merge = producer(t, "Reshape") if perm == PERM_BNHS else None
    flips = _sbd_kt(merge)
    if flips:
        chain, tr = [merge] + flips[:-1], flips[-1]
    else:
        t, chain = _untranspose_k(t, perm)
        merge = producer(t, "Reshape")
        tr = transpose_of(inputs(merge)[0], (1, 0, 2)) if merge is not None else None
        chain = chain + [merge]
    rs = producer(inputs(tr)[0], "Reshape") if tr is not None else None
    if rs is None:
        return None
    return HeadSplit(inputs(rs)[0], rs, "sbd", chain + [tr], merge=merge)


def _sbd_kt(merge: Node | None) -> list[Node]:
    """The Transposes, consumers first, that turn a sequence-first split [S,B·N,H] into the
    [B·N,H,S] under ``merge`` (a Kᵀ unfolded to [B,N,H,T]); [] when it is not one."""
    if merge is None:
        return []
    one = transpose_of(inputs(merge)[0], (1, 2, 0))
    if one is not None:
        return [one]
    flip = transpose_of(inputs(merge)[0], (0, 2, 1))
    tr = transpose_of(inputs(flip)[0], (1, 0, 2)) if flip is not None else None
    return [flip, tr] if tr is not None else []


def _k_through_3d(t: Tensor | None) -> tuple[list[Node], Tensor] | None:
    """Kᵀ as the dynamo exporter writes it: ``Reshape(Transpose(Reshape(y, [-1,T,H]), (0,2,1)),
    [B,N,H,T])`` with ``y`` = [B,N,T,H] (or [1,B,N,T,H], an unbound part whose Squeeze the
    inner Reshape took): (the three nodes, consumers first; ``y``) when both targets provably
    have those elements, else None."""
    outer = producer(t, "Reshape")
    flip = transpose_of(inputs(outer)[0], (0, 2, 1)) if outer is not None else None
    inner = producer(inputs(flip)[0], "Reshape") if flip is not None else None
    y = inputs(inner)[0] if inner is not None else None
    if y is None or rank(y) not in (None, 4, 5):
        return None
    dims = current_dims()
    lead = rank(y) - 4 if rank(y) is not None else 0
    if lead and dims.key(y, 0) != ("int", 1):
        return None
    k = [dims.key(y, lead + i) for i in range(4)]
    ie = shape_elements(inputs(inner)[1], dims)
    oe = shape_elements(inputs(outer)[1], dims)
    if ie is None or oe is None or len(ie) != 3 or len(oe) != 4:
        return None
    folded = {("int", -1), arith("Mul", k[0], k[1]), arith("Mul", k[1], k[0])}
    if ie[0] not in folded or ie[1:] != [k[2], k[3]]:
        return None
    want = [k[0], k[1], k[3], k[2]]
    free = [i for i, e in enumerate(oe) if e == ("int", -1)]
    if len(free) > 1 or any(e != w for i, (e, w) in enumerate(zip(oe, want)) if i not in free):
        return None
    return [outer, flip, inner], y


# ------------------------------------------------------------------------- head count
def head_count(
    split: HeadSplit, dims: Dims, batch: set[Key] | None = None
) -> tuple[int, int] | str:
    """(N, H) of a head split, or why they cannot be determined.  ``batch``: the query's batch
    (:func:`batch_keys`), which a key or value split may name for its own (cross-attention:
    ``[B_q, -1, N, H]``; were the batches different, the kernel would refuse the inputs at run
    time)."""
    if split.layout == "packed":
        return _heads_packed(split.reshape, split.x, dims)
    if split.layout == "sbd":
        return _heads_sbd(split.reshape, split.merge, split.x, dims)
    if split.layout in ("bnsh", "bsnh", "bnht"):
        n = dims.key(split.x, 2 if split.layout == "bsnh" else 1)
        h = dims.key(split.x, 2 if split.layout == "bnht" else 3)
        if n[0] != "int" and split.source is not None:  # the heads of the split walked back to
            src = head_count(split.source, dims)
            n = ("int", src[0]) if not isinstance(src, str) else n
        if n[0] != "int" or h[0] != "int":
            return f"heads and head size of '{split.x.name}' [B,N,T,H] are not static"
        return n[1], h[1]
    return _heads_bsd(split.reshape, split.x, dims, batch)


def _copy_key(reshape: Node) -> tuple:
    """The target element that copies the input dim (0, unless ``allowzero``)."""
    return () if reshape.attrs.get("allowzero", 0) else (("int", 0),)


def _static_width(x: Tensor) -> int | None:
    """The last dim of a 3-D ``x``, from its shape or resolved from how it was computed."""
    if rank(x) != 3:
        return None
    width = current_dims().key(x, 2)
    return int(width[1]) if width[0] == "int" else None


def _resolve(n: Key, h: Key, width: int | None, groups: int = 1) -> tuple[int | None, int | None]:
    """N and H as ints, one -1 among them inferred from the static ``width``."""
    ints = [e[1] if e[0] == "int" else None for e in (n, h)]
    if width and ints[0] is not None and ints[0] > 0 and ints[1] == -1:
        ints[1] = width // (groups * ints[0])
    elif width and ints[1] is not None and ints[1] > 0 and ints[0] == -1:
        ints[0] = width // (groups * ints[1])
    return ints[0], ints[1]


def _heads_bsd(
    reshape: Node, x: Tensor, dims: Dims, batch: set[Key] | None = None
) -> tuple[int, int] | str:
    """(N, H) of ``Reshape(x [B,S,D], [B,S,N,H])``, or why not."""
    target = inputs(reshape)[1]
    elems = shape_elements(target, dims)
    if elems is None:
        return f"the reshape target '{target.name}' is computed at run time and not resolvable"
    if len(elems) != 4:
        return f"the reshape target has {len(elems)} elements, not 4"
    lead = _leading_axes(x)
    width = _static_width(x) if lead == (0, 1) else int(x.shape[3])
    n, h = _resolve(elems[2], elems[3], width)
    if n is None or h is None or n <= 0 or h <= 0:
        return f"heads and head size {elems[2:]} are not static"
    if width is not None and n * h != width:
        return f"{n}×{h} heads do not split the hidden size {width}"
    if not _keeps_batch_seq(reshape, elems, x, dims, batch, lead):
        return f"the reshape target {elems[:2]} does not keep the batch and sequence dims"
    return n, h


def _leading_axes(x: Tensor) -> tuple[int, int]:
    """The batch and sequence axes of a projection: (0, 1) of [B,S,D], or (0, 2) of a
    [B,1,S,D] with a static D (GPT-BigCode's TorchScript export unsqueezes its c_attn)."""
    shape = x.shape
    if shape is not None and len(shape) == 4 and shape[1] == 1 and isinstance(shape[3], int):
        return (0, 2)
    return (0, 1)


def _keeps_batch_seq(
    reshape: Node,
    elems: list[Key],
    x: Tensor,
    dims: Dims,
    batch: set[Key] | None = None,
    lead: tuple[int, int] = (0, 1),
) -> bool:
    copy = _copy_key(reshape) if lead == (0, 1) else ()  # a 0 would copy the unit axis
    seq = dims.key(x, lead[1])
    b_kept = elems[0] in (*copy, dims.key(x, 0))
    s_ok = elems[1] in (*copy, seq, ("int", -1)) or (b_kept and _rest_is_width(elems[2:], x))
    b_ok = (
        b_kept
        or (batch is not None and elems[0] in batch and elems[1] == ("int", -1))
        or (  # dynamo writes [-1, S, N, H]
            elems[0] == ("int", -1)
            and elems[1] in (*copy, seq)
            and all(e[0] == "int" and e[1] > 0 for e in elems[2:])
        )
    )
    return b_ok and s_ok and elems[:2] != [("int", -1), ("int", -1)]


def _rest_is_width(rest: list[Key], x: Tensor) -> bool:
    """Whether the static trailing elements of a split's target multiply to the static width
    of its 3-D source: with the batch kept, the one element left can then only be the
    sequence (dynamo's symbolic length, such as GPT-Neo's ``max(min(past+seq, w) − min(w,
    past), 0)`` of a sliding-window cache, is the sequence whenever the Reshape runs)."""
    width = _static_width(x)
    ints = [e[1] for e in rest if e[0] == "int" and e[1] > 0]
    return width is not None and len(ints) == len(rest) and int(np.prod(ints)) == width


def _heads_packed(reshape: Node, x: Tensor, dims: Dims) -> tuple[int, int] | str:
    """(N, H) of ``Reshape(x [B,S,3·N·H], [B,S,3,N,H])``, or why not."""
    elems = shape_elements(inputs(reshape)[1], dims)
    if elems is None or len(elems) != 5:
        return f"the packed reshape target {elems} is not [B, S, 3, N, H]"
    width = _static_width(x)
    n, h = _resolve(elems[3], elems[4], width, 3) if elems[2] == ("int", 3) else (None, None)
    if n is None or h is None or min(n, h) <= 0:
        return f"the packed reshape target {elems} does not split into 3 × N × H"
    if width is None or 3 * n * h != width:
        return f"3×{n}×{h} does not split the packed width {width}"
    if not _keeps_batch_seq(reshape, elems, x, dims):
        return f"the packed reshape target {elems[:2]} does not keep the batch and sequence dims"
    return n, h


def _heads_sbd(split: Node, merge: Node, x: Tensor, dims: Dims) -> tuple[int, int] | str:
    """(N, H) of ``Reshape(Transpose(Reshape(x [S,B,D], [S,-1,H]), (1,0,2)), [B,N,S,H])``."""
    ea = shape_elements(inputs(split)[1], dims)
    eb = shape_elements(inputs(merge)[1], dims)
    if ea is None or eb is None:
        return "a sequence-first reshape target is computed at run time and not resolvable"
    if _sbd_kt(merge) and len(eb) == 4:
        eb = [eb[0], eb[1], eb[3], eb[2]]  # Kᵀ unfolded as [B,N,H,T]
    if len(ea) != 3 or len(eb) != 4:
        return f"the sequence-first reshape targets have {len(ea)} and {len(eb)} elements, not 3, 4"
    width = _static_width(x)
    if width is None:
        return f"the hidden size of '{x.name}' is not static"
    h, n = ea[2], eb[1]
    if h[0] != "int" or n[0] != "int" or h[1] <= 0 or n[1] <= 0 or eb[3] != h:
        return f"heads and head size {[n, h]} are not static and consistent"
    if n[1] * h[1] != width:
        return f"{n[1]}×{h[1]} heads do not split the hidden size {width}"
    seq, batch = dims.key(x, 0), dims.key(x, 1)
    # [S, -1, H], or [·, B·N, H]: with B·N·H = B·D the count forces the first to be S
    explicit = ea[1] in (arith("Mul", batch, n), arith("Mul", n, batch))
    if not explicit and (ea[0] not in (*_copy_key(split), seq) or ea[1] != ("int", -1)):
        return (
            f"the reshape target {ea} does not keep the sequence dim {seq} and fold batch "
            f"{batch} × heads"
        )
    # with B·N explicit, the split's first dim is S however it is spelled
    seqs = {seq} | ({ea[0], dims.key(split.outputs[0], 0)} if explicit else set())
    if eb[2] not in seqs or eb[0] not in (("int", -1), batch):
        return f"the reshape target {eb} does not unfold batch × heads"
    return n[1], h[1]


_SAME_ROWS = (
    "Add",
    "Sub",
    "Mul",
    "Div",
    "MatMul",
    "Cast",
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
)


def batch_keys(t: Tensor, dims: Dims, depth: int = 8) -> set[Key]:
    """The batch (axis 0) of ``t`` and of the tensors of its residual stream: ``t`` is computed
    from them by linear layers, norms and same-rank element-wise ops (a residual Add is assumed
    not to broadcast over the batch: no exporter writes one that does)."""
    keys = {dims.key(t, 0)}
    node = producer(t, _SAME_ROWS)
    if node is None or depth == 0:
        return keys
    ins = [i for i in inputs(node)[: 1 if node.op == "MatMul" else 2] if i is not None]
    for i in ins:  # a rewrite's result may not know its rank yet; a bias vector is not a row
        if rank(i) not in (0, 1) and (rank(i) == rank(t) or None in (rank(i), rank(t))):
            keys |= batch_keys(i, dims, depth - 1)
    return keys


def source_axis(layout: str, which: str) -> int:
    """The batch or sequence axis of a [B,S,D], [S,B,D], [B,N,S,H], [B,S,N,H] or [B,N,H,T]
    source."""
    if layout == "bnht":
        return 3 if which == "seq" else 0
    if layout == "bnsh":
        return 2 if which == "seq" else 0
    if layout == "bsnh":
        return 1 if which == "seq" else 0
    return int((which == "seq") ^ (layout == "sbd"))


__all__ = [
    "HeadSplit",
    "already_split",
    "per_head_key",
    "per_head_split",
    "head_count",
    "rank",
    "rotated_split",
    "source_axis",
    "split_heads",
    "transposed_key",
]

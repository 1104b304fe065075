"""Stage 3 (lower): build the target's attention kernel for a recognized, lifted attention.

``com.microsoft.MultiHeadAttention(q, k, v, bias?, , attention_bias?; num_heads[, scale])``, or
the ONNX ``Attention`` op (opset ≥ 23: 4-D q/k/v [B,N,S,H], which every runtime that has it takes
— TensorRT only those — and which carries a cache's [B,Nkv,T,H] keys and grouped heads as they
are; the bias as ``attn_mask``; the q/k/v bias Adds stay in front, the op has no bias input).
Sequence-first sources are made batch-first around the kernel; the output replaces the heads'
merging Reshape (when it provably yields [B,S,D]; else that Reshape is kept after the kernel) or,
where the merged heads [B,S,N,H] have other readers, the merging Transpose (then the kernel's
[B,S,D] is reshaped to [B,S,N,H] and the shape cleanups fold the readers' Reshapes into it).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from onnx import TensorProto, numpy_helper

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import rank, same_dim
from graphopt.opt.graph.ir import Node, Tensor, Variable, constant_value, dtype_of
from graphopt.opt.rewrite.engine import Builder

from ..activation import MS, inputs, producer
from .lifted import Attention, GqaPlan


def lower(a: Attention, b: Builder) -> Tensor:
    """The replacement of the root's output."""
    q, k, v, bias = a.q.x, a.k.x, a.v.x, None
    if a.k.layout == "bnht":  # a kept Kᵀ [B,N,H,T]: the key [B,T,N,H] from here on
        k = b.op("Transpose", [k], {"perm": [0, 3, 1, 2]}, name=f"{a.core.root.name}/k_rows")
        k.dtype = dtype_of(a.k.x)
        a = replace(a, k=replace(a.k, x=k, layout="bsnh"))
    if a.qkv_bias is not None:
        q, k, v = a.qkv_bias.sources
        bias = b.const(a.qkv_bias.vector, "qkv_bias")
    if a.q.layout == "packed":
        q, k, v = _unpack(a, b, q)
    q, k, v = (
        _batch_first(a, b, t, s.layout, r)
        for r, t, s in (("q", q, a.q), ("k", k, a.k), ("v", v, a.v))
    )
    q = rotated(b, a.q.rotary, q, a.num_heads, f"{a.core.root.name}/q_rotary")
    if a.q.layout == "bnsh":
        q = heads_merged(b, q, a.num_heads * a.head_size, f"{a.core.root.name}/q")
    if a.head_scale is not None:
        q = _head_scaled(a, b, q)
    if a.gqa is not None:
        return _finish(a, b, lower_gqa(a, b, q))
    name = a.core.root.name
    if a.op == "Attention":
        return _finish(a, b, _onnx_attention(a, b, q, k, v))
    if _unequal_heads(a):  # MultiHeadAttention's [B,N,T,H] key and value are of one shape
        a = replace(a, k=replace(a.k, kept=True), v=replace(a.v, kept=True))
    if a.k.kept:
        k = heads_merged(b, k, a.num_heads * a.head_size, f"{name}/k", a.k.layout == "bsnh")
    if a.v.kept:
        v = heads_merged(b, v, a.num_heads * a.v_head_size, f"{name}/v")
    if a.kv_broadcast:
        k, v = (
            _all_heads(b, k, a.num_heads, f"{name}/k"),
            _all_heads(b, v, a.num_heads, f"{name}/v"),
        )
    bias_in = attention_bias(a, b, q, k) if a.bias is not None else None
    if a.core.sink is not None:
        k_axis = 2 if a.k.layout == "bnsh" and not a.k.kept else 1
        bias_in = _sink_bias(a, b, bias_in, q, k, k_axis)
        k = _null_row(b, k, k_axis, f"{name}/k")
        v = _null_row(b, v, k_axis, f"{name}/v")
    attrs = {"num_heads": a.num_heads}
    ins = [q, k, v, bias, None, bias_in]
    while ins and ins[-1] is None:
        ins.pop()
    if a.scale is not None:
        attrs["scale"] = float(a.scale)
    out = b.op(a.op, ins, attrs, domain=MS, name=f"{name}/{a.op}")
    out.dtype = dtype_of(a.core.root.outputs[0])
    return _finish(a, b, out)


def _null_row(b: Builder, t: Tensor, axis: int, name: str) -> Tensor:
    """``t`` with one more key along ``axis``, all zeros (the sink's key and value)."""
    row = b.op(
        "Slice",
        [t, *(b.const(np.array([v], np.int64), n) for v, n in ((0, "zero"), (1, "one")))]
        + [b.const(np.array([axis], np.int64), "axis")],
        name=f"{name}_first",
    )
    shape = b.op("Shape", [row], name=f"{name}_null_shape")
    zero = numpy_helper.from_array(np.zeros(1, dtype=dtype_of(t)))
    null = b.op("ConstantOfShape", [shape], {"value": zero}, name=f"{name}_null")
    out = b.op("Concat", [t, null], {"axis": axis}, name=f"{name}_with_null")
    out.dtype = null.dtype = dtype_of(t)
    shape.dtype = np.dtype(np.int64)
    return out


def _sink_bias(
    a: Attention, b: Builder, bias: Tensor | None, q: Tensor, k: Tensor, k_axis: int
) -> Tensor:
    """The attention_bias [B|1,N,S,T+1]: ``bias`` (zeros when None) over every head, then the
    sink logits as the column of the null key (a computed column [B|1,N|1,S,1] and the bias
    both broadcast to their common rows)."""
    name, dt, n = a.core.root.name, dtype_of(a.q.x), a.num_heads
    if bias is None:
        lens = [_dim(b, q, f"{name}/q_len"), _dim(b, k, f"{name}/k_len", axis=k_axis)]
        ones = b.const(np.ones(2, dtype=np.int64), "bias_prefix")
        shape = b.op("Concat", [ones, *lens], {"axis": 0}, name=f"{name}/bias_shape")
        zero = numpy_helper.from_array(np.zeros(1, dtype=dt))
        bias = b.op("ConstantOfShape", [shape], {"value": zero}, name=f"{name}/no_bias")
        shape.dtype, bias.dtype = np.dtype(np.int64), dt
    heads = b.const(np.array([1, n, 1, 1], dtype=np.int64), "all_heads")
    bias = b.op("Expand", [bias, heads], name=f"{name}/bias_heads")
    one = b.const(np.ones(1, np.int64), "one")
    if a.core.sink.column is None:
        logits = np.broadcast_to(a.core.sink.values, (n,)).reshape(1, n, 1, 1).astype(dt)
        sinks = b.const(logits, "sinks")
    else:  # the rows both have: the bias's first column against the sink column
        sinks = a.core.sink.column
        zero = b.const(np.zeros(1, np.int64), "zero")
        axis = b.const(np.array([3], np.int64), "axis")
        first = b.op("Slice", [bias, zero, one, axis], name=f"{name}/bias_first")
        both = b.op("Add", [first, sinks], name=f"{name}/bias_and_sinks")
        rows = b.op("Shape", [both], {"end": 3}, name=f"{name}/rows")
        keys = b.op("Shape", [bias], {"start": 3}, name=f"{name}/bias_keys")
        full = b.op("Concat", [rows, keys], {"axis": 0}, name=f"{name}/bias_full")
        bias = b.op("Expand", [bias, full], name=f"{name}/bias_rows_all")
        first.dtype = both.dtype = bias.dtype = dt
        rows.dtype = keys.dtype = full.dtype = np.dtype(np.int64)
    lead = b.op("Shape", [bias], {"end": 3}, name=f"{name}/bias_rows")
    col_shape = b.op("Concat", [lead, one], {"axis": 0}, name=f"{name}/sink_rows")
    col = b.op("Expand", [sinks, col_shape], name=f"{name}/sink_column")
    out = b.op("Concat", [bias, col], {"axis": -1}, name=f"{name}/bias_with_sinks")
    for t in (bias, col, out):
        t.dtype = dt
    lead.dtype = col_shape.dtype = np.dtype(np.int64)
    return out


def _unequal_heads(a: Attention) -> bool:
    """Per-head [B,N,T,H] key and value whose head sizes differ (DeepSeek's latent attention:
    a key of nope + rope dims, a value of nope dims): merged to [B,T,N·H], the layout in
    which MultiHeadAttention takes a value of another width."""
    per_head = all(s.layout == "bnsh" and not s.kept for s in (a.k, a.v))
    return per_head and a.head_size != a.v_head_size and not a.kv_broadcast


def _onnx_attention(a: Attention, b: Builder, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The ONNX Attention op on [B,N,S,H] heads, from the 3-D query ``q`` and the batch-first
    key and value (3-D, or per head as the model computes them: a cache's [B,Nkv,T,H] goes
    as it is, grouped or one head); its [B,N,S,Hv] output merged to [B,S,N·Hv]."""
    name, dt = a.core.root.name, dtype_of(a.core.root.outputs[0])
    per_head = a.k.layout == "bnsh" and not a.k.kept
    if a.bias is None:
        bias_in = None
    elif per_head:
        bias_in = attention_bias(a, b, q, k)
    else:
        k_len = _dim(b, k, f"{name}/k_len", axis=2 if a.k.layout == "bnsh" else 1)
        bias_in = attention_bias(a, b, q, None, k_len=k_len)
    q4 = heads_split(b, q, a.num_heads, a.head_size, f"{name}/q")
    if a.k.layout == "bsnh":
        k4 = heads_first(b, k, f"{name}/k")
    elif a.k.layout == "bnsh":
        k4 = k
    else:
        k4 = heads_split(b, k, a.num_heads, a.head_size, f"{name}/k")
    v4 = v if a.v.layout == "bnsh" else heads_split(b, v, a.num_heads, a.v_head_size, f"{name}/v")
    attrs: dict = {}
    if a.scale is not None:
        attrs["scale"] = float(a.scale)
    if a.core.softcap is not None:
        attrs["softcap"] = a.core.softcap.cap
    ins = [q4, k4, v4] + ([bias_in] if bias_in is not None else [])
    out = b.op("Attention", ins, attrs, name=f"{name}/Attention")
    out.dtype = dt
    if q4.shape is not None:
        out.shape = [q4.shape[0], a.num_heads, q4.shape[2], a.v_head_size]
    return heads_merged(b, out, a.num_heads * a.v_head_size, f"{name}/out")


def _finish(a: Attention, b: Builder, out: Tensor) -> Tensor:
    """The kernel's [B,S,N·H] output guarded, made sequence-first and merged like the root's."""
    name = a.core.root.name
    src = a.q.x
    if src.shape is not None and len(src.shape) in (3, 4):
        bax, sax = (1, 0) if a.q.layout == "sbd" else (0, 2 if a.q.layout == "bnsh" else 1)
        out.shape = [src.shape[bax], src.shape[sax], a.num_heads * a.v_head_size]
    if a.core.nan_guard is not None:
        out = _nan_to_zero(a, b, out)
    if a.core.row_guard is not None:
        out = _zero_masked_rows(a, b, out)
    if a.core.out_layout == "sbd":
        out = b.op("Transpose", [out], {"perm": [1, 0, 2]}, name=f"{name}/seq_first")
    return _merged(a, b, out)


def _head_scaled(a: Attention, b: Builder, q: Tensor) -> Tensor:
    """``q`` [B,S,N·H] times its head's factor of the scores (each repeated over the head)."""
    vec = np.repeat(a.head_scale, a.head_size).astype(dtype_of(q))
    out = b.op("Mul", [q, b.const(vec, "head_scale")], name=f"{a.core.root.name}/q_head_scale")
    out.dtype, out.shape = dtype_of(q), q.shape
    return out


def _all_heads(b: Builder, t: Tensor, heads: int, name: str) -> Tensor:
    """A key or value of one head [B,1,T,H] repeated for every query head (multi-query
    attention that the MatMuls broadcast): MultiHeadAttention takes as many as the query."""
    ones = b.const(np.array([1, heads, 1, 1], dtype=np.int64), "all_heads")
    out = b.op("Expand", [t, ones], name=f"{name}_all_heads")
    out.dtype = dtype_of(t)
    if t.shape is not None and len(t.shape) == 4:
        out.shape = [t.shape[0], heads, t.shape[2], t.shape[3]]
    return out


def heads_merged(b: Builder, q: Tensor, width: int, name: str, bsnh: bool = False) -> Tensor:
    """A per-head tensor [B,N,S,H] (or, with ``bsnh``, [B,S,N,H]) as the kernel takes it:
    [B,S,N·H]."""
    first = q if bsnh else heads_first(b, q, name)
    target = b.const(np.array([0, 0, width], dtype=np.int64), "heads_width")
    out = b.op("Reshape", [first, target], name=f"{name}_merged")
    out.dtype = dtype_of(q)
    if first.shape is not None and len(first.shape) == 4:
        out.shape = [first.shape[0], first.shape[1], width]
    return out


def heads_first(b: Builder, t: Tensor, name: str) -> Tensor:
    """[B,S,N,H] ↔ [B,N,S,H]: the heads' Transpose (0,2,1,3)."""
    out = b.op("Transpose", [t], {"perm": [0, 2, 1, 3]}, name=f"{name}_heads_first")
    out.dtype = dtype_of(t)
    if t.shape is not None and len(t.shape) == 4:
        out.shape = [t.shape[0], t.shape[2], t.shape[1], t.shape[3]]
    return out


def heads_split(b: Builder, x: Tensor, heads: int, size: int, name: str) -> Tensor:
    """A [B,S,N·H] tensor as per-head [B,N,S,H]."""
    target = b.const(np.array([0, 0, heads, size], dtype=np.int64), "heads_split")
    bsnh = b.op("Reshape", [x, target], name=f"{name}_heads")
    out = b.op("Transpose", [bsnh], {"perm": [0, 2, 1, 3]}, name=f"{name}_heads_first")
    out.dtype = bsnh.dtype = dtype_of(x)
    if x.shape is not None and len(x.shape) == 3:
        bsnh.shape = [x.shape[0], x.shape[1], heads, size]
        out.shape = [x.shape[0], heads, x.shape[1], size]
    return out


def _batch_first(a: Attention, b: Builder, t: Tensor, layout: str, role: str) -> Tensor:
    if layout != "sbd":
        return t
    return b.op(
        "Transpose", [t], {"perm": [1, 0, 2]}, name=f"{a.core.root.name}/{role}_batch_first"
    )


def rotated(b: Builder, rot: Node | None, x: Tensor, heads: int, name: str) -> Tensor:
    """``x`` [B,S,N·H] rotated as ``rot`` rotates its [B,N,S,H] heads: the same RotaryEmbedding
    with ``num_heads`` (the same per-head rotation, without going through [B,N,S,H])."""
    if rot is None:
        return x
    attrs = {**rot.attrs, "num_heads": heads}
    out = b.op(rot.op, [x, *inputs(rot)[1:]], attrs, domain=rot.domain or "", name=name)
    out.dtype, out.shape = dtype_of(x), x.shape
    return out


def _nan_to_zero(a: Attention, b: Builder, out: Tensor) -> Tensor:
    """The SDPA export's guard of fully masked rows, applied to the fused output."""
    name = a.core.root.name
    isnan = b.op("IsNaN", [out], like=out, name=f"{name}/IsNaN")
    isnan.dtype = np.dtype(bool)
    zero = b.const(np.zeros((), dtype=dtype_of(a.q.x)), "zero")
    return b.op("Where", [isnan, zero, out], like=out, name=f"{name}/nan_to_zero")


def _zero_masked_rows(a: Attention, b: Builder, out: Tensor) -> Tensor:
    """XSoftmax's guard on the fused [B,S,D] output: a query row whose keys the mask masks
    all (``cond`` [B,1,S,T] holds everywhere, or nowhere for a keep-mask) is 0."""
    name, guard = a.core.root.name, a.core.row_guard
    cond = inputs(guard)[0]
    masked = cond
    if not a.core.where_fills_true:  # Where(cond, P, 0): cond holds where keys are kept
        masked = b.op("Not", [cond], name=f"{name}/rows_masked")
        masked.dtype, masked.shape = np.dtype(bool), cond.shape
    flag = b.op("Cast", [masked], {"to": TensorProto.FLOAT}, name=f"{name}/rows_flag")
    flag.dtype = np.dtype(np.float32)
    one = b.const(np.array([1], dtype=np.int64), "heads_axis")
    last = b.const(np.array([-1], dtype=np.int64), "keys_axis")
    opset = b.ir.opset
    sq_ins, sq_attrs = ([flag, one], {}) if opset >= 13 else ([flag], {"axes": [1]})
    rows = b.op("Squeeze", sq_ins, sq_attrs, name=f"{name}/rows_of_heads")
    rows.dtype = flag.dtype
    red_ins, red_attrs = ([rows, last], {}) if opset >= 18 else ([rows], {"axes": [-1]})
    every = b.op("ReduceMin", red_ins, {**red_attrs, "keepdims": 1}, name=f"{name}/rows_all")
    every.dtype = flag.dtype
    whole = b.op("Cast", [every], {"to": TensorProto.BOOL}, name=f"{name}/rows_whole")
    whole.dtype = np.dtype(bool)
    zero = b.const(np.zeros((), dtype=dtype_of(out)), "zero")
    return b.op("Where", [whole, zero, out], like=out, name=f"{name}/masked_rows_zero")


def _merged(a: Attention, b: Builder, out: Tensor) -> Tensor:
    """``out`` [B,S,D] in the shape of the root's output ([B,N,S,H] for a context read per
    head)."""
    root = a.core.root if a.merge_reshape is None else a.merge_reshape
    if a.core.out_layout == "bnsh":
        target = b.const(np.array([0, 0, a.num_heads, a.v_head_size], dtype=np.int64), "heads")
        split = b.op("Reshape", [out, target], name=f"{root.name}/split_heads")
        split.dtype = dtype_of(root.outputs[0])
        if out.shape is not None:
            split.shape = [out.shape[0], out.shape[1], a.num_heads, a.v_head_size]
        perm = {"perm": [0, 2, 1, 3]}
        return b.op("Transpose", [split], perm, like=root.outputs[0], name=f"{root.name}/heads")
    if a.merge_reshape is not None and a.out_direct:
        out.shape = root.outputs[0].shape if out.shape is None else out.shape
        return out
    if a.merge_reshape is not None:
        target, attrs = inputs(root)[1], dict(root.attrs)
    else:
        target = b.const(np.array([0, 0, a.num_heads, a.v_head_size], dtype=np.int64), "heads")
        attrs = {}
    return b.op(
        "Reshape", [out, target], attrs, like=root.outputs[0], name=f"{root.name}/merge_heads"
    )


def _unpack(a: Attention, b: Builder, packed: Tensor) -> list[Tensor]:
    """Split the [B, S, 3·D] projection into q, k, v of [B, S, D] each."""
    hidden = a.num_heads * a.head_size
    sizes = np.full(3, hidden, dtype=np.int64)
    ins, attrs = [packed], {"axis": 2}
    if b.ir.opset >= 13:
        ins.append(b.const(sizes, "qkv_sizes"))
    else:
        attrs["split"] = [int(x) for x in sizes]
    parts = b.op("Split", ins, attrs, outputs=3, name=f"{a.core.root.name}/unpack_qkv")
    for t in parts:
        t.dtype = dtype_of(a.q.x)
        if a.q.x.shape is not None and len(a.q.x.shape) == 3:
            t.shape = [a.q.x.shape[0], a.q.x.shape[1], hidden]
    return parts


# --------------------------------------------------------------------- attention_bias
def attention_bias(
    a: Attention, b: Builder, q: Tensor, k: Tensor | None, k_len: Tensor | None = None
) -> Tensor:
    """The kernel's attention_bias; its key length read from ``k`` or given as ``k_len``."""
    plan, dt, name = a.bias, dtype_of(a.q.x), a.core.root.name
    parts = []
    if plan.where is not None:
        cond, fill, fills_true = plan.where
        zero = b.const(np.zeros((), dtype=dt), "zero")
        value = b.const(np.asarray(fill, dtype=dt), "mask_value")
        picks = [value, zero] if fills_true else [zero, value]
        parts.append(b.op("Where", [cond, *picks], name=f"{name}/causal_bias"))
    parts += plan.terms
    parts += [_unfolded_term(a, b, t) for t in plan.folded]
    if plan.window is not None:
        parts += plan.window.masks
    bias = parts[0]
    for i, part in enumerate(parts[1:]):
        bias = b.op("Add", [bias, part], name=f"{name}/attention_bias{i or ''}")
        bias.dtype = dt  # known, so that a sum of constant masks folds right away
    if plan.window is not None:
        return _tile_windows(a, b, bias, q)
    if plan.direct:
        return _four_d(b, bias, max(4 if rank(p) is None else rank(p) for p in parts), name)
    # k is batch-first here, and a per-head key merged to [B,T,D]
    k_axis = a.axis("k", "seq") if a.k.layout == "bnsh" and not a.k.kept else 1
    cached = _shared_expand(b, bias, (q, 1), (k, k_axis)) if k is not None else None
    if cached is not None:
        return cached
    if k_len is None:
        k_len = _dim(b, k, f"{name}/k_len", axis=k_axis)
    lens = [_dim(b, q, f"{name}/q_len"), k_len]
    ones = b.const(np.ones(2, dtype=np.int64), "bias_prefix")
    shape = b.op("Concat", [ones, *lens], {"axis": 0}, name=f"{name}/bias_shape")
    return b.op("Expand", [bias, shape], name=f"{name}/attention_bias_expand")


def _four_d(b: Builder, bias: Tensor, r: int, name: str) -> Tensor:
    """``bias`` of rank ``r`` as 4-D (leading 1s): the kernels take a 4-D attention_bias only,
    and a learned [N, S, T] table (LeViT) adds to the scores by broadcasting."""
    if r >= 4:
        return bias
    ones = b.const(np.ones(4 - r, dtype=np.int64), "bias_lead")
    dims = b.op("Shape", [bias], name=f"{name}/bias_dims")
    shape = b.op("Concat", [ones, dims], {"axis": 0}, name=f"{name}/bias_4d_shape")
    dims.dtype = shape.dtype = np.dtype(np.int64)
    dims.shape, shape.shape = [r], [4]
    out = b.op("Reshape", [bias, shape], name=f"{name}/attention_bias_4d")
    out.dtype = bias.dtype
    return out


def _unfolded_term(a: Attention, b: Builder, t: Tensor) -> Tensor:
    """A term [B·N, S|1, T] of the folded scores as [B, N, S|1, T]."""
    name = a.core.root.name
    lead = b.const(np.array([-1, a.num_heads], dtype=np.int64), "unfold_heads")
    tail = b.op("Shape", [t], {"start": 1}, name=f"{name}/term_dims")
    shape = b.op("Concat", [lead, tail], {"axis": 0}, name=f"{name}/term_shape")
    tail.dtype = shape.dtype = np.dtype(np.int64)
    tail.shape, shape.shape = [2], [4]
    out = b.op("Reshape", [t, shape], name=f"{name}/term_unfolded")
    out.dtype = dtype_of(t)
    if t.shape is not None and len(t.shape) == 3:
        out.shape = [None, a.num_heads, t.shape[1], t.shape[2]]
    return out


def _tile_windows(a: Attention, b: Builder, bias: Tensor, q: Tensor) -> Tensor:
    """The [1, nW, N|1, S, T] window bias repeated over the images: [B, N, S, T]."""
    n_win, heads, s, t = a.bias.window.dims
    name = a.core.root.name
    batch = _dim(b, q, f"{name}/windows", axis=0)
    images = b.op(
        "Div",
        [batch, b.const(np.array([n_win], dtype=np.int64), "num_windows")],
        name=f"{name}/images",
    )
    tail = b.const(np.array([n_win, heads, s, t], dtype=np.int64), "window_bias_dims")
    shape = b.op("Concat", [images, tail], {"axis": 0}, name=f"{name}/window_shape")
    tiled = b.op("Expand", [bias, shape], name=f"{name}/window_bias")
    flat = b.const(np.array([-1, heads, s, t], dtype=np.int64), "bias_shape")
    return b.op("Reshape", [tiled, flat], name=f"{name}/window_bias_flat")


def _dim(b: Builder, t: Tensor, name: str, axis: int = 1) -> Tensor:
    """``Shape(t)[axis:axis+1]``."""
    if b.ir.opset >= 15:
        return b.op("Shape", [t], {"start": axis, "end": axis + 1}, name=name)
    shape = b.op("Shape", [t], name=name)
    start, end = b.const(np.array([axis]), "start"), b.const(np.array([axis + 1]), "end")
    return b.op("Slice", [shape, start, end], name=f"{name}/slice")


def _shared_expand(
    b: Builder, bias: Tensor, q: tuple[Tensor, int], k: tuple[Tensor, int]
) -> Tensor | None:
    """An Expand of the same bias to provably the same [1,1,S,T], made for another layer.

    Exporters often recompute the mask per layer (``Where(mask, 0, -inf)`` twelve times);
    a bias computed by an identical node from the same inputs counts as the same bias.
    """
    for node in b.ir.graph.nodes:
        if node.op != "Expand" or b.ir.provenance.get(node.name) != b.rule:
            continue
        if not node.outputs or not _same_value(inputs(node)[0], bias):
            continue
        concat = producer(inputs(node)[1], "Concat")
        if concat is None or len(inputs(concat)) != 3:
            continue
        srcs = [_shape_source(t) for t in inputs(concat)[1:]]
        if any(s is None for s in srcs):
            continue
        if all(same_dim(*src, *want) for src, want in zip(srcs, (q, k))):
            return node.outputs[0]
    return None


def _same_value(x: Tensor, y: Tensor) -> bool:
    """``x`` is ``y``, or both come from identical nodes over the same inputs (one level)."""
    if x is y:
        return True
    px = x.inputs[0] if isinstance(x, Variable) and x.inputs else None
    py = y.inputs[0] if isinstance(y, Variable) and y.inputs else None
    if px is None or py is None or len(px.outputs) != 1 or len(py.outputs) != 1:
        return False
    if (px.op, px.domain or "", px.attrs) != (py.op, py.domain or "", py.attrs):
        return False
    ix, iy = inputs(px), inputs(py)
    if len(ix) != len(iy):
        return False
    for s, t in zip(ix, iy):
        if s is t:
            continue
        vs, vt = constant_value(s), constant_value(t)
        if vs is None or vt is None or vs.dtype != vt.dtype or not np.array_equal(vs, vt):
            return False
    return True


def _shape_source(t: Tensor) -> tuple[Tensor, int] | None:
    """(tensor, axis) of ``Shape(tensor)[axis:axis+1]`` as :func:`_dim` writes it."""
    node = producer(t, ("Shape", "Slice"))
    if node is None:
        return None
    if node.op == "Shape":
        return inputs(node)[0], int(node.attrs.get("start", 0))
    start = constant_value(inputs(node)[1])
    node = producer(inputs(node)[0], "Shape")
    if node is None or start is None or start.size != 1:
        return None
    return inputs(node)[0], int(start.reshape(-1)[0])


def lower_gqa(a: Attention, b: Builder, q: Tensor) -> Tensor:
    """GroupQueryAttention for ``a`` (its plan in ``a.gqa``) from the 3-D query ``q`` (already
    rotated); returns the [B,S,N·H] output, the present outputs moved onto the kernel's."""
    plan: GqaPlan = a.gqa
    name = a.core.root.name
    kv_width = plan.key.kv_heads * a.head_size
    k = rotated(b, plan.key.new.rotary, plan.key.new.x, plan.key.kv_heads, f"{name}/k_rotary")
    if plan.key.new.kept:
        k = heads_merged(b, k, kv_width, f"{name}/k")
    v = plan.value.new.x
    if plan.value.new.kept:
        v = heads_merged(b, v, kv_width, f"{name}/v")
    if plan.key.past is None:
        total = _len(b, q, 1, f"{name}/new_len")
    else:
        total = b.op(
            "Add",
            [_len(b, plan.key.past, 2, f"{name}/past_len"), _len(b, q, 1, f"{name}/new_len")],
            name=f"{name}/total_len",
        )
    ins = [q, k, v, plan.key.past, plan.value.past, *_lengths(b, q, total, name)]
    if a.bias is not None or a.core.sink is not None:
        bias = attention_bias(a, b, q, None, total) if a.bias is not None else None
        ins += [None, None, None, bias]
    if a.core.sink is not None:
        sinks = np.broadcast_to(a.core.sink.values, (a.num_heads,))
        ins.append(b.const(sinks.astype(dtype_of(q)), "head_sink"))
    attrs = {"num_heads": a.num_heads, "kv_num_heads": plan.key.kv_heads, "causal": 0}
    if a.scale is not None:
        attrs["scale"] = float(a.scale)
    if a.core.softcap is not None:
        attrs["softcap"] = a.core.softcap.cap
    out, pk, pv = b.op(
        "GroupQueryAttention", ins, attrs, domain=MS, outputs=3, name=f"{name}/GroupQueryAttention"
    )
    out.dtype = dtype_of(a.core.root.outputs[0])
    for new, old in ((pk, plan.key.present), (pv, plan.value.present)):
        if old is None:  # no cache: the present outputs are read by nothing
            new.dtype = dtype_of(q)
            continue
        new.dtype, new.shape = old.dtype, old.shape
        b.ir.replace_all_uses(old, new)
    return out


def _len(b: Builder, t: Tensor, axis: int, name: str) -> Tensor:
    out = b.op("Shape", [t], {"start": axis, "end": axis + 1}, name=name)
    out.dtype, out.shape = np.dtype(np.int64), [1]
    return out


def _lengths(b: Builder, q: Tensor, total: Tensor, name: str) -> list[Tensor]:
    """``seqlens_k`` = T − 1 in every row (int32 [B]) and ``total_sequence_length`` (int32 [])."""
    last = b.op("Sub", [total, b.const(np.array([1], np.int64), "one")], name=f"{name}/last_key")
    rows = last
    if current_dims().key(q, 0) != ("int", 1):
        rows = b.op("Expand", [last, _len(b, q, 0, f"{name}/batch")], name=f"{name}/seqlens")
    seqlens = b.op("Cast", [rows], {"to": 6}, name=f"{name}/seqlens_k")
    scalar = b.op("Squeeze", [total, b.const(np.array([0], np.int64), "axis0")], name=f"{name}/t")
    total32 = b.op("Cast", [scalar], {"to": 6}, name=f"{name}/total_sequence_length")
    for t in (seqlens, total32):
        t.dtype = np.dtype(np.int32)
    return [seqlens, total32]

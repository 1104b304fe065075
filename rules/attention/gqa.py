"""Decoder grouped-query self-attention → ``com.microsoft.GroupQueryAttention`` (stages 2, 3).

Stage 2 reads the key and value of a recognized attention back to the decoder's cache:
``present = Concat(past, new, axis=2)`` (a graph output), the new heads a batch-first split of
``[B,S,Nkv·H]`` (the key's rotated by a RotaryEmbedding after the split) or a per-head
tensor walked back to one (:func:`.heads.per_head_split`: q/k norms, partial rotary, a fused
projection's head slice; merged to [B,S,Nkv·H] for the kernel), and HF's repeat_kv
``Reshape(Expand(Unsqueeze(present, 2), [B,Nkv,rep,T,H]), [B,Nkv·rep,T,H])`` — query head
``j`` reads kv head ``j // rep``, as the kernel groups them — or no repeat (``Nkv = N``, or
one kv head ``[B,1,T,H]`` that the MatMuls broadcast).

Stage 3 builds ``GroupQueryAttention(q, k_new, v_new, past_key, past_value, seqlens_k,
total_sequence_length, , , , attention_bias; causal=0)`` whose present outputs take the
``present`` names.  It is exact for any mask (checked against the exporters' attention:
docs/benchmarks.md): every row's ``seqlens_k`` is
``T − 1`` (no key is hidden by the kernel's per-row length, so the new tokens are written at
``past`` in every row, as the Concat does), ``causal=0`` and the exporter's whole mask
(causal, padding, window) is the ``attention_bias`` (with the kernel's causal masking a fully
masked row of a finite fill would average over fewer keys than the exporter's).  The kernel
refuses a batch above 1 with a past and several new tokens, so it is chosen only where the
batch or the new tokens are provably 1, or where the user declares (option
``decoder_steps="generate"``, :data:`OPTION`) that every step given a past has one new token or
a batch of 1 — a prefill over an empty cache and batched one-token decode steps, as generation
loops run — then a batched multi-token step over a past fails loudly in the kernel, never
computes other numbers; each such fusion says so in an ``analysis`` remark
(``declared-decoder-steps``).  Elsewhere the attention lowers to MultiHeadAttention over the
repeated heads.  Rotary embeddings are redone on the 3-D q and k (``num_heads``), not folded
into the kernel (``do_rotary``): the kernel rotates at positions it derives from the lengths
(``past + i``, the prompt from the first ``position_ids`` element), while the model rotates at
its ``position_ids`` input, which a left-padded batch sets otherwise.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import Dims, arith, rank, shape_elements
from graphopt.opt.graph.ir import Tensor, constant_value

from ..activation import inputs, producer
from .heads import (
    PERM_BNSH,
    head_count,
    per_head_split,
    rotated_split,
    source_axis,
    split_heads,
)
from .lifted import Attention, GqaPlan, KvCache

#: the option (``optimize(options={OPTION: "generate"})``) declaring that the model runs as a
#: generation loop: a step given a non-empty past has one new token or a batch of 1
OPTION = "decoder_steps"


def plan_gqa(
    a: Attention, dims: Dims, declared: bool = False, without_past: bool = False
) -> GqaPlan | None:
    """The caches when the attention is provably GroupQueryAttention's computation, else None.
    ``declared``: the user declared generation steps (:data:`OPTION`), so the batch or the new
    tokens need not be provably 1.  ``without_past``: a decoder's attention over its new keys
    alone (no cache) may lower too (GroupQueryAttention without past_key, at any batch: what
    soft-capped scores need, the one kernel with ``softcap`` before the mask)."""
    if a.qkv_bias is not None or a.head_size % 8:
        return None  # onnxruntime 1.32's kernel: "head_size must be a multiple of 8"
    if a.q.layout != "bsd" and not a.q.kept:
        return None
    batch, seq = dims.key(a.q.x, 0), dims.key(a.q.x, a.axis("q", "seq"))
    if without_past and a.k.layout == a.v.layout == "bsd":  # plain batch-first key and value
        key, value = (KvCache(None, None, s, a.num_heads) for s in (a.k, a.v))
        same = all(dims.key(s.x, 1) == seq for s in (a.k, a.v))
        return GqaPlan(key, value) if same and a.v_head_size == a.head_size else None
    if a.k.layout != "bnsh" or a.k.kept:
        return None
    key, value = _cache(a.k.x, a, dims, True), _cache(a.v.x, a, dims, False)
    if key is None or value is None or key.kv_heads != value.kv_heads:
        return None
    if (key.past is None) != (value.past is None) or (key.past is None and not without_past):
        return None
    if key.past is not None and ("int", 1) not in (batch, seq) and not declared:
        return None  # the kernel refuses batch > 1 with a past and several new tokens
    if any(dims.key(c.new.x, source_axis(c.new.layout, "seq")) != seq for c in (key, value)):
        return None
    if a.v_head_size != a.head_size:
        return None
    return GqaPlan(key, value)


def _cache(x: Tensor, a: Attention, dims: Dims, rotated: bool) -> KvCache | None:
    """``x`` [B,N,T,H] as present [→ repeat_kv], present = Concat(past, new split); or the new
    split alone (no cache: present and past None)."""
    present, kv_heads = _unrepeat(x, a.num_heads, dims)
    concat = producer(present, "Concat")
    if concat is None:
        past, new_heads, present = None, present, None
    elif len(inputs(concat)) != 2 or concat.attrs.get("axis") not in (2, -2):
        return None
    else:
        past, new_heads = inputs(concat)
    split = (rotated_split(new_heads) if rotated else None) or split_heads(new_heads, PERM_BNSH)
    if split is None or split.layout != "bsd" or rank(split.x) not in (None, 3):
        split = per_head_split(new_heads)  # a norm, partial rotary or a fused QKV's head slice
    if split is None:
        return None
    if head_count(split, dims) != (kv_heads, a.head_size):
        return None
    if past is None:
        return KvCache(None, None, split, kv_heads)
    if rank(past) != 4:
        return None
    for axis in (1, 3):
        if dims.key(past, axis) != ("int", (kv_heads, a.head_size)[axis // 2]):
            return None
    return KvCache(present, past, split, kv_heads)


def _unrepeat(x: Tensor, heads: int, dims: Dims) -> tuple[Tensor, int]:
    """(present, kv heads) under HF's repeat_kv of ``x``, or (``x``, ``heads``) without one."""
    rs = producer(x, "Reshape")
    ex = producer(inputs(rs)[0], "Expand") if rs is not None else None
    un = producer(inputs(ex)[0], "Unsqueeze") if ex is not None else None
    if un is None:  # no repeat, or one head the MatMuls broadcast (multi-query)
        return x, 1 if dims.key(x, 1) == ("int", 1) else heads
    present = inputs(un)[0]
    axes = constant_value(inputs(un)[1]) if len(inputs(un)) > 1 else un.attrs.get("axes")
    if axes is None or list(np.asarray(axes).reshape(-1)) not in ([2], [-3]) or rank(present) != 4:
        return x, 0
    kv = dims.key(present, 1)
    if kv[0] != "int" or kv[1] <= 0 or heads % kv[1]:
        return x, 0
    rep = heads // kv[1]
    shape = _expand_elements(inputs(ex)[1], dims)
    want = [{dims.key(present, i)} for i in range(4)]
    want[2] |= _concat_length(present, dims)
    if shape is None or len(shape) != 5 or shape[2] != ("int", rep):
        return x, 0
    if any(e != ("int", 1) and e not in w for e, w in zip(shape[:2] + shape[3:], want)):
        return x, 0
    target = shape_elements(inputs(rs)[1], dims)
    copy = () if rs.attrs.get("allowzero", 0) else (("int", 0),)
    if target is None or len(target) != 4 or target[1] != ("int", heads):
        return x, 0
    if target[0] not in (*copy, *want[0]) or target[2] not in (*want[2], ("int", -1)):
        return x, 0
    if target[3] not in want[3] and not (target[3] == ("int", -1) and target[2] in want[2]):
        return x, 0
    return present, kv[1]


def _concat_length(present: Tensor, dims: Dims) -> set:
    """The key of past + new for ``present`` = Concat(past, new) on axis 2 (dynamo names the
    output's length with a symbol of its own)."""
    cat = producer(present, "Concat")
    if cat is None or len(inputs(cat)) != 2 or cat.attrs.get("axis") not in (2, -2):
        return set()
    past, new = inputs(cat)
    return {arith("Add", dims.key(past, 2), dims.key(new, 2))}


def _expand_elements(shape: Tensor, dims: Dims) -> list | None:
    """The elements of an Expand's shape; TorchScript's ``Where(Equal(s, -1), 1, s)`` (its
    expand(-1) keeps a dim: Expand's 1) is read as ``s`` with -1 as 1."""
    where = producer(shape, "Where")
    eq = producer(inputs(where)[0], "Equal") if where is not None else None
    if eq is None or inputs(eq)[0] is not inputs(where)[2]:
        return shape_elements(shape, dims)
    minus, ones = constant_value(inputs(eq)[1]), constant_value(inputs(where)[1])
    if minus is None or ones is None or np.any(minus != -1) or np.any(ones != 1):
        return None
    elems = shape_elements(inputs(where)[2], dims)
    return None if elems is None else [("int", 1) if e == ("int", -1) else e for e in elems]

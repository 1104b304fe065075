"""fuse-attention through per-head math on the key side and in fused projections: a key
normalized and rotated head by head beside a plainly split value (encoders), a fused QKV
projection whose heads are sliced out of one [B,S,G,H] split with one key/value head the
MatMuls broadcast (multi-query), a packed [B,S,3,N,H] projection unbound by Split and Squeeze,
and GroupQueryAttention built from per-head queries and keys; each checked by onnxruntime
parity, with the rotation fused before the attention or left as the exporter wrote it."""

import dataclasses

import numpy as np
import pytest
from test_rules_attention_llm import (
    GQA,
    HIDDEN,
    MHA,
    NQ,
    ROT,
    H,
    _topo,
    decoder,
    dim,
    feeds,
    heads,
    mask,
    mk,
    node,
    rope,
)
from test_rules_rotary import freqs_mul

from conftest import assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

RULE = "fuse-attention"


@pytest.fixture
def rotary_unfused(monkeypatch):
    """cpu without the rotary fusion: the attention meets the exporter's rotate_half."""
    from graphopt.opt.rewrite import target as targets

    cpu = targets.TARGETS["cpu"]
    off = cpu.disabled_rules | {"fuse-rotary-embedding"}
    monkeypatch.setitem(targets.TARGETS, "cpu", dataclasses.replace(cpu, disabled_rules=off))


def _core(q: str, kt: str, v: str, terms: list[str], width: int) -> tuple[list, list]:
    nodes = [
        mk("Mul", [q, "qk_scale"], ["qs"]),
        mk("Mul", [kt, "qk_scale"], ["kts"]),
        mk("MatMul", ["qs", "kts"], ["scores"]),
    ]
    z = "scores"
    for i, t in enumerate(terms):
        nodes.append(mk("Add", [z, t], [f"z{i}"]))
        z = f"z{i}"
    nodes += [
        mk("Softmax", [z], ["P"], axis=-1),
        mk("MatMul", ["P", v], ["ctx"]),
        mk("Transpose", ["ctx"], ["ctxT"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["ctxT", "merge"], ["y"]),
    ]
    return nodes, [const("qk_scale", H**-0.25), const("merge", [0, 0, width], np.int64)]


def _finish(nodes, inputs, outputs, inits, opset=17):
    nodes = _topo(nodes, inputs, inits)
    for i, nd in enumerate(nodes):
        nd.name = f"n{i}_{nd.op_type}"
    return model(nodes, inputs, outputs, inits, opset=opset)


# ------------------------------------------------------------------ per-head key, encoder
def per_head_key_encoder(key_op: str = "norm"):
    """An encoder self-attention: q and k RMSNorm-ed and rotated head by head after the
    split, v split plainly, a padding mask [B,1,1,S]. ``key_op="mix"`` mixes the key's heads
    (a Softmax over the head axis): not per head."""
    rng = np.random.default_rng(3)
    nodes, inits = freqs_mul("position_ids")
    for r in "qkv":
        nodes += heads(rng, r, NQ, inits, False, norm=r != "v")
    for r in "qk":
        n, i = rope(r, False)
        nodes, inits = nodes + n, inits + i
    k = "k_rot"
    if key_op == "mix":
        nodes.append(mk("Softmax", ["k_rot"], ["k_mixed"], axis=1))
        k = "k_mixed"
    nodes += [
        mk("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
        mk("Unsqueeze", ["attention_mask", "ax12"], ["am4"]),
        mk("Cast", ["am4"], ["amf"], to=1),
        mk("Sub", ["fone", "amf"], ["inv"]),
        mk("Mul", ["inv", "fill"], ["pad_bias"]),
    ]
    core, core_inits = _core("q_rot", "kt", "v_heads", ["pad_bias"], HIDDEN)
    inits += core_inits + [
        const("ax12", [1, 2], np.int64),
        const("fone", 1.0),
        const("fill", -1e4),
    ]
    inputs = [
        vi("x", ["batch", "seq", HIDDEN]),
        vi("attention_mask", ["batch", "seq"], 7),
        vi("position_ids", ["batch", "seq"], 7),
    ]
    return _finish(nodes + core, inputs, [vi("y", ["batch", "seq", HIDDEN])], inits)


def encoder_feeds(batch=2, seq=5, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    am = np.ones((batch, seq), np.int64)
    am[0, seq - 2 :] = 0
    pos = np.broadcast_to(np.arange(seq), (batch, seq)).astype(np.int64)
    return {
        "x": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
        "attention_mask": am,
        "position_ids": np.ascontiguousarray(pos),
    }


@pytest.mark.parametrize("order", ["rotary-first", "attention-first"])
def test_per_head_key_beside_a_split_value_fuses(order, request):
    """The key normalized and rotated head by head, the value a plain split: the key is kept
    per head and reaches the kernel as [B,T,D] beside the value's [B,T,D], in either order of
    the rotary and attention fusions."""
    if order == "attention-first":
        request.getfixturevalue("rotary_unfused")
    m = per_head_key_encoder()
    out, report = assert_optimized(m, inputs=encoder_feeds())
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1, h
    assert h.get(ROT, 0) == (2 if order == "rotary-first" else 0), h
    assert codes(report, RULE) == []
    mha = node(out, "MultiHeadAttention")
    assert {a.name: a.i for a in mha.attribute}["num_heads"] == NQ
    assert run(out, inputs=encoder_feeds(batch=3, seq=7, seed=1))[1].parity.ok


def test_key_mixed_across_heads_goes_to_the_kernel_as_it_is():
    """A key whose heads are mixed (a Softmax over the head axis) is no per-head split: the
    kernel takes it as the [B,N,T,H] it is, and the value's split per head beside it."""
    m = per_head_key_encoder("mix")
    out, report = run(m, inputs=encoder_feeds())
    assert report.parity.ok
    assert op_histogram(out.graph.node).get(MHA) == 1
    assert "k_mixed" in node(out, "MultiHeadAttention").input
    assert [r for r in report.remarks if r.rule == RULE and r.kind == "missed"] == []
    assert run(out, inputs=encoder_feeds(batch=3, seq=7, seed=1))[1].parity.ok


# ------------------------------------------------------------- fused QKV, multi-query
def fused_qkv_multi_query(batch="batch", pick="slice"):
    """Falcon's multi-query attention: one projection [B,S,(N+2)·H] split into [B,S,N+2,H],
    the query heads Slice(0:N), the key head N, the value head N+1 along the head axis, each
    transposed and reshaped to [B,n,S,H] (a Reshape that keeps every dim), rotated, the key
    and value cached with one head, which the MatMuls broadcast over the N query heads; with
    ``pick="gather"`` the key and value heads are ``Gather(qkv4, [i], axis=2)`` (the rank kept,
    as ``fused_qkv[..., [-2], :]`` exports)."""
    rng = np.random.default_rng(5)
    nodes, inits = freqs_mul("position_ids")
    inits += [
        const("Wqkv", rng.standard_normal((HIDDEN, (NQ + 2) * H)) * 0.2),
        const("groups", [0, 0, NQ + 2, H], np.int64),
        const("ax2", [2], np.int64),
        const("h", [H], np.int64),
    ]
    nodes += [
        mk("MatMul", ["x", "Wqkv"], ["qkv"]),
        mk("Reshape", ["qkv", "groups"], ["qkv4"]),
        dim("x", 0, 1, "b"),
        dim("x", 1, 2, "s"),
    ]
    for r, lo, hi in (("q", 0, NQ), ("k", NQ, NQ + 1), ("v", NQ + 1, NQ + 2)):
        inits += [const(f"{r}_first", [lo], np.int64), const(f"{r}_end", [hi], np.int64)]
        inits.append(const(f"{r}_count", [hi - lo], np.int64))
        take = mk("Slice", ["qkv4", f"{r}_first", f"{r}_end", "ax2"], [f"{r}_sl"])
        if pick == "gather" and r != "q":
            take = mk("Gather", ["qkv4", f"{r}_first"], [f"{r}_sl"], axis=2)
        nodes += [
            take,
            mk("Transpose", [f"{r}_sl"], [f"{r}_t"], perm=[0, 2, 1, 3]),
            mk("Concat", ["b", f"{r}_count", "s", "h"], [f"{r}_shape"], axis=0),
            mk("Reshape", [f"{r}_t", f"{r}_shape"], [f"{r}_heads"]),
        ]
    for r in "qk":
        n, i = rope(r, False)
        nodes, inits = nodes + n, inits + i
    nodes += [
        mk("Concat", ["past_key", "k_rot"], ["present_key"], axis=-2),
        mk("Concat", ["past_value", "v_heads"], ["present_value"], axis=-2),
        mk("Transpose", ["present_key"], ["kt"], perm=[0, 1, 3, 2]),
    ]
    mask_nodes, mask_inits = mask(None, -np.inf)
    core, core_inits = _core("q_rot", "kt", "present_value", ["bias"], HIDDEN)
    nodes += mask_nodes + core
    inits += mask_inits + core_inits
    inputs = [
        vi("x", [batch, "seq", HIDDEN]),
        vi("attention_mask", [batch, "total"], 7),
        vi("position_ids", [batch, "seq"], 7),
        vi("past_key", [batch, 1, "past", H]),
        vi("past_value", [batch, 1, "past", H]),
    ]
    outputs = [
        vi("y", [batch, "seq", HIDDEN]),
        vi("present_key", [batch, 1, "total", H]),
        vi("present_value", [batch, 1, "total", H]),
    ]
    return _finish(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("order", ["rotary-first", "attention-first"])
def test_fused_qkv_multi_query_fuses_with_the_key_head_broadcast(order, request):
    """The query's heads walked back through the rotation and the dim-keeping Reshape to the
    fused projection's head slice; the one cached key/value head is repeated for the kernel."""
    if order == "attention-first":
        request.getfixturevalue("rotary_unfused")
    m = fused_qkv_multi_query()
    out, report = assert_optimized(m, inputs=feeds(1))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and GQA not in h, h
    assert codes(report, RULE) == []
    assert [o.name for o in out.graph.output] == ["y", "present_key", "present_value"]
    assert run(out, inputs=feeds(1, batch=1, seq=1, past=7, seed=2))[1].parity.ok


@pytest.mark.parametrize("pick", ["slice", "gather"])
def test_fused_qkv_multi_query_lowers_to_group_query_attention_with_one_kv_head(pick):
    """A batch of 1: GroupQueryAttention with kv_num_heads 1 takes the new key and value head
    merged to [B,S,H] and the cache; exact on a prefill and on padded decode steps."""
    m = fused_qkv_multi_query(batch=1, pick=pick)
    out, report = assert_optimized(m, inputs=feeds(1, batch=1))
    h = op_histogram(out.graph.node)
    assert h.get(GQA) == 1 and MHA not in h, h
    gqa = node(out, "GroupQueryAttention")
    attrs = {a.name: a.i for a in gqa.attribute}
    assert attrs["kv_num_heads"] == 1 and attrs["num_heads"] == NQ
    assert list(gqa.output[1:]) == ["present_key", "present_value"]
    for f in (
        feeds(1, batch=1, seq=6, past=0, seed=2),
        feeds(1, batch=1, seq=1, past=9, left=True, seed=3),
    ):
        assert run(out, inputs=f)[1].parity.ok


def grouped_fused_qkv(kv_groups: int = 2):
    """Falcon's new decoder architecture: one projection split into ``kv_groups`` groups of
    ``rep`` query heads, a key and a value head ([B,S,G,rep+2,H]); the query is
    Reshape(Slice(…, 0:rep, axis 3), [B,S,N,H]) — its source is not [B,S,D] — and the key and
    value heads are broadcast to every query head (Expand) before the cache of N heads."""
    rep = NQ // kv_groups
    rng = np.random.default_rng(11)
    nodes, inits = freqs_mul("position_ids")
    inits += [
        const("Wqkv", rng.standard_normal((HIDDEN, kv_groups * (rep + 2) * H)) * 0.2),
        const("groups", [0, 0, kv_groups, rep + 2, H], np.int64),
        const("ax3", [3], np.int64),
        const("all_q", [0, 0, NQ, H], np.int64),
        const("rep_shape", [1, 1, 1, rep, 1], np.int64),
    ]
    nodes += [
        mk("MatMul", ["x", "Wqkv"], ["qkv"]),
        mk("Reshape", ["qkv", "groups"], ["qkv5"]),
    ]
    for r, lo, hi in (("q", 0, rep), ("k", rep, rep + 1), ("v", rep + 1, rep + 2)):
        inits += [const(f"{r}_first", [lo], np.int64), const(f"{r}_end", [hi], np.int64)]
        nodes.append(mk("Slice", ["qkv5", f"{r}_first", f"{r}_end", "ax3"], [f"{r}_sl"]))
        src = f"{r}_sl"
        if r != "q":
            nodes.append(mk("Expand", [src, "rep_shape"], [f"{r}_rep"]))
            src = f"{r}_rep"
        nodes += [
            mk("Reshape", [src, "all_q"], [f"{r}_4"]),
            mk("Transpose", [f"{r}_4"], [f"{r}_heads"], perm=[0, 2, 1, 3]),
        ]
    for r in "qk":
        n, i = rope(r, False)
        nodes, inits = nodes + n, inits + i
    nodes += [
        mk("Concat", ["past_key", "k_rot"], ["present_key"], axis=-2),
        mk("Concat", ["past_value", "v_heads"], ["present_value"], axis=-2),
        mk("Transpose", ["present_key"], ["kt"], perm=[0, 1, 3, 2]),
    ]
    mask_nodes, mask_inits = mask(None, -np.inf)
    core, core_inits = _core("q_rot", "kt", "present_value", ["bias"], HIDDEN)
    nodes += mask_nodes + core
    inits += mask_inits + core_inits
    inputs = [
        vi("x", ["batch", "seq", HIDDEN]),
        vi("attention_mask", ["batch", "total"], 7),
        vi("position_ids", ["batch", "seq"], 7),
        vi("past_key", ["batch", NQ, "past", H]),
        vi("past_value", ["batch", NQ, "past", H]),
    ]
    outputs = [
        vi("y", ["batch", "seq", HIDDEN]),
        vi("present_key", ["batch", NQ, "total", H]),
        vi("present_value", ["batch", NQ, "total", H]),
    ]
    return _finish(nodes, inputs, outputs, inits, opset=18)


def test_query_of_a_grouped_fused_projection_is_walked_per_head():
    """A query whose split reads [B,S,G,rep,H], not [B,S,D]: kept per head and merged for
    MultiHeadAttention over the cache (was refused as unknown-shape)."""
    m = grouped_fused_qkv()
    out, report = assert_optimized(m, inputs=feeds(NQ))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1, h
    assert codes(report, RULE) == []
    assert run(out, inputs=feeds(NQ, batch=1, seq=1, past=7, seed=2))[1].parity.ok


# ------------------------------------------- head groups of a fused projection, CodeGen
def head_grouped_qkv(rotate: bool):
    """CodeGen: one projection viewed as G=2 groups [B,S,G,3L] and Split on its last axis into
    q, v and k [B,S,G,L] (L = two heads), each Reshape-d to [B,S,N,H]: no part is [B,S,D].
    With ``rotate`` q and k are rotated head by head; the value is a plain split."""
    rng = np.random.default_rng(13)
    groups, part = 2, HIDDEN // 2
    nodes, inits = freqs_mul("position_ids") if rotate else ([], [])
    inits += [
        const("Wqkv", rng.standard_normal((HIDDEN, 3 * HIDDEN)) * 0.2),
        const("groups", [0, 0, groups, 3 * part], np.int64),
        const("parts", [part] * 3, np.int64),
        const("heads4", [0, 0, -1, H], np.int64),
    ]
    nodes += [
        mk("MatMul", ["x", "Wqkv"], ["qkv"]),
        mk("Reshape", ["qkv", "groups"], ["qkv4"]),
        mk("Split", ["qkv4", "parts"], ["q_g", "v_g", "k_g"], axis=-1),
    ]
    for r in "qkv":
        nodes += [
            mk("Reshape", [f"{r}_g", "heads4"], [f"{r}_4"]),
            mk("Transpose", [f"{r}_4"], [f"{r}_heads"], perm=[0, 2, 1, 3]),
        ]
    q, k = "q_heads", "k_heads"
    if rotate:
        for r in "qk":
            n, i = rope(r, False)
            nodes, inits = nodes + n, inits + i
        q, k = "q_rot", "k_rot"
    nodes.append(mk("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]))
    core, core_inits = _core(q, "kt", "v_heads", [], HIDDEN)
    inputs = [vi("x", ["batch", "seq", HIDDEN])]
    if rotate:
        inputs.append(vi("position_ids", ["batch", "seq"], 7))
    outputs = [vi("y", ["batch", "seq", HIDDEN])]
    return _finish(nodes + core, inputs, outputs, inits + core_inits, opset=18)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_head_groups_of_a_fused_projection_fuse(rotate, target):
    """The parts of [B,S,G,3L] go to the kernel per head (was ``unknown-shape``: 'has rank 4;
    MultiHeadAttention takes [B,S,D] inputs')."""
    f = encoder_feeds()
    del f["attention_mask"]
    if not rotate:
        del f["position_ids"]
    out, report = assert_optimized(head_grouped_qkv(rotate), target=target, inputs=f)
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and "Softmax" not in h, h
    assert codes(report, RULE) == []


# -------------------------------------------------- GQA from per-head queries and keys
@pytest.mark.parametrize(
    "spelling", ["qk-norm", "partial-rotary"], ids=["qk-norm", "partial-rotary-concat"]
)
def test_group_query_attention_from_per_head_queries(spelling):
    """Grouped kv heads (4 query / 2 kv) with per-head math on q and on the new k (an RMSNorm
    per head, or a rotated slice concatenated with the pass-through one): with a batch of 1
    the per-head query and new key are merged to [B,S,·] for GroupQueryAttention."""
    passed = 8 if spelling == "partial-rotary" else 0
    m = decoder(2, batch=1, phi3=bool(passed), qk_norm=not passed, passed=passed)
    hp = H + passed
    out, report = assert_optimized(m, inputs=feeds(2, batch=1, hp=hp))
    h = op_histogram(out.graph.node)
    assert h.get(GQA) == 1 and MHA not in h, h
    assert codes(report, RULE) == []
    attrs = {a.name: a.i for a in node(out, "GroupQueryAttention").attribute}
    assert attrs["kv_num_heads"] == 2 and attrs["num_heads"] == NQ
    for f in (
        feeds(2, batch=1, seq=6, past=0, seed=2, hp=hp),
        feeds(2, batch=1, seq=1, past=9, left=True, seed=3, hp=hp),
    ):
        assert run(out, inputs=f)[1].parity.ok


# ---------------------------------------------------------- packed QKV, Split + Squeeze
def packed_split_squeeze(split_axis: int = -3, squeeze_axis: int = 2):
    """ModernBERT: Reshape(x·Wqkv, [B,S,3,N,H]), Split on axis 2, each part Squeeze-d and
    transposed to [B,N,S,H], q and k rotated (the axes as TorchScript writes them, -3 and 2;
    dynamo: 2 and -3)."""
    rng = np.random.default_rng(9)
    nodes, inits = freqs_mul("position_ids")
    inits += [
        const("Wqkv", rng.standard_normal((HIDDEN, 3 * HIDDEN)) * 0.2),
        const("packed", [0, 0, 3, NQ, H], np.int64),
        const("ax2", [squeeze_axis], np.int64),
    ]
    nodes += [
        mk("MatMul", ["x", "Wqkv"], ["qkv"]),
        mk("Reshape", ["qkv", "packed"], ["qkv5"]),
        mk("Split", ["qkv5"], ["q5", "k5", "v5"], axis=split_axis, num_outputs=3),
    ]
    for r in "qkv":
        nodes += [
            mk("Squeeze", [f"{r}5", "ax2"], [f"{r}4"]),
            mk("Transpose", [f"{r}4"], [f"{r}_heads"], perm=[0, 2, 1, 3]),
        ]
    for r in "qk":
        n, i = rope(r, False)
        nodes, inits = nodes + n, inits + i
    nodes.append(mk("Transpose", ["k_rot"], ["kt"], perm=[0, 1, 3, 2]))
    core, core_inits = _core("q_rot", "kt", "v_heads", [], HIDDEN)
    inputs = [vi("x", ["batch", "seq", HIDDEN]), vi("position_ids", ["batch", "seq"], 7)]
    outputs = [vi("y", ["batch", "seq", HIDDEN])]
    return _finish(nodes + core, inputs, outputs, inits + core_inits, opset=18)


@pytest.mark.parametrize("split_axis, squeeze_axis", [(-3, 2), (2, -3)])
def test_packed_projection_unbound_by_split_and_squeeze_fuses(split_axis, squeeze_axis):
    m = packed_split_squeeze(split_axis, squeeze_axis)
    f = encoder_feeds()
    del f["attention_mask"]
    out, report = assert_optimized(m, inputs=f)
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and h.get(ROT) == 2, h
    assert codes(report, RULE) == []


def test_the_cuda_rewrite_fuses_every_spelling_here():
    """cuda (its rewrite run for semantics on the CPU) fuses each of these as MultiHeadAttention:
    its GroupQueryAttention runs fp16/bf16 only."""
    for m, f in (
        (per_head_key_encoder(), encoder_feeds()),
        (fused_qkv_multi_query(batch=1), feeds(1, batch=1)),
    ):
        out, report = assert_optimized(m, target="cuda", inputs=f)
        assert op_histogram(out.graph.node).get(MHA) == 1
        assert codes(report, RULE) == []

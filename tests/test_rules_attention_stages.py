"""fuse-attention's stages on spellings of held-out exports: the merged heads read by two
Reshapes (GPT-2 eager after the shape cleanups), a KV cache whose present key/value are graph
outputs, cross-attention whose key split names the query's batch, several additive bias terms
and one mask shared by every layer; misses name their stage and tensor."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

N, H = 2, 4
D = N * H
RULE = "fuse-attention"
MHA = "com.microsoft.MultiHeadAttention"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def project(rng, name: str, src: str, inits: list, target: str = "heads") -> list:
    """``name`` = Transpose(Reshape(src · W, target), (0,2,1,3)) [B,N,S,H]."""
    inits.append(const(f"W{name}", rng.standard_normal((D, D)) * 0.3))
    return [
        mk("MatMul", [src, f"W{name}"], [f"{name}2"]),
        mk("Reshape", [f"{name}2", target], [f"{name}4"]),
        mk("Transpose", [f"{name}4"], [name], perm=[0, 2, 1, 3]),
    ]


def core(p: str, q: str, kt: str, v: str, terms: list[str], inits: list) -> list:
    """Softmax(q·kᵀ/√H + Σ terms)·v merged back by Transpose into ``{p}ctxT`` [B,S,N,H]."""
    if "sqrt_h" not in {i.name for i in inits}:
        inits.append(const("sqrt_h", np.sqrt(H)))
    nodes = [mk("MatMul", [q, kt], [f"{p}qk"]), mk("Div", [f"{p}qk", "sqrt_h"], [f"{p}z0"])]
    for i, t in enumerate(terms):
        nodes.append(mk("Add", [f"{p}z{i}", t], [f"{p}z{i + 1}"]))
    return nodes + [
        mk("Softmax", [f"{p}z{len(terms)}"], [f"{p}P"], axis=-1),
        mk("MatMul", [f"{p}P", v], [f"{p}ctx"]),
        mk("Transpose", [f"{p}ctx"], [f"{p}ctxT"], perm=[0, 2, 1, 3]),
    ]


def finish(nodes, inputs, outputs, inits):
    for i, nd in enumerate(nodes):
        nd.name = f"n{i}_{nd.op_type}"
    return model(nodes, inputs, outputs, inits)


def base_inits() -> list:
    return [const("heads", [0, 0, N, H], np.int64), const("merge", [0, 0, D], np.int64)]


def layer(rng, p: str, x: str, terms: list[str], inits: list) -> list:
    """One self-attention layer on ``x`` whose output is ``{p}attn`` [B,S,D]."""
    nodes = []
    for r in "qkv":
        nodes += project(rng, f"{p}{r}", x, inits)
    nodes.append(mk("Transpose", [f"{p}k"], [f"{p}kt"], perm=[0, 1, 3, 2]))
    nodes += core(p, f"{p}q", f"{p}kt", f"{p}v", terms, inits)
    return nodes + [mk("Reshape", [f"{p}ctxT", "merge"], [f"{p}attn"])]


def mha_count(m) -> int:
    return op_histogram(m.graph.node).get(MHA, 0)


def test_merged_heads_read_by_two_reshapes_fuse():
    """GPT-2's eager export after the shape cleanups: the merged heads feed the output
    projection's flat Reshape and a Reshape read only by Shape (was shared-intermediate)."""
    rng = np.random.default_rng(0)
    inits = base_inits() + [const("flat", [-1, D], np.int64), const("Wo", rng.random((D, D)))]
    nodes = []
    for r in "qkv":
        nodes += project(rng, r, "x", inits)
    nodes.append(mk("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    nodes += core("", "q", "kt", "v", ["mask_bias"], inits)
    nodes += [
        mk("Reshape", ["ctxT", "merge"], ["attn"]),
        mk("Shape", ["attn"], ["attn_shape"]),
        mk("Reshape", ["ctxT", "flat"], ["attn2d"]),
        mk("MatMul", ["attn2d", "Wo"], ["y"]),
    ]
    inputs = [vi("x", ["batch", "seq", D]), vi("mask_bias", ["batch", 1, 1, "seq"])]
    outputs = [vi("y", None), vi("attn_shape", None, TensorProto.INT64)]
    out, report = assert_optimized(finish(nodes, inputs, outputs, inits))
    assert mha_count(out) == 1 and "Softmax" not in op_histogram(out.graph.node)
    assert codes(report, RULE) == []


def k_transposed(k: str, form: str, inits: list) -> list:
    """``kt`` = Kᵀ of the [B,N,T,H] tensor ``k``: one Transpose, or the dynamo exporter's 3-D
    transpose with targets built from Shape(k)."""
    if form == "transpose":
        return [mk("Transpose", [k], ["kt"], perm=[0, 1, 3, 2])]
    inits += [
        const("km1", [-1], np.int64),
        const("k_2", [-2], np.int64),
        const("kmin", [np.iinfo(np.int64).min], np.int64),
        const("kh", [H], np.int64),
    ]
    return [
        mk("Shape", [k], ["ks"], start=0),
        mk("Slice", ["ks", "k_2", "km1"], ["kslen"]),
        mk("Slice", ["ks", "kmin", "k_2"], ["kbn"]),
        mk("Concat", ["km1", "kslen", "kh"], ["k3"], axis=0),
        mk("Concat", ["kbn", "kh", "kslen"], ["k4t"], axis=0),
        mk("Reshape", [k, "k3"], ["K3"], allowzero=1),
        mk("Transpose", ["K3"], ["K3T"], perm=[0, 2, 1]),
        mk("Reshape", ["K3T", "k4t"], ["kt"], allowzero=1),
    ]


def kv_cache(k_form: str = "transpose"):
    """A decoder step: K and V are Concat(past, new) along the sequence and graph outputs."""
    rng = np.random.default_rng(1)
    inits = base_inits()
    nodes = project(rng, "q", "x", inits) + project(rng, "kn", "x", inits)
    nodes += project(rng, "vn", "x", inits)
    nodes += [
        mk("Concat", ["past_key", "kn"], ["present_key"], axis=-2),
        mk("Concat", ["past_value", "vn"], ["present_value"], axis=2),
    ]
    nodes += k_transposed("present_key", k_form, inits)
    nodes += core("", "q", "kt", "present_value", ["mask_bias"], inits)
    nodes.append(mk("Reshape", ["ctxT", "merge"], ["y"]))
    inputs = [
        vi("x", ["batch", "seq", D]),
        vi("past_key", ["batch", N, "past", H]),
        vi("past_value", ["batch", N, "past", H]),
        vi("mask_bias", ["batch", 1, "seq", "total"]),
    ]
    outputs = [vi("y", None), vi("present_key", None), vi("present_value", None)]
    return finish(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("k_form", ["transpose", "dynamo"])
def test_kv_cache_present_outputs_keep_their_names(k_form):
    """GPT-2 / Whisper decoder steps: the present.* outputs are K and V; the kernel reads them
    as [B,N,T,H] and the Concats stay."""
    shapes = {"x": (2, 3, D), "past_key": (2, N, 5, H), "past_value": (2, N, 5, H)}
    feeds = {
        k: np.random.default_rng(2).standard_normal(s).astype(np.float32) for k, s in shapes.items()
    }
    feeds["mask_bias"] = np.where(np.random.default_rng(3).random((2, 1, 3, 8)) < 0.3, -1e4, 0.0)
    feeds["mask_bias"] = feeds["mask_bias"].astype(np.float32)
    out, report = assert_optimized(kv_cache(k_form), inputs=feeds)
    assert mha_count(out) == 1 and op_histogram(out.graph.node)["Concat"] >= 2
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    assert list(mha.input[1:3]) == ["present_key", "present_value"]


def test_kv_cache_without_multiheadattention_lowers_to_4d_attention():
    """The ONNX Attention op (TensorRT's table) on [B,N,S,H] heads takes a cache's per-head
    key and value as they are: ``present_key`` feeds the op and stays a graph output."""
    shapes = {"x": (2, 3, D), "past_key": (2, N, 5, H), "past_value": (2, N, 5, H)}
    rng = np.random.default_rng(2)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    feeds["mask_bias"] = np.where(rng.random((2, 1, 3, 8)) < 0.3, -1e4, 0.0).astype(np.float32)
    out, report = run(kv_cache(), target="tensorrt", opset=23, inputs=feeds)
    assert report.parity.ran and report.parity.ok
    assert not [r for r in report.remarks if r.rule == RULE and r.kind == "missed"]
    node = next(n for n in out.graph.node if n.op_type == "Attention")
    assert list(node.input[1:3]) == ["present_key", "present_value"]


def test_cross_attention_key_split_with_the_querys_batch():
    """Whisper/BART cross-attention: the encoder states are split with the decoder's batch,
    ``[Shape(r)[0], -1, N, H]`` (``r`` the residual stream the query is computed from), which
    cannot be proven to be the encoder's own."""
    rng = np.random.default_rng(4)
    inits = base_inits() + [const("tail", [-1, N, H], np.int64)]
    nodes = [
        mk("Add", ["r", "h"], ["x"]),
        mk("Shape", ["r"], ["xb"], start=0, end=1),
        mk("Concat", ["xb", "tail"], ["cross_heads"], axis=0),
    ]
    nodes += project(rng, "q", "x", inits)
    nodes += project(rng, "k", "enc", inits, "cross_heads")
    nodes += project(rng, "v", "enc", inits, "cross_heads")
    nodes.append(mk("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    nodes += core("", "q", "kt", "v", [], inits)
    nodes.append(mk("Reshape", ["ctxT", "merge"], ["y"]))
    inputs = [vi(n, [f"{n}_batch", "seq", D]) for n in ("r", "h")]
    inputs.append(vi("enc", ["enc_batch", "enc_seq", D]))
    feeds = {
        n: np.random.default_rng(i).standard_normal(shape).astype(np.float32)
        for i, (n, shape) in enumerate((("r", (2, 3, D)), ("h", (2, 3, D)), ("enc", (2, 7, D))))
    }
    out, report = assert_optimized(finish(nodes, inputs, [vi("y", None)], inits), inputs=feeds)
    assert mha_count(out) == 1, codes(report, RULE)


def test_additive_terms_sum_into_one_bias_and_a_shared_mask_fuses_every_layer():
    """T5: relative position bias and padding mask added to the scores one after the other;
    the same mask tensor is read by both layers (an input of each fusion, not an
    intermediate of one)."""
    rng = np.random.default_rng(6)
    inits = base_inits()
    nodes = [mk("Where", ["pad", "zero", "lowest"], ["mask_bias"])]
    inits += [const("zero", 0.0), const("lowest", np.finfo(np.float32).min)]
    nodes += layer(rng, "a_", "x", ["pos_bias", "mask_bias"], inits)
    nodes += layer(rng, "b_", "a_attn", ["mask_bias", "pos_bias"], inits)
    inputs = [
        vi("x", ["batch", "seq", D]),
        vi("pad", ["batch", 1, 1, "seq"], TensorProto.BOOL),
        vi("pos_bias", [1, N, "seq", "seq"]),
    ]
    out, report = assert_optimized(finish(nodes, inputs, [vi("b_attn", None)], inits))
    assert mha_count(out) == 2 and codes(report, RULE) == []


def _query_given_split(batch: str):
    rng = np.random.default_rng(7)
    inits = base_inits()
    nodes = project(rng, "k", "x", inits) + project(rng, "v", "x", inits)
    nodes.append(mk("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    nodes += core("", "q4", "kt", "v", [], inits)
    nodes.append(mk("Reshape", ["ctxT", "merge"], ["y"]))
    inputs = [vi("x", ["batch", "seq", D]), vi("q4", [batch, N, "seq", H])]
    return finish(nodes, inputs, [vi("y", None)], inits)


def test_a_query_given_split_with_the_keys_batch_fuses():
    """Q given already split (a 4-D graph input) with the key's batch and heads: the kernel
    takes it merged to [B,S,N·H]."""
    rng = np.random.default_rng(8)
    feeds = {
        "x": rng.standard_normal((2, 5, D)).astype(np.float32),
        "q4": rng.standard_normal((2, N, 5, H)).astype(np.float32),
    }
    out, report = run(_query_given_split("batch"), inputs=feeds)
    assert report.parity.ok and mha_count(out) == 1, codes(report, RULE)


def test_a_miss_names_its_stage_and_tensor():
    """Q given already split whose batch is not provably the key's (another named dim) is not
    a head split stage 2 can give the kernel."""
    _, report = run(_query_given_split("q_batch"))
    missed = [r for r in report.remarks if r.rule == RULE and r.kind == "missed"]
    assert [r.code for r in missed] == ["unrecognized-layout"]
    assert missed[0].args["stage"] == "2 (lift)" and missed[0].args["tensor"] == "q4"
    assert missed[0].message.startswith("stage 2 (lift): Q 'q4'")

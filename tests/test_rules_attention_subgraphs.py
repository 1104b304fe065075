"""Attention inside the branches of an If that read their weights from the outer graph (the
merged decoder optimum writes: ``If(use_cache_branch)`` whose ``then_branch`` is the decoder with
a KV cache and ``else_branch`` the one without, both full decoders named alike, every weight an
initializer of the outer graph).  Both branches fuse, the weights stay in the outer graph once,
each branch's attention has its own remark, and the output matches the original on both values
of the condition in a bare onnxruntime session.  The first step without a cache returns its key
and value heads as ``present``: the kernel then reads those [B,N,T,H] tensors."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

N, H = 2, 4
D = N * H
MHA = "com.microsoft.MultiHeadAttention"
RULE = "fuse-attention"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def weights(rng) -> list:
    """What both branches read from the outer graph: projections, biases, head split targets."""
    inits = [const("heads", [0, 0, N, H], np.int64), const("merge", [0, 0, D], np.int64)]
    inits += [const("scale", 1 / np.sqrt(H))]
    for name in ("Wq", "Wk", "Wv", "Wo"):
        inits.append(const(name, rng.standard_normal((D, D)) * 0.3))
    for name in ("bq", "bk", "bv"):
        inits.append(const(name, rng.standard_normal(D) * 0.1))
    return inits


def decoder_nodes(cache: bool) -> list:
    """One attention layer as the exporters write it, reading the outer weights; with ``cache``
    the new key and value are concatenated to the past ones, without it the new heads are the
    present key and value themselves.  Node names are the same in both spellings."""
    nodes = []
    for r in "qkv":
        nodes += [
            mk("MatMul", ["x", f"W{r}"], [f"{r}_p"], name=f"/attn/{r}_proj/MatMul"),
            mk("Add", [f"{r}_p", f"b{r}"], [f"{r}_b"], name=f"/attn/{r}_proj/Add"),
            mk("Reshape", [f"{r}_b", "heads"], [f"{r}_4"], name=f"/attn/{r}/Reshape"),
        ]
    nodes.append(mk("Transpose", ["q_4"], ["Q"], name="/attn/q/Transpose", perm=[0, 2, 1, 3]))
    for r in "kv":
        new = f"{r}_new" if cache else f"present_{r}"
        nodes.append(
            mk("Transpose", [f"{r}_4"], [new], name=f"/attn/{r}/Transpose", perm=[0, 2, 1, 3])
        )
        if cache:
            nodes.append(
                mk("Concat", [f"past_{r}", new], [f"present_{r}"], name=f"/attn/{r}/Concat", axis=2)
            )
    return nodes + [
        mk("Transpose", ["present_k"], ["KT"], name="/attn/k/Transpose_1", perm=[0, 1, 3, 2]),
        mk("MatMul", ["Q", "KT"], ["qk"], name="/attn/MatMul"),
        mk("Mul", ["qk", "scale"], ["qks"], name="/attn/Mul"),
        mk("Add", ["qks", "mask_bias"], ["z"], name="/attn/Add"),
        mk("Softmax", ["z"], ["P"], name="/attn/Softmax", axis=-1),
        mk("MatMul", ["P", "present_v"], ["ctx"], name="/attn/MatMul_1"),
        mk("Transpose", ["ctx"], ["ctxT"], name="/attn/Transpose", perm=[0, 2, 1, 3]),
        mk("Reshape", ["ctxT", "merge"], ["attn"], name="/attn/Reshape"),
        mk("MatMul", ["attn", "Wo"], ["y"], name="/attn/o_proj/MatMul"),
    ]


OUTPUTS = [
    vi("y", ["batch", "sequence_length", D]),
    vi("present_k", ["batch", N, "present_length", H]),
    vi("present_v", ["batch", N, "present_length", H]),
]
INPUTS = [
    vi("x", ["batch", "sequence_length", D]),
    vi("mask_bias", ["batch", 1, 1, "present_length"]),
    vi("past_k", ["batch", N, "past_length", H]),
    vi("past_v", ["batch", N, "past_length", H]),
]


def merged(rng) -> onnx.ModelProto:
    """``If(use_cache_branch)``: the decoder with the cache, else the one without."""

    def branch(name: str, cache: bool) -> onnx.GraphProto:
        return helper.make_graph(decoder_nodes(cache), name, [], OUTPUTS)

    if_node = mk(
        "If",
        ["use_cache_branch"],
        [o.name for o in OUTPUTS],
        name="optimum::if",
        then_branch=branch("with_past", True),
        else_branch=branch("no_past", False),
    )
    cond = vi("use_cache_branch", [1], TensorProto.BOOL)
    return model([if_node], INPUTS + [cond], OUTPUTS, weights(rng))


def first_step(rng) -> onnx.ModelProto:
    """The decoder without a cache on its own: its key and value heads are graph outputs."""
    return model(decoder_nodes(False), INPUTS[:2], OUTPUTS, weights(rng))


def feeds(rng, use_cache: bool, batch: int = 2) -> dict[str, np.ndarray]:
    """A decoding step (2 new tokens after 5 cached) or a first step (6 tokens, no cache); row
    0 of the mask pads its first two positions."""
    past, new = (5, 2) if use_cache else (0, 6)
    bias = np.zeros((batch, 1, 1, past + new), np.float32)
    bias[0, ..., :2] = np.finfo(np.float32).min
    out = {"x": rng.standard_normal((batch, new, D)).astype(np.float32), "mask_bias": bias}
    for r in "kv":
        out[f"past_{r}"] = rng.standard_normal((batch, N, past, H)).astype(np.float32)
    out["use_cache_branch"] = np.array([use_cache])
    return out


def bodies(m: onnx.ModelProto) -> dict[str, onnx.GraphProto]:
    (node,) = [n for n in m.graph.node if n.op_type == "If"]
    return {a.g.name: a.g for a in node.attribute}


def weight_bytes(m: onnx.ModelProto) -> int:
    """Bytes of the initializers of every graph of the model."""
    graphs, total = [m.graph], 0
    while graphs:
        g = graphs.pop()
        total += sum(onnx.numpy_helper.to_array(t).nbytes for t in g.initializer)
        graphs += [a.g for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    return total


def bare_session(m: onnx.ModelProto) -> ort.InferenceSession:
    """A plain onnxruntime session, no graph optimization: the model as it ships."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


class TestAttentionInIfBranchesReadingOuterWeights:
    @pytest.mark.parametrize("target", ["cpu", "cuda"])
    @pytest.mark.parametrize("use_cache", [True, False])
    def test_both_branches_fuse_with_parity_on_the_taken_one(self, target, use_cache):
        rng = np.random.default_rng(0)
        m = merged(rng)
        out, report = run(m, target=target, inputs=feeds(rng, use_cache))
        assert report.parity.ran and report.parity.ok, report.parity
        for name, body in bodies(out).items():
            ops = op_histogram(body.node)
            assert ops.get(MHA) == 1 and "Softmax" not in ops, (name, ops)
        # one remark per branch, though the branches name their nodes alike
        fired = [r for r in report.remarks if r.rule == RULE and r.kind == "passed"]
        assert len(fired) == 2, fired
        assert not [r for r in report.remarks if r.rule == RULE and r.kind == "missed"]

    @pytest.mark.parametrize("target", ["cpu", "cuda"])
    def test_a_bare_session_matches_the_original_on_both_branches(self, target):
        rng = np.random.default_rng(1)
        m = merged(rng)
        out, _ = run(m, target=target, inputs=feeds(rng, True))
        original, optimized = bare_session(m), bare_session(out)
        for use_cache in (True, False):
            for batch in (1, 3):
                f = feeds(rng, use_cache, batch)
                for want, got in zip(original.run(None, f), optimized.run(None, f)):
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    def test_outer_weights_stay_in_the_outer_graph_once(self):
        rng = np.random.default_rng(2)
        m = merged(rng)
        out, _ = run(m, inputs=feeds(rng, False))
        outer = {t.name for t in out.graph.initializer}
        assert {"Wq", "Wk", "Wv", "Wo"} <= outer
        for body in bodies(out).values():
            local = [t for t in body.initializer if np.prod(t.dims) >= D * D]
            assert not local, [t.name for t in local]
        # a copy per branch would be twice the weights; the fusions' own small constants aside
        assert weight_bytes(out) <= weight_bytes(m) + 64

    def test_the_rewrite_is_idempotent(self):
        rng = np.random.default_rng(3)
        f = feeds(rng, True)
        out, _ = run(merged(rng), inputs=f)
        again, second = run(out, inputs=f)
        assert not [r for r in second.remarks if r.kind == "passed" and r.rule == RULE]
        assert {k: op_histogram(b.node) for k, b in bodies(again).items()} == {
            k: op_histogram(b.node) for k, b in bodies(out).items()
        }


class TestKeyAndValueHeadsReturnedAsPresent:
    """A decoder's first step returns its key and value heads [B,N,T,H] as ``present``: the
    split is the model's, and the kernel reads the heads it made."""

    @pytest.mark.parametrize("target", ["cpu", "cuda"])
    def test_fuses_with_the_heads_left_to_the_model(self, target):
        rng = np.random.default_rng(4)
        m = first_step(rng)
        f = {k: v for k, v in feeds(rng, False).items() if k in ("x", "mask_bias")}
        out, report = run(m, target=target, inputs=f)
        assert report.parity.ran and report.parity.ok, report.parity
        ops = op_histogram(out.graph.node)
        assert ops.get(f"{MHA}") == 1 and "Softmax" not in ops, ops
        mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
        assert list(mha.input[1:3]) == ["present_k", "present_v"]
        assert [o.name for o in out.graph.output] == ["y", "present_k", "present_v"]

    def test_a_head_split_read_elsewhere_as_bsnh_stays_for_that_reader(self):
        """The heads' [B,S,N,H] form read by another node is no [B,N,T,H] tensor the kernel
        could take: the kernel takes the key as [B,T,D], and the split stays for its reader."""
        rng = np.random.default_rng(5)
        nodes = decoder_nodes(False)
        nodes.append(mk("ReduceSum", ["k_4"], ["k_sum"], keepdims=0))
        outputs = OUTPUTS[:1] + [vi("k_sum", None)]
        m = model(nodes, INPUTS[:2], outputs, weights(rng))
        f = {k: v for k, v in feeds(rng, False).items() if k in ("x", "mask_bias")}
        out, report = run(m, inputs=f)
        assert report.parity.ok
        missed = [r.code for r in report.remarks if r.rule == RULE and r.kind == "missed"]
        assert missed == [], missed
        ops = op_histogram(out.graph.node)
        assert ops.get(MHA) == 1 and ops.get("ReduceSum") == 1, ops

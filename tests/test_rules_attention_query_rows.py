"""unfold-query-rows: multi-query attention with the query heads folded into the sequence
(GPT-BigCode before transformers 5), checked by graphopt's parity run on padded inputs."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

B, S, N, H = 2, 5, 4, 8
D = N * H


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def query_rows(zeros: bool = True, fill: float = float(np.finfo(np.float32).min)):
    """q [B,S,N·H] viewed as [B,S·N,H] against one key head [B,H,T]; the scores (baddbmm:
    zeros times beta added) viewed [B,S,N,T], masked by Where(mask [B,S,1,T]); the
    probabilities viewed back for one value head [B,T,H]."""
    rng = np.random.default_rng(0)
    nodes = [
        mk("MatMul", ["x", "Wq"], ["q"]),
        mk("MatMul", ["x", "Wkv"], ["kv"]),
        mk("Split", ["kv", "halves"], ["k", "v"], axis=-1),
        mk("Shape", ["x"], ["xs"]),
        mk("Gather", ["xs", "i0"], ["b"], axis=0),
        mk("Gather", ["xs", "i1"], ["s"], axis=0),
        mk("Unsqueeze", ["b", "ax0"], ["b1"]),
        mk("Unsqueeze", ["s", "ax0"], ["s1"]),
        mk("Concat", ["b1", "m1", "hsz"], ["rows_shape"], axis=0),
        mk("Reshape", ["q", "rows_shape"], ["q3"]),
        mk("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        mk("MatMul", ["q3", "kt"], ["qk"]),
        mk("Mul", ["qk", "scale"], ["scaled"]),
    ]
    s3 = "scaled"
    if zeros:
        nodes += [
            mk("Shape", ["scaled"], ["ss"]),
            mk("ConstantOfShape", ["ss"], ["zeros"]),
            mk("Mul", ["zeros", "beta"], ["zb"]),
            mk("Add", ["scaled", "zb"], ["s3"]),
        ]
        s3 = "s3"
    nodes += [
        mk("Concat", ["b1", "s1", "heads", "m1"], ["s4_shape"], axis=0),
        mk("Reshape", [s3, "s4_shape"], ["s4"]),
        mk("Where", ["mask", "s4", "fill"], ["z"]),
        mk("Softmax", ["z"], ["p"], axis=-1),
        mk("Shape", ["k"], ["ks"]),
        mk("Gather", ["ks", "i1"], ["t"], axis=0),
        mk("Unsqueeze", ["t", "ax0"], ["t1"]),
        mk("Concat", ["b1", "m1", "t1"], ["p3_shape"], axis=0),
        mk("Reshape", ["p", "p3_shape"], ["p3"]),
        mk("MatMul", ["p3", "v"], ["ctx3"]),
        mk("Concat", ["b1", "s1", "width"], ["out_shape"], axis=0),
        mk("Reshape", ["ctx3", "out_shape"], ["attn"]),
        mk("MatMul", ["attn", "Wo"], ["y"]),
    ]
    inits = [
        const("Wq", rng.standard_normal((D, D)) * 0.4),
        const("Wkv", rng.standard_normal((D, 2 * H)) * 0.4),
        const("Wo", rng.standard_normal((D, D)) * 0.4),
        const("halves", [H, H], np.int64),
        const("i0", 0, np.int64),
        const("i1", 1, np.int64),
        const("ax0", [0], np.int64),
        const("m1", [-1], np.int64),
        const("hsz", [H], np.int64),
        const("heads", [N], np.int64),
        const("width", [D], np.int64),
        const("scale", H**-0.5),
        const("beta", 1.0),
        const("fill", fill),
    ]
    inputs = [
        vi("x", ["batch", "seq", D]),
        vi("mask", ["batch", "seq", 1, "seq"], TensorProto.BOOL),
    ]
    return model(nodes, inputs, [vi("y", ["batch", "seq", D])], inits)


def feeds():
    rng = np.random.default_rng(1)
    mask = np.tril(np.ones((S, S), bool))[None, :, None, :].repeat(B, 0)
    mask[1, :, :, -2:] = False  # the second sequence padded by two tokens
    mask[1, :, :, 0] = True  # every row keeps a key
    return {"x": rng.standard_normal((B, S, D)).astype(np.float32), "mask": mask}


@pytest.mark.parametrize("target", ["cuda", "cpu"])
@pytest.mark.parametrize("zeros", [True, False], ids=["baddbmm", "matmul"])
def test_query_rows_become_heads_and_fuse(target, zeros):
    out, report = run(query_rows(zeros), target=target, inputs=feeds())
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "unfold-query-rows", "passed") == ["fired"]
    h = op_histogram(out.graph.node)
    assert h.get("com.microsoft.MultiHeadAttention") == 1 and "Softmax" not in h, h


def test_a_fill_no_bias_can_carry_leaves_it_as_written():
    out, report = run(query_rows(fill=-100.0), target="cuda", inputs=feeds())
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "unfold-query-rows") == ["mask-shape"]
    assert "Softmax" in op_histogram(out.graph.node)

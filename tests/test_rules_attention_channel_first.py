"""Attention over channel-first activations [B,C,S] (SqueezeBERT's 1×1 convolution
projections, the key used as Kᵀ as it is): ``channel-first-attention`` makes it the
batch-first spelling and ``fuse-attention`` fuses it.  Every graph is checked against
onnxruntime by graphopt's parity run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

B, S, N, H = 2, 16, 4, 8
C = N * H


def squeeze_attention(masked: bool = True, merge=(B, C, S), seed: int = 0):
    rng = np.random.default_rng(seed)
    nodes, inits = (
        [],
        [const("split", [B, N, H, S], np.int64), const("merge", list(merge), np.int64)],
    )

    def add(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=f"n{len(nodes)}", **attrs))
        return out

    x = add("Transpose", ["x"], "bcs", perm=[0, 2, 1])
    heads = {}
    for r in "qkv":
        inits.append(const(f"W{r}", rng.standard_normal((C, C // 2, 1)) * 0.3, np.float32))
        inits.append(const(f"b{r}", rng.standard_normal(C) * 0.1, np.float32))
        p = add("Conv", [x, f"W{r}", f"b{r}"], f"{r}_conv", group=2, kernel_shape=[1])
        heads[r] = add("Reshape", [p, "split"], f"{r}_heads")  # [B,N,H,S]
    q = add("Transpose", [heads["q"]], "q", perm=[0, 1, 3, 2])
    v = add("Transpose", [heads["v"]], "v", perm=[0, 1, 3, 2])
    z = add("MatMul", [q, heads["k"]], "qk")
    inits.append(const("root", np.float32(np.sqrt(H)), np.float32))
    z = add("Div", [z, "root"], "scores")
    inputs = [vi("x", [B, S, C])]
    if masked:
        inputs.append(vi("mask", [B, 1, 1, S]))
        z = add("Add", [z, "mask"], "masked")
    p = add("Softmax", [z], "P", axis=-1)
    ctx = add("MatMul", [p, v], "ctx")
    t = add("Transpose", [ctx], "ctx_t", perm=[0, 1, 3, 2])
    y = add("Reshape", [t, "merge"], "ctx_c")
    inits.append(const("Wo", rng.standard_normal((C, C, 1)) * 0.3, np.float32))
    if len(merge) == 3:
        add("Conv", [y, "Wo"], "y", kernel_shape=[1])
        out = vi("y", [B, C, S])
    else:
        add("Identity", [y], "y")
        out = vi("y", list(merge))
    return model(nodes, inputs, [out], inits)


def feed(masked: bool = True) -> dict:
    rng = np.random.default_rng(1)
    f = {"x": rng.standard_normal((B, S, C)).astype(np.float32)}
    if masked:
        m = np.zeros((B, 1, 1, S), np.float32)
        m[1, ..., -4:] = -1e4
        f["mask"] = m
    return f


def fused(m) -> int:
    return sum(v for k, v in op_histogram(m.graph.node).items() if k.endswith("MultiHeadAttention"))


@pytest.mark.parametrize("target, masked", [("cuda", True), ("cuda", False), ("cpu", False)])
def test_channel_first_attention_fuses(target, masked):
    out, report = run(squeeze_attention(masked), target=target, inputs=feed(masked))
    assert report.parity.ran and report.parity.ok, report.parity
    assert fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []
    assert "Softmax" not in op_histogram(out.graph.node)


def test_masked_short_sequence_on_cpu_is_refused_before_any_change():
    out, report = run(squeeze_attention(), target="cpu", inputs=feed())
    assert report.parity.ok and fused(out) == 0
    assert codes(report, "channel-first-attention") == ["slower-on-target"]
    assert codes(report, "fuse-attention") == []  # said once, by the rule that refused
    assert "channel-first-attention" not in {r.rule for r in report.remarks if r.kind == "passed"}


def test_a_merge_that_is_not_back_to_channels_is_missed_with_a_remark():
    out, report = run(squeeze_attention(merge=(B, C * S)), target="cuda", inputs=feed())
    assert report.parity.ok and fused(out) == 0
    assert codes(report, "fuse-attention") == ["unrecognized-layout"]

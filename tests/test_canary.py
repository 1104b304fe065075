"""A float16 output must not kill the process that builds a default onnxruntime session of it:
the canary asks a child, and the validity safety net reverts the rewrite that made it crash."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import codes, run
from graphopt.opt import optimizer
from graphopt.opt.graph.ir import op_histogram
from graphopt.opt.verify import canary

F16 = TensorProto.FLOAT16


def transposed_projection(perm=(1, 0, 2)) -> onnx.ModelProto:
    """x [S,B,64] (float16) → Transpose(perm) → MatMul of a constant [64,32]: the spelling
    onnxruntime 1.32's CPU session at ORT_ENABLE_ALL dies on (sequence-first models)."""
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((64, 32)).astype(np.float16), "w"
    )
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=list(perm), name="back"),
        helper.make_node("MatMul", ["t", "w"], ["y"], name="proj"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F16, ["s", "b", 64])],
        [helper.make_tensor_value_info("y", F16, [None, None, 32])],
        [w],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def default_session_survives(model: onnx.ModelProto) -> bool:
    child = (
        "import sys, onnxruntime as ort\n"
        "so = ort.SessionOptions()\n"
        "so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL\n"
        "ort.InferenceSession(sys.stdin.buffer.read(), so, providers=['CPUExecutionProvider'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], input=model.SerializeToString(), capture_output=True
    )
    return proc.returncode >= 0


def test_float16_graphs_are_asked_and_float32_ones_are_not():
    assert canary.at_risk(transposed_projection())
    m = transposed_projection()
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((64, 32), np.float32), "w"))
    assert not canary.at_risk(m)


def test_a_child_killed_by_a_signal_is_a_crash_and_a_healthy_one_is_not(monkeypatch):
    data = transposed_projection(perm=(0, 1, 2)).SerializeToString()
    assert canary.crash(data, None, None) is None
    monkeypatch.setattr(canary, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert "SIGSEGV" in canary.crash(data, None, None)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_a_float16_transpose_before_a_projection_is_moved_after_it(target):
    x = np.random.default_rng(1).standard_normal((5, 2, 64)).astype(np.float16)
    out, report = run(transposed_projection(), target=target, inputs={"x": x})
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "transpose-after-half-matmul", "passed") == ["fired"]
    assert [n.op_type for n in out.graph.node] == ["MatMul", "Transpose"]
    assert default_session_survives(out)


def test_a_float16_transpose_shared_by_projections_is_moved_after_each():
    """Longformer's q, k and v read one transposed input: each projection gets its own
    Transpose after it (one of them alone already kills a default session)."""
    m = transposed_projection()
    w2 = numpy_helper.from_array(np.full((64, 32), 0.5, np.float16), "w2")
    m.graph.initializer.append(w2)
    m.graph.node.append(helper.make_node("MatMul", ["t", "w2"], ["y2"], name="proj2"))
    m.graph.output.append(helper.make_tensor_value_info("y2", F16, [None, None, 32]))
    x = np.random.default_rng(3).standard_normal((5, 2, 64)).astype(np.float16)
    out, report = run(m, target="cuda", inputs={"x": x})
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "transpose-after-half-matmul", "passed") == ["fired", "fired"]
    assert op_histogram(out.graph.node) == {"MatMul": 2, "Transpose": 2}
    assert default_session_survives(out)


def test_the_safety_net_reverts_the_rewrite_whose_output_a_default_session_dies_on(monkeypatch):
    """Any output onnxruntime would crash on (here: as if it died on a FusedMatMul) sends the
    safety net to the rewrite that made it; that rewrite is reverted and said."""
    real = canary.crash

    def crash(data, path, base_dir):
        model = onnx.load_from_string(data) if data is not None else onnx.load(str(path))
        if any(n.op_type == "FusedMatMul" for n in model.graph.node):
            return "onnxruntime crashed (SIGSEGV) building a session of it at ORT_ENABLE_ALL"
        return real(data, path, base_dir)

    monkeypatch.setattr(optimizer.canary, "crash", crash)
    w = numpy_helper.from_array(np.ones((8, 16), np.float16), "w")
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1], name="flip"),
        helper.make_node("MatMul", ["t", "k"], ["y"], name="mm"),
        helper.make_node("MatMul", ["y", "w"], ["z"], name="proj"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", F16, [2, 8, 4]),
            helper.make_tensor_value_info("k", F16, [2, 8, 8]),
        ],
        [helper.make_tensor_value_info("z", F16, None)],
        [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((2, 8, 4)).astype(np.float16),
        "k": rng.standard_normal((2, 8, 8)).astype(np.float16),
    }
    out, report = run(m, target="cuda", inputs=feeds)
    assert report.parity.ok
    assert "com.microsoft.FusedMatMul" not in op_histogram(out.graph.node)
    failures = [r for r in report.remarks if r.kind == "failure" and r.code == "invalid-output"]
    assert [r.rule for r in failures] == ["fuse-matmul-transpose"]
    assert "SIGSEGV" in failures[0].message

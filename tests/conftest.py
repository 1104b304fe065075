"""Shared test helpers: build small models, run graphopt on them, check parity and idempotence."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.opt.verify.parity import check_parity

# CLI progress lines on a non-terminal stderr are timed (a phase still running after N s): keep
# them out of tests that read stderr, except where a test sets the variable itself.
os.environ.setdefault("GRAPHOPT_PROGRESS_AFTER", "3600")
# The performance safety net times every cpu optimization (>= 10 s each): off in tests, except
# where a test turns it on (tests/test_perfnet.py).
os.environ.setdefault("GRAPHOPT_NO_MEASURE", "1")
# Generated kernels are on by default where a compiler is present (each gate times its kernel):
# off in tests, except where a test asks for them (--kernels, a pipeline naming the pass).
os.environ.setdefault("GRAPHOPT_NO_KERNELS", "1")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def const(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def vi(name: str, shape, elem=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def model(
    nodes, inputs, outputs, inits=(), opset: int = 17, ir_version: int = 8
) -> onnx.ModelProto:
    """A checked model; outputs declared with shape None get their type from shape inference."""
    outputs = list(outputs)
    g = helper.make_graph(nodes, "test", list(inputs), outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version
    inferred = onnx.shape_inference.infer_shapes(m)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in m.graph.output:
        if not out.type.tensor_type.HasField("shape") and out.name in known:
            out.type.CopyFrom(known[out.name].type)
    onnx.checker.check_model(m)
    return m


def run(m: onnx.ModelProto, *, level: int = 2, target: str = "cpu", pipeline=None, **kw):
    """Optimize with parity checked; returns (optimized model, report)."""
    out, report = graphopt.optimize(m, level=level, target=target, pipeline=pipeline, **kw)
    onnx.checker.check_model(out)
    return out, report


def ops(m: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in m.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def codes(report, rule: str, kind: str = "missed") -> list[str]:
    return [r.code for r in report.remarks if r.rule == rule and r.kind == kind]


def assert_optimized(m: onnx.ModelProto, *, level: int = 2, target: str = "cpu", **kw):
    """Optimize, then assert parity, unchanged output names and idempotence."""
    out, report = run(m, level=level, target=target, **kw)
    assert report.parity.ran and report.parity.ok, report.parity
    net = [r.message for r in report.remarks if r.pass_name == "safety-net"]
    assert not net, net  # parity holds because a rewrite was reverted: that rewrite is wrong
    assert [o.name for o in out.graph.output] == [o.name for o in m.graph.output]
    again, second = run(out, level=level, target=target, **kw)
    assert ops(again) == ops(out), "second run changed the graph"
    assert not any(r.kind == "passed" for r in second.remarks), [
        r for r in second.remarks if r.kind == "passed"
    ]
    return out, report


@pytest.fixture
def wide(tmp_path, rng):
    """MatMul + Add + Relu with 2 MiB of weights: model.onnx is larger than a fingerprint reads."""
    inits = [const("W", rng.standard_normal((512, 1024))), const("b", rng.standard_normal(1024))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "b"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    p = tmp_path / "wide.onnx"
    onnx.save(model(nodes, [vi("x", [2, 512])], [vi("y", None)], inits), p)
    return p


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def cpu_without_fp16_casts(monkeypatch):
    """The cpu target as if its runtime did not run float16 nodes by casting around float
    kernels (``fp16_via_float`` off): fusions then need a float16 kernel of their own."""
    import dataclasses

    from graphopt.opt.rewrite.target import TARGETS
    from graphopt.targets.profiles import CPU

    tgt = dataclasses.replace(CPU, name="cpu-no-fp16-casts", fp16_via_float=False)
    monkeypatch.setitem(TARGETS, tgt.name, tgt)
    return tgt.name


__all__ = ["assert_optimized", "check_parity", "codes", "const", "model", "ops", "run", "vi"]


@pytest.fixture
def default_on(monkeypatch):
    """Generated kernels as users get them (the test suite turns them off above)."""
    monkeypatch.delenv("GRAPHOPT_NO_KERNELS", raising=False)


@pytest.fixture
def faster(monkeypatch):
    """Structure, not timing: the generated kernels' benchmark gate passes."""
    from graphopt.targets.codegen import gates

    def fake(unfused, fused, feeds, library, **kw):
        return gates.GateResult(True, numbers={"fused_us": 1.0, "unfused_us": 2.0, "speedup": 2.0})

    monkeypatch.setattr(gates, "benchmark", fake)

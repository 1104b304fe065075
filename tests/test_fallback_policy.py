"""The fallback policy on cuda: a node the original model already ran on the CPU provider is a
warning (an ``original-fallback`` analysis remark, the manifest's ``fallbacks``, exit 0); only a
fallback graphopt's rewrites introduced is a ``cpu-fallback`` failure (exit 4), and
``--strict-fallback`` makes every fallback one.  A model mostly on the CPU says so in one line."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphopt
from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt.rewrite import target as target_mod
from graphopt.opt.rewrite.target import Target
from graphopt.opt.verify.verdict import fallback_warnings
from graphopt.targets.fallback import (
    INTRODUCED,
    ORIGINAL,
    Census,
    classify,
    original_fallbacks,
)
from graphopt.targets.profiles import CUDA

runner = CliRunner()
ML = "ai.onnx.ml"
MS = "com.microsoft"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def legalize(report, code=None, kind=None):
    return [
        r
        for r in report.remarks
        if r.pass_name == "legalize"
        and (code is None or r.code == code)
        and (kind is None or r.kind == kind)
    ]


def detector_tail() -> onnx.ModelProto:
    """Post-processing as torchvision detectors and CLIP pooling export it: ArgMax on int32
    and ReduceProd on int64 between device ops (neither has a CUDA kernel at that dtype)."""
    assert not CUDA.has_kernel("ArgMax", "", 17, "tensor(int32)")
    assert not CUDA.has_kernel("ReduceProd", "", 17, "tensor(int64)")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "two"], ["m"], name="scale"),
        helper.make_node("Cast", ["m"], ["mi"], name="to_int32", to=TensorProto.INT32),
        helper.make_node("ArgMax", ["mi"], ["am"], name="argmax_i32", axis=1, keepdims=0),
        helper.make_node("Cast", ["m"], ["ml"], name="to_int64", to=TensorProto.INT64),
        helper.make_node("ReduceProd", ["ml"], ["p"], name="reduceprod_i64", keepdims=0),
        helper.make_node("Cast", ["p"], ["pf"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Sigmoid", ["pf"], ["y"], name="sigmoid"),
    ]
    return model(
        nodes,
        [vi("x", [2, 4])],
        [vi("y", None), vi("am", None, TensorProto.INT64)],
        [const("two", 2.0)],
    )


def trees() -> onnx.ModelProto:
    """A gradient-boosted model as skl2onnx/LightGBM converters write it: Scaler and
    TreeEnsembleRegressor (ai.onnx.ml, CPU only in onnxruntime), then a Sigmoid."""
    scaler = helper.make_node(
        "Scaler", ["x"], ["xs"], name="scaler", domain=ML, offset=[0.0] * 4, scale=[1.0] * 4
    )
    ensemble = helper.make_node(
        "TreeEnsembleRegressor",
        ["xs"],
        ["score"],
        name="trees",
        domain=ML,
        n_targets=1,
        nodes_treeids=[0, 0, 0],
        nodes_nodeids=[0, 1, 2],
        nodes_featureids=[0, 0, 0],
        nodes_values=[0.5, 0.0, 0.0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
        nodes_truenodeids=[1, 0, 0],
        nodes_falsenodeids=[2, 0, 0],
        target_ids=[0, 0],
        target_nodeids=[1, 2],
        target_treeids=[0, 0],
        target_weights=[-1.0, 1.0],
        post_transform="NONE",
        aggregate_function="SUM",
    )
    sigmoid = helper.make_node("Sigmoid", ["score"], ["y"], name="sigmoid")
    g = helper.make_graph(
        [scaler, ensemble, sigmoid],
        "trees",
        [vi("x", ["N", 4])],
        [vi("y", ["N", 1])],
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 3)]
    )
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def conv_relu() -> onnx.ModelProto:
    """Conv + Relu: graphopt fuses them into com.microsoft.FusedConv on cuda."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    inits = [const("w", rng.standard_normal((4, 3, 3, 3))), const("b", rng.standard_normal(4))]
    return model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", None)], inits)


@pytest.fixture
def no_fused_conv_kernel(monkeypatch):
    """A cuda kernel table without FusedConv, while the fusing rule still believes it has one:
    the rewrite introduces a node the device cannot run (falls back to onnxruntime's CPU
    FusedConv)."""
    table = dict(CUDA.kernels())
    table.pop(("FusedConv", MS))
    believed = Target.has_kernel

    def has_kernel(self, op, domain="", opset=None, dtype=None):
        if self.name == "cuda" and op == "FusedConv":
            return True
        return believed(self, op, domain, opset, dtype)

    monkeypatch.setitem(target_mod._CACHE, "cuda", table)
    monkeypatch.setattr(Target, "has_kernel", has_kernel)


# ------------------------------------------------------------------ (a) the original's fallbacks
def test_fallbacks_the_original_had_are_warnings_not_failures():
    _, report = graphopt.optimize(detector_tail(), target="cuda")
    assert report.legal and not legalize(report, kind="failure")
    inherited = legalize(report, "original-fallback")
    assert sorted(r.nodes[0] for r in inherited) == ["argmax_i32", "reduceprod_i64"]
    assert {(r.args["op"], r.args["dtype"]) for r in inherited} == {
        ("ArgMax", "tensor(int32)"),
        ("ReduceProd", "tensor(int64)"),
    }
    assert all(r.kind == "analysis" and r.args["origin"] == ORIGINAL for r in inherited)
    assert "the original model runs it on CPUExecutionProvider too" in inherited[0].message
    (line,) = fallback_warnings(report)  # not mostly on the CPU: 2 of 8 nodes
    assert line.startswith("2 node(s) run on CPUExecutionProvider as in the original model")
    assert "ArgMax tensor(int32)" in line and "ReduceProd tensor(int64)" in line
    assert "--strict-fallback" in line
    summary = legalize(report, "summary")[0]
    assert summary.args["fallback"] == summary.args["fallback_original"] == 2


def test_cli_exits_0_with_a_warning_and_the_manifest_lists_the_fallbacks(tmp_path):
    p = tmp_path / "tail.onnx"
    onnx.save(detector_tail(), p)
    res = invoke("optimize", p, "-t", "cuda", "-o", tmp_path / "b", "-q")
    assert res.exit_code == 0, res.output
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert "2 node(s) run on CPUExecutionProvider as in the original model" in line
    assert "device<->host copies per inference" in line
    fb = json.loads((tmp_path / "b" / "manifest.json").read_text())["fallbacks"]
    assert fb["nodes"] == fb["original"] == 2 and fb["introduced"] == 0
    assert not fb["strict"] and fb["fallback_target"] == "cpu"
    placed = {n["node"]: n for island in fb["islands"] for n in island["nodes"]}
    assert placed["argmax_i32"] == {
        "node": "argmax_i32",
        "op": "ArgMax",
        "domain": "ai.onnx",
        "dtype": "tensor(int32)",
        "origin": "original",
    }
    assert placed["reduceprod_i64"]["dtype"] == "tensor(int64)"
    for island in fb["islands"]:
        assert island["provider"] == "CPUExecutionProvider"
        assert island["copies_per_inference"] == len(island["copied_in"]) + len(
            island["copied_out"]
        )
    # the Cast results cross to the host, ReduceProd's result back to the device for Sigmoid
    assert fb["copies_per_inference"] == sum(i["copies_per_inference"] for i in fb["islands"])
    assert fb["copies_per_inference"] >= 3
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["legal"] is True


# ------------------------------------------------------------------ (b) mostly on the CPU
def test_a_tree_ensemble_on_cuda_exits_0_and_says_it_runs_mostly_on_the_cpu(tmp_path):
    p = tmp_path / "trees.onnx"
    onnx.save(trees(), p)
    res = invoke("optimize", p, "-t", "cuda", "-o", tmp_path / "b", "-q")
    assert res.exit_code == 0, res.output
    warnings = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert (
        "warning: most of this model runs on CPUExecutionProvider under cuda: 2 of 3 nodes "
        "(Scaler, TreeEnsembleRegressor)" in warnings
    )
    assert any("as in the original model" in w for w in warnings)
    fb = json.loads((tmp_path / "b" / "manifest.json").read_text())["fallbacks"]
    (island,) = fb["islands"]
    assert [n["op"] for n in island["nodes"]] == ["Scaler", "TreeEnsembleRegressor"]
    assert {n["domain"] for n in island["nodes"]} == {ML}
    assert island["copied_out"] == ["score"] and island["copies_per_inference"] == 1


def test_mostly_is_said_once_and_not_for_a_few_fallbacks():
    _, report = graphopt.optimize(trees(), target="cuda")
    (mostly,) = legalize(report, "mostly-fallback")
    assert mostly.args["fallback"] == 2 and mostly.args["compute"] == 3
    _, report = graphopt.optimize(detector_tail(), target="cuda")
    assert not legalize(report, "mostly-fallback")
    _, report = graphopt.optimize(trees(), target="cpu")  # cpu has no fallback: nothing to say
    assert report.legal and not legalize(report, "mostly-fallback")
    assert not legalize(report, "fallback-island")


# ------------------------------------------------------------------ (c) graphopt's own fallbacks
def test_a_fallback_a_rewrite_introduced_still_fails(no_fused_conv_kernel, tmp_path):
    out, report = graphopt.optimize(conv_relu(), target="cuda")
    assert [n.op_type for n in out.graph.node] == ["FusedConv"]
    (f,) = legalize(report, "cpu-fallback")
    assert f.kind == "failure" and f.args["origin"] == INTRODUCED and f.args["op"] == "FusedConv"
    assert "graphopt introduced it: rule" in f.message
    assert not report.legal and not legalize(report, "original-fallback")
    p = tmp_path / "conv.onnx"
    onnx.save(conv_relu(), p)
    res = invoke("optimize", p, "-t", "cuda", "-o", tmp_path / "b", "-q")
    assert res.exit_code == 4, res.output
    assert "error: legalize: cpu-fallback: com.microsoft.FusedConv" in res.stderr
    fb = json.loads((tmp_path / "b" / "manifest.json").read_text())["fallbacks"]
    assert fb["introduced"] == 1 and fb["original"] == 0
    assert fb["islands"][0]["nodes"][0]["origin"] == INTRODUCED


def test_an_introduced_fallback_beside_the_originals_fails_alone(no_fused_conv_kernel):
    """The original's ArgMax stays a warning while the FusedConv graphopt made fails."""
    conv = conv_relu()
    extra = [
        helper.make_node("Cast", ["y"], ["yi"], name="to_int32", to=TensorProto.INT32),
        helper.make_node("ArgMax", ["yi"], ["am"], name="argmax_i32", axis=1, keepdims=0),
    ]
    m = model(
        list(conv.graph.node) + extra,
        list(conv.graph.input),
        [vi("am", None, TensorProto.INT64)],
        list(conv.graph.initializer),
    )
    _, report = graphopt.optimize(m, target="cuda")
    assert [r.args["op"] for r in legalize(report, "cpu-fallback")] == ["FusedConv"]
    assert [r.args["op"] for r in legalize(report, "original-fallback")] == ["ArgMax"]
    assert not report.legal


# ------------------------------------------------------------------ (d) --strict-fallback
def test_strict_fallback_makes_the_originals_fallbacks_exit_4(tmp_path):
    p = tmp_path / "tail.onnx"
    onnx.save(detector_tail(), p)
    res = invoke("optimize", p, "-t", "cuda", "-o", tmp_path / "b", "-q", "--strict-fallback")
    assert res.exit_code == 4, res.output
    assert "error: legalize: cpu-fallback: ArgMax (tensor(int32))" in res.stderr
    assert "(--strict-fallback)" in res.stderr
    fb = json.loads((tmp_path / "b" / "manifest.json").read_text())["fallbacks"]
    assert fb["strict"] and fb["original"] == 2
    _, report = graphopt.optimize(detector_tail(), target="cuda", options={"strict_fallback": True})
    fs = legalize(report, "cpu-fallback", kind="failure")
    assert sorted(f.nodes[0] for f in fs) == ["argmax_i32", "reduceprod_i64"]
    assert all(f.args["origin"] == ORIGINAL for f in fs) and not report.legal
    assert not fallback_warnings(report)  # failures now: the verdict's line says it


def test_strict_fallback_changes_nothing_on_cpu(tmp_path):
    p = tmp_path / "tail.onnx"
    onnx.save(detector_tail(), p)
    res = invoke("optimize", p, "-o", tmp_path / "b", "-q", "--strict-fallback")
    assert res.exit_code == 0, res.output
    fb = json.loads((tmp_path / "b" / "manifest.json").read_text())["fallbacks"]
    assert fb["nodes"] == 0 and fb["islands"] == [] and fb["fallback_target"] is None


# ------------------------------------------------------------------ the census and the split
def test_the_census_is_taken_on_the_original_with_the_same_table():
    census = original_fallbacks(CUDA, detector_tail())
    assert census.counts == {
        ("ArgMax", "", "tensor(int32)"): 1,
        ("ReduceProd", "", "tensor(int64)"): 1,
    }
    assert census.labels["argmax_i32"] == ("ArgMax", "", "tensor(int32)")
    only = original_fallbacks(CUDA, detector_tail(), ops=[("ArgMax", "")])
    assert list(only.counts) == [("ArgMax", "", "tensor(int32)")]
    assert original_fallbacks(CUDA, conv_relu()).total == 0


def test_the_census_infers_types_the_model_does_not_declare():
    m = detector_tail()
    del m.graph.value_info[:]  # intermediate types only from inference
    census = original_fallbacks(CUDA, m)
    assert census.counts[("ReduceProd", "", "tensor(int64)")] == 1


def test_classify_survivors_renames_and_excess():
    key = ("ReduceProd", "", "tensor(int64)")
    census = Census({key: 1}, {"r": key})
    # the node survived
    assert classify([("r", key, None)], census) == {"r": ORIGINAL}
    # rebuilt under another name: no more of them than the original had
    assert classify([("r2", key, "some-rule")], census) == {"r2": ORIGINAL}
    # one more than the original: the survivor is the original's, the rule's node is not
    assert classify([("new", key, "some-rule"), ("r", key, None)], census) == {
        "new": INTRODUCED,
        "r": ORIGINAL,
    }
    # neither survived: the node a rule made takes the blame
    assert classify([("a", key, "some-rule"), ("b", key, None)], census) == {
        "a": INTRODUCED,
        "b": ORIGINAL,
    }
    # a changed dtype is not the same fallback
    other = ("ReduceProd", "", "tensor(int32)")
    assert classify([("r", other, None)], census) == {"r": INTRODUCED}
    # an untyped node matches any dtype of its op, either way round
    assert classify([("r", ("ReduceProd", "", None), None)], census) == {"r": ORIGINAL}
    untyped = Census({("ReduceProd", "", None): 1}, {})
    assert classify([("x", key, None)], untyped) == {"x": ORIGINAL}
    # without the original, nothing can be the original's
    assert classify([("r", key, None)], None) == {"r": INTRODUCED}

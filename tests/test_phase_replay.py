"""A rule-set phase that left the main graph unchanged is replayed, not run again, on that same
graph: the report (remarks with their pass names and order, refusals, attempt counts, rewrites)
and the optimized model are those of running it again; a graph whose shapes were inferred since,
or another rule's refusal since, runs the phase again."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import check_parity, const, model, vi
from graphopt.opt.optimizer import optimize
from graphopt.opt.rewrite import manager
from graphopt.opt.rewrite.engine import apply_rules


def _model() -> onnx.ModelProto:
    """A LayerNorm to fuse (a later phase), a Dropout whose training mode is a graph input (a
    cleanup refusal every round) and a Reshape that does nothing (shape inference shows it)."""
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "train"], ["dr"], name="drop"),
        helper.make_node("ReduceMean", ["dr", "axes"], ["mu"], name="mean"),
        helper.make_node("Sub", ["dr", "mu"], ["d"], name="sub"),
        helper.make_node("Pow", ["d", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], name="var"),
        helper.make_node("Add", ["var", "eps"], ["ve"], name="addeps"),
        helper.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
        helper.make_node("Div", ["d", "sd"], ["n"], name="div"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["y"], name="reshape"),
    ]
    inits = [
        const("ratio", 0.1),
        const("axes", [-1], np.int64),
        const("two", 2.0),
        const("eps", 1e-5),
        const("shape", [2, 8], np.int64),
    ]
    inputs = [vi("x", [2, 8]), vi("train", [], elem=onnx.TensorProto.BOOL)]
    return model(nodes, inputs, [vi("y", [2, 8])], inits, opset=18)


def _report(monkeypatch, replay: bool, pipeline: str | None = None):
    if not replay:  # every phase runs, as before replays existed
        monkeypatch.setattr(manager, "_run_phase", apply_rules)
    replayed = []
    real = manager._replay
    monkeypatch.setattr(manager, "_replay", lambda *a: replayed.append(a[2]) or real(*a))
    out, report = optimize(_model(), pipeline=pipeline, check=False, measure=False)
    monkeypatch.undo()
    remarks = [(r.kind, r.pass_name, r.rule, r.code, r.nodes, r.message) for r in report.remarks]
    rules = {k: {a: b for a, b in v.items() if a != "seconds"} for k, v in report.rules.items()}
    summary = (out.SerializeToString(), remarks, rules, report.applied, report.ops_after)
    return summary, replayed


@pytest.mark.parametrize(
    "pipeline",
    [None, "rules{level=1},fold-constants,rules{level=2}", "rules{level=1},rules{level=2}"],
)
def test_replayed_phases_report_what_running_them_again_would(monkeypatch, pipeline):
    want, _ = _report(monkeypatch, replay=False, pipeline=pipeline)
    got, replayed = _report(monkeypatch, replay=True, pipeline=pipeline)
    assert got == want
    remarks, rules = got[1], got[2]
    assert ("missed", "training-mode") in {(r[0], r[3]) for r in remarks}
    assert rules["eliminate-dropout"]["attempts"] >= 2
    if pipeline is None:  # rules{level=2}'s cleanup phase on what rules{level=1} settled
        assert replayed == ["rules{level=2}"]
    elif "fold-constants" in pipeline:  # shapes inferred since: the noop Reshape goes
        assert not replayed
        assert "eliminate-noop-reshape" in {r[2] for r in remarks if r[0] == "passed"}
    else:
        assert replayed == ["rules{level=2}"]
        assert any(r[1] == "rules{level=2}" and r[3] == "training-mode" for r in remarks)


def test_a_refusal_of_another_rule_since_runs_the_phase_again(monkeypatch):
    from graphopt.opt.graph.ir import ModelIR
    from graphopt.opt.rewrite.context import PassContext
    from graphopt.opt.rewrite.manager import RuleSetPass, run_pass
    from graphopt.opt.rewrite.target import get_target

    ir = ModelIR(_model())
    cx = PassContext(target=get_target("cpu"), level=2, ir=ir)
    ran = []
    real = manager.apply_rules
    monkeypatch.setattr(manager, "apply_rules", lambda *a: ran.append(1) or real(*a))
    cleanup = RuleSetPass(max_level=1)
    assert not run_pass(cleanup, ir, cx)
    assert not run_pass(cleanup, ir, cx) and len(ran) == 1  # replayed
    cx.record_miss("fuse-attention", "no-kernel", ["somewhere"], {})
    assert not run_pass(cleanup, ir, cx) and len(ran) == 2  # run again
    assert cx.stats["eliminate-dropout"].attempts == 3
    assert len(cx.misses["eliminate-dropout"]) == 3


def test_the_replayed_pipeline_keeps_parity():
    m = _model()
    out, report = optimize(m, check=False, measure=False)
    assert "LayerNormalization" in report.ops_after
    feeds = {"x": np.random.default_rng(0).random((2, 8), np.float32), "train": np.array(False)}
    assert check_parity(m, out, inputs=feeds, seed=0).ok

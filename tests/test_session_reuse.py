"""One onnxruntime run of the original per session level: the bundle's check at its session
settings compares with the outputs the performance net already got from the original."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import helper

import graphopt
from conftest import const, model, vi
from graphopt.opt.optimizer import run_of
from graphopt.opt.verify import perf
from graphopt.targets import bundle


def small():
    nodes = [
        helper.make_node("Identity", ["x"], ["i"]),
        helper.make_node("MatMul", ["i", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["y"]),
    ]
    w = np.random.default_rng(0).random((16, 16)).astype(np.float32)
    return model(nodes, [vi("x", [4, 16])], [vi("y", [4, 16])], [const("W", w), const("b", w[0])])


def test_the_bundle_reuses_the_original_outputs_of_the_performance_net(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHOPT_NO_MEASURE", raising=False)
    monkeypatch.setattr(perf, "MIN_BUDGET_S", 1.0)
    out, report = graphopt.optimize(small())
    assert report.performance["measured"], report.performance
    ran = run_of(report).context["original_outputs"]["ORT_ENABLE_ALL"]
    assert set(ran) == {"y"}
    levels = []
    real = bundle.Session

    def counted(m, *args, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL, **kw):
        levels.append((m is run_of(report).context["original"], level))
        return real(m, *args, level=level, **kw)

    monkeypatch.setattr(bundle, "Session", counted)
    bundle.write_bundle(out, report, tmp_path / "b")
    assert (True, ort.GraphOptimizationLevel.ORT_ENABLE_ALL) not in levels
    deployed = report.parity_deployed
    assert deployed.ran and deployed.ok, deployed.error
    run_of(report).context["original_outputs"] = {}  # without them the original is loaded
    bundle.write_bundle(out, report, tmp_path / "c")
    assert (True, ort.GraphOptimizationLevel.ORT_ENABLE_ALL) in levels
    assert report.parity_deployed.ok


def test_the_validity_session_is_dropped_when_parity_does_not_take_it():
    from graphopt.opt import optimizer

    graphopt.optimize(small(), check=False)
    assert not optimizer._LOADED  # an output's weights are not held through the bundle

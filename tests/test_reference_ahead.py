"""Parity's run of the original goes on beside the passes (ReferenceRun): the same inputs and
outputs as parity's own run, one run of the original, and stopped when the optimization fails."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import helper

import graphopt
from conftest import const, model, vi
from graphopt.opt import optimizer
from graphopt.opt.errors import GraphoptError
from graphopt.opt.verify import parity


def conv_bn(batch="N"):
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"]),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    inits = [
        const("W", rng.standard_normal((8, 3, 3, 3)).astype(np.float32)),
        const("g", rng.random(8).astype(np.float32) + 0.5),
        const("b", rng.standard_normal(8).astype(np.float32)),
        const("m", rng.standard_normal(8).astype(np.float32)),
        const("v", rng.random(8).astype(np.float32) + 0.5),
    ]
    return model(nodes, [vi("x", [batch, 3, 12, 12])], [vi("y", [batch, 8, 12, 12])], inits)


def test_the_run_ahead_gives_parity_what_its_own_run_gives():
    m = conv_bn()
    out = graphopt.optimize(m, check=False)[0]
    own = parity.check_parity(m, out, shapes={"x": [2, 3, 12, 12]}, seed=3)
    ahead = parity.ReferenceRun(m, shapes={"x": [2, 3, 12, 12]}, seed=3)
    early = parity.check_parity(m, out, shapes={"x": [2, 3, 12, 12]}, seed=3, ahead=ahead)
    assert own.ok and early.ok and own.inputs == early.inputs == {"x": [2, 3, 12, 12]}
    for name, value in own.reference_outputs.items():
        assert np.array_equal(value, early.reference_outputs[name])  # bit for bit
    assert np.array_equal(own.feeds["x"], early.feeds["x"])


def test_a_run_ahead_of_other_arguments_is_not_used():
    m = conv_bn()
    ahead = parity.ReferenceRun(m, seed=1)
    assert not ahead.matches(m, None, None, 2, None)
    assert not ahead.matches(conv_bn(), None, None, 1, None)
    assert ahead.matches(m, None, None, 1, None)
    report = parity.check_parity(m, m, seed=2, ahead=ahead)
    assert report.ok and report.seed == 2
    mine = parity.check_parity(m, m, seed=2)
    assert np.array_equal(report.feeds["x"], mine.feeds["x"])


def test_optimize_runs_the_original_once_for_parity(monkeypatch):
    m = conv_bn()
    runs = []
    real = parity.Session.run

    def counted(self, feeds, names=None, options=None):
        runs.append(threading.current_thread().name)
        return real(self, feeds, names, options)

    monkeypatch.setattr(parity.Session, "run", counted)
    _, report = graphopt.optimize(m, measure=False)
    assert report.parity.ran and report.parity.ok
    # the original on the reference thread, the optimized model on the caller's
    assert runs == ["graphopt-reference", threading.current_thread().name]


def test_what_the_run_ahead_raises_is_raised_where_parity_takes_it():
    m = conv_bn()
    m.graph.node[0].op_type = "NoSuchOp"  # onnxruntime cannot load it
    ahead = parity.ReferenceRun(m)
    with pytest.raises(GraphoptError, match="cannot load"):
        ahead.result()


def test_a_failed_optimization_stops_the_run_ahead(monkeypatch):
    m = conv_bn()
    started = []
    real = parity.ReferenceRun.__init__

    def kept(self, *args, **kw):
        real(self, *args, **kw)
        started.append(self)

    def failing(*_args, **_kw):
        raise GraphoptError("a pass failed")

    monkeypatch.setattr(parity.ReferenceRun, "__init__", kept)
    monkeypatch.setattr(optimizer, "run_pass", failing)
    with pytest.raises(GraphoptError, match="a pass failed"):
        graphopt.optimize(m)
    assert len(started) == 1 and started[0]._options.terminate
    assert not started[0]._thread.is_alive()


def test_no_run_ahead_without_parity_or_when_parity_runs_lean(monkeypatch):
    started = []
    real = parity.ReferenceRun.__init__

    def kept(self, *args, **kw):
        real(self, *args, **kw)
        started.append(self)

    monkeypatch.setattr(parity.ReferenceRun, "__init__", kept)
    graphopt.optimize(conv_bn(), check=False)
    graphopt.optimize(conv_bn(), reference="float64", measure=False)
    assert not started
    monkeypatch.setattr(optimizer, "is_lean", lambda _m: True)
    with optimizer._reference_ahead(conv_bn(), True, "original", None, None, 0, None) as ahead:
        assert ahead is None

"""A fixpoint does not run a pass again on the graph it already ran on without changing it:
the confirming round only runs what some later change could have given new work, and the
optimized model is the one every pass re-run gives."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from conftest import const, model, vi
from graphopt.opt.graph.ir import ModelIR
from graphopt.opt.optimizer import optimize
from graphopt.opt.rewrite.context import Pass, PassContext
from graphopt.opt.rewrite.manager import Fixpoint, run_pass
from graphopt.opt.rewrite.target import get_target
from graphopt.opt.verify.parity import check_parity
from graphopt.passes.dce import DeadCodeElimination


class _Once(Pass):
    """Reports a change on its first run only."""

    name = "test-once"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, ir, cx):
        self.calls += 1
        return self.calls == 1


class _Never(Pass):
    name = "test-never"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, ir, cx):
        self.calls += 1
        return False


def _ir() -> ModelIR:
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    return ModelIR(model(nodes, [vi("x", [2])], [vi("y", None)]))


def test_a_pass_that_changed_nothing_since_the_last_change_is_not_run_again():
    ir, once, never = _ir(), _Once(), _Never()
    cx = PassContext(target=get_target("cpu"), level=2)
    run_pass(Fixpoint([once, never]), ir, cx)
    # round 1: once changes, never not; round 2: once changes nothing, so never is settled
    assert (once.calls, never.calls) == (2, 1)
    assert [(r.name, r.iteration, r.changed) for r in cx.records] == [
        ("test-once", 1, True),
        ("test-never", 1, False),
        ("test-once", 2, False),
    ]
    # a later fixpoint on the same graph: both settled, neither runs
    run_pass(Fixpoint([never, once]), ir, cx)
    assert (once.calls, never.calls) == (2, 1)


def test_a_change_by_any_pass_runs_the_settled_ones_again():
    ir, once, never = _ir(), _Once(), _Never()
    cx = PassContext(target=get_target("cpu"), level=2)
    run_pass(Fixpoint([never, once]), ir, cx)
    # round 1: never, then once changes; round 2: never again (the graph changed), once
    assert (never.calls, once.calls) == (2, 2)
    other = _ir()  # another IR: nothing settled there
    run_pass(Fixpoint([never]), other, cx)
    assert never.calls == 3


def test_optimized_model_is_the_same_as_with_every_pass_rerun(monkeypatch):
    """The default pipeline's result with settled passes skipped equals its result with every
    pass of every round run (the skip turned off), and keeps parity."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Shape", ["r"], ["s"], name="shape"),
        helper.make_node("Reshape", ["r", "s"], ["y0"], name="reshape"),
        helper.make_node("Identity", ["y0"], ["y"], name="id"),
    ]
    inits = [
        const("W", rng.standard_normal((4, 3, 3, 3))),
        const("g", rng.random(4) + 0.5),
        const("b", rng.standard_normal(4)),
        const("m", rng.standard_normal(4)),
        const("v", rng.random(4) + 0.1),
    ]
    m = model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", None)], inits)
    fast, fast_report = optimize(m, level=2, target="cpu")
    monkeypatch.setattr(PassContext, "is_settled", lambda self, p, ir: False)
    full, full_report = optimize(m, level=2, target="cpu")
    assert [n.SerializeToString() for n in fast.graph.node] == [
        n.SerializeToString() for n in full.graph.node
    ]
    assert len(fast.graph.node) < len(m.graph.node)
    assert len(fast_report.passes) < len(full_report.passes)  # some pass was settled
    parity = check_parity(m, fast)
    assert parity.ran and parity.ok, parity


def test_dce_settles():
    ir = _ir()
    cx = PassContext(target=get_target("cpu"), level=2)
    run_pass(DeadCodeElimination(), ir, cx)
    assert cx.is_settled(DeadCodeElimination(), ir)
    assert not cx.is_settled(_Never(), ir)
    assert isinstance(ir.to_onnx(), onnx.ModelProto)

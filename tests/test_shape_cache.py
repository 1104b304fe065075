"""Shape inference is re-run only for the graphs a pass changed: a change inside one If branch
leaves the other branch's shapes as they are, without exporting it again."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import const, model, run, vi
from graphopt.opt.graph import analysis
from graphopt.opt.graph.ir import Constant, ModelIR, subgraphs


def if_model():
    then = helper.make_graph(
        [
            helper.make_node("Shape", ["r"], ["s"]),
            helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["r", "sf"], ["t_out"]),
        ],
        "then",
        [],
        [vi("t_out", None)],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["r"], ["n"]), helper.make_node("Add", ["n", "k"], ["e_out"])],
        "else",
        [],
        [vi("e_out", None)],
        [const("k", np.ones(3))],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
        helper.make_node("Greater", ["sx", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    return model(nodes, [vi("x", [3])], [vi("y", None)], [const("zero", 0.0)])


@pytest.fixture
def inferences(monkeypatch):
    """How many times onnx's shape inference ran."""
    calls = []
    real = onnx.shape_inference.infer_shapes

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counted)
    return calls


def infer_everywhere(ir: ModelIR) -> None:
    analysis.infer_shapes(ir)
    for node in ir.graph.nodes:
        for sub in subgraphs(node):
            with ir.scoped(sub):
                analysis.infer_shapes(ir)


def test_a_change_in_one_branch_reinfers_that_branch_only(inferences):
    ir = ModelIR(if_model())
    inferences.clear()  # importing may infer too
    infer_everywhere(ir)
    assert len(inferences) == 3  # the main graph and both branches
    bodies = subgraphs([n for n in ir.graph.nodes if n.op == "If"][0])
    then, other = sorted(bodies, key=lambda g: g.name != "then")
    # fold the Shape→Cast of the then-branch by hand, as a pass would
    cast = [n for n in then.nodes if n.op == "Cast"][0]
    sf = cast.outputs[0]
    cast.outputs.clear()
    sf.to_constant(np.array([3.0], np.float32))
    then.cleanup()
    ir.mutations += 1
    infer_everywhere(ir)
    assert len(inferences) == 3 + 2  # the then-branch and the main graph that holds it
    ir.mutations += 1  # a pass that changed nothing in these graphs
    infer_everywhere(ir)
    assert len(inferences) == 5
    assert isinstance(sf, Constant) and other.outputs[0].dtype == np.float32


def test_a_new_type_of_an_outer_value_reinfers_the_body(inferences):
    ir = ModelIR(if_model())
    inferences.clear()  # importing may infer too
    infer_everywhere(ir)
    r = [n for n in ir.graph.nodes if n.op == "Relu"][0].outputs[0]
    r.shape = ["n"]  # what the branches read from outside changed
    ir.mutations += 1
    for sub in subgraphs([n for n in ir.graph.nodes if n.op == "If"][0]):
        with ir.scoped(sub):
            analysis.infer_shapes(ir)
    assert len(inferences) == 3 + 2
    r.shape = None  # the main graph's own tensor lost its type: inferred again
    ir.mutations += 1
    analysis.infer_shapes(ir)
    assert len(inferences) == 3 + 3 and r.shape == [3]


def test_if_model_optimizes_with_parity():
    out, report = run(if_model(), level=2)
    assert report.parity.ok
    assert [n.op_type for n in out.graph.node].count("If") == 1

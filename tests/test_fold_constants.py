"""Constant folding: shape glue collapses, everything constant folds, big outputs are a decision."""

import numpy as np
from onnx import TensorProto, helper

from conftest import assert_optimized, codes, const, model, ops, run, vi


def test_shape_glue_folds_to_constant_reshape():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        helper.make_node("Concat", ["n1", "m1"], ["t"], axis=0),
        helper.make_node("Reshape", ["r", "t"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [2, 3, 4])],
        [vi("y", None)],
        [const("i0", 0, np.int64), const("ax", [0], np.int64), const("m1", [-1], np.int64)],
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Relu": 1, "Reshape": 1}


def test_dynamic_dims_are_not_folded():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["sf"], ["y"], keepdims=0),
    ]
    m = model(nodes, [vi("x", ["batch", 3])], [vi("y", None)])
    out, report = assert_optimized(m, level=1, shapes={"x": [5, 3]})
    assert ops(out) == {"Shape": 1, "Cast": 1, "ReduceSum": 1}


def test_all_constant_graph_folds_to_zero_nodes():
    nodes = [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Exp", ["c"], ["y"])]
    m = model(nodes, [], [vi("y", [3])], [const("a", [1, 2, 3]), const("b", [0.5, 0.5, 0.5])])
    out, report = run(m, level=1)
    assert len(out.graph.node) == 0 and report.parity.ok


def test_large_constant_of_shape_is_a_decision():
    """ConstantOfShape building a 4 MiB weight (the zoo's 'light' models) is not folded."""
    nodes = [
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["w"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.02]),
        ),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]
    m = model(
        nodes, [vi("x", [1, 1024])], [vi("y", None)], [const("shape", [1024, 1024], np.int64)]
    )
    out, report = run(m, level=1)
    assert ops(out)["ConstantOfShape"] == 1
    assert codes(report, "fold-constants") == ["fold-size-limit"]
    remark = [r for r in report.remarks if r.code == "fold-size-limit"][0]
    assert remark.args["output_bytes"] == 4 * 2**20
    # Raising the limit folds it.
    out2, _ = run(m, level=1, options={"fold_size_limit": 8 * 2**20})
    assert "ConstantOfShape" not in ops(out2)


def test_random_ops_are_not_folded():
    nodes = [
        helper.make_node("RandomNormal", [], ["r"], shape=[3], seed=1.0),
        helper.make_node("Add", ["x", "r"], ["y"]),
    ]
    m = model(nodes, [vi("x", [3])], [vi("y", None)])
    out, _ = run(m, level=1, check=False)
    assert ops(out)["RandomNormal"] == 1

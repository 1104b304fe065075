"""Symbolic shape folding with dynamic dims: exporter reshape glue becomes a constant target."""

import numpy as np
from onnx import helper, numpy_helper

from conftest import assert_optimized, const, model, ops, vi


def split_heads(batch="B", seq="S"):
    """x[B,S,8] → Reshape(x, Concat(Shape(x)[0], Shape(x)[1], 2, 4)), as exporters write it."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["d0"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["d1"], axis=0),
        helper.make_node("Unsqueeze", ["d0", "ax"], ["u0"]),
        helper.make_node("Unsqueeze", ["d1", "ax"], ["u1"]),
        helper.make_node("Concat", ["u0", "u1", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["r", "target"], ["y"]),
    ]
    inits = [
        const("i0", 0, np.int64),
        const("i1", 1, np.int64),
        const("ax", [0], np.int64),
        const("heads", [2, 4], np.int64),
    ]
    return model(nodes, [vi("x", [batch, seq, 8])], [vi("y", None)], inits)


def test_dynamic_reshape_target_becomes_constant():
    out, report = assert_optimized(split_heads(), level=1, shapes={"x": [3, 5, 8]})
    assert ops(out) == {"Relu": 1, "Reshape": 1}
    reshape = [n for n in out.graph.node if n.op_type == "Reshape"][0]
    target = {t.name: t for t in out.graph.initializer}[reshape.input[1]]
    assert numpy_helper.to_array(target).tolist() == [0, 0, 2, 4]
    assert any(r.code == "symbolic-reshape" for r in report.remarks)


def test_static_dims_of_dynamic_shape_fold():
    """Gather of a static dim (8) from a dynamically shaped tensor folds to a constant."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i2"], ["d2"], axis=0),
        helper.make_node("Cast", ["d2"], ["f"], to=1),
        helper.make_node("Mul", ["x", "f"], ["y"]),
    ]
    m = model(nodes, [vi("x", ["B", "S", 8])], [vi("y", None)], [const("i2", 2, np.int64)])
    out, _ = assert_optimized(m, level=1, shapes={"x": [2, 3, 8]})
    assert ops(out) == {"Mul": 1}

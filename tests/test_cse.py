"""Common-subexpression elimination: what merges, what must not, and bodies reading merged
values."""

import numpy as np
from onnx import TensorProto, helper

from conftest import assert_optimized, const, model, ops, run, vi

PIPE = "cse,dce"


def twice(op="Relu", attrs2=None, **attrs):
    nodes = [
        helper.make_node(op, ["x"], ["a"], name="first", **attrs),
        helper.make_node(op, ["x"], ["b"], name="second", **(attrs if attrs2 is None else attrs2)),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    return model(nodes, [vi("x", ["n", 4])], [vi("y", None)])


def test_same_op_same_inputs_merge():
    out, report = assert_optimized(twice(), pipeline=PIPE)
    assert ops(out) == {"Relu": 1, "Add": 1}
    assert report.rules["cse"]["fired"] == 1
    add = next(n for n in out.graph.node if n.op_type == "Add")
    assert add.input[0] == add.input[1]


def test_different_attributes_do_not_merge():
    out, _ = assert_optimized(twice("LeakyRelu", attrs2={"alpha": 0.2}, alpha=0.1), pipeline=PIPE)
    assert ops(out)["LeakyRelu"] == 2


def test_chains_merge_in_one_pass():
    nodes = [
        helper.make_node("Shape", ["x"], ["s1"]),
        helper.make_node("Shape", ["x"], ["s2"]),
        helper.make_node("Gather", ["s1", "i"], ["g1"], axis=0),
        helper.make_node("Gather", ["s2", "i"], ["g2"], axis=0),
        helper.make_node("Add", ["g1", "g2"], ["y"]),
    ]
    m = model(
        nodes, [vi("x", ["n", 4])], [vi("y", None, TensorProto.INT64)], [const("i", 0, np.int64)]
    )
    out, _ = assert_optimized(m, pipeline=PIPE)
    assert ops(out) == {"Shape": 1, "Gather": 1, "Add": 1}


def test_random_and_graph_outputs_are_not_merged():
    nodes = [
        helper.make_node("RandomUniformLike", ["x"], ["r1"]),
        helper.make_node("RandomUniformLike", ["x"], ["r2"]),
        helper.make_node("Relu", ["x"], ["y1"]),
        helper.make_node("Relu", ["x"], ["y2"]),
        helper.make_node("Add", ["r1", "r2"], ["y3"]),
    ]
    m = model(nodes, [vi("x", [2, 3])], [vi("y1", None), vi("y2", None), vi("y3", None)])
    out, _ = run(m, pipeline=PIPE, check=False)
    assert ops(out) == {"RandomUniformLike": 2, "Relu": 2, "Add": 1}


def test_equal_constants_are_shared_but_a_scalar_is_not_a_vector():
    """Per-layer copies of one constant become one; 2 and [2] stay apart (shape differs)."""
    nodes = [
        helper.make_node("Mul", ["x", "c1"], ["a"]),
        helper.make_node("Mul", ["x", "c2"], ["b"]),
        helper.make_node("Mul", ["x", "scalar"], ["c"]),
        helper.make_node("Mul", ["x", "vector"], ["d"]),
        helper.make_node("Sum", ["a", "b", "c", "d"], ["y"]),
    ]
    inits = [
        const("c1", [0.5, 2.0, 3.0, 4.0]),
        const("c2", [0.5, 2.0, 3.0, 4.0]),
        const("scalar", 2.0),
        const("vector", [2.0]),
    ]
    m = model(nodes, [vi("x", ["n", 4])], [vi("y", None)], inits)
    out, _ = assert_optimized(m, pipeline=PIPE)
    assert ops(out) == {"Mul": 3, "Sum": 1}
    assert sorted(t.name for t in out.graph.initializer) == ["c1", "scalar", "vector"]


def test_merged_value_read_inside_an_if_body():
    """A body reads the duplicate from the enclosing scope: it must read the kept one."""
    then_body = helper.make_graph(
        [helper.make_node("Neg", ["b"], ["t"])], "then", [], [vi("t", None)]
    )
    else_body = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["e"])], "else", [], [vi("e", None)]
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["x"], ["b"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_body, else_branch=else_body),
    ]
    m = model(nodes, [vi("x", [2, 3]), vi("cond", [], TensorProto.BOOL)], [vi("y", None)])
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    for c in (True, False):
        out, _ = assert_optimized(m, pipeline=PIPE, inputs={"x": x, "cond": np.array(c)})
        assert ops(out) == {"Relu": 1, "If": 1}

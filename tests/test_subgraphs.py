"""Subgraphs: constant-condition If is inlined; passes and rules run inside If/Loop bodies with
outer-scope values handled; symbolic dims survive."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, const, model, ops, run, vi


def branch(name, nodes, out, inits=()):
    return helper.make_graph(nodes, name, [], [vi(out, None)], list(inits))


def if_model(cond: bool, extra_outer=True):
    then = branch(
        "then",
        [helper.make_node("Add", ["r", "one"], ["t_out"])],
        "t_out",
        [const("one", np.ones(3))],
    )
    other = branch("else", [helper.make_node("Neg", ["r"], ["e_out"])], "e_out")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("If", ["c"], ["y0"], then_branch=then, else_branch=other, name="if"),
        helper.make_node("Mul", ["y0", "r"], ["y"], name="mul"),
    ]
    return model(nodes, [vi("x", [3])], [vi("y", [3])], [const("c", cond, np.bool_)])


@pytest.mark.parametrize("cond,op", [(True, "Add"), (False, "Neg")])
def test_constant_if_is_inlined(cond, op):
    m = if_model(cond)
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    out, report = assert_optimized(m, level=1)
    assert ops(out) == {"Relu": 1, op: 1, "Mul": 1}
    assert any(r.rule == "inline-constant-if" and r.kind == "passed" for r in report.remarks)


def test_if_branch_output_becomes_graph_output():
    then = branch("then", [helper.make_node("Sigmoid", ["x"], ["t"])], "t")
    other = branch("else", [helper.make_node("Tanh", ["x"], ["e"])], "e")
    m = model(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [vi("x", [2])],
        [vi("y", [2])],
        [const("c", True, np.bool_)],
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Sigmoid": 1} and out.graph.node[0].output[0] == "y"


def test_rules_and_folding_run_inside_dynamic_if_branches():
    """With a run-time condition the If stays, but its bodies are optimized."""
    then = branch(
        "then",
        [
            helper.make_node("Identity", ["r"], ["i"]),
            helper.make_node("Add", ["i", "k2"], ["t_out"]),
        ],
        "t_out",
        [],
    )
    other = branch(
        "else",
        [
            helper.make_node("Shape", ["r"], ["s"]),
            helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["r", "sf"], ["e_out"]),
        ],
        "e_out",
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Add", ["one", "one"], ["k2"]),  # foldable outer constant
        helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
        helper.make_node("Greater", ["sx", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    m = model(
        nodes, [vi("x", [3])], [vi("y", None)], [const("one", np.ones(3)), const("zero", 0.0)]
    )
    out, report = run(m, level=1)
    assert report.parity.ok
    if_node = [n for n in out.graph.node if n.op_type == "If"][0]
    then_ops = [
        n.op_type
        for n in helper.get_attribute_value(
            if_node.attribute[[a.name for a in if_node.attribute].index("then_branch")]
        ).node
    ]
    else_ops = [
        n.op_type
        for n in helper.get_attribute_value(
            if_node.attribute[[a.name for a in if_node.attribute].index("else_branch")]
        ).node
    ]
    assert "Identity" not in then_ops
    assert else_ops == ["Mul"]  # Shape of the static outer tensor folded inside the branch
    # With a negative sum the else branch runs: parity on that path too.
    out2, r2 = run(m, level=1, inputs={"x": -np.ones(3, np.float32)})
    assert r2.parity.ok


def test_loop_body_is_optimized():
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["acc_in"], ["a1"]),
            helper.make_node("Add", ["a1", "x"], ["acc_out"]),
        ],
        "body",
        [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL), vi("acc_in", [3])],
        [vi("cond_out", [], TensorProto.BOOL), vi("acc_out", [3])],
    )
    nodes = [helper.make_node("Loop", ["n", "", "init"], ["y"], body=body)]
    m = model(
        nodes, [vi("x", [3])], [vi("y", [3])], [const("n", 4, np.int64), const("init", np.zeros(3))]
    )
    out, report = assert_optimized(m, level=1)
    loop = out.graph.node[0]
    body_ops = [n.op_type for n in helper.get_attribute_value(loop.attribute[0]).node]
    assert body_ops.count("Identity") == 1  # cond passthrough (input→output) must stay
    onnx.checker.check_model(out, full_check=True)


def test_symbolic_dims_survive():
    m = model(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])],
        [vi("x", ["batch", "seq", 8])],
        [vi("y", ["batch", "seq", 8])],
    )
    out, _ = assert_optimized(m, level=2)
    dims = [d.dim_param or d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq", 8]
    dims = [d.dim_param or d.dim_value for d in out.graph.output[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq", 8]


def _body_ops(g: onnx.GraphProto) -> dict[str, int]:
    """Op counts of every If/Loop body below ``g``, by body name."""
    out = {}
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out[a.g.name] = len(a.g.node)
                out.update(_body_ops(a.g))
    return out


@pytest.mark.parametrize("sr", [16000, 8000])
def test_silero_like_vad_with_if_and_loop(sr):
    """examples/vad_tiny.onnx (examples/make_vad.py): an If on the sample rate, a Loop running
    an LSTM cell per frame whose weights the export re-slices from constants every frame.  Both
    branches keep parity, the Loop body sheds its per-frame weight glue, dims stay symbolic."""
    from conftest import EXAMPLES

    src = onnx.load(str(EXAMPLES / "vad_tiny.onnx"))
    rng = np.random.default_rng(0)
    feed = {
        "audio": rng.standard_normal((2, 4000)).astype(np.float32),
        "sr": np.array(sr, dtype=np.int64),
        "h": rng.standard_normal((2, 32)).astype(np.float32),
        "c": rng.standard_normal((2, 32)).astype(np.float32),
    }
    out, report = assert_optimized(src, inputs=feed)
    before, after = _body_ops(src.graph), _body_ops(out.graph)
    loop = next(n for n in out.graph.node if n.op_type == "Loop")
    body = loop.attribute[0].g
    assert len(body.node) < before[body.name] / 4  # 88 → 13: Slice/Concat of weights folded
    assert not [n for n in body.node if n.op_type in ("Constant", "Concat")]
    assert {"If", "Loop"} <= set(ops(out)) and ops(out).get("FusedConv") == 2
    dims = [d.dim_param for d in out.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "samples"]
    assert sum(after.values()) < sum(before.values())


def nested_if_model():
    """An If whose then-branch holds a constant-condition If (inlined at -O1) and a dynamic If
    whose branches forward the inlined value through Identity nodes into their outputs."""
    inner_const = helper.make_node(
        "If",
        ["k"],
        ["y"],
        then_branch=branch("bt", [helper.make_node("Relu", ["x"], ["ry"])], "ry"),
        else_branch=branch("be", [helper.make_node("Neg", ["x"], ["ny"])], "ny"),
        name="if_const",
    )
    inner_dyn = helper.make_node(
        "If",
        ["c"],
        ["z"],
        then_branch=branch("ct", [helper.make_node("Identity", ["y"], ["zt"])], "zt"),
        else_branch=branch("ce", [helper.make_node("Identity", ["y"], ["ze"])], "ze"),
        name="if_dyn",
    )
    then = helper.make_graph(
        [inner_const, inner_dyn], "then", [], [vi("z", None)], [const("k", True, np.bool_)]
    )
    other = branch("else", [helper.make_node("Sigmoid", ["x"], ["s"])], "s")
    return model(
        [helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other)],
        [vi("x", [3]), vi("c", [], TensorProto.BOOL)],
        [vi("out", [3])],
    )


def test_rewrite_in_a_body_never_touches_nested_bodies():
    """Inlining a constant If inside a branch creates nodes whose outputs are read by Identity
    nodes of a nested body; those must be rewritten (if at all) in their own scope, so every
    branch output keeps its producer (the model stays valid)."""
    feeds = {"x": np.array([-1, 0, 2], np.float32), "c": np.array(True)}
    out, report = run(nested_if_model(), level=1, inputs=feeds)
    onnx.checker.check_model(out, full_check=True)
    assert report.parity.ran and report.parity.ok, report.parity
    assert ops(out) == {"If": 1}


def test_rules_are_tried_only_on_nodes_of_the_graph_being_rewritten(monkeypatch):
    """A value's readers include nodes of nested bodies; the driver of the enclosing graph must
    not queue them (a rule would then rewrite a body node in the wrong scope)."""
    from graphopt.opt.rewrite.engine import Op, Rule, applies_only_if
    from graphopt.opt.rewrite.manager import RULES

    seen = []

    class Spy(Rule):
        name = "test-spy-identity"
        root = "Identity"
        level = 1
        summary = "records where it is tried (tests only)"
        pattern = Op("Identity", "src")

        def structure(self, m, cx):
            seen.append(any(n is m.root for n in cx.ir.graph.nodes))
            applies_only_if(False)

    monkeypatch.setitem(RULES, Spy.name, Spy())
    run(nested_if_model(), level=1, pipeline="rules{level=1}", check=False)
    assert seen and all(seen)


def test_large_constant_nodes_are_not_merged_by_cse():
    """Two Constant nodes over CSE's size limit are different tensors, never one."""
    a = np.arange(5000, dtype=np.float32)
    nodes = [
        helper.make_node("Constant", [], ["ca"], value=const("va", a)),
        helper.make_node("Constant", [], ["cb"], value=const("vb", -a)),
        helper.make_node("Add", ["x", "ca"], ["p"]),
        helper.make_node("Add", ["x", "cb"], ["q"]),
        helper.make_node("Sub", ["p", "q"], ["y"]),
    ]
    m = model(nodes, [vi("x", [5000])], [vi("y", [5000])])
    out, report = run(m, level=1, pipeline="cse")
    assert report.parity.ran and report.parity.ok, report.parity
    assert ops(out)["Constant"] == 2

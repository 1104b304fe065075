"""graphopt bisect: a deliberately wrong, test-only rule is found within log2(rewrites)+2 runs."""

import json

import numpy as np
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt.bisect import bisect, max_runs
from graphopt.opt.rewrite.engine import Op, Rule
from graphopt.opt.rewrite.manager import RULES


class WrongReluToAbs(Rule):
    """Deliberately wrong: Relu(x) is not Abs(x)."""

    name = "test-wrong-relu-to-abs"
    root = "Relu"
    level = 2
    summary = "deliberately wrong rewrite (tests only)"
    pattern = Op("Relu", "x")
    exclusive = False

    def rewrite(self, m, b):
        return [b.op("Abs", [m.x], like=m.root.outputs[0])]


@pytest.fixture
def wrong_rule(monkeypatch):
    monkeypatch.setitem(RULES, WrongReluToAbs.name, WrongReluToAbs())


def many_rewrites(rng, n_identities=9):
    """Identities (harmless rewrites) around one Relu and a downstream Add."""
    nodes, prev = [], "x"
    for i in range(n_identities):
        nodes.append(helper.make_node("Identity", [prev], [f"id{i}"], name=f"id{i}"))
        prev = f"id{i}"
    nodes += [
        helper.make_node("Relu", [prev], ["r"], name="relu"),
        helper.make_node("Add", ["r", "c"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "c"], ["y"], name="mul"),
    ]
    return model(nodes, [vi("x", [4, 4])], [vi("y", [4, 4])], [const("c", rng.random(4) + 1)])


PIPELINE = "eliminate-identity,test-wrong-relu-to-abs,dce"


def test_bisect_names_the_wrong_rule(wrong_rule, rng):
    result = bisect(many_rewrites(rng), pipeline=PIPELINE)
    assert result.found
    assert result.culprit["rule"] == "test-wrong-relu-to-abs"
    assert result.culprit["node"] == "relu"
    assert result.parity_runs <= max_runs(result.rewrites)
    assert result.remark.rule == "test-wrong-relu-to-abs"
    # The first tensor present in both graphs that diverges is the Add right after it.
    assert result.culprit["first_divergence"]["tensor"] == "a"
    # The minimal pair: one Relu before, one Abs after, same inputs and outputs.
    assert [n.op_type for n in result.before.graph.node] == ["Relu"]
    assert "Abs" in [n.op_type for n in result.after.graph.node]
    assert [o.name for o in result.before.graph.output] == [
        o.name for o in result.after.graph.output
    ]


def test_bisect_run_bound_with_many_rewrites(wrong_rule, rng):
    result = bisect(many_rewrites(rng, n_identities=40), pipeline=PIPELINE)
    assert result.found and result.rewrites == 41
    assert result.parity_runs <= max_runs(41) == 8


def test_bisect_when_parity_holds(rng):
    result = bisect(many_rewrites(rng), pipeline="eliminate-identity,dce")
    assert not result.found and result.parity_runs == 1


def test_bisect_cli_writes_pair(wrong_rule, rng, tmp_path):
    import onnx

    p = tmp_path / "m.onnx"
    onnx.save(many_rewrites(rng), p)
    res = CliRunner().invoke(
        app,
        ["bisect", str(p), "--pipeline", PIPELINE, "-o", str(tmp_path / "b"), "--format", "json"],
    )
    assert res.exit_code == 3, res.output
    data = json.loads(res.stdout)
    assert data["culprit"]["rule"] == "test-wrong-relu-to-abs"
    assert (tmp_path / "b" / "before.onnx").exists() and (tmp_path / "b" / "after.onnx").exists()
    onnx.checker.check_model(onnx.load(tmp_path / "b" / "after.onnx"))


def test_parity_localizes_first_divergence(wrong_rule, rng):
    import graphopt

    _, report = graphopt.optimize(many_rewrites(rng), pipeline=PIPELINE, parity_net=False)
    assert not report.parity.ok
    assert report.parity.first_divergence["tensor"] == "a"
    assert report.parity.first_divergence["op"] == "Add"
    assert np.isfinite(report.parity.first_divergence["max_abs"])


def test_bisect_inside_a_subgraph_returns_whole_models(wrong_rule, rng):
    """A culprit inside an If body cannot be cut out alone: the whole models are the pair."""
    from onnx import TensorProto

    def branch(name, op):
        return helper.make_graph(
            [helper.make_node(op, ["x"], [f"{name}_o"], name=f"{name}_n")],
            name,
            [],
            [vi(f"{name}_o", None)],
        )

    m = model(
        [
            helper.make_node(
                "If", ["c"], ["y"], then_branch=branch("t", "Relu"), else_branch=branch("e", "Neg")
            )
        ],
        [vi("x", [4]), vi("c", [], TensorProto.BOOL)],
        [vi("y", [4])],
    )
    result = bisect(m, pipeline="test-wrong-relu-to-abs", inputs={"c": np.array(True)})
    assert result.found and result.culprit["node"] == "t_n"
    assert result.before is not None and result.after is not None
    assert "If" in [n.op_type for n in result.before.graph.node]


def test_the_parity_safety_net_reverts_the_wrong_rewrite(wrong_rule, rng):
    """A rewrite that breaks parity is found by bisection and reverted: parity holds, the
    harmless rewrites stay, and a failure remark names the rule and the node."""
    import graphopt

    optimized, report = graphopt.optimize(many_rewrites(rng), pipeline=PIPELINE)
    assert report.parity.ok
    assert "Abs" not in {n.op_type for n in optimized.graph.node}
    assert "Identity" not in {n.op_type for n in optimized.graph.node}
    [net] = [r for r in report.remarks if r.pass_name == "safety-net"]
    assert (net.kind, net.rule, net.code) == ("failure", "test-wrong-relu-to-abs", "parity-failure")
    assert net.nodes == ("relu",) or list(net.nodes) == ["relu"]


def test_the_parity_safety_net_warns_on_the_command_line(wrong_rule, rng, tmp_path):
    import onnx

    p = tmp_path / "m.onnx"
    onnx.save(many_rewrites(rng), p)
    res = CliRunner().invoke(
        app, ["optimize", str(p), "--pipeline", PIPELINE, "-o", str(tmp_path / "b")]
    )
    assert res.exit_code == 0, res.output
    assert "safety net: parity failed after test-wrong-relu-to-abs at 'relu'" in res.output


def test_a_rule_wrong_at_more_nodes_than_three_reverts_is_reverted_whole(wrong_rule, rng):
    nodes = [helper.make_node("Relu", [f"x{i}"], [f"r{i}"], name=f"relu{i}") for i in range(5)]
    nodes.append(helper.make_node("Concat", [f"r{i}" for i in range(5)], ["y"], axis=0))
    inputs = [vi(f"x{i}", [4, 4]) for i in range(5)]
    m = model(nodes, inputs, [vi("y", [20, 4])])
    import graphopt

    optimized, report = graphopt.optimize(m, pipeline="test-wrong-relu-to-abs")
    assert report.parity.ok
    assert "Abs" not in {n.op_type for n in optimized.graph.node}
    net = [r for r in report.remarks if r.pass_name == "safety-net"]
    assert sorted(r.nodes[0] for r in net) == [f"relu{i}" for i in range(5)]


def test_an_input_onnxruntime_refuses_by_default_is_named_when_the_output_stays_invalid(
    monkeypatch,
):
    """Tiles whose repeats are computed 2-D: the checker cannot tell and a plain load runs,
    but onnxruntime's own constant folding at its default level refuses the model; folded, the
    output fails the checker.  Where the safety net cannot fix the output (here: it finds no
    rewrite to revert), the error says the input itself does not load."""
    import graphopt
    from graphopt.opt import optimizer
    from graphopt.opt.errors import GraphoptError

    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Cast", ["ax32"], ["ax"], to=7),
        helper.make_node("Unsqueeze", ["s", "ax"], ["r"]),
        helper.make_node("Tile", ["x", "r"], ["y"]),
    ]
    m = model(nodes, [vi("x", [2, 3])], [vi("y", ["a", "b"])], [const("ax32", [0], np.int32)])
    monkeypatch.setattr(optimizer, "_first_bad", lambda *a, **k: None)
    with pytest.raises(GraphoptError, match="the input model does not load in onnxruntime"):
        graphopt.optimize(m, target="cpu")

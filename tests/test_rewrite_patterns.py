"""The pattern language and the rule driver: op alternatives, n-ary commutation, constant and
attribute leaves, optional inputs, guards retried per candidate, roots from patterns, priority,
phases and typed refusals."""

import pytest
from onnx import helper

from conftest import check_parity, const, model, vi
from graphopt.opt.graph.ir import Constant, ModelIR
from graphopt.opt.rewrite.context import PassContext
from graphopt.opt.rewrite.engine import PHASES, Alt, Const, Op, Rule, Var, opt, require
from graphopt.opt.rewrite.manager import RuleSetPass, run_pass
from graphopt.opt.rewrite.patterns import MAX_COMMUTED, match, roots
from graphopt.opt.rewrite.target import get_target


def _ir(nodes, inputs, inits=(), opset=17):
    m = model(nodes, inputs, [vi("y", None)], inits, opset=opset)
    return m, ModelIR(m)


def _node(ir, name):
    return next(n for n in ir.graph.nodes if n.name == name)


def _run(ir, rules, level=2):
    cx = PassContext(target=get_target("cpu"), level=level, ir=ir)
    run_pass(RuleSetPass(rules), ir, cx)
    return cx


def test_op_alternatives_bind_the_node_that_says_which():
    nodes = [helper.make_node("LeakyRelu", ["x"], ["y"], name="act")]
    _, ir = _ir(nodes, [vi("x", [2])])
    pat = Op(("Relu", "LeakyRelu"), "x", name="act")
    (b,) = match(pat, _node(ir, "act"))
    assert b["act"].op == "LeakyRelu"
    assert not list(match(Op(("Relu", "Tanh"), "x"), _node(ir, "act")))


def test_commute_tries_every_order_of_three_inputs():
    nodes = [helper.make_node("Sum", ["c", "a", "b"], ["y"], name="s")]
    _, ir = _ir(nodes, [vi("a", [2]), vi("b", [2])], [const("c", [1.0, 1.0])])
    pat = Op("Sum", "p", Const("one", value=1.0), "q", commute=True, name="s")
    found = list(match(pat, _node(ir, "s")))
    assert {(f["p"].name, f["q"].name) for f in found} == {("a", "b"), ("b", "a")}
    assert all(f["one"].name == "c" for f in found)
    with pytest.raises(ValueError):
        Op("Sum", *[f"x{i}" for i in range(MAX_COMMUTED + 1)], commute=True)


def test_commute_positions_keep_the_others_in_place():
    nodes = [helper.make_node("Sum", ["a", "b", "c"], ["y"], name="s")]
    _, ir = _ir(nodes, [vi("a", [2]), vi("b", [2]), vi("c", [2])])
    pat = Op("Sum", "p", "q", "r", commute=(1, 2), name="s")
    found = [(f["p"].name, f["q"].name, f["r"].name) for f in match(pat, _node(ir, "s"))]
    assert found == [("a", "b", "c"), ("a", "c", "b")]


@pytest.mark.parametrize(
    ("leaf", "hit"),
    [
        (Const("c"), True),
        (Const("c", value=2.0), True),
        (Const("c", value=2.0001, rel=1e-3), True),
        (Const("c", value=1.0), False),
        (Const("c", scalar=True), False),
        (Const("c", kind="i"), False),
        (Const("c", kind="f"), True),
    ],
)
def test_constant_leaves(leaf, hit):
    nodes = [helper.make_node("Mul", ["x", "c"], ["y"], name="mul")]
    _, ir = _ir(nodes, [vi("x", [2])], [const("c", [2.0, 2.0])])
    assert bool(list(match(Op("Mul", "x", leaf), _node(ir, "mul")))) is hit


def test_constant_leaf_refuses_a_computed_tensor_and_takes_an_absent_optional():
    nodes = [helper.make_node("Clip", ["x", "lo"], ["y"], name="clip")]
    _, ir = _ir(nodes, [vi("x", [2]), vi("lo", [])])
    assert not list(match(Op("Clip", "x", Const("lo"), opt("hi")), _node(ir, "clip")))
    pat = Op("Clip", "x", Var("lo"), Const("hi", optional=True), name="clip")
    (b,) = match(pat, _node(ir, "clip"))
    assert b["hi"] is None


def test_attribute_leaves_read_schema_defaults():
    nodes = [helper.make_node("Softmax", ["x"], ["y"], name="sm")]
    _, ir = _ir(nodes, [vi("x", [2, 3])], opset=13)
    node = _node(ir, "sm")
    assert list(match(Op("Softmax", "x", attrs={"axis": -1}), node))
    assert not list(match(Op("Softmax", "x", attrs={"axis": 1}), node))
    assert list(match(Op("Softmax", "x", attrs={"axis": lambda a: a in (-1, 1)}), node))
    assert not list(match(Op("Softmax", "x", attrs=lambda n: "axis" in n.attrs), node))


def test_alternatives_and_roots():
    pat = Alt(Op("Div", "x", "c"), Op(("Mul", "Div"), "x", "c"))
    assert roots(pat) == ("Div", "Mul")

    class Derived(Rule):
        name = "test-derived"
        pattern = pat

    assert Derived.roots == ("Div", "Mul") and Derived.root == "Div"


class _AddConstToSub(Rule):
    """Test rule: ``x + c`` → ``x - (-c)``; the guard requires c to be a constant, checked
    after the structure (so the commuted candidate must be retried)."""

    name = "test-add-const"
    level = 2
    pattern = Op("Add", "x", "c", commute=True)

    def check(self, m, cx):
        require(isinstance(m.c, Constant), "not-constant", f"'{m.c.name}' is computed")

    def rewrite(self, m, b):
        neg = b.const(-m.c.values, "neg")
        return [b.op("Sub", [m.x, neg], like=m.root.outputs[0])]


def test_check_is_retried_on_the_commuted_candidate(rng):
    nodes = [helper.make_node("Add", ["c", "x"], ["y"], name="add")]
    m, ir = _ir(nodes, [vi("x", [3])], [const("c", rng.standard_normal(3))])
    cx = _run(ir, [_AddConstToSub()])
    assert [n.op for n in ir.graph.nodes] == ["Sub"]
    assert cx.stats["test-add-const"].fired == 1 and cx.stats["test-add-const"].missed == 0
    assert check_parity(m, ir.to_onnx()).ok


def test_when_every_candidate_fails_the_first_failure_is_reported():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    _, ir = _ir(nodes, [vi("a", [3]), vi("b", [3])])
    cx = _run(ir, [_AddConstToSub()])
    (miss,) = [r for r in cx.remarks if r.kind == "missed"]
    assert miss.code == "not-constant" and "'b'" in miss.message  # the written order first
    assert [(x.rule, x.code, x.nodes) for x in cx.misses["test-add-const"]] == [
        ("test-add-const", "not-constant", ("add",))
    ]


class _Tag(Rule):
    """Test rule: rename the root op to ``to`` (Relu → Abs ...), recording the order it ran."""

    level = 2
    exclusive = False
    log: list = []

    def check(self, m, cx):
        self.log.append(self.name)

    def rewrite(self, m, b):
        return [b.op(self.to, [m.x], like=m.root.outputs[0])]


class _HighRelu(_Tag):
    name, to, priority = "test-z-high", "Abs", 5
    pattern = Op("Relu", "x")


class _LowRelu(_Tag):
    name, to = "test-a-low", "Neg"
    pattern = Op("Relu", "x")


def test_priority_not_name_or_order_decides():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="r")]
    for rules in ([_LowRelu(), _HighRelu()], [_HighRelu(), _LowRelu()]):
        _, ir = _ir(nodes, [vi("x", [2])])
        _run(ir, rules)
        assert [n.op for n in ir.graph.nodes] == ["Abs"]


class _EarlyLinear(_Tag):
    name, to, phase = "test-linear", "Abs", "linear"
    pattern = Op("Relu", "x")


class _LateFuse(_Tag):
    name, to = "test-fuse", "Neg"
    pattern = Op("Sigmoid", "x")


def test_phases_run_in_order_whatever_the_graph_order():
    assert PHASES.index("fuse") < PHASES.index("attention") < PHASES.index("linear")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Sigmoid", ["r"], ["y"], name="sig"),
    ]
    _, ir = _ir(nodes, [vi("x", [2])])
    _Tag.log.clear()
    _run(ir, [_EarlyLinear(), _LateFuse()])
    assert _Tag.log == ["test-fuse", "test-linear"]
    assert _LateFuse().rule_phase() == "fuse" and _EarlyLinear().rule_phase() == "linear"


def test_unknown_phase_is_refused_at_registration():
    from graphopt.opt.rewrite.manager import register_rule

    class Bad(Rule):
        name, phase = "test-bad-phase", "later"
        pattern = Op("Relu", "x")

    with pytest.raises(ValueError, match="phase"):
        register_rule(Bad)


def test_matches_are_silent_when_structure_fails_on_every_candidate():
    nodes = [helper.make_node("Mul", ["a", "b"], ["y"], name="mul")]
    _, ir = _ir(nodes, [vi("a", [3]), vi("b", [3])])

    class NeedsConst(_AddConstToSub):
        name = "test-mul-const"
        pattern = Op("Mul", "x", Const("c"), commute=True)

    cx = _run(ir, [NeedsConst()])
    assert not [r for r in cx.remarks if r.kind == "missed"]
    assert cx.stats["test-mul-const"].attempts == 0


@pytest.mark.parametrize("miss_first", [True, False])
def test_a_miss_at_a_node_a_fusion_absorbed_is_dropped_whichever_came_first(miss_first):
    from graphopt.opt.remarks import Remark, RemarkLog

    miss = Remark("missed", "rules", "test-linear", "shared-intermediate", ("add",), "stays")
    took = Remark(
        "passed", "rules", "test-fused", "fired", ("root",), "fused", {"absorbed": ["add"]}
    )
    log = RemarkLog()
    for r in (miss, took) if miss_first else (took, miss):
        log.add(r)
    assert [r.rule for r in log.final()] == ["test-fused"]


def test_forgetting_a_miss_keeps_everything_else():
    """A fold refused at one try and done at a later one: its miss goes, nothing else does."""
    from graphopt.opt.remarks import Remark, RemarkLog

    log = RemarkLog()
    log.add(Remark("missed", "fold", "fold-constants", "fold-size-budget", ("a",), "budget"))
    log.add(Remark("missed", "fold", "fold-constants", "fold-size-limit", ("b",), "limit"))
    log.add(Remark("analysis", "fold", "fold-constants", "fold-eval-failed", ("a",), "ort"))
    log.forget_miss("fold-constants", "a")
    log.forget_miss("other-rule", "b")
    assert [(r.nodes, r.code) for r in log] == [
        (("b",), "fold-size-limit"),
        (("a",), "fold-eval-failed"),
    ]


def test_a_later_miss_that_got_less_far_keeps_the_staged_one():
    """A staged rule's refusal at stage 3 stays when a later round, on a graph other rules have
    since rewritten, refuses the same node at stage 1; a later refusal as far or further wins."""
    from graphopt.opt.remarks import Remark, RemarkLog

    def miss(code, stage):
        return Remark("missed", "rules", "test-staged", code, ("root",), code, {"stage": stage})

    log = RemarkLog()
    log.add(miss("no-kernel", "3 (lower)"))
    log.add(miss("unrecognized-layout", "1 (core)"))
    assert [r.code for r in log] == ["no-kernel"]
    log.add(miss("slower-on-target", "3 (lower)"))
    assert [r.code for r in log] == ["slower-on-target"]
    log.add(Remark("missed", "rules", "test-staged", "plain", ("root",), "no stage"))
    assert [r.code for r in log] == ["plain"]


def test_one_domain_normalization():
    from graphopt.opt.graph.domains import MS, in_domains, is_default, norm_domain, same_domain

    assert [norm_domain(d) for d in (None, "", "ai.onnx", MS)] == ["", "", "", MS]
    assert is_default("ai.onnx") and not is_default(MS)
    assert same_domain(None, "ai.onnx") and not same_domain("", MS)
    assert in_domains("ai.onnx", "", MS) and not in_domains("custom", "", MS)


def test_an_op_pattern_may_name_several_domains():
    nodes = [helper.make_node("Gelu", ["x"], ["y"], name="g", domain="com.microsoft")]
    g = helper.make_graph(nodes, "t", [vi("x", [2])], [vi("y", [2])])
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    node = ModelIR(m).graph.nodes[0]
    assert list(match(Op("Gelu", "x", domain=("", "com.microsoft")), node))
    assert not list(match(Op("Gelu", "x"), node))


def test_a_miss_of_the_same_softmax_at_another_anchor_replaces_the_first():
    """An attention refused, then refused again after another rule rewrote its merge (a new
    anchor): one miss for its Softmax, the latest; other Softmax and other rules keep theirs."""
    from graphopt.opt.remarks import Remark, RemarkLog

    def miss(anchor, softmax, rule="test-attention"):
        args = {"softmax": softmax, "stage": "3 (lower)"}
        return Remark("missed", "rules", rule, "slower-on-target", (anchor,), anchor, args)

    log = RemarkLog()
    for r in (
        miss("merge", "sm"),
        miss("sm2_root", "sm2"),
        miss("flat", "sm"),
        miss("x", "sm", "other"),
    ):
        log.add(r)
    assert sorted((r.rule, r.nodes[0]) for r in log) == [
        ("other", "x"),
        ("test-attention", "flat"),
        ("test-attention", "sm2_root"),
    ]

"""Pass manager: pipeline text, levels, fixpoint cap, bisect limit, verify-each, timing."""

import numpy as np
import pytest
from onnx import helper

import graphopt
from conftest import const, model, ops, run, vi
from graphopt.opt.errors import UsageError
from graphopt.opt.graph.ir import ModelIR
from graphopt.opt.rewrite.context import PassContext
from graphopt.opt.rewrite.engine import Op, Rule
from graphopt.opt.rewrite.manager import Fixpoint, RuleSetPass, run_pass
from graphopt.opt.rewrite.pipeline import parse, preset, to_text
from graphopt.opt.rewrite.target import get_target


def test_pipeline_text_round_trips():
    text = "fold-constants,fixpoint(fuse-conv-bn,matmul-add-to-gemm,dce){max-iterations=8}"
    assert to_text(parse(text)) == text
    for level in range(4):
        assert to_text(parse(preset(level))) == preset(level)


@pytest.mark.parametrize(
    "bad",
    [
        "nope",
        "fixpoint(",
        "fixpoint(dce){max-iterations=x}",
        "dce{foo=1}",
        "fold-constants,,dce",
        "dce)",
    ],
)
def test_bad_pipeline_text_is_a_usage_error(bad):
    with pytest.raises(UsageError):
        parse(bad)


def bn_chain(rng):
    c = 4
    inits = [
        const("W", rng.standard_normal((c, c, 1, 1))),
        const("g", rng.random(c) + 0.5),
        const("b", rng.standard_normal(c)),
        const("m", rng.standard_normal(c)),
        const("v", rng.random(c) + 0.1),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"], name="bn"),
        helper.make_node("Identity", ["bn"], ["i"], name="id"),
        helper.make_node("Relu", ["i"], ["y"], name="relu"),
    ]
    return model(nodes, [vi("x", [1, c, 4, 4])], [vi("y", None)], inits)


def test_levels(rng):
    m = bn_chain(rng)
    assert ops(run(m, level=0)[0]) == ops(m)
    assert ops(run(m, level=1)[0]) == {"Conv": 1, "BatchNormalization": 1, "Relu": 1}
    assert ops(run(m, level=2)[0]) == {"FusedConv": 1}


def test_explicit_pipeline_runs_only_named_rules(rng):
    out, report = run(bn_chain(rng), pipeline="fuse-conv-bn,dce")
    assert ops(out) == {"Conv": 1, "Identity": 1, "Relu": 1}
    assert report.pipeline == "fuse-conv-bn,dce"


def test_bisect_limit_applies_only_first_rewrites(rng):
    m = bn_chain(rng)
    full = run(m, level=2)[1]
    assert full.rewrites == 3  # identity, conv-bn, conv-relu
    out, report = run(m, level=2, bisect_limit=1)
    assert len([r for r in report.remarks if r.kind == "passed"]) == 1
    assert ops(out) in (
        {"Conv": 1, "Identity": 1, "Relu": 1},
        {"Conv": 1, "BatchNormalization": 1, "Relu": 1},
    )
    out0, _ = run(m, level=2, bisect_limit=0)
    assert ops(out0) == ops(m)


class _Flip(Rule):
    """Test-only pair of rules that undo each other: the fixpoint must stop and say so."""

    level = 9
    exclusive = False

    def rewrite(self, m, b):
        return [b.op(self.to, [m.x], like=m.root.outputs[0])]


class ReluToAbs(_Flip):
    name, root, to = "test-relu-to-abs", "Relu", "Abs"
    pattern = Op("Relu", "x")


class AbsToRelu(_Flip):
    name, root, to = "test-abs-to-relu", "Abs", "Relu"
    pattern = Op("Abs", "x")


def test_fixpoint_cap_reports_did_not_converge():
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])])
    ir = ModelIR(m)
    cx = PassContext(target=get_target("cpu"), level=2, ir=ir)
    run_pass(Fixpoint([RuleSetPass([ReluToAbs(), AbsToRelu()])], max_iterations=3), ir, cx)
    failures = [r for r in cx.remarks if r.code == "did-not-converge"]
    assert {r.rule for r in failures} >= {"fixpoint"}
    assert [r.args["max_iterations"] for r in failures if r.rule == "fixpoint"] == [3]
    assert len(ir.graph.nodes) == 1, "rewritten-away nodes must not accumulate"


def test_timing_and_report_fields(rng):
    _, report = run(bn_chain(rng), level=2)
    d = report.to_dict()
    for key in (
        "nodes_before",
        "nodes_after",
        "ops_before",
        "ops_after",
        "remarks",
        "parity",
        "passes",
        "target",
        "level",
    ):
        assert key in d
    assert all(p["seconds"] >= 0 for p in d["passes"])
    assert d["rules"]["fuse-conv-bn"]["fired"] == 1
    assert d["parity"]["ok"] is True


def test_verify_each_passes_on_valid_rewrites(rng):
    out, report = run(bn_chain(rng), level=2, verify_each=True)
    assert report.parity.ok


def test_input_model_is_not_modified(rng):
    m = bn_chain(rng)
    before = m.SerializeToString()
    graphopt.optimize(m, level=3)
    assert m.SerializeToString() == before


def test_weights_exported_as_inputs_are_frozen(rng):
    """Every initializer listed as an input, weights among them: the signature of
    keep_initializers_as_inputs=True.  They become constants, leave the inputs, and fold;
    an analysis remark says so."""
    m = bn_chain(rng)
    m.graph.input.extend([vi(t.name, list(t.dims)) for t in m.graph.initializer])
    before = m.SerializeToString()
    out, report = run(m, level=2)
    assert m.SerializeToString() == before  # the caller's model is untouched
    assert [i.name for i in out.graph.input] == ["x"]
    assert ops(out) == {"FusedConv": 1} and report.parity.ok
    (note,) = [r for r in report.remarks if r.code == "weights-frozen"]
    assert note.kind == "analysis" and note.message.startswith("5 initializers")
    assert "--keep-initializer-inputs" in note.message


def test_keep_initializers_as_inputs_interface_is_preserved_on_request(rng):
    """keep_weight_inputs (--keep-initializer-inputs), and -O0: they stay overridable inputs."""
    m = bn_chain(rng)
    m.graph.input.extend([vi(t.name, list(t.dims)) for t in m.graph.initializer])
    for kw in ({"level": 2, "keep_weight_inputs": True}, {"level": 0}):
        out, report = run(m, **kw)
        assert [i.name for i in out.graph.input] == [i.name for i in m.graph.input]
        assert {t.name for t in out.graph.initializer} >= {"g", "b", "m", "v"}
        assert not [r for r in report.remarks if r.code == "weights-frozen"]
        missed = [r.code for r in report.remarks if r.rule == "fuse-conv-bn"]
        assert missed == (["non-constant-param"] if kw["level"] else [])


def test_some_initializers_listed_are_deliberate_defaults(rng):
    """Only some initializers listed (the Conv weight is not): overridable defaults, kept."""
    m = bn_chain(rng)
    m.graph.input.extend([vi(t.name, list(t.dims)) for t in m.graph.initializer[1:]])
    out, report = run(m, level=2)
    assert [i.name for i in out.graph.input] == [i.name for i in m.graph.input]
    assert "non-constant-param" in [r.code for r in report.remarks if r.rule == "fuse-conv-bn"]
    assert not [r for r in report.remarks if r.code == "weights-frozen"]


def test_listed_scalars_alone_are_not_weights(rng):
    """Every initializer listed but none a weight (rank < 2): deliberate defaults, kept."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["y"], name="mul")]
    m = model(
        nodes,
        [vi("x", [2, 3]), vi("s", [])],
        [vi("y", None)],
        [const("s", np.array(2.0))],
    )
    out, report = run(m, level=2)
    assert [i.name for i in out.graph.input] == ["x", "s"]
    assert not [r for r in report.remarks if r.code == "weights-frozen"]


def test_ir3_initializers_as_inputs_are_constants(rng):
    m = bn_chain(rng)
    m.graph.input.extend([vi(t.name, list(t.dims)) for t in m.graph.initializer])
    m.ir_version = 3
    m.opset_import[0].version = 9
    out, report = graphopt.optimize(m, level=2)
    assert [i.name for i in out.graph.input] == ["x"]
    assert ops(out) == {"FusedConv": 1}
    assert report.parity.ok
    assert np.isfinite(report.parity.outputs[0].max_abs)

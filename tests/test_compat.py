"""Every model onnxruntime accepts is accepted, and what the user wrote survives the round trip.

Small models built here: IR < 4 initializers, model-local functions (inlined, or kept and judged
by their bodies), ``--opset`` with functions, string tensors, an ai.onnx.ml classifier with
ZipMap (:func:`zipmap_classifier`, also usable by parity tests of sequence/map outputs), and the
annotations graphsurgeon would drop (doc_strings, dim_params, per-node metadata).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from conftest import const, vi
from graphopt.opt.errors import UsageError
from graphopt.opt.graph import compat
from graphopt.opt.graph.io import load_model
from graphopt.opt.graph.ir import ModelIR
from graphopt.opt.graph.upgrade import upgrade_opset
from graphopt.opt.rewrite.context import PassContext
from graphopt.opt.rewrite.manager import run_pass
from graphopt.opt.rewrite.pipeline import parse
from graphopt.opt.rewrite.target import get_target

ML = "ai.onnx.ml"


def _model(nodes, inputs, outputs, inits=(), *, opset=17, ir_version=8, functions=(), extra=()):
    g = helper.make_graph(nodes, "g", list(inputs), list(outputs), list(inits))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra]
    m = helper.make_model(g, opset_imports=imports, functions=list(functions))
    m.ir_version = ir_version
    return m


def _run(m: onnx.ModelProto, feeds: dict) -> list:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _optimize_ok(m: onnx.ModelProto, **kw):
    out, report = graphopt.optimize(m, **kw)
    onnx.checker.check_model(out)
    assert report.parity.ran and report.parity.ok, report.parity
    assert report.legal, [r.message for r in report.remarks if r.kind == "failure"]
    return out, report


# ---------------------------------------------------------------------- 1. IR < 4
def _ir3_model() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        [vi("x", [2, 3])],
        [vi("y", [2, 3])],
        [const("W", np.arange(6).reshape(2, 3))],
        opset=8,
        ir_version=3,
    )


def test_ir3_initializer_not_listed_is_accepted_from_file(tmp_path):
    m = _ir3_model()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(m)  # what onnx says; onnxruntime runs it
    path = tmp_path / "ir3.onnx"
    path.write_bytes(m.SerializeToString())
    before = path.read_bytes()
    loaded = load_model(path)
    assert path.read_bytes() == before, "the input file must not change"
    notes = compat.load_notes(loaded)
    assert [n.code for n in notes] == ["ir-initializers-listed"] and "W" in notes[0].message
    out, report = _optimize_ok(path)
    assert out.ir_version == 4 and [i.name for i in out.graph.input] == ["x"]
    load = [r.code for r in report.remarks if r.pass_name == "load" and r.kind == "analysis"]
    assert load == ["ir-initializers-listed", "ir-version-raised"]
    x = np.ones((2, 3), np.float32)
    assert np.array_equal(_run(out, {"x": x})[0], _run(m, {"x": x})[0])


def test_ir3_notes_become_analysis_remarks():
    loaded = compat.accept_on_load(_ir3_model())
    ir = ModelIR(loaded)
    codes = [r.code for r in compat.remarks(loaded, ir)]
    assert codes == ["ir-initializers-listed", "ir-version-raised"]
    assert all(r.kind == "analysis" for r in compat.remarks(loaded, ir))


def test_accept_on_load_leaves_ir4_models_alone():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])])
    before = m.SerializeToString()
    assert compat.accept_on_load(m).SerializeToString() == before
    assert compat.load_notes(m) == []


# ------------------------------------------------------------ 2. local functions
def _block_function() -> onnx.FunctionProto:
    """y = LayerNorm(x) spelled out (fuses to LayerNormalization when visible) + Relu."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]),
        helper.make_node("Sub", ["x", "mu"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
        helper.make_node("Constant", [], ["eps"], value_float=1e-5),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]),
        helper.make_node("Mul", ["n", "g"], ["ng"]),
        helper.make_node("Add", ["ng", "b"], ["y0"]),
        helper.make_node("Relu", ["y0"], ["y"]),
    ]
    return helper.make_function(
        "local", "Block", ["x", "g", "b"], ["y"], nodes, [helper.make_opsetid("", 17)]
    )


def _function_model(calls: int = 2, opset: int = 17) -> onnx.ModelProto:
    nodes, prev = [], "x"
    for i in range(calls):
        nodes.append(helper.make_node("Block", [prev, "g", "b"], [f"h{i}"], domain="local"))
        prev = f"h{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    unused = helper.make_function(
        "local",
        "Unused",
        ["a"],
        ["c"],
        [helper.make_node("Neg", ["a"], ["c"])],
        [helper.make_opsetid("", 17)],
    )
    rng = np.random.default_rng(0)
    return _model(
        nodes,
        [vi("x", [2, 8])],
        [vi("y", [2, 8])],
        [const("g", rng.standard_normal(8) + 1), const("b", rng.standard_normal(8))],
        opset=opset,
        functions=[_block_function(), unused],
        extra=[("local", 1)],
    )


def test_local_functions_are_inlined_legal_and_fused():
    m = _function_model()
    ref = _run(m, {"x": np.ones((2, 8), np.float32)})
    out, report = _optimize_ok(m)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("LayerNormalization") == 2, ops
    assert "Block" not in ops
    assert [f.name for f in out.functions] == ["Unused"], "an uncalled function is kept"
    assert np.allclose(_run(out, {"x": np.ones((2, 8), np.float32)})[0], ref[0], atol=1e-5)
    codes = [r.code for r in compat.remarks(m, ModelIR(m))]
    assert codes == ["functions-inlined"]
    assert "functions-inlined" in [r.code for r in report.remarks if r.pass_name == "load"]


def test_nested_function_calls_inside_if_are_inlined():
    inner = helper.make_function(
        "local",
        "Inner",
        ["a"],
        ["c"],
        [helper.make_node("Relu", ["a"], ["c"])],
        [helper.make_opsetid("", 17)],
    )
    outer = helper.make_function(
        "local",
        "Outer",
        ["a"],
        ["c"],
        [
            helper.make_node("Inner", ["a"], ["t"], domain="local"),
            helper.make_node("Neg", ["t"], ["c"]),
        ],
        [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
    )
    then = helper.make_graph(
        [helper.make_node("Outer", ["x"], ["t1"], domain="local")], "then", [], [vi("t1", [3])]
    )
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["t2"])], "else", [], [vi("t2", [3])])
    m = _model(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [vi("c", [], TensorProto.BOOL), vi("x", [3])],
        [vi("y", [3])],
        functions=[inner, outer],
        extra=[("local", 1)],
    )
    assert compat.called_functions(m) == {("local", "Outer"): 1, ("local", "Inner"): 1}
    out, _ = _optimize_ok(m, inputs={"c": np.array(True), "x": np.array([-1, 2, -3], np.float32)})
    assert not out.functions


def _legalize(ir: ModelIR, target: str = "cpu") -> PassContext:
    cx = PassContext(target=get_target(target), level=2, ir=ir)
    for p in parse("legalize"):
        run_pass(p, ir, cx)
    return cx


def test_legalize_judges_a_kept_function_call_by_its_body():
    ir = ModelIR(_function_model(), inline=False)
    assert ("local", "Block") in ir.functions
    cx = _legalize(ir)
    assert not [r for r in cx.remarks if r.kind == "failure"]
    exported = ir.to_onnx()
    assert {f.name for f in exported.functions} == {"Block", "Unused"}
    x = np.ones((2, 8), np.float32)
    assert np.allclose(_run(exported, {"x": x})[0], _run(_function_model(), {"x": x})[0])


def test_legalize_names_the_body_node_a_target_cannot_run():
    f = helper.make_function(
        "local",
        "Odd",
        ["a"],
        ["c"],
        [helper.make_node("Erf", ["a"], ["c"])],
        [helper.make_opsetid("", 17)],
    )
    m = _model(
        [helper.make_node("Odd", ["x"], ["y"], domain="local")],
        [vi("x", [2])],
        [vi("y", [2])],
        functions=[f],
        extra=[("local", 1)],
    )
    cx = _legalize(ModelIR(m, inline=False), "npu")
    failures = [r for r in cx.remarks if r.kind == "failure"]
    assert failures and failures[0].code == "no-kernel", [r.message for r in failures]
    assert "local.Odd" in failures[0].message and "Erf" in failures[0].message


# ----------------------------------------------------------- 3. --opset with functions
def test_opset_upgrade_keeps_functions_by_inlining_them():
    m = _function_model(opset=17)
    up, before = upgrade_opset(m, 18)
    assert before == 17 and not compat.called_functions(up)
    assert [f.name for f in up.functions] == ["Unused"]
    assert len(m.functions) == 2, "the input model is not modified"
    out, report = _optimize_ok(m, opset=18)
    assert [o.version for o in out.opset_import if o.domain == ""] == [18]
    assert "functions-inlined" in [r.code for r in compat.remarks(m, ModelIR(up))]


def test_opset_upgrade_refuses_functions_it_cannot_inline():
    m = _function_model()
    m.functions[0].node[0].op_type = "NoSuchOp"  # the inliner's version conversion fails
    m.functions[0].opset_import[0].version = 11
    with pytest.raises(UsageError, match="model-local functions"):
        upgrade_opset(m, 18)


# -------------------------------------------------------------------- 4. strings
def test_string_tensors_pass_through_untouched():
    then = helper.make_graph(
        [helper.make_node("Identity", ["words"], ["t"])], "then", [], [vi("t", [2], 8)]
    )
    other = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], ["e"], value=helper.make_tensor("e", 8, [2], [b"u"] * 2)
            )
        ],
        "else",
        [],
        [vi("e", [2], 8)],
    )
    m = _model(
        [
            helper.make_node("Identity", ["words"], ["w1"]),
            helper.make_node("Concat", ["w1", "s"], ["both"], axis=0),
            helper.make_node("If", ["c"], ["picked"], then_branch=then, else_branch=other),
            helper.make_node("Reshape", ["s", "flat"], ["up"]),
            helper.make_node("Relu", ["x"], ["r"]),
        ],
        [vi("s", [2], TensorProto.STRING), vi("x", [2]), vi("c", [], TensorProto.BOOL)],
        [
            vi("both", [4], TensorProto.STRING),
            vi("picked", [2], TensorProto.STRING),
            vi("up", [2], TensorProto.STRING),
            vi("r", [2]),
        ],
        [
            numpy_helper.from_array(np.array(["a", "b"], dtype=object), "words"),
            const("flat", [-1], np.int64),
        ],
    )
    feeds = {
        "s": np.array(["a", "q"], dtype=object),
        "x": np.array([-1, 1], np.float32),
        "c": np.array(True),
    }
    for level in (1, 2):
        out, _ = _optimize_ok(m, level=level, inputs=feeds)
        for want, got in zip(_run(m, feeds), _run(out, feeds)):
            assert np.array_equal(want, got)


def test_folded_string_constant_exports_as_string_data():
    m = _model(
        [helper.make_node("Identity", ["words"], ["y"])],
        [],
        [vi("y", [3], TensorProto.STRING)],
        [numpy_helper.from_array(np.array(["a", "bb", ""], dtype=object), "words")],
    )
    out, _ = graphopt.optimize(m, level=1)
    onnx.checker.check_model(out)
    assert list(_run(out, {})[0]) == ["a", "bb", ""]


# --------------------------------------------------------------- 5. ai.onnx.ml ZipMap
def zipmap_classifier(string_labels: bool = False) -> onnx.ModelProto:
    """skl2onnx's default classifier layout: LinearClassifier → label (Cast) and probabilities
    (Normalizer) → ZipMap, whose output is a sequence of maps (class → probability)."""
    coef = np.array([[1, 2], [3, 4], [-1, 0.5]], np.float32)
    labels = ["a", "b", "c"] if string_labels else [0, 1, 2]
    cls = {"classlabels_strings": labels} if string_labels else {"classlabels_ints": labels}
    zip_kw = {"classlabels_strings": labels} if string_labels else {"classlabels_int64s": labels}
    key = TensorProto.STRING if string_labels else TensorProto.INT64
    nodes = [
        helper.make_node(
            "LinearClassifier",
            ["x"],
            ["label", "probability_tensor"],
            domain=ML,
            coefficients=coef.flatten().tolist(),
            intercepts=[0.0, 0.1, 0.2],
            multi_class=1,
            **cls,
        ),
        helper.make_node(
            "Normalizer", ["probability_tensor"], ["probabilities"], domain=ML, norm="L1"
        ),
        helper.make_node(
            "Identity" if string_labels else "Cast",
            ["label"],
            ["output_label"],
            **({} if string_labels else {"to": TensorProto.INT64}),
        ),
        helper.make_node("ZipMap", ["probabilities"], ["output_probability"], domain=ML, **zip_kw),
    ]
    maps = helper.make_sequence_type_proto(
        helper.make_map_type_proto(key, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    )
    m = _model(
        nodes,
        [vi("x", ["N", 2])],
        [vi("output_label", ["N"], key), helper.make_value_info("output_probability", maps)],
        extra=[(ML, 1)],
    )
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("string_labels", [False, True])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_zipmap_classifier_optimizes_and_keeps_its_sequence_of_maps(string_labels, level):
    m = zipmap_classifier(string_labels)
    out, report = _optimize_ok(m, level=level)
    assert out.graph.output[1].type == m.graph.output[1].type
    x = np.array([[1, 0], [0.5, -2]], np.float32)
    want, got = _run(m, {"x": x}), _run(out, {"x": x})
    assert np.array_equal(want[0], got[0])
    assert [sorted(d) for d in want[1]] == [sorted(d) for d in got[1]]
    for dw, dg in zip(want[1], got[1]):
        assert np.allclose([dw[k] for k in sorted(dw)], [dg[k] for k in sorted(dg)])


# ---------------------------------------------------------------- 6. round trip
def _annotated_model() -> onnx.ModelProto:
    """Nodes named "dup" in the main graph and in an If branch (each graph's names are its
    own), with different doc_strings and metadata."""
    x = vi("x", ["batch", 4])
    x.doc_string = "the features"
    y = vi("y", ["batch", 4])
    y.doc_string = "the scores"
    a = helper.make_node("Relu", ["x"], ["h"], name="dup", doc_string="first")
    a.metadata_props.add(key="origin", value="layer1")
    inner = helper.make_node("Neg", ["h"], ["t"], name="dup", doc_string="second")
    inner.metadata_props.add(key="origin", value="layer2")
    then = helper.make_graph([inner], "then", [], [vi("t", ["batch", 4])])
    other = helper.make_graph(
        [helper.make_node("Abs", ["h"], ["e"])], "else", [], [vi("e", ["batch", 4])]
    )
    b = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)
    c = helper.make_node("ReduceMax", ["x"], ["xm"], keepdims=0, axes=[0, 1])
    d = helper.make_node("Greater", ["xm", "zero"], ["c"])
    zero = const("zero", 0.0)
    m = _model([b, a, d, c], [x], [y], [zero], ir_version=10)  # out of order: export sorts
    m.doc_string = "model doc"
    m.producer_name, m.producer_version = "maker", "1.2"
    m.metadata_props.add(key="license", value="MIT")
    m.graph.value_info.append(vi("h", ["batch", 4]))
    return m


def test_round_trip_keeps_annotations_and_identity_keyed_metadata():
    m = _annotated_model()
    for pipeline in ("dce", None):
        out, report = graphopt.optimize(m, pipeline=pipeline, shapes={"x": [2, 4]})
        assert report.parity.ok, report.parity
        assert out.doc_string == "model doc" and out.producer_name == "maker"
        assert ("license", "MIT") in [(p.key, p.value) for p in out.metadata_props]
        assert out.graph.input[0].doc_string == "the features"
        assert out.graph.output[0].doc_string == "the scores"
        nodes = {n.op_type: n for n in out.graph.node}
        then = next(a.g for a in nodes["If"].attribute if a.name == "then_branch")
        neg = then.node[0]
        assert neg.op_type == "Neg", nodes["If"]
        assert nodes["Relu"].doc_string == "first" and neg.doc_string == "second"
        assert [(p.key, p.value) for p in nodes["Relu"].metadata_props] == [("origin", "layer1")]
        assert [(p.key, p.value) for p in neg.metadata_props] == [("origin", "layer2")]
        assert "h" in [v.name for v in out.graph.value_info]


def test_declared_dim_params_survive_static_inputs():
    """An output declared ["batch", 4] stays symbolic even when the input is static."""
    m = _model(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Flatten", ["h"], ["y"])],
        [vi("x", [2, 4])],
        [vi("y", ["batch", "features"])],
    )
    out, report = _optimize_ok(m)
    dims = out.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "features"]


def test_pinned_inputs_of_a_static_target_are_the_one_exception():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["N", 4])], [vi("y", ["N", 4])])
    out, _ = graphopt.optimize(m, target="npu", shapes={"x": [1, 4]})
    dims = out.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [1, 4]


def test_training_info_and_unused_functions_are_kept():
    m = _annotated_model()
    info = m.training_info.add()
    info.algorithm.name = "step"
    out, _ = graphopt.optimize(m, shapes={"x": [2, 4]})
    assert out.training_info[0].algorithm.name == "step"


@pytest.mark.parametrize("string_labels", [False, True])
def test_zipmap_bundle_is_written_and_runs(tmp_path, string_labels):
    """The CLI path: the bundle's golden files hold no pickles (strings as text, the sequence
    of maps left out of the golden outputs) and ``graphopt run`` describes the sequence."""
    from cli_runner import CliRunner
    from graphopt.cli import app

    path = tmp_path / "clf.onnx"
    path.write_bytes(zipmap_classifier(string_labels).SerializeToString())
    runner = CliRunner()
    done = runner.invoke(app, ["optimize", str(path), "-o", str(tmp_path / "b"), "-q"])
    assert done.exit_code == 0, done.output
    ran = runner.invoke(app, ["run", str(tmp_path / "b"), "--format", "json"])
    assert ran.exit_code == 0, ran.output
    summary = json.loads(ran.output)
    assert summary["outputs"]["output_probability"] == {"dtype": "seq(map)", "shape": [1]}
    assert summary["golden"]["ok"]


def test_string_constants_are_never_decoded():
    """Strings are bytes to ONNX: a non-UTF-8 one must come out as it went in."""
    raw = [b"x", b"\xff\xfe"]
    m = _model(
        [
            helper.make_node("Concat", ["a", "b"], ["c"], axis=0),
            helper.make_node("Reshape", ["c", "shape"], ["y"]),
        ],
        [],
        [vi("y", [2, 2], TensorProto.STRING)],
        [
            helper.make_tensor("a", TensorProto.STRING, [2], [b"a", "é".encode()]),
            helper.make_tensor("b", TensorProto.STRING, [2], raw),
            const("shape", [2, 2], np.int64),
        ],
    )
    for level in (1, 2):
        out, _ = graphopt.optimize(m, level=level, check=False)
        onnx.checker.check_model(out)
        kept = {t.name: list(t.string_data) for t in out.graph.initializer}
        assert kept["b"] == raw and kept["a"] == [b"a", "é".encode()]


def test_inferred_annotations_do_not_grow_the_output():
    """value_info the input did not carry is not written (onnxruntime infers it): an optimized
    model is never bigger for annotations; the input's own annotations stay."""
    from conftest import model as make_model

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Sigmoid", ["a"], ["b"])]
    nodes.append(helper.make_node("Tanh", ["b"], ["y"]))
    m = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    m.graph.value_info.append(vi("b", [2, 3]))
    out, _ = graphopt.optimize(m, level=1, check=False)
    assert [vi.name for vi in out.graph.value_info] == ["b"]

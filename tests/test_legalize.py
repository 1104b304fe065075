"""The legalize pass: every node maps to a kernel of the target, or a failure remark names it
(op, dtype, node) with a stable code, and `optimize` exits 4."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphopt
from cli_runner import CliRunner
from conftest import EXAMPLES, const, model, run, vi
from graphopt.cli import app
from graphopt.opt.errors import UsageError
from graphopt.opt.rewrite.pipeline import preset
from graphopt.targets.kernels import primary_dtype, resolve
from graphopt.targets.profiles import CPU, CUDA, NPU

runner = CliRunner()


def failures(report, code=None):
    return [
        r
        for r in report.remarks
        if r.kind == "failure" and r.pass_name == "legalize" and (code is None or r.code == code)
    ]


def summary(report):
    return next(r for r in report.remarks if r.pass_name == "legalize" and r.code == "summary")


def relu_model(elem=TensorProto.FLOAT, shape=(2, 4), opset=17):
    return model(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        [vi("x", list(shape), elem)],
        [vi("y", None, elem)],
        opset=opset,
    )


def test_legalize_runs_last_in_every_preset():
    for level in (1, 2, 3):
        assert preset(level).endswith(",legalize")
    assert preset(0) == ""


@pytest.mark.parametrize("target", ["cpu", "cuda", "tensorrt", "npu"])
def test_simple_model_is_legal_everywhere(target):
    _, report = run(relu_model(), target=target)
    assert report.legal and not failures(report)
    s = summary(report)
    assert s.args["legal"] == s.args["total"] == 1


def test_erf_on_npu_is_a_failure_naming_op_dtype_and_node():
    m = model(
        [helper.make_node("Erf", ["x"], ["y"], name="the_erf")], [vi("x", [2, 4])], [vi("y", None)]
    )
    _, report = run(m, target="npu")
    (f,) = failures(report)
    assert f.code == "no-kernel" and f.nodes == ("the_erf",)
    assert f.args["op"] == "Erf" and f.args["dtype"] == "tensor(float)"
    assert "Erf" in f.message and "tensor(float)" in f.message and "the_erf" in f.message
    assert not report.legal and report.parity.ok  # parity is about numerics, legality apart


def test_dtype_unsupported():
    _, report = run(relu_model(TensorProto.INT32), target="npu")
    (f,) = failures(report)
    assert f.code == "dtype-unsupported" and f.args["dtype"] == "tensor(int32)"


def test_opset_unsupported():
    _, report = run(relu_model(opset=10), target="npu")  # the npu table starts at opset 11
    (f,) = failures(report)
    assert f.code == "opset-unsupported"


def test_unknown_domain_on_every_target():
    g = helper.make_graph(
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="acme.custom", name="frob")],
        "custom",
        [vi("x", [2])],
        [vi("y", [2])],
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme.custom", 1)]
    )
    for target in ("cpu", "cuda", "tensorrt", "npu"):
        _, report = graphopt.optimize(m, target=target, check=False)
        (f,) = failures(report)
        assert f.code == "unknown-domain" and f.args["domain"] == "acme.custom", target


def test_contrib_op_unknown_to_tensorrt():
    """A com.microsoft op without a standard-op decomposition stays and is reported."""
    g = helper.make_graph(
        [
            helper.make_node(
                "Attention", ["x", "w", "b"], ["y"], domain="com.microsoft", num_heads=2, name="att"
            )
        ],
        "att",
        [vi("x", [1, 4, 8])],
        [vi("y", [1, 4, 8])],
        [const("w", np.ones((8, 24))), const("b", np.zeros(24))],
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    _, report = graphopt.optimize(m, target="tensorrt", check=False)
    (f,) = failures(report)
    assert f.code == "unknown-domain" and f.nodes == ("att",)
    _, report = graphopt.optimize(m, target="cpu", check=False)
    assert report.legal


def _cuda_lacks_but_cpu_has() -> str:
    for (op, domain), _ in sorted(CPU.kernels().items()):
        if domain or op in ("Constant",) or not onnx.defs.has(op):
            continue
        schema = onnx.defs.get_schema(op, 17)
        if len(schema.inputs) != 1 or len(schema.outputs) != 1 or schema.attributes:
            continue
        float_in = "tensor(float)" in next(
            (tc.allowed_type_strs for tc in schema.type_constraints), []
        )
        if not float_in:
            continue
        if CPU.has_kernel(op, "", 17, "tensor(float)") and not CUDA.has_kernel(
            op, "", 17, "tensor(float)"
        ):
            return op
    pytest.skip("every unary CPU op has a CUDA kernel")


def test_cuda_fallback_islands_with_copies_warn_when_the_original_had_them():
    """The nodes are the input's own: warnings (original-fallback); --strict-fallback
    (options["strict_fallback"]) makes them failures.  Fallbacks graphopt introduced:
    tests/test_fallback_policy.py."""
    op = _cuda_lacks_but_cpu_has()  # e.g. Acos
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="on_gpu_1"),
        helper.make_node(op, ["a"], ["b"], name="island_1"),
        helper.make_node(op, ["b"], ["c"], name="island_2"),
        helper.make_node("Relu", ["c"], ["y"], name="on_gpu_2"),
    ]
    m = model(nodes, [vi("x", [2, 4])], [vi("y", None)])
    _, report = run(m, target="cuda", check=False)
    assert not failures(report) and report.legal
    warned = [r for r in report.remarks if r.code == "original-fallback"]
    assert sorted(r.nodes[0] for r in warned) == ["island_1", "island_2"]
    assert {r.args["island"] for r in warned} == {0}
    (island,) = [r for r in report.remarks if r.code == "fallback-island"]
    assert island.args["copied_in"] == ["a"] and island.args["copied_out"] == ["c"]
    assert island.args["copies"] == 2
    _, report = run(m, target="cuda", check=False, options={"strict_fallback": True})
    fs = failures(report, "cpu-fallback")
    assert sorted(f.nodes[0] for f in fs) == ["island_1", "island_2"]
    assert not report.legal
    _, report = run(m, target="cpu", check=False)
    assert report.legal


def test_function_ops_run_as_their_body_on_onnxruntime():
    """ops without a kernel but with an ONNX function body are legal where the runtime inlines."""
    res = None
    for name in ("Swish", "Mish", "HardSwish", "Celu", "Shrink"):
        if not CPU.has_kernel(name, "", 24) and onnx.defs.has(name):
            res = resolve(CPU, name, "", 24, "tensor(float)")
            break
    if res is None:
        pytest.skip("every candidate has a CPU kernel in this onnxruntime")
    assert res.status == "ok" and res.kind.startswith("function-body")
    assert not resolve(NPU, "Swish", "", 20, "tensor(float)").runs  # the npu does not inline


def test_float16_runs_via_float_on_the_cpu_provider():
    res = resolve(CPU, "Elu", "", 17, "tensor(float16)")
    if CPU.has_kernel("Elu", "", 17, "tensor(float16)"):
        pytest.skip("this onnxruntime has an fp16 Elu")
    assert res.status == "ok" and res.kind == "float16-via-float"
    assert not resolve(NPU, "Erf", "", 17, "tensor(float16)").runs


def test_primary_dtype_skips_fixed_type_operands():
    m = model(
        [helper.make_node("Where", ["c", "x", "z"], ["y"], name="w")],
        [vi("c", [4], TensorProto.BOOL), vi("x", [4]), vi("z", [4])],
        [vi("y", None)],
    )
    _, report = run(m, target="cpu")
    assert report.legal
    from graphopt.opt.graph.ir import ModelIR

    node = ModelIR(m).graph.nodes[0]
    assert primary_dtype(node, 17) == "tensor(float)"  # not the bool condition


# ------------------------------------------------------------------- static shapes
def dynamic_relu():
    return model(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x", ["N", 4])], [vi("y", None)]
    )


def test_static_target_without_shape_is_a_failure_saying_which_shape_to_pass():
    _, report = run(dynamic_relu(), target="npu")
    fs = failures(report, "dynamic-shape")
    assert fs and fs[0].nodes == ("x",)
    assert "--shape x=N,4" in fs[0].message


def test_static_target_pins_the_parity_shapes():
    out, report = run(dynamic_relu(), target="npu", shapes={"x": [3, 4]})
    assert report.legal and report.parity.ok
    pinned = [r for r in report.remarks if r.code == "pinned-shape"]
    assert pinned and pinned[0].args["shape"] == [3, 4]
    dims = lambda vi_: [d.dim_value for d in vi_.type.tensor_type.shape.dim]  # noqa: E731
    assert dims(out.graph.input[0]) == [3, 4] and dims(out.graph.output[0]) == [3, 4]


def test_pinned_shape_must_fit_the_static_dims():
    """A --shape that contradicts a static dim is refused before anything runs (exit 2)."""
    with pytest.raises(UsageError, match="fixes it to"):
        run(dynamic_relu(), target="npu", shapes={"x": [3, 5]}, check=False)


def test_pinning_folds_the_shape_glue():
    """Shape→Gather→Unsqueeze→Concat→Reshape is constant once the input is static."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="gather"),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"], name="unsq"),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0, name="concat"),
        helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["y"], name="relu"),
    ]
    inits = [
        const("zero", 0, np.int64),
        const("axes", [0], np.int64),
        const("minus1", [-1], np.int64),
    ]
    m = model(nodes, [vi("x", ["N", 2, 3])], [vi("y", None)], inits)
    out, report = run(m, target="npu", shapes={"x": [2, 2, 3]})
    assert report.legal, [f.message for f in failures(report)]
    assert sorted(n.op_type for n in out.graph.node) == ["Relu", "Reshape"]


# ----------------------------------------------------------------- cli exit code 4
def test_cli_exits_4_when_the_target_cannot_run_the_model(tmp_path):
    m = model(
        [helper.make_node("Erf", ["x"], ["y"], name="the_erf")], [vi("x", [2, 4])], [vi("y", None)]
    )
    p = tmp_path / "erf.onnx"
    onnx.save(m, p)
    res = runner.invoke(app, ["optimize", str(p), "--target", "npu", "--format", "json", "-q"])
    assert res.exit_code == 4, res.output
    res = runner.invoke(app, ["optimize", str(p), "--target", "cpu", "-q"])
    assert res.exit_code == 0, res.output


def test_bert_tiny_on_npu_o2_fails_on_erf_and_o3_removes_it():
    m = onnx.load(EXAMPLES / "bert_tiny.onnx")
    shapes = {"input_ids": [1, 16], "attention_mask": [1, 16]}
    _, r2 = graphopt.optimize(m, target="npu", level=2, shapes=shapes)
    erf = [f for f in failures(r2) if f.args.get("op") == "Erf"]
    assert len(erf) == 2 and all("intermediate_act_fn/Erf" in f.nodes[0] for f in erf)
    out, r3 = graphopt.optimize(m, target="npu", level=3, shapes=shapes)
    assert not [n for n in out.graph.node if n.op_type == "Erf"]
    assert not [f for f in failures(r3) if f.args.get("op") == "Erf"]
    assert r3.parity.ok
    assert [r for r in r3.remarks if r.code == "approximation-error"]


# --------------------------------------------------- conformance: no false failures
def _ort_runnable_cases(every: int):
    from backend_cases import _run, cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for c in cases(every):
            if not c.data_sets:
                continue
            feeds = {i.name: v for i, v in zip(c.model.graph.input, c.data_sets[0][0])}
            try:
                _run(c.model, feeds)
            except Exception:  # noqa: BLE001 - onnxruntime cannot run it: not our concern here
                continue
            yield c


def test_no_false_failures_on_cases_onnxruntime_runs():
    """legalize against the live CPU registry must accept what onnxruntime's CPU provider runs
    (fp16 via float, function bodies, sequences, subgraphs, bool conditions...)."""
    checked, wrong = 0, []
    for c in _ort_runnable_cases(every=7):
        _, report = graphopt.optimize(c.model, level=1, check=False)
        checked += 1
        wrong += [(c.name, f.message) for f in failures(report)]
    assert checked > 180
    assert not wrong, wrong[:5]

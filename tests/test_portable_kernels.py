"""Generated kernels are the machine tier: model.onnx runs in a bare onnxruntime session (each
fused node is a model-local function of standard ops), and load_session registers the kernel
library only where it can run."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from test_kernels_default import gated, optimize

from graphopt.opt.errors import GraphoptError
from graphopt.targets import bundle
from graphopt.targets.codegen import toolchain
from graphopt.targets.codegen.expr import FUNCS, Expr, evaluate, parse
from graphopt.targets.codegen.portable import function_for
from graphopt.targets.codegen.spec import DOMAIN, KernelSpec

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def substitute(lib) -> None:
    """Replace a library file with other bytes: a new file renamed over it (the process may
    have the old one mapped; writing into that file would change code it runs)."""
    tmp = lib.with_name(lib.name + ".new")
    tmp.write_bytes(lib.read_bytes() + b"\0")
    os.replace(tmp, lib)


def call_model(spec: KernelSpec, shape: list[int], channels: int, opset: int) -> onnx.ModelProto:
    """A model whose one node calls the kernel's function: inputs x0.., p0.. ([C] each)."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
    xs = [helper.make_tensor_value_info(f"x{i}", elem, shape) for i in range(spec.inputs)]
    ps = [helper.make_tensor_value_info(f"p{i}", elem, [channels]) for i in range(spec.params)]
    node = helper.make_node(
        spec.op_type,
        [v.name for v in xs + ps],
        ["y"],
        domain=DOMAIN,
        **spec.attrs(),
    )
    graph = helper.make_graph(
        [node], "call", xs + ps, [helper.make_tensor_value_info("y", elem, shape)]
    )
    m = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
        ir_version=8,
    )
    m.functions.append(function_for(spec, opset))
    onnx.checker.check_model(m, full_check=True)
    return m


def exprs() -> list[str]:
    """One expression per function of the grammar, each over x0 and a per-channel p0."""
    lits = {"clip": "-0.5,0.75", "leakyrelu": "0.1", "elu": "0.7", "hardsigmoid": "0.2,0.5"}
    out = []
    for name, (arity, nlits) in sorted(FUNCS.items()):
        if name == "pow":
            out += [f"pow(add(abs(x0),p0),{k})" for k in ("-0.5", "2", "3")]
            continue
        args = ["add(abs(x0),p0)" if name in ("log", "sqrt") else "x0", "p0"][:arity]
        if arity == 1 and name not in ("log", "sqrt"):
            args = ["mul(x0,p0)"]
        extra = [lits[name]] if nlits else []
        out.append(f"{name}({','.join(args + extra)})")
    return out


@pytest.mark.parametrize("text", exprs())
@pytest.mark.parametrize("axis,opset", [(-3, 17), (-1, 13), (-3, 9)])
def test_function_body_computes_the_expression(text, axis, opset):
    spec = KernelSpec(parse(text), "float32", axis)
    shape = [2, 4, 3, 5] if axis == -3 else [2, 3, 4]
    channels = shape[axis]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32) * 2
    p = (rng.random(channels) + 0.5) * np.sign(rng.standard_normal(channels))
    p = (np.abs(p) if text.startswith(("log", "sqrt", "pow")) else p).astype(np.float32)
    sess = ort.InferenceSession(
        call_model(spec, shape, channels, opset).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    feeds = {"x0": x, "p0": p} if spec.params else {"x0": x}
    got = sess.run(
        None, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
    )
    bshape = [channels] + [1] * (-axis - 1)
    want = evaluate(spec.expr, [x.astype(np.float64)], [p.astype(np.float64).reshape(bshape)])
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=2e-6)


def test_float16_body_and_literals():
    spec = KernelSpec(parse("mul(x0,sigmoid(add(mul(x0,0.5),p0)))"), "float16", -1)
    x = np.linspace(-3, 3, 24, dtype=np.float16).reshape(2, 3, 4)
    p = np.array([0.25, -0.5, 1.0, 2.0], np.float16)
    m = call_model(spec, [2, 3, 4], 4, 17)
    consts = [n for n in m.functions[0].node if n.op_type == "Constant"]
    assert all(n.attribute[0].t.data_type == onnx.TensorProto.FLOAT16 for n in consts)
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x0": x, "p0": p}
    )[0]
    want = evaluate(spec.expr, [x.astype(np.float64)], [p.astype(np.float64)])
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2, atol=1e-3)


def test_a_leaf_expression_body_still_ends_in_a_node():
    f = function_for(KernelSpec(Expr.call("max", Expr.x(0), Expr.x(1))), 17)
    assert [n.op_type for n in f.node] == ["Max"] and list(f.node[-1].output) == ["y"]


@needs_gcc
def test_model_onnx_runs_bare_and_load_session_uses_the_library(default_on, faster, tmp_path):
    out = tmp_path / "b"
    optimize(gated(tmp_path), out)
    m = onnx.load(out / "model.onnx")
    fused = {n.op_type for n in m.graph.node if n.domain == DOMAIN}
    assert fused and fused == {f.name for f in m.functions if f.domain == DOMAIN}
    assert m.ir_version >= 8
    onnx.checker.check_model(m, full_check=True)
    # a bare session: no library registered, default settings
    bare = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    with np.load(out / "golden" / "inputs.npz") as f:
        feeds = {k: f[k] for k in f.files}
    with np.load(out / "golden" / "outputs.npz") as f:
        golden = {k: f[k] for k in f.files}
    (y,) = bare.run(["y"], feeds)
    np.testing.assert_allclose(y, golden["y"], rtol=1e-4, atol=1e-5)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verified"]["bare_session"]["ok"] is True
    _, how = bundle.open_session(out, fast_path=False)
    assert how["kernels"] == {"used": True, "why": None}


@needs_gcc
def test_without_a_runnable_library_the_bodies_run(default_on, faster, tmp_path, monkeypatch):
    out = tmp_path / "b"
    optimize(gated(tmp_path), out)
    with np.load(out / "golden" / "inputs.npz") as f:
        feeds = {k: f[k] for k in f.files}
    expected = bundle.load_session(out, fast_path=False).run(["y"], feeds)[0]
    # a CPU without the features the library was built for
    monkeypatch.setattr(toolchain, "cpu_flags", lambda: frozenset({"sse2"}))
    sess, how = bundle.open_session(out, fast_path=False)
    assert how["kernels"]["used"] is False and "lacks" in how["kernels"]["why"]
    np.testing.assert_allclose(sess.run(["y"], feeds)[0], expected, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    # the library gone: the model still runs, and says why the kernels did not
    (lib,) = (out / "kernels" / "cpu").glob("*.so")
    lib.unlink()
    sess, how = bundle.open_session(out)
    assert how["kernels"]["used"] is False and "missing" in how["kernels"]["why"]
    np.testing.assert_allclose(sess.run(["y"], feeds)[0], expected, rtol=1e-4, atol=1e-5)


@needs_gcc
def test_a_substituted_library_is_still_refused(default_on, faster, tmp_path):
    out = tmp_path / "b"
    optimize(gated(tmp_path), out)
    (lib,) = (out / "kernels" / "cpu").glob("*.so")
    substitute(lib)
    with pytest.raises(GraphoptError, match="sha256"):
        bundle.load_session(out, fast_path=False)


@needs_gcc
def test_reoptimizing_the_output_keeps_the_kernel_calls(default_on, faster, tmp_path):
    out = tmp_path / "b"
    optimize(gated(tmp_path), out)
    again = optimize(out / "model.onnx", tmp_path / "again")
    assert any(op.startswith("graphopt.fused.") for op in again["ops_before"])
    assert again["ops_after"] == again["ops_before"]


def backend_cases_with_chains():
    """The ONNX backend node cases whose models are element-wise chains (the expanded function
    cases: LayerNormalization, HardSigmoid, Selu, ...): those generated kernels can fuse."""
    import warnings

    from backend_cases import cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = cases()
    return [
        c for c in every if "expanded" in c.name or c.name.startswith(("test_selu", "test_hard"))
    ]


CHAIN_CASES = backend_cases_with_chains()


@needs_gcc
@pytest.mark.parametrize("mode", ["inputs", "folded"])
@pytest.mark.parametrize("case", CHAIN_CASES[::2], ids=[c.name for c in CHAIN_CASES[::2]])
def test_backend_cases_with_kernels_run_in_a_bare_session(case, mode, faster):
    """Kernels on (their gates pass): the output still runs in a bare onnxruntime session."""
    from backend_cases import run_case
    from graphopt.targets.codegen import kernel_pipeline

    outcome = run_case(case, mode, pipeline=kernel_pipeline("cpu", 2, None, True))
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    assert outcome.status == "pass", outcome.detail


def test_the_manifest_states_bytes_per_tier_and_the_machine_tier_can_stay_out(tmp_path):
    from cli_runner import CliRunner
    from conftest import EXAMPLES
    from graphopt.cli import app

    runner = CliRunner()
    src = EXAMPLES / "mobilenet_bn.onnx"
    for name, flags in (("with", []), ("without", ["--no-machine-tier"])):
        res = runner.invoke(app, ["optimize", str(src), "-o", str(tmp_path / name), "-q", *flags])
        assert res.exit_code == 0, res.output
    with_tier = json.loads((tmp_path / "with" / "manifest.json").read_text())["tiers"]
    without = json.loads((tmp_path / "without" / "manifest.json").read_text())
    assert with_tier["portable"]["bytes"] == (tmp_path / "with" / "model.onnx").stat().st_size
    assert with_tier["machine"]["weights_copied"] and with_tier["machine"]["bytes"] > 0
    assert without["tiers"]["machine"] == {
        "files": [],
        "bytes": 0,
        "weights_copied": False,
        "why": None,
    }
    assert "--no-machine-tier" in without["fast_path"]["why"]
    assert not (tmp_path / "without" / "model.machine.onnx").exists()
    res = runner.invoke(
        app, ["optimize", str(src), "-o", str(tmp_path / "x"), "--kernels", "--no-machine-tier"]
    )
    assert res.exit_code == 2 and "--no-machine-tier" in res.output


def _config(out):
    return json.loads((out / "session_config.json").read_text())


def _set_config(out, config):
    (out / "session_config.json").write_text(json.dumps(config))


@needs_gcc
def test_only_libraries_the_manifest_vouches_for_are_loaded(default_on, faster, tmp_path):
    """A library is code: it must lie inside the bundle and match the manifest's sha256, also
    with verify='none'; anything else is refused before onnxruntime sees it."""
    out = tmp_path / "b"
    optimize(gated(tmp_path), out)
    (lib,) = (out / "kernels" / "cpu").glob("*.so")
    original = _config(out)
    outside = tmp_path / "evil.so"
    shutil.copy(lib, outside)
    for named in (str(outside), "../evil.so", "kernels/cpu/other.so"):
        config = json.loads(json.dumps(original))
        config["custom_op_libraries"]["CPUExecutionProvider"] = named
        _set_config(out, config)
        for verify in ("fingerprint", "none"):
            with pytest.raises(GraphoptError, match="refused"):
                bundle.load_session(out, fast_path=False, verify=verify)
    _set_config(out, original)
    manifest = json.loads((out / "manifest.json").read_text())
    substitute(lib)  # --verify none
    with pytest.raises(GraphoptError, match="sha256"):
        bundle.load_session(out, fast_path=False, verify="none")
    # the manifest's sha256 deleted: not vouched for
    del manifest["kernels"]["libraries"]["CPUExecutionProvider"]["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GraphoptError, match="refused"):
        bundle.load_session(out, fast_path=False, verify="none")


def test_a_bundle_without_kernels_loads_no_library(tmp_path):
    """A library planted in a bundle that had none, and named in its session config: refused."""
    from cli_runner import CliRunner
    from conftest import EXAMPLES
    from graphopt.cli import app

    out = tmp_path / "b"
    res = CliRunner().invoke(
        app, ["optimize", str(EXAMPLES / "mobilenet_bn.onnx"), "-o", str(out), "-q", "--no-kernels"]
    )
    assert res.exit_code == 0, res.output
    (out / "kernels" / "cpu").mkdir(parents=True)
    (out / "kernels" / "cpu" / "libx.so").write_bytes(b"\x7fELF")
    config = _config(out)
    config["custom_op_libraries"] = {"CPUExecutionProvider": "kernels/cpu/libx.so"}
    _set_config(out, config)
    with pytest.raises(GraphoptError, match="refused"):
        bundle.load_session(out, verify="none")

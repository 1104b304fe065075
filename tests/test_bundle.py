"""The per-target bundle: manifest, session config, golden files, memory plan, `graphopt run`
and `graphopt.load_session`."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graphopt
from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt.rewrite.target import get_target
from graphopt.targets.bundle import session_config
from graphopt.targets.memory import memory_plan, shape_view

runner = CliRunner()
FILES = {"model.onnx", "report.json", "manifest.json", "session_config.json", "memory_plan.json"}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def conv_net(tmp_path, rng):
    """Conv+BN → Relu → pixel shuffle (Reshape/Transpose/Reshape) with a dynamic batch."""
    c, r = 2, 2
    inits = [
        const("W", rng.standard_normal((c * r * r, 3, 3, 3))),
        const("g", rng.random(c * r * r) + 0.5),
        const("b", rng.standard_normal(c * r * r)),
        const("m", rng.standard_normal(c * r * r)),
        const("v", rng.random(c * r * r) + 0.1),
        const("s1", [-1, c, r, r, 6, 6], np.int64),
        const("s2", [-1, c, 12, 12], np.int64),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["a"], name="relu"),
        helper.make_node("Reshape", ["a", "s1"], ["p"], name="ps/r1"),
        helper.make_node("Transpose", ["p"], ["t"], perm=[0, 1, 4, 2, 5, 3], name="ps/t"),
        helper.make_node("Reshape", ["t", "s2"], ["y"], name="ps/r2"),
    ]
    p = tmp_path / "net.onnx"
    onnx.save(model(nodes, [vi("x", ["N", 3, 6, 6])], [vi("y", None)], inits), p)
    return p


def read(bundle, name):
    return json.loads((bundle / name).read_text())


def test_cpu_bundle(conv_net, tmp_path):
    out = tmp_path / "cpu.bundle"
    res = invoke("optimize", conv_net, "-o", out, "--target", "cpu", "-q")
    assert res.exit_code == 0, res.output
    assert FILES <= {p.name for p in out.iterdir()}
    assert {p.name for p in (out / "golden").iterdir()} == {"inputs.npz", "outputs.npz"}
    assert not list(tmp_path.glob(".cpu.bundle*")), "staging directory left behind"
    m = read(out, "manifest.json")
    optimized = onnx.load(out / "model.onnx")
    assert [n["name"] for n in m["nodes"]] == [n.name for n in optimized.graph.node]
    assert m["coverage"]["fraction"] == 1.0 and m["coverage"]["nodes"] == 2
    for n in m["nodes"]:
        k = n["kernel"]
        domain = n.get("domain") or "ai.onnx"
        assert k["provider"] == "CPUExecutionProvider" and isinstance(k["since_version"], int)
        assert k["kernel_def"].startswith(f"CPUExecutionProvider::{domain}::{n['op']}(")
        assert n["dtype"] == "tensor(float)" and n["outputs"][0]["shape"]
    conv = next(n for n in m["nodes"] if n["op"] == "FusedConv")  # Conv + Relu
    assert conv["layout"] == "NCHW" and conv["workspace_bytes"] == 3 * 9 * 36 * 4  # im2col
    assert [n["op"] for n in m["nodes"]] == ["FusedConv", "DepthToSpace"]
    assert m["verified_shape_range"] == {"x": {"min": [1, 3, 6, 6], "max": [1, 3, 6, 6]}}
    assert m["verified"]["parity"]["ok"] and m["verified"]["bundle_session"]["golden_ok"]
    assert m["verified"]["device"] == "pass"  # the cpu target's device is this machine
    assert m["latency"]["median_ms"] > 0 and m["latency"]["runs"] >= 3
    cfg = read(out, "session_config.json")
    assert cfg["graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert cfg["providers"] == ["CPUExecutionProvider"]
    report = read(out, "report.json")
    assert report["legal"] is True and report["outputs"]["manifest"].endswith("manifest.json")


def test_golden_files_are_the_original_models_outputs(conv_net, tmp_path):
    out = tmp_path / "b"
    assert invoke("optimize", conv_net, "-o", out, "-q", "--seed", "3").exit_code == 0
    feeds = dict(np.load(out / "golden" / "inputs.npz"))
    golden = dict(np.load(out / "golden" / "outputs.npz"))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(conv_net), so, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(ref.run(None, feeds)[0], golden["y"])


def test_run_and_load_session(conv_net, tmp_path):
    out = tmp_path / "b"
    assert invoke("optimize", conv_net, "-o", out, "-q").exit_code == 0
    res = invoke("run", out, "--format", "json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["golden"]["ok"] and data["outputs"]["y"]["shape"] == [1, 2, 12, 12]
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    res = invoke("run", out, "--inputs", tmp_path / "x.npz", "-o", tmp_path / "y.npz")
    assert res.exit_code == 0, res.output
    y = np.load(tmp_path / "y.npz")["y"]
    sess = graphopt.load_session(out)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], y)
    assert sess.get_providers() == ["CPUExecutionProvider"]


def test_load_session_refuses_a_tampered_model(conv_net, tmp_path):
    out = tmp_path / "b"
    assert invoke("optimize", conv_net, "-o", out, "-q").exit_code == 0
    m = onnx.load(out / "model.onnx")
    m.doc_string = "edited"
    onnx.save(m, out / "model.onnx")
    with pytest.raises(graphopt.GraphoptError, match="does not match the manifest"):
        graphopt.load_session(out)
    assert invoke("run", out).exit_code == 1


def test_run_reports_a_golden_mismatch(conv_net, tmp_path):
    out = tmp_path / "b"
    assert invoke("optimize", conv_net, "-o", out, "-q").exit_code == 0
    golden = dict(np.load(out / "golden" / "outputs.npz"))
    np.savez(out / "golden" / "outputs.npz", y=golden["y"] + 1.0)
    res = invoke("run", out)
    assert res.exit_code == 3
    assert "error: the bundle's outputs differ from its golden outputs (max abs 1)" in res.stderr


def test_cuda_bundle_without_the_device(conv_net, tmp_path):
    out = tmp_path / "cuda"
    res = invoke("optimize", conv_net, "-o", out, "--target", "cuda", "-q")
    assert res.exit_code == 0, res.output
    m = read(out, "manifest.json")
    assert m["verified"]["device"] == "not-run" and m["latency"] is None
    assert all(n["kernel"]["provider"] == "CUDAExecutionProvider" for n in m["nodes"])
    assert "cuda_kernels.json" in m["runtime"]["kernels"]
    assert m["verified"]["bundle_session"]["providers"] == ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert invoke("run", out).exit_code == 2  # never a silent fallback
    res = invoke("run", out, "--provider", "CPUExecutionProvider")
    assert res.exit_code == 0, res.output


def test_npu_bundle_is_not_an_onnxruntime_session(conv_net, tmp_path):
    out = tmp_path / "npu"
    res = invoke("optimize", conv_net, "-o", out, "--target", "npu", "--shape", "x=1,3,6,6", "-q")
    assert res.exit_code == 0, res.output
    cfg = read(out, "session_config.json")
    assert cfg["onnxruntime"] is False and cfg["providers"] == []
    with pytest.raises(graphopt.GraphoptError, match="CPUExecutionProvider"):
        graphopt.load_session(out)
    sess = graphopt.load_session(out, providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[0].shape == [1, 3, 6, 6]  # pinned: static shapes
    m = read(out, "manifest.json")
    assert {n["op"] for n in m["nodes"]} == {"Conv", "Relu", "DepthToSpace"}
    assert m["verified"]["device"] == "not-run" and m["verified"]["legal"]


def test_no_check_writes_no_golden(conv_net, tmp_path):
    out = tmp_path / "b"
    assert invoke("optimize", conv_net, "-o", out, "--no-check", "-q").exit_code == 0
    m = read(out, "manifest.json")
    assert m["golden"]["written"] is False and "parity did not run" in m["golden"]["why"]
    assert not (out / "golden").exists()
    assert invoke("run", out).exit_code == 2  # no golden inputs: pass --inputs


def test_bundle_of_an_illegal_model_says_so(tmp_path):
    m = model(
        [helper.make_node("Erf", ["x"], ["y"], name="erf")], [vi("x", [2, 3])], [vi("y", None)]
    )
    p = tmp_path / "erf.onnx"
    onnx.save(m, p)
    res = invoke("optimize", p, "-o", tmp_path / "b", "--target", "npu", "-q")
    assert res.exit_code == 4
    man = read(tmp_path / "b", "manifest.json")
    (node,) = man["nodes"]
    assert node["status"] == "no-kernel" and node["kernel"] is None and "Erf" in node["why_not"]
    assert man["coverage"]["unsupported_ops"] == {"Erf": 1} and not man["verified"]["legal"]


# ----------------------------------------------------------------- session config
def conv_bn_fp16():
    rng = np.random.default_rng(0)
    f = np.float16
    inits = [const("W", rng.standard_normal((4, 3, 3, 3)), f)] + [
        const(n, v, f)
        for n, v in zip(
            "gbmv",
            [rng.random(4) + 0.5, rng.standard_normal(4), rng.standard_normal(4), rng.random(4)],
        )
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn"),
    ]
    return model(
        nodes,
        [vi("x", [1, 3, 8, 8], TensorProto.FLOAT16)],
        [vi("y", None, TensorProto.FLOAT16)],
        inits,
    )


def _ort_ops(m: onnx.ModelProto, cfg: dict, tmp_path) -> list[str]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "ort.onnx")
    for k, v in cfg["session_config_entries"].items():
        so.add_session_config_entry(k, v)
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(tmp_path / "ort.onnx").graph.node]


def test_fp16_batchnorm_keeps_onnxruntime_from_refolding(tmp_path):
    m = conv_bn_fp16()
    cfg = session_config(get_target("cpu"), m)
    assert (
        cfg["disabled_optimizers"] == ["ConvBNFusion"] and "fp16" in cfg["reasons"]["ConvBNFusion"]
    )
    assert "BatchNormalization" in _ort_ops(m, cfg, tmp_path)  # the entry takes effect
    empty = dict(cfg, session_config_entries={})
    assert "BatchNormalization" not in _ort_ops(m, empty, tmp_path)  # onnxruntime would fold


def test_fusion_measured_slower_is_disabled(tmp_path):
    cpu = get_target("cpu")
    if "SkipLayerNormalization" not in cpu.measured_slower:
        pytest.skip("the cpu profile records no SkipLayerNormalization measurement")
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Add", ["x", "s"], ["a"], name="add"),
        helper.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1, name="ln"),
    ]
    m = model(
        nodes,
        [vi("x", [1, 4, 8]), vi("s", [1, 4, 8])],
        [vi("y", None)],
        [const("g", rng.random(8)), const("b", rng.random(8))],
    )
    cfg = session_config(cpu, m)
    assert "SkipLayerNormFusion" in cfg["disabled_optimizers"]
    assert "LayerNormalization" in _ort_ops(m, cfg, tmp_path)
    assert "SkipLayerNormalization" in _ort_ops(m, dict(cfg, session_config_entries={}), tmp_path)
    assert session_config(cpu, conv_bn_fp16())["disabled_optimizers"] == ["ConvBNFusion"]


# -------------------------------------------------------------------- memory plan
def plan_of(nodes, inputs, outputs, inits=()):
    m = model(nodes, inputs, outputs, inits)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    return memory_plan(m, shape_view(m, shapes), shapes)


def test_memory_plan_chain():
    """x → Relu → Relu → Relu (1000 floats each): at most two buffers live at once."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),
        helper.make_node("Relu", ["a"], ["b"], name="r2"),
        helper.make_node("Relu", ["b"], ["y"], name="r3"),
    ]
    p = plan_of(nodes, [vi("x", [1000])], [vi("y", None)])
    assert p["sum_bytes"] == p["no_reuse_bytes"] == 12000
    assert p["peak_bytes"] == 8000 and p["exact_size_reuse_bytes"] == 8000
    assert p["inputs_bytes"] == 4000 and p["unknown_size_count"] == 0


def test_memory_plan_aliasing_and_sizes():
    """Reshape is a view (no buffer); a smaller tensor cannot take a bigger freed buffer's
    place in exact-size reuse, while the ideal plan only counts live bytes."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),  # 4000
        helper.make_node("Reshape", ["a", "s"], ["b"], name="view"),  # alias of a
        helper.make_node("Relu", ["b"], ["c"], name="r2"),  # 4000
        helper.make_node("ReduceSum", ["c", "axes"], ["d"], keepdims=1, name="sum"),  # [10, 1]
        helper.make_node("Relu", ["d"], ["y"], name="r3"),  # 40
    ]
    p = plan_of(
        nodes,
        [vi("x", [1000])],
        [vi("y", None)],
        [const("s", [10, 100], np.int64), const("axes", [1], np.int64)],
    )
    assert p["sum_bytes"] == 4000 * 3 + 40 + 40
    assert p["no_reuse_bytes"] == 4000 * 2 + 40 + 40
    assert p["peak_bytes"] == 8000
    assert p["exact_size_reuse_bytes"] == 4000 * 2 + 40 + 40
    assert p["peak_at_node"] == "r2"


def test_memory_plan_keeps_graph_outputs_alive():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),
        helper.make_node("Relu", ["a"], ["b"], name="r2"),
        helper.make_node("Relu", ["b"], ["c"], name="r3"),
    ]
    p = plan_of(nodes, [vi("x", [100])], [vi("a", None), vi("c", None)])
    assert p["peak_bytes"] == 1200  # a never freed

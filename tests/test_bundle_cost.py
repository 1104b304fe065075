"""What writing a bundle costs: the portable model is loaded once (that session verifies the
bundle and saves the fast path), the fast path is checked against that run, its files carry a
fingerprint but no full sha256, ``--no-check`` builds none, and the manifest's latency comes
from the performance safety net's rounds instead of a second timing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import graphopt
import graphopt.targets.bundle as bundle
from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt.verify import perf
from graphopt.opt.verify.perf import Timing


@pytest.fixture
def sessions(monkeypatch):
    """Every session the bundle phase creates from a bundle file: (file, level, saves, run
    once: weights not pre-packed)."""
    calls: list[tuple[str, str, bool, bool]] = []
    real = bundle._session

    def spy(path, manifest, config, name, wanted, level, verify, save_to=None, once=False, **kw):
        calls.append((name, level, save_to is not None, once))
        return real(path, manifest, config, name, wanted, level, verify, save_to, once, **kw)

    monkeypatch.setattr(bundle, "_session", spy)
    return calls


def manifest_of(out):
    return json.loads((out / "manifest.json").read_text())


def feeds():
    return {"x": np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)}


# ---------------------------------------------------------------------- one session
def test_the_portable_model_is_loaded_once_and_saves_the_fast_path(wide, tmp_path, sessions):
    optimized, report = graphopt.optimize(wide, target="cpu")
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    portable = [c for c in sessions if c[0] == "model.onnx"]
    # saves the fast path and is not run (no weights pre-packed); the fast path, loaded as
    # load_session loads it, verifies the bundle
    assert portable == [("model.onnx", "ORT_ENABLE_ALL", True, True)]
    assert [c for c in sessions if c[0] == bundle.FAST_MODEL] == [
        (bundle.FAST_MODEL, "ORT_DISABLE_ALL", False, False)
    ]
    m = manifest_of(out)
    assert m["source_model_sha256"] == bundle.file_sha256(wide)  # hashed beside the sessions
    fast = m["fast_path"]
    assert fast["written"] and fast["verified"]["ok"]
    assert "golden outputs (the original's)" in fast["verified"]["against"]
    assert "the run verifying the bundle" in fast["verified"]["against"]
    assert "its fast path" in m["verified"]["bundle_session"]["what"]
    assert m["verified"]["bundle_session"]["golden_ok"] and m["verified"]["deploy_parity"]["ok"]
    sess, how = graphopt.open_session(out)
    assert how["fast_path"] and how["why"] is None
    ref = graphopt.load_session(out, fast_path=False).run(None, feeds())[0]
    np.testing.assert_allclose(sess.run(None, feeds())[0], ref, rtol=1e-5, atol=1e-5)


def int4_model(path):
    """int4 block-quantized DequantizeLinear + MatMul: onnxruntime fuses it into MatMulNBits at
    ORT_ENABLE_ALL, whose pre-packed kernel computes otherwise than without pre-packing (int8
    activations) and than the graph as written."""
    rng = np.random.default_rng(0)
    k, n, block = 128, 64, 32
    w = helper.make_tensor("w", onnx.TensorProto.INT4, [k, n], rng.integers(-8, 8, k * n).tolist())
    s = const("s", (rng.random((k // block, n)) * 0.02 + 0.01).astype(np.float32))
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], axis=0, block_size=block),
        helper.make_node("MatMul", ["x", "wf"], ["y"], name="mm"),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    g = helper.make_graph(nodes, "q", [vi("x", [1, 16, k])], [vi("z", [1, 16, n])], [w, s])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def test_the_bundle_is_checked_with_weights_packed_as_deployed(tmp_path):
    """Pre-packing changes what an int4 model computes at ALL: the deploy parity loads the
    original as deployed, and the fast path is kept when it agrees with model.onnx at ALL, even
    though neither agrees with the graph as written (--no-measure: no safety net's outputs)."""
    src = int4_model(tmp_path / "q.onnx")
    x = {"x": np.random.default_rng(1).standard_normal((1, 16, 128)).astype(np.float32)}

    def run(level, pack=True):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        if not pack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        return ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, x)

    level = ort.GraphOptimizationLevel
    as_written, packed = run(level.ORT_DISABLE_ALL)[0], run(level.ORT_ENABLE_ALL)[0]
    assert np.abs(packed - as_written).max() > 1e-3  # the premise: packing changes the numbers
    np.testing.assert_array_equal(run(level.ORT_ENABLE_ALL, pack=False)[0], as_written)
    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["optimize", str(src), "-o", str(out), "--no-measure", "-q"])
    assert res.exit_code == 0, res.output
    m = manifest_of(out)
    assert m["verified"]["deploy_parity"]["ok"] and not m["verified"]["bundle_session"]["golden_ok"]
    fast = m["fast_path"]
    assert fast["written"] and "the portable model at ORT_ENABLE_ALL" in fast["verified"]["against"]
    assert "the runtime's own numerics" in fast["verified"]["against"]


def test_a_fast_path_that_disagrees_is_removed(wide, tmp_path, monkeypatch):
    optimized, report = graphopt.optimize(wide, target="cpu")
    real = bundle._session

    class Off:
        """The reloaded fast path, its outputs off by one."""

        def __init__(self, sess):
            self.sess = sess

        def get_inputs(self):
            return self.sess.get_inputs()

        def get_outputs(self):
            return self.sess.get_outputs()

        def run(self, names, feeds):
            return [o + 1.0 for o in self.sess.run(names, feeds)]

    def off_by_one(path, manifest, config, name, *a, **k):
        sess = real(path, manifest, config, name, *a, **k)
        return Off(sess) if name == bundle.FAST_MODEL else sess

    monkeypatch.setattr(bundle, "_session", off_by_one)
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    fast = manifest_of(out)["fast_path"]
    assert not fast["written"] and "differ from the portable model's (y)" in fast["why"]
    assert not (out / bundle.FAST_MODEL).exists() and not (out / bundle.FAST_DATA).exists()
    m = manifest_of(out)
    assert set(m["integrity"]["files"]) == {"model.onnx"}
    # the portable model, run in its stead, verified the bundle
    assert m["verified"]["bundle_session"]["golden_ok"]
    assert "fast path" not in m["verified"]["bundle_session"]["what"]


def test_a_fast_path_that_does_not_load_is_removed(wide, tmp_path, monkeypatch):
    optimized, report = graphopt.optimize(wide, target="cpu")
    real = bundle._session

    def refuses(path, manifest, config, name, *a, **k):
        if name == bundle.FAST_MODEL:
            raise bundle.GraphoptError("onnxruntime cannot load the bundle: broken (test)")
        return real(path, manifest, config, name, *a, **k)

    monkeypatch.setattr(bundle, "_session", refuses)
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    m = manifest_of(out)
    assert not m["fast_path"]["written"] and "could not reload or run it" in m["fast_path"]["why"]
    assert "broken (test)" in m["fast_path"]["why"] and m["verified"]["bundle_session"]["golden_ok"]
    assert not (out / bundle.FAST_MODEL).exists()


# ---------------------------------------------------------------------- --no-check
def test_no_check_builds_no_fast_path(wide, tmp_path, sessions):
    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["optimize", str(wide), "-o", str(out), "--no-check", "-q"])
    assert res.exit_code == 0, res.output
    m = manifest_of(out)
    assert not m["fast_path"]["written"] and "--no-check" in m["fast_path"]["why"]
    assert "golden inputs" in m["fast_path"]["why"]
    assert not (out / bundle.FAST_MODEL).exists() and sessions == []  # no session at all
    assert set(m["integrity"]["files"]) == {"model.onnx"}
    sess, how = graphopt.open_session(out)
    assert not how["fast_path"] and "the bundle has none (not built without golden" in how["why"]
    assert sess.run(None, feeds())[0].shape == (2, 1024)


def test_no_check_fast_path_when_asked_is_checked_on_random_inputs(wide, tmp_path, sessions):
    optimized, report = graphopt.optimize(wide, target="cpu", check=False)
    out = graphopt.write_bundle(optimized, report, tmp_path / "b", fast_path=True)
    fast = manifest_of(out)["fast_path"]
    assert fast["written"] and "seeded random inputs" in fast["verified"]["against"]
    assert [c[0] for c in sessions] == ["model.onnx", bundle.FAST_MODEL]


# ---------------------------------------------------------------------- integrity
def test_fast_path_files_have_a_fingerprint_and_no_full_hash(wide, tmp_path):
    optimized, report = graphopt.optimize(wide, target="cpu")
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    files = manifest_of(out)["integrity"]["files"]
    for name in bundle.FAST_FILES:
        rec = files[name]
        assert rec["sha256"] is None and rec["size"] == (out / name).stat().st_size
        assert rec["fingerprint"] == bundle.fingerprint(out / name)
    assert files["model.onnx"]["sha256"] == bundle.file_sha256(out / "model.onnx")
    # the default load checks the fast path's fingerprint and uses it
    assert graphopt.open_session(out)[1]["fast_path"]
    # full verification checks every byte of what it loads: the portable model
    sess, how = graphopt.open_session(out, verify="full")
    assert not how["fast_path"] and how["why"] == bundle.FULL_VERIFY_WHY
    assert sess.run(None, feeds())[0].shape == (2, 1024)
    res = CliRunner().invoke(app, ["run", str(out), "--verify", "full"])
    assert res.exit_code == 0 and "fast path not used: verify='full'" in res.stdout
    with pytest.raises(graphopt.GraphoptError, match="no sha256"):
        bundle.check_integrity(out, manifest_of(out), [bundle.FAST_DATA], "full")
    # a damaged sampled block of the fast path still fails the default load
    data = out / bundle.FAST_DATA
    offset, _ = bundle.sampled_blocks(data.stat().st_size)[4]
    raw = bytearray(data.read_bytes())
    raw[offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(graphopt.GraphoptError, match="fingerprint"):
        graphopt.load_session(out)
    graphopt.load_session(out, verify="full")  # the portable model is intact


# ---------------------------------------------------------------------- latency
def test_latency_of_a_measurement():
    t = Timing(1.0, 0.9, 1.1, 4, 0.1, (1.0,) * 4, (0.004, 0.002, 0.003, 0.010), 0.25)
    lat = perf.latency(t)
    assert lat == {
        "median_ms": 3.5,
        "p95_ms": 10.0,
        "runs": 4,
        "session_create_ms": 250.0,
        "threads": 1,
    }
    assert perf.latency(Timing(1.0, 0.9, 1.1, 4, 0.1)) is None  # synthetic: no times
    pooled = t.pooled(Timing(1.0, 0.9, 1.1, 2, 0.1, (1.0, 1.0), (0.001, 0.001), 0.5))
    assert pooled.runs_s == t.runs_s + (0.001, 0.001) and pooled.created_s == 0.5


def test_manifest_latency_is_the_safety_nets(wide, tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHOPT_NO_MEASURE", raising=False)
    monkeypatch.setattr(perf, "MIN_BUDGET_S", 1.0)

    def no_second_timing(*_a, **_k):
        raise AssertionError("the bundle timed the model again")

    optimized, report = graphopt.optimize(wide, target="cpu")
    assert report.performance["measured"], report.performance
    monkeypatch.setattr(bundle, "_latency", no_second_timing)
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    m = manifest_of(out)
    net = report.performance["latency"]
    assert net["median_ms"] > 0 and net["runs"] >= perf.MIN_FLOOR and net["threads"] == 1
    assert {k: m["latency"][k] for k in net} == net
    assert "safety net" in m["latency"]["where"]
    assert m["performance"]["latency"] == net


def test_manifest_latency_is_timed_when_the_net_did_not_measure(wide, tmp_path):
    optimized, report = graphopt.optimize(wide, target="cpu")  # GRAPHOPT_NO_MEASURE in tests
    assert not report.performance["measured"]
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    lat = manifest_of(out)["latency"]
    assert lat["median_ms"] > 0 and lat["runs"] >= 3 and lat["threads"] == "onnxruntime default"
    assert lat["session_create_ms"] > 0  # the fast path's, as load_session creates it here


def test_manifest_latency_is_not_timed_when_timing_was_turned_off(wide, tmp_path):
    optimized, report = graphopt.optimize(wide, target="cpu", measure=False)  # --no-measure
    assert report.performance["why"] == "not requested (--no-measure)"
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    manifest = manifest_of(out)
    assert manifest["latency"] is None and manifest["verified"]["bundle_session"]["golden_ok"]
    assert manifest["verified"]["deploy_parity"]["ok"]


# ---------------------------------------------------------------------- memory plan
def contrib_model(rng) -> onnx.ModelProto:
    """MatMul → com.microsoft.Gelu (untyped by onnx's inference) → MatMul → Relu, 2 MiB of
    weights, and a bfloat16 weight (kept in the model: numpy has no bfloat16)."""
    bf = helper.make_tensor("bf", onnx.TensorProto.BFLOAT16, [1024], np.zeros(1024, np.uint16))
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Gelu", ["m"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("MatMul", ["g", "V"], ["h"], name="mm2"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Cast", ["bf"], ["bf32"], to=onnx.TensorProto.FLOAT, name="cast"),
        helper.make_node("Add", ["r", "bf32"], ["y"], name="add"),
    ]
    inits = [
        const("W", rng.standard_normal((512, 1024))),
        const("V", rng.standard_normal((1024, 1024)) / 32),
        bf,
    ]
    g = helper.make_graph(nodes, "t", [vi("x", [2, 512])], [vi("y", [2, 1024])], inits)
    m = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    m.ir_version = 8
    return m


def test_unknown_shapes_are_measured_without_serializing_the_weights(rng):
    from graphopt.targets.memory import _weightless, measured_view, nbytes, shape_view

    m = contrib_model(rng)
    before = m.SerializeToString()
    view = shape_view(m, {"x": [2, 512]})
    unknown = [o for n in m.graph.node for o in n.output if nbytes(view.get(o)) is None]
    assert set(unknown) == {"g", "h", "r", "y"}
    light, weights = _weightless(m, unknown)
    assert set(weights) == {"W", "V"} and light.ByteSize() < 8 * 1024  # bf16 stays inline
    assert [o.name for o in light.graph.output] == ["y", "g", "h", "r"]
    x = {"x": rng.standard_normal((2, 512)).astype(np.float32)}
    shapes = measured_view(m, x, unknown)
    assert shapes == {n: (onnx.TensorProto.FLOAT, [2, 1024]) for n in unknown}
    assert m.SerializeToString() == before  # the model itself is untouched


def test_memory_plan_of_a_contrib_model_has_every_size(rng, tmp_path, monkeypatch):
    """Parity's run of the output profiles its nodes: the contrib ops' output shapes come from
    it, with no run of the bundle's own, and equal what such a run measures."""
    src = tmp_path / "c.onnx"
    onnx.save(contrib_model(rng), src)
    optimized, report = graphopt.optimize(src, target="cpu", level=0)
    known = report.parity.shapes
    assert {n: known[n] for n in "ghry"} == {n: (onnx.TensorProto.FLOAT, [2, 1024]) for n in "ghry"}
    measured = bundle.measured_view(optimized, report.parity.feeds, list("ghry"))
    assert measured == {n: known[n] for n in "ghry"}
    runs = []
    monkeypatch.setattr(bundle, "measured_view", lambda *a: runs.append(a) or {})
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["measured_shapes"] >= 3 and plan["unknown_size_count"] == 0 and not runs


def test_profiled_shapes_of_nodes_run_in_another_type(rng):
    """An fp16 graph onnxruntime runs in float between casts it inserts: the dims of its
    outputs come from the profile, their element types do not (static inference has them)."""
    from graphopt.opt.verify.parity import Session

    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Softmax", ["m"], ["p"], axis=-1, name="softmax"),
        helper.make_node("Relu", ["p"], ["y"], name="relu"),
    ]
    w = onnx.numpy_helper.from_array(rng.standard_normal((8, 32)).astype(np.float16), "W")
    f16 = onnx.TensorProto.FLOAT16
    g = helper.make_graph(
        nodes,
        "h",
        [helper.make_tensor_value_info("x", f16, [3, 8])],
        [helper.make_tensor_value_info("y", f16, [3, 32])],
        [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    sess = Session(m, profile=True)
    sess.run({"x": rng.standard_normal((3, 8)).astype(np.float16)})
    # MatMul and Relu ran in float between inserted casts: dims, no element type; the fp16
    # Softmax was expanded into other ops (a function), so its output is left to a run
    undefined = onnx.TensorProto.UNDEFINED
    assert sess.node_shapes(m) == {"m": (undefined, [3, 32]), "y": (undefined, [3, 32])}


def test_a_session_profiles_only_when_asked(rng, tmp_path):
    from graphopt.opt.verify.parity import Session

    m = contrib_model(rng)
    x = {"x": rng.standard_normal((2, 512)).astype(np.float32)}
    plain = Session(m)
    plain.run(x)
    assert plain.node_shapes(m) == {}
    profiled = Session(m, profile=True)
    profiled.run(x)
    folder = Path(profiled._profile.name)
    shapes = profiled.node_shapes(m)
    assert set(shapes) == {o for n in m.graph.node for o in n.output}
    assert not folder.exists() and profiled.node_shapes(m) == {}  # the profile is gone


# ---------------------------------------------------------------------- safety net runs
@pytest.mark.parametrize("run_s, expected", [(0.05, 2 + 2 * perf.MIN_FLOOR), (1e-4, None)])
def test_a_slow_run_is_a_round_without_estimating_repeats(monkeypatch, run_s, expected):
    """A warm-up run of at least ONE_RUN_S: one run per round, no runs to estimate how many."""
    relu = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [4])], [vi("y", [4])])
    calls: list[int] = []

    def fake_time(run, k):
        calls.append(k)
        return run_s * k

    duel = perf.Duel(relu, {"x": np.ones(4, np.float32)}, lambda m: {})
    monkeypatch.setattr(perf, "_time", fake_time)
    t = duel.measure(relu, 0.0)
    assert t.rounds == perf.MIN_FLOOR and t.runs_s == (run_s,) * perf.MIN_FLOOR
    if expected is not None:
        assert len(calls) == expected and set(calls) == {1}
    else:  # a fast model: two warm-ups, four timing runs, then rounds of k repeats
        assert calls[:6] == [1] * 6 and set(calls[6:]) == {math.ceil(perf.ROUND_S / run_s)}
    assert perf.latency(t)["median_ms"] == pytest.approx(run_s * 1e3)


def test_no_whole_model_session_no_fast_path(wide, tmp_path, monkeypatch, sessions):
    """A model too large for one session is verified in pieces: no fast path, and why."""
    optimized, report = graphopt.optimize(wide, target="cpu")
    monkeypatch.setattr(bundle, "too_large", lambda m: "over the piece budget (test)")
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    fast = manifest_of(out)["fast_path"]
    assert not fast["written"] and "over the piece budget (test)" in fast["why"]
    assert not (out / bundle.FAST_MODEL).exists() and sessions == []


def test_element_types_from_schemas():
    """Outputs static inference cannot type take their type from the op's schema: a type
    variable bound by an input (contrib ops too), or a constraint of one type."""
    from graphopt.targets.memory import schema_elem_types

    f16, f32, i64 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    nodes = [
        helper.make_node("FastGelu", ["x"], ["g"], domain="com.microsoft"),
        helper.make_node(
            "SkipLayerNormalization", ["g", "x", "s", "b"], ["n", "mean"], domain="com.microsoft"
        ),
        helper.make_node("Reshape", ["n", "shape"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Cast", ["r"], ["c"], to=f32),
        helper.make_node("Concat", ["g", "n", "r"], ["cat"], axis=0),
        helper.make_node("Unknown", ["r"], ["u"], domain="custom.domain"),
    ]
    g = helper.make_graph(nodes, "s", [vi("x", [2, 4], f16)], [vi("cat", None, f16)])
    m = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    got = schema_elem_types(m, {"x": f16, "s": f16, "b": f16, "shape": i64})
    # Cast's output type is its attribute's, not its schema's; an unknown op decides nothing
    assert got == {"g": f16, "n": f16, "mean": f32, "r": f16, "rs": i64, "cat": f16}


def test_memory_plan_types_profiled_fp16_tensors_from_schemas(rng, tmp_path, monkeypatch):
    """onnxruntime runs an fp16 FastGelu in float (expanded between casts it inserts): parity's
    profile has the dims of the Reshape after it but no element type, and static inference
    none; the schemas type it, so only FastGelu's own output (not profiled) is measured."""
    f16 = onnx.TensorProto.FLOAT16
    w = onnx.numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float16), "W")
    shape = onnx.numpy_helper.from_array(np.array([3, 8, 8], np.int64), "shape")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("FastGelu", ["m"], ["g"], domain="com.microsoft", name="gelu"),
        helper.make_node("Reshape", ["g", "shape"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["y"], name="relu"),
    ]
    g = helper.make_graph(
        nodes,
        "f",
        [helper.make_tensor_value_info("x", f16, [3, 64])],
        [helper.make_tensor_value_info("y", f16, [3, 8, 8])],
        [w, shape],
    )
    m = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    m.ir_version = 8
    src = tmp_path / "f.onnx"
    onnx.save(m, src)
    optimized, report = graphopt.optimize(src, target="cpu", level=0)
    assert report.parity.shapes["r"] == (onnx.TensorProto.UNDEFINED, [3, 8, 8])
    asked, real = [], bundle.measured_view
    monkeypatch.setattr(
        bundle,
        "measured_view",
        lambda m, f, names, *a: asked.extend(names) or real(m, f, names, *a),
    )
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["unknown_size_count"] == 0 and asked == ["g"]

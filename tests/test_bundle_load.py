"""Bundles as a library (`graphopt.write_bundle`), integrity at load (size + fingerprint, full
sha256 on request) and the machine-specific fast path with its fallbacks."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import graphopt
import graphopt.targets.bundle as bundle
from cli_runner import CliRunner
from graphopt.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def written(wide, tmp_path):
    """The bundle of ``wide`` written through the library."""
    optimized, report = graphopt.optimize(wide, target="cpu")
    return graphopt.write_bundle(optimized, report, tmp_path / "b")


def feeds():
    return {"x": np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)}


def portable_outputs(path):
    return graphopt.load_session(path, fast_path=False).run(None, feeds())


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ library
def test_write_bundle_is_the_library_call_the_cli_makes(wide, written, tmp_path):
    names = {p.name for p in written.iterdir()}
    assert {"model.onnx", "manifest.json", "report.json", "session_config.json"} <= names
    assert json.loads((written / "report.json").read_text())["outputs"]["model"] == str(
        written / "model.onnx"
    )
    cli_out = tmp_path / "c"
    assert invoke("optimize", wide, "-o", cli_out, "-q").exit_code == 0
    assert {p.name for p in cli_out.iterdir()} == names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_write_bundle_refuses_a_folder_that_is_not_a_bundle(wide, tmp_path):
    optimized, report = graphopt.optimize(wide, target="cpu", check=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(graphopt.GraphoptError, match="not a graphopt bundle") as e:
        graphopt.write_bundle(optimized, report, mine)
    assert e.value.exit_code == 2 and (mine / "notes.txt").read_text() == "keep"


def test_write_bundle_default_folder_beside_the_input(wide):
    optimized, report = graphopt.optimize(wide, target="cpu", check=False)
    assert graphopt.write_bundle(optimized, report) == wide.with_name("wide.cpu.graphopt")


def test_target_help_names_every_target():
    from graphopt.cli import TARGET
    from graphopt.opt.rewrite.target import TARGETS

    assert all(name in TARGET.help for name in TARGETS) and len(TARGETS) >= 4


# ---------------------------------------------------------------------------- integrity
def test_integrity_recorded_once_at_write(written):
    manifest = json.loads((written / "manifest.json").read_text())
    files = manifest["integrity"]["files"]
    assert set(files) == {"model.onnx", bundle.FAST_MODEL, bundle.FAST_DATA}
    assert manifest["fast_path"]["files"] == [bundle.FAST_MODEL, bundle.FAST_DATA]
    rec = files["model.onnx"]
    assert rec["size"] == (written / "model.onnx").stat().st_size > 2 * 2**20
    assert rec["sha256"] == manifest["model_sha256"] == bundle.file_sha256(written / "model.onnx")
    assert rec["fingerprint"] == bundle.fingerprint(written / "model.onnx")
    # the fingerprint reads a bounded part of a large file
    read = sum(n for _, n in bundle.sampled_blocks(rec["size"]))
    assert read == (bundle.FINGERPRINT_SAMPLES + 2) * bundle.FINGERPRINT_BLOCK < rec["size"]


def test_tampering_in_a_sampled_block_is_caught_at_load(written):
    target = written / "model.onnx"
    offset, length = bundle.sampled_blocks(target.stat().st_size)[9]
    flip(target, offset + length // 2)
    with pytest.raises(graphopt.GraphoptError, match="fingerprint"):
        graphopt.load_session(written)
    with pytest.raises(graphopt.GraphoptError, match="fingerprint"):
        graphopt.load_session(written, fast_path=False)
    assert invoke("run", written).exit_code == 1


def test_the_fast_path_weights_are_checked_too(written):
    data = written / bundle.FAST_DATA
    offset, _ = bundle.sampled_blocks(data.stat().st_size)[5]
    flip(data, offset)
    with pytest.raises(graphopt.GraphoptError, match="fingerprint"):
        graphopt.load_session(written)
    graphopt.load_session(written, fast_path=False)  # not read on the portable path


def test_full_verification_catches_what_sampling_misses(written):
    target = written / "model.onnx"
    blocks = bundle.sampled_blocks(target.stat().st_size)
    gap = (blocks[9][0] + blocks[9][1] + blocks[10][0]) // 2  # between two sampled blocks
    assert all(not (o <= gap < o + n) for o, n in blocks)
    flip(target, gap)
    graphopt.load_session(written, fast_path=False)  # the cheap check cannot see it
    with pytest.raises(graphopt.GraphoptError, match="sha256"):
        graphopt.load_session(written, verify="full")
    res = invoke("run", written, "--verify", "full")
    assert res.exit_code == 1 and "sha256" in res.stderr
    assert invoke("run", written, "--verify", "none").exit_code in (0, 3)


def test_a_truncated_file_is_caught_by_its_size(written):
    fast = written / bundle.FAST_MODEL
    fast.write_bytes(fast.read_bytes()[:-10])
    with pytest.raises(graphopt.GraphoptError, match="bytes"):
        graphopt.load_session(written)
    graphopt.load_session(written, fast_path=False)  # the portable model is intact


def test_unknown_verify_mode_is_a_usage_error(written):
    with pytest.raises(graphopt.GraphoptError) as e:
        graphopt.load_session(written, verify="sometimes")
    assert e.value.exit_code == 2


# ---------------------------------------------------------------------------- fast path
def test_fast_path_is_used_on_the_machine_that_wrote_it(written):
    manifest = json.loads((written / "manifest.json").read_text())
    fast = manifest["fast_path"]
    assert fast["written"] and fast["verified"]["ok"]
    assert fast["graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert fast["built_for"]["onnxruntime"] == ort.__version__
    assert fast["built_for"]["cpu_features"] == list(bundle.cpu_features())
    sess, how = graphopt.open_session(written)
    assert how["fast_path"] and how["model"] == bundle.FAST_MODEL and how["why"] is None
    np.testing.assert_allclose(
        sess.run(None, feeds())[0], portable_outputs(written)[0], rtol=1e-5, atol=1e-5
    )
    res = invoke("run", written, "--format", "json")
    assert res.exit_code == 0 and json.loads(res.stdout)["session"]["fast_path"] is True


@pytest.mark.parametrize(
    "fake, why",
    [
        ("cpu", "CPU with other features"),
        ("ort", "onnxruntime"),
        ("level", "graph_optimization_level"),
        ("off", "not asked for"),
    ],
)
def test_fast_path_falls_back_to_the_portable_model(written, monkeypatch, fake, why):
    kw = {}
    if fake == "cpu":
        monkeypatch.setattr(bundle, "cpu_features", lambda: ("sse2", "fake_isa"))
    elif fake == "ort":
        monkeypatch.setattr(bundle.ort, "__version__", "0.0.1")
    elif fake == "level":
        kw["level"] = "ORT_ENABLE_EXTENDED"
    else:
        kw["fast_path"] = False
    sess, how = graphopt.open_session(written, **kw)
    assert not how["fast_path"] and how["model"] == "model.onnx" and why in how["why"]
    np.testing.assert_allclose(
        sess.run(None, feeds())[0], portable_outputs(written)[0], rtol=1e-5, atol=1e-5
    )


def test_run_says_why_the_fast_path_was_not_used(written, monkeypatch):
    monkeypatch.setattr(bundle, "cpu_features", lambda: ("sse2",))
    res = invoke("run", written)
    assert res.exit_code == 0 and "fast path not used: built on a CPU" in res.stdout
    assert "model.onnx" in invoke("run", written, "--portable").stdout


def test_a_fast_path_onnxruntime_refuses_falls_back(written):
    (written / bundle.FAST_MODEL).write_bytes(b"not a model")
    sess, how = graphopt.open_session(written, verify="none")
    assert not how["fast_path"] and "onnxruntime refused it" in how["why"]
    assert sess.run(None, feeds())[0].shape == (2, 1024)


def test_no_fast_path_when_onnxruntime_cannot_save_it(wide, tmp_path, monkeypatch):
    real = bundle._session

    def refuses_to_save(*args, **kw):
        if kw.get("save_to") or len(args) > 7:
            raise bundle.GraphoptError("onnxruntime cannot save this graph")
        return real(*args, **kw)

    monkeypatch.setattr(bundle, "_session", refuses_to_save)
    optimized, report = graphopt.optimize(wide, target="cpu")
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    fast = json.loads((out / "manifest.json").read_text())["fast_path"]
    assert not fast["written"] and "cannot save this graph" in fast["why"]
    assert not (out / bundle.FAST_MODEL).exists()
    monkeypatch.undo()
    sess, how = graphopt.open_session(out)
    assert not how["fast_path"] and "the bundle has none" in how["why"]
    assert sess.run(None, feeds())[0].shape == (2, 1024)


def test_fast_path_without_golden_inputs_is_checked_on_random_ones(wide, tmp_path):
    optimized, report = graphopt.optimize(wide, target="cpu", check=False)
    out = graphopt.write_bundle(optimized, report, tmp_path / "b", fast_path=True)  # asked for
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["golden"]["written"]
    assert manifest["fast_path"]["written"]
    assert "seeded random inputs" in manifest["fast_path"]["verified"]["against"]
    assert graphopt.open_session(out)[1]["fast_path"]


def test_fast_path_only_for_cpu_by_default(wide, tmp_path):
    optimized, report = graphopt.optimize(wide, target="cuda")
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    fast = json.loads((out / "manifest.json").read_text())["fast_path"]
    assert not fast["written"] and "cuda" in fast["why"]
    assert not (out / bundle.FAST_MODEL).exists()


def test_fast_path_refused_for_external_data(wide, tmp_path):
    ext = tmp_path / "ext.onnx"
    m = onnx.load(wide)
    onnx.save(m, ext, save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin")
    optimized, report = graphopt.optimize(ext, target="cpu")
    out = graphopt.write_bundle(optimized, report, tmp_path / "b")
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["fast_path"]["written"] and "external data" in manifest["fast_path"]["why"]
    assert set(manifest["integrity"]["files"]) == {"model.onnx", *manifest["external_data"]}
    data = out / manifest["external_data"][0]
    offset, _ = bundle.sampled_blocks(data.stat().st_size)[9]
    flip(data, offset)
    with pytest.raises(graphopt.GraphoptError, match="does not match"):
        graphopt.load_session(out)

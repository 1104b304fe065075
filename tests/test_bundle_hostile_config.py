"""Tampered bundles: a session config or manifest onnxruntime would crash on or misread, a path
that leads out of the bundle, a file that is not a regular file, corrupt golden arrays.  Each is
refused before onnxruntime sees it, with one line and exit 1 (a corrupt bundle)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_hostile_inputs import one_line as _one_line

import graphopt.targets.bundle as bundle
from cli_runner import CliRunner
from conftest import vi
from graphopt.cli import app
from graphopt.opt.graph.io import file_sha256

runner = CliRunner()
OPSETS = [helper.make_opsetid("", 17)]


def one_line(res) -> str:
    """The one stderr line of a run that exited 1 (a corrupt bundle)."""
    return _one_line(res, 1)


def in_own_process(*args) -> str:
    """``graphopt ARGS`` in a process of its own: a crash or a hang there fails the test only."""
    code = "import sys; from graphopt.cli import console; sys.argv[0] = 'graphopt'; console()"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"graphopt {' '.join(map(str, args))} hung")
    assert out.returncode == 1, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    return lines[0]


@pytest.fixture
def bundle_dir(tmp_path):
    """The cpu bundle of a one-Relu model (input ``x`` [N, 64]), with x.npz beside it."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu", [vi("x", ["N", 64])], [vi("y", ["N", 64])]
    )
    onnx.save(helper.make_model(g, opset_imports=OPSETS), tmp_path / "r.onnx")
    out = tmp_path / "b"
    res = runner.invoke(app, ["optimize", tmp_path / "r.onnx", "-o", out, "-q", "--no-measure"])
    assert res.exit_code == 0, res.output
    np.savez(tmp_path / "x.npz", x=np.ones((2, 64), np.float32))
    return out


def edit(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def run(b, *extra):
    return runner.invoke(app, ["run", b, "--inputs", b.parent / "x.npz", *extra])


# ------------------------------------------------------------------ session options
@pytest.mark.parametrize("key", ["intra_op_num_threads", "inter_op_num_threads", "kernel_threads"])
@pytest.mark.parametrize("value", [2**40, -1])
def test_a_thread_count_out_of_range_is_refused_naming_it(bundle_dir, key, value):
    edit(bundle_dir / "session_config.json", lambda c: c.update({key: value}))
    said = one_line(run(bundle_dir, "--verify", "none"))
    assert f"'{key}' is {value}, not a thread count from 0 to {bundle.MAX_THREADS}" in said


def test_a_hundred_thousand_threads_are_refused_not_a_crash(bundle_dir):
    edit(bundle_dir / "session_config.json", lambda c: c.update(intra_op_num_threads=100000))
    said = in_own_process("run", bundle_dir, "--inputs", bundle_dir.parent / "x.npz")
    assert "'intra_op_num_threads' is 100000" in said


def test_a_sane_thread_count_still_runs(bundle_dir):
    edit(bundle_dir / "session_config.json", lambda c: c.update(intra_op_num_threads=2))
    assert run(bundle_dir).exit_code == 0


@pytest.mark.parametrize(
    "entries,said",
    [
        ({"": "v"}, "'session_config_entries' has an empty key"),
        ({"k" * 1025: "1"}, "is 1025 bytes, more than onnxruntime's 1024"),
        ({"session.x": "v" * 8193}, "its value is 8193 bytes, more than onnxruntime's 8192"),
        ({"session.x": 1}, "'session_config_entries.session.x' is an integer, not a string"),
        (
            {"session.model_external_initializers_file_folder_path": "/"},
            "names a file or folder for onnxruntime to read or write",
        ),
        ({"ep.context_file_path": "../x.onnx"}, "names a file or folder"),
    ],
)
def test_a_config_entry_onnxruntime_refuses_is_refused_first(bundle_dir, entries, said):
    edit(bundle_dir / "session_config.json", lambda c: c.update(session_config_entries=entries))
    assert said in one_line(run(bundle_dir))


@pytest.mark.parametrize(
    "file,change,said",
    [
        (
            "session_config.json",
            lambda d: d.update(custom_op_libraries=["kernels/cpu/lib.so"]),
            "'custom_op_libraries' is a list, not an object or null",
        ),
        (
            "session_config.json",
            lambda d: d.update(custom_op_libraries={"CPUExecutionProvider": ["a.so"]}),
            "'custom_op_libraries.CPUExecutionProvider' is a list, not a string",
        ),
        (
            "manifest.json",
            lambda d: d.update(kernels={"libraries": ["x"]}),
            "'kernels.libraries' is a list, not an object",
        ),
        (
            "manifest.json",
            lambda d: d.update(kernels={"libraries": {"CPUExecutionProvider": {"path": 3}}}),
            "'kernels.libraries.CPUExecutionProvider.path' is an integer, not a string",
        ),
    ],
)
def test_library_sections_of_the_wrong_type_are_refused(bundle_dir, file, change, said):
    edit(
        bundle_dir / "session_config.json",
        lambda c: c.update(custom_op_libraries={"CPUExecutionProvider": "kernels/cpu/x.so"}),
    )
    edit(bundle_dir / file, change)
    assert said in one_line(run(bundle_dir))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_vouched_library_onnxruntime_cannot_register_is_refused_with_its_path(bundle_dir):
    folder = bundle_dir / "kernels" / "cpu"
    folder.mkdir(parents=True)
    (folder / "l.c").write_text("int graphopt_nothing(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", folder / "l.so", folder / "l.c"], check=True)
    rel = "kernels/cpu/l.so"
    edit(
        bundle_dir / "session_config.json",
        lambda c: c.update(custom_op_libraries={"CPUExecutionProvider": rel}),
    )
    lib = {"path": rel, "sha256": file_sha256(bundle_dir / rel), "march": None}
    edit(
        bundle_dir / "manifest.json",
        lambda m: m.update(kernels={"libraries": {"CPUExecutionProvider": lib}}),
    )
    said = one_line(run(bundle_dir))
    assert "refused to load the library" in said and "l.so" in said
    assert "RegisterCustomOps" in said


# ------------------------------------------------------------------ JSON nested too deep
@pytest.mark.parametrize(
    "file,text",
    [
        ("manifest.json", "[" * 100000 + "]" * 100000),
        ("manifest.json", '{"a": ' * 100000 + "1" + "}" * 100000),
        ("session_config.json", "[" * 100000 + "]" * 100000),
    ],
)
def test_json_nested_too_deep_is_a_corrupt_bundle(bundle_dir, file, text):
    (bundle_dir / file).write_text(text)
    assert f"corrupt bundle: {file} is nested too deep" in one_line(run(bundle_dir))


# ------------------------------------------------------------------ golden arrays
def npy_bytes(array) -> bytes:
    """An .npy file's bytes: an array that is not an .npz archive."""
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.mark.parametrize(
    "write,said",
    [
        (lambda p: p.write_bytes(b"\x93NUMPY" + b"\xff" * 100), "not an .npz archive"),
        (lambda p: p.write_bytes(b"PK\x03\x04garbage"), "corrupt bundle file"),
        (lambda p: np.savez(p, x=np.array([{"a": 1}], dtype=object)), "Object arrays"),
        (lambda p: p.write_bytes(npy_bytes(np.ones(3))), "not an .npz archive"),
    ],
)
def test_corrupt_golden_inputs_are_refused_with_the_file(bundle_dir, write, said):
    write(bundle_dir / "golden" / "inputs.npz")
    line = one_line(runner.invoke(app, ["run", bundle_dir]))
    assert "golden/inputs.npz: corrupt bundle file" in line and said in line


# ------------------------------------------------------------------ regular files only
@pytest.mark.parametrize(
    "name", ["model.onnx", "model.machine.onnx", "session_config.json", "golden/outputs.npz"]
)
def test_a_bundle_file_that_is_a_fifo_is_refused_without_blocking(bundle_dir, name):
    (bundle_dir / name).unlink()
    os.mkfifo(bundle_dir / name)
    said = in_own_process("run", bundle_dir, "--verify", "none")
    assert f"'{name}' is a FIFO, not a regular file" in said


def test_a_bundle_file_that_is_a_folder_is_refused(bundle_dir):
    (bundle_dir / "model.onnx").unlink()
    (bundle_dir / "model.onnx").mkdir()
    said = one_line(run(bundle_dir, "--portable", "--verify", "none"))
    assert "'model.onnx' is a directory, not a regular file" in said


# ------------------------------------------------------------------ paths out of the bundle
@pytest.mark.parametrize(
    "change,said",
    [
        (lambda m: m.update(model="../outside.onnx"), "manifest.json 'model' '../outside.onnx'"),
        (lambda m: m.update(model="/etc/passwd"), "manifest.json 'model' '/etc/passwd'"),
        (lambda m: m["fast_path"].update(files=["/etc/passwd"]), "'fast_path.files'"),
        (lambda m: m.update(external_data=["../outside.onnx"]), "'external_data'"),
    ],
)
def test_a_path_the_manifest_names_outside_the_bundle_is_refused(bundle_dir, change, said):
    shutil.copy(bundle_dir / "model.onnx", bundle_dir.parent / "outside.onnx")
    edit(bundle_dir / "manifest.json", change)
    for extra in ([], ["--verify", "none"], ["--portable", "--verify", "none"]):
        line = one_line(run(bundle_dir, *extra))
        assert said in line and "it is outside the bundle" in line


def test_a_bundle_model_linked_out_of_the_bundle_is_refused(bundle_dir):
    outside = bundle_dir.parent / "outside.onnx"
    shutil.copy(bundle_dir / "model.onnx", outside)
    (bundle_dir / "model.onnx").unlink()
    (bundle_dir / "model.onnx").symlink_to(outside)
    said = one_line(run(bundle_dir, "--portable", "--verify", "none"))
    assert "refused model.onnx 'model.onnx': it is outside the bundle" in said


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_external_data_of_the_bundle_model_outside_the_bundle_is_refused(bundle_dir, where):
    """model.onnx replaced by one reading its weights from a file beside the bundle, the manifest
    updated to match: refused whatever --verify says, whichever model runs."""
    secret = bundle_dir.parent / "secret.bin"
    secret.write_bytes(bytes(range(256)))
    w = numpy_helper.from_array(np.ones((1, 64), np.float32), "W")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    location = str(secret) if where == "absolute" else "../secret.bin"
    w.external_data.add(key="location", value=location)
    w.external_data.add(key="length", value="256")
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "add",
        [vi("x", ["N", 64])],
        [vi("y", ["N", 64])],
        [w],
    )
    model = bundle_dir / "model.onnx"
    model.write_bytes(helper.make_model(g, opset_imports=OPSETS).SerializeToString())
    record = {
        "size": model.stat().st_size,
        "sha256": file_sha256(model),
        "fingerprint": bundle.fingerprint(model),
    }

    def vouch(manifest):
        manifest["model_sha256"] = record["sha256"]
        manifest["integrity"]["files"]["model.onnx"] = record

    edit(bundle_dir / "manifest.json", vouch)
    for extra in ([], ["--verify", "none"], ["--portable", "--verify", "none"], ["--portable"]):
        said = one_line(run(bundle_dir, *extra))
        assert f"external data location '{location}' escapes the model directory" in said

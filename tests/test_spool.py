"""The output written whole one weight at a time (opt/graph/spool.py): the very bytes of
SerializeToString, its sha256, where each weight lies; onnxruntime loading the model from that
file; and the validity check writing the output once, for the bundle to move into place."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graphopt
from conftest import EXAMPLES, const, model, vi
from graphopt.cli import app
from graphopt.opt import optimizer
from graphopt.opt.errors import ModelSaveError
from graphopt.opt.graph.spool import SpoolDir, session_skeleton, spool
from graphopt.opt.verify.parity import Session, make_inputs

EXAMPLE_MODELS = sorted(EXAMPLES.glob("*.onnx"))  # a CNN, a BERT, a super-resolution net, If/Loop


@pytest.mark.parametrize("path", EXAMPLE_MODELS, ids=lambda p: p.stem)
def test_the_spooled_file_is_the_serialized_model(path, tmp_path):
    m = onnx.load(path)
    written = spool(m, tmp_path)
    data = m.SerializeToString()
    assert written.path.read_bytes() == data
    assert written.size == len(data)
    assert written.sha256 == hashlib.sha256(data).hexdigest()
    assert len(written.spans) == len(m.graph.initializer)
    for tensor, span in zip(m.graph.initializer, written.spans):
        if tensor.HasField("raw_data"):
            offset, length = span
            assert data[offset : offset + length] == tensor.raw_data
        else:
            assert span is None


def test_tensors_of_every_form_are_written_as_serialized(tmp_path):
    """raw bytes, typed fields (no raw_data), fields after raw_data, a field onnx does not know
    (that tensor is written whole, its raw bytes found by their header)."""
    raw = const("raw", np.arange(600, dtype=np.float32))
    raw.doc_string = "after raw_data"  # field 12
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    strange = onnx.TensorProto.FromString(
        const("strange", np.ones(300, np.float32)).SerializeToString() + bytes([0xF8, 0x3E, 7])
    )  # + field 999, a varint
    nodes = [helper.make_node("Add", ["raw", "raw"], ["y"])]
    m = model(nodes, [], [vi("y", [600])], [raw, typed, strange])
    written = spool(m, tmp_path)
    data = m.SerializeToString()
    assert written.path.read_bytes() == data
    (a, n), none, (b, k) = written.spans
    assert none is None
    assert data[a : a + n] == raw.raw_data and data[b : b + k] == strange.raw_data


def test_a_model_that_cannot_be_written_in_pieces_is_left_to_the_caller(tmp_path):
    m = onnx.load(EXAMPLES / "mobilenet_bn.onnx")
    unknown = m.SerializeToString() + bytes([999 << 3 & 0x7F | 0x80, 999 >> 4, 1])  # field 999
    strange = onnx.ModelProto.FromString(unknown)
    assert spool(strange, tmp_path) is None
    graphless = onnx.ModelProto(ir_version=8)
    assert spool(graphless, tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # nothing left behind


@pytest.mark.parametrize("name", ["mobilenet_bn", "bert_tiny"])
def test_onnxruntime_loads_the_model_from_the_spooled_file(name, tmp_path):
    m = onnx.load(EXAMPLES / f"{name}.onnx")
    written = spool(m, tmp_path)
    skeleton = session_skeleton(m, written)
    external = [t for t in skeleton.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert external and all(not t.HasField("raw_data") for t in external)
    assert skeleton.ByteSize() < written.size / 10  # the weights are not in it
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as Session
    whole = ort.InferenceSession(m.SerializeToString(), options, ["CPUExecutionProvider"])
    feeds = make_inputs(whole, {}, seed=0)
    mapped = Session(skeleton, base_dir=tmp_path)
    for a, b in zip(whole.run(None, feeds), mapped.run(feeds)):
        np.testing.assert_array_equal(a, b)


W = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)


def matmul_model() -> onnx.ModelProto:
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    return model([node], [vi("x", [4, 64])], [vi("y", [4, 64])], [const("w", W)])


def test_an_invalid_output_leaves_no_spooled_file(tmp_path):
    holder = optimizer.Serialized(SpoolDir(tmp_path))
    bad = matmul_model()
    bad.graph.node[0].domain = "com.example.none"  # the checker skips it; onnxruntime refuses
    bad.opset_import.append(helper.make_opsetid("com.example.none", 1))
    assert "cannot load" in optimizer._invalid(bad, into=holder)
    assert holder.spooled is None and list(holder.folder.path.iterdir()) == []
    good = matmul_model()
    assert optimizer._invalid(good, into=holder) is None
    first = holder.spooled.path
    assert first.read_bytes() == good.SerializeToString()
    again = matmul_model()
    assert optimizer._invalid(again, into=holder) is None
    assert not first.exists() and holder.model is again  # only the latest is held
    holder.folder.cleanup()
    assert not holder.folder.path.exists()


def test_the_bundle_moves_the_spooled_model_beside_it(tmp_path):
    from cli_runner import CliRunner

    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["optimize", str(src), "-o", str(out), "--no-check", "-q"])
    assert res.exit_code == 0, res.output
    written = out / "model.onnx"
    mode = stat.S_IMODE(written.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # a new file's permissions, not a temporary's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out"]  # no spool left
    loaded = onnx.load(written)
    assert {p.key for p in loaded.metadata_props} >= {"graphopt.pipeline", "graphopt.target"}


def test_the_library_spools_into_the_temporary_folder_and_cleans_up(tmp_path):
    out, report = graphopt.optimize(matmul_model(), check=False)
    spool_dir = optimizer.run_of(report).serialized.folder
    assert optimizer.run_of(report).serialized.spooled.path.parent == spool_dir.path
    graphopt.write_bundle(out, report, tmp_path / "b")
    assert list(spool_dir.path.iterdir()) == []  # moved into the bundle
    folder = spool_dir.path
    del spool_dir
    assert not folder.exists()  # the folder goes with the last reference to it


def test_a_full_disk_is_a_save_error_with_nothing_left_behind(tmp_path, monkeypatch):
    """It was an internal error (exit 1, 'OSError: No space left on device') from the spool."""
    from cli_runner import CliRunner

    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)
    real = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, _data):
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: Full(real(fd, mode, *a, **k)))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["optimize", str(src), "-o", str(out), "--no-check", "-q"])
    assert res.exit_code == ModelSaveError.exit_code, res.output
    assert "No space left on device" in res.stderr and "internal error" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no spool, no bundle


@pytest.mark.parametrize("inline", [0, 1000, 1 << 30])
def test_the_hash_is_the_files_whether_pieces_are_hashed_inline_or_on_the_thread(
    inline, tmp_path, monkeypatch
):
    """Small pieces are hashed where they are written, large ones on the thread behind the
    write, slice by slice (weights of several slices included): one sha256 of the file."""
    from graphopt.opt.graph import spool as spool_module

    monkeypatch.setattr(spool_module, "INLINE_HASH", inline)
    monkeypatch.setattr(spool_module, "SLICE", 4096)
    big = const("big", np.arange(5000, dtype=np.float32))  # 20 kB: five slices
    small = const("small", np.arange(10, dtype=np.float32))
    nodes = [
        helper.make_node("Add", ["big", "big"], ["y"]),
        helper.make_node("Neg", ["small"], ["z"]),
    ]
    m = model(nodes, [], [vi("y", [5000]), vi("z", [10])], [big, small])
    written = spool(m, tmp_path)
    data = m.SerializeToString()
    assert written.path.read_bytes() == data
    assert written.sha256 == hashlib.sha256(data).hexdigest()


def test_the_spool_folder_is_beside_an_output_whose_folders_do_not_exist_yet(tmp_path):
    final = tmp_path / "a" / "b" / "out"
    spool_dir = SpoolDir.beside(final)
    assert spool_dir.path.parent == final.parent  # the same file system: moved, not copied
    spool_dir.cleanup()
    assert list(tmp_path.iterdir()) == []  # the folders it made, still empty, are gone
    spool_dir = SpoolDir.beside(final)
    final.mkdir()  # the output was written there
    spool_dir.cleanup()
    assert final.is_dir() and not spool_dir.path.exists()


def test_a_nested_new_output_folder_gets_the_spooled_model_moved_in(tmp_path, monkeypatch):
    from cli_runner import CliRunner
    from graphopt.opt.graph import spool as spool_module

    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)
    made = []
    mkdtemp = spool_module.tempfile.mkdtemp
    monkeypatch.setattr(
        spool_module.tempfile, "mkdtemp", lambda **kw: made.append(kw.get("dir")) or mkdtemp(**kw)
    )
    out = tmp_path / "x" / "y" / "out"
    res = CliRunner().invoke(app, ["optimize", str(src), "-o", str(out), "--no-check", "-q"])
    assert res.exit_code == 0, res.output
    assert (out / "model.onnx").is_file()
    # spooled beside it (not in the temporary folder): renamed into place
    assert {Path(d).resolve() for d in made} == {out.parent.resolve()}  # and the staging
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]

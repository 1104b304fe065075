"""Loading and saving: bad files give one clear error; external data stays inside its folder."""

import os

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import const, model, vi
from graphopt.opt.errors import ModelLoadError
from graphopt.opt.io import load_model, save_model


def small():
    return model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [vi("x", [2, 64])],
        [vi("y", [2, 64])],
        [const("W", np.ones((64, 64)))],
    )


@pytest.mark.parametrize("content", [b"", b"hello, not onnx", os.urandom(2000)])
def test_garbage_is_refused(tmp_path, content):
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    with pytest.raises(ModelLoadError):
        load_model(p)


def test_truncated_file_is_refused(tmp_path):
    data = small().SerializeToString()
    p = tmp_path / "trunc.onnx"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError):
        load_model(p)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "nope.onnx")


def test_external_data_round_trip(tmp_path):
    p = tmp_path / "m.onnx"
    save_model(small(), p, external=True)
    assert (tmp_path / "m.onnx.data").exists()
    m = load_model(p)
    w = [t for t in m.graph.initializer if t.name == "W"][0]
    assert np.array_equal(onnx.numpy_helper.to_array(w), np.ones((64, 64), np.float32))
    assert not list(tmp_path.glob(".graphopt-*")), "temporary files left behind"


@pytest.mark.parametrize("location", ["/etc/passwd", "../outside.data", "sub/../../x.data"])
def test_escaping_external_data_is_refused(tmp_path, location):
    m = small()
    w = m.graph.initializer[0]
    w.data_location = onnx.TensorProto.EXTERNAL
    w.ClearField("raw_data")
    w.ClearField("float_data")
    w.external_data.add(key="location", value=location)
    p = tmp_path / "m.onnx"
    p.write_bytes(m.SerializeToString())
    with pytest.raises(ModelLoadError, match="escapes|outside"):
        load_model(p)


def test_symlink_escape_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "w.data").write_bytes(b"\0" * 64 * 64 * 4)
    inside = tmp_path / "model"
    inside.mkdir()
    os.symlink(outside / "w.data", inside / "w.data")
    m = small()
    w = m.graph.initializer[0]
    w.data_location = onnx.TensorProto.EXTERNAL
    w.ClearField("raw_data")
    w.ClearField("float_data")
    w.external_data.add(key="location", value="w.data")
    (inside / "m.onnx").write_bytes(m.SerializeToString())
    with pytest.raises(ModelLoadError, match="outside"):
        load_model(inside / "m.onnx")


def test_missing_and_short_external_data(tmp_path):
    p = tmp_path / "m.onnx"
    save_model(small(), p, external=True)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(p)
    data.unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(p)

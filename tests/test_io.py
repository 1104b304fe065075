"""Loading and saving: bad files give one clear error; external data stays inside its folder."""

import os

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import const, model, vi
from graphopt.opt.errors import ModelLoadError
from graphopt.opt.graph.io import load_model, save_model


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


def test_lazy_external_data_stays_on_disk_and_output_is_self_contained(tmp_path):
    """Optimizing a model with external data reads no weight it does not need, and writes a
    bundle whose data file is its own (it survives moving; the input's file is untouched)."""
    import shutil

    import graphopt
    from cli_runner import CliRunner
    from graphopt.cli import app
    from graphopt.opt.graph import ir as ir_module

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Identity", ["h"], ["i"]),
        helper.make_node("Add", ["i", "b"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [2, 256])],
        [vi("y", [2, 256])],
        [const("W", rng.standard_normal((256, 256))), const("b", rng.standard_normal(256))],
    )
    src = tmp_path / "in" / "m.onnx"
    save_model(m, src, external=True)
    data_before = (tmp_path / "in" / "m.onnx.data").read_bytes()

    loaded = []
    real_load = ir_module.ExternalValues.load

    def spy(self):
        loaded.append(self.tensor.name)
        return real_load(self)

    ir_module.ExternalValues.load = spy
    try:
        out, report = graphopt.optimize(src)
    finally:
        ir_module.ExternalValues.load = real_load
    assert report.parity.ok and "W" not in loaded  # the 256 KiB weight was never read
    assert [n.op_type for n in out.graph.node] == ["Gemm"]

    res = CliRunner().invoke(app, ["optimize", str(src), "-o", str(tmp_path / "b"), "-q"])
    assert res.exit_code == 0, res.output
    moved = tmp_path / "elsewhere"
    shutil.move(str(tmp_path / "b"), moved)
    out_model = onnx.load(moved / "model.onnx", load_external_data=False)
    locations = {
        e.value for t in out_model.graph.initializer for e in t.external_data if e.key == "location"
    }
    assert locations == {"model.onnx.data"}
    reloaded = load_model(moved / "model.onnx")
    w = {t.name: onnx.numpy_helper.to_array(t) for t in reloaded.graph.initializer}
    assert np.array_equal(w["W"], onnx.numpy_helper.to_array(m.graph.initializer[0]))
    assert (tmp_path / "in" / "m.onnx.data").read_bytes() == data_before

"""Tensors stored in ways few exporters use, on load: sparse initializers are made dense (as
onnxruntime reads them) and optimized with parity; an element type ONNX does not define, an
initializer stored in segments and a NUL byte in an external-data location are refused with
one line and exit 1 (not an internal error)."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from cli_runner import CliRunner
from conftest import vi
from graphopt.cli import app

runner = CliRunner()
OPSET = [helper.make_opsetid("", 17)]


def _save(graph, path):
    m = helper.make_model(graph, opset_imports=OPSET)
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("coordinates", [False, True], ids=["linear", "coordinates"])
def test_a_sparse_initializer_is_made_dense_and_optimized(tmp_path, coordinates):
    values = numpy_helper.from_array(np.array([1.5, -2.0, 3.0], np.float32), "W")
    at = [[0, 0], [1, 1], [1, 3]] if coordinates else [0, 5, 7]
    sparse = helper.make_sparse_tensor(
        values, numpy_helper.from_array(np.array(at, np.int64)), [2, 4]
    )
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [vi("x", [3, 2])],
        [vi("y", [3, 4])],
        sparse_initializer=[sparse],
    )
    src = _save(g, tmp_path / "m.onnx")
    res = runner.invoke(app, ["optimize", str(src), "-o", str(tmp_path / "b"), "--no-measure"])
    assert res.exit_code == 0, res.output
    out = onnx.load(tmp_path / "b" / "model.onnx")
    assert not out.graph.sparse_initializer
    w = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}["W"]
    want = np.zeros((2, 4), np.float32)
    want.reshape(-1)[[0, 5, 7]] = [1.5, -2.0, 3.0]
    np.testing.assert_array_equal(w, want)


def _odd(kind: str, tmp_path):
    c = numpy_helper.from_array(np.ones(4, np.float32), "c")
    x = vi("x", [4])
    if kind == "elem-type":
        x.type.tensor_type.elem_type = 999
    elif kind == "init-type":
        c.data_type = 999
    elif kind == "segment":
        c.segment.begin, c.segment.end = 0, 4
    elif kind == "nul-location":
        c.ClearField("raw_data")
        c.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", "w\x00.bin"), ("offset", "0"), ("length", "16")):
            c.external_data.add(key=k, value=v)
    g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g", [x], [vi("y", [4])])
    g.initializer.append(c)
    return _save(g, tmp_path / "m.onnx")


@pytest.mark.parametrize(
    "kind, said",
    [
        ("elem-type", "'x' has element type 999, which ONNX does not define"),
        ("init-type", "initializer 'c' has element type 999"),
        ("segment", "initializer 'c' is stored in segments"),
        ("nul-location", "external data location contains a NUL byte"),
    ],
)
@pytest.mark.parametrize("command", ["optimize", "lint"])
def test_odd_tensors_are_refused_in_one_line(tmp_path, kind, said, command):
    src = _odd(kind, tmp_path)
    args = [command, str(src)] + (["-o", str(tmp_path / "b")] if command == "optimize" else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    assert said in res.stderr and "internal error" not in res.stderr, res.stderr

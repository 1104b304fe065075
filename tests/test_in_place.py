"""Weights left in their model file (opt/graph/io.py, load_model(lazy_external=True) on a large
file): the model is read without its large weights, each a reference to where its bytes lie in the
file; what is optimized and written is the same as when the file is read whole."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_runner import CliRunner
from conftest import EXAMPLES, const, vi
from graphopt.cli import app
from graphopt.opt.errors import ModelLoadError
from graphopt.opt.graph import io

EXAMPLE_MODELS = sorted(EXAMPLES.glob("*.onnx"))


@pytest.fixture
def in_place(monkeypatch):
    """Every file is large enough, every weight of 1 KiB or more is left in place."""
    monkeypatch.setenv("GRAPHOPT_IN_PLACE_ABOVE", "0")
    monkeypatch.setattr(io, "IN_PLACE_BYTES", 1024)


def weights(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


@pytest.mark.parametrize("path", EXAMPLE_MODELS, ids=lambda p: p.stem)
def test_large_weights_are_left_in_the_file_and_read_back_the_same(path, in_place):
    whole = onnx.load(path)
    lazy = io.load_model(path, lazy_external=True, in_place=True)
    left = [t for t in lazy.graph.initializer if io.is_in_place(t)]
    assert left and not io.has_data_files(lazy) and not io.needs_external_data(lazy)
    assert all(io.tensor_nbytes(t) >= 1024 for t in left)
    kept = {t.name for t in lazy.graph.initializer if not io.is_in_place(t)}
    assert all(io.tensor_nbytes(t) < 1024 for t in whole.graph.initializer if t.name in kept)
    expected = weights(whole)
    for t in left:
        src, offset, length = io.in_place_region(t)
        assert src == path.resolve()
        with open(src, "rb") as f:
            f.seek(offset)
            raw = f.read(length)
        original = next(w for w in whole.graph.initializer if w.name == t.name)
        assert raw == original.raw_data and list(t.dims) == list(original.dims)
    lazy_nodes = [n.SerializeToString() for n in lazy.graph.node]
    assert lazy_nodes == [n.SerializeToString() for n in whole.graph.node]
    assert len(lazy.graph.initializer) == len(expected)


@pytest.mark.parametrize("path", EXAMPLE_MODELS, ids=lambda p: p.stem)
def test_the_bundle_is_the_same_as_when_the_file_is_read_whole(path, tmp_path, monkeypatch):
    def run(out, above):
        monkeypatch.setenv("GRAPHOPT_IN_PLACE_ABOVE", str(above))
        args = ["optimize", str(path), "-o", str(out), "-q", "--no-measure"]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        report = json.loads((out / "report.json").read_text())
        return (out / "model.onnx").read_bytes(), report

    monkeypatch.setattr(io, "IN_PLACE_BYTES", 1024)
    whole, whole_report = run(tmp_path / "whole", 1 << 40)
    lazy, lazy_report = run(tmp_path / "lazy", 0)
    assert lazy == whole
    assert lazy_report["remarks"] == whole_report["remarks"]
    assert lazy_report["parity"]["ok"] and whole_report["parity"]["ok"]
    manifest = json.loads((tmp_path / "lazy" / "manifest.json").read_text())
    assert manifest["source_model_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_tensors_that_are_not_plain_weights_stay_inline(tmp_path, in_place):
    values = np.arange(600, dtype=np.float32)
    plain = const("plain", values)
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [600], values.tolist())  # float_data
    short = const("short", values)
    short.raw_data = short.raw_data[:-4]  # fewer bytes than its dims need
    strings = helper.make_tensor("strings", TensorProto.STRING, [300], [b"x" * 8] * 300)
    nodes = [helper.make_node("Add", ["plain", "typed"], ["y"])]
    graph = helper.make_graph(nodes, "g", [], [vi("y", [600])], [plain, typed, short, strings])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    lazy = io.load_model(path, lazy_external=True, in_place=True, check=False)
    assert [io.is_in_place(t) for t in lazy.graph.initializer] == [True, False, False, False]


def test_a_broken_file_is_refused_as_before(tmp_path, in_place):
    data = (EXAMPLES / "mobilenet_bn.onnx").read_bytes()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        io.load_model(path, lazy_external=True, in_place=True)


def test_weights_in_an_external_file_stay_there(tmp_path, in_place):
    m = onnx.load(EXAMPLES / "mobilenet_bn.onnx")
    onnx.save_model(m, tmp_path / "m.onnx", save_as_external_data=True, location="m.data")
    lazy = io.load_model(tmp_path / "m.onnx", lazy_external=True, in_place=True)
    assert io.has_data_files(lazy)
    assert not any(io.is_in_place(t) for t in lazy.graph.initializer)


def _moved_into_a_node(m: onnx.ModelProto) -> onnx.ModelProto:
    """``m`` with its initializer ``w`` moved into a Constant node (as a pass may move a weight
    into a node or a subgraph)."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    w = next(t for t in out.graph.initializer if t.name == "w")
    node = helper.make_node("Constant", [], ["w"], value=w)
    kept = [t for t in out.graph.initializer if t.name != "w"]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    out.graph.node.insert(0, node)
    return out


def test_a_weight_moved_out_of_the_initializers_is_written_as_read(tmp_path, in_place):
    from graphopt.opt.graph.spool import spool

    nodes = [helper.make_node("Add", ["x", "w"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [vi("x", [600])], [vi("y", [600])], [const("w", np.arange(600.0))]
    )
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    lazy = _moved_into_a_node(io.load_model(path, lazy_external=True, in_place=True))
    whole = _moved_into_a_node(onnx.load(path))
    assert io.is_in_place(lazy.graph.node[0].attribute[0].t)
    assert spool(lazy, tmp_path) is None  # not written piece by piece: materialized instead
    out = tmp_path / "out"
    out.mkdir()
    io.write_model_files(lazy, out / "model.onnx", external=False, base_dir=tmp_path)
    assert (out / "model.onnx").read_bytes() == whole.SerializeToString()


def test_a_weight_read_from_the_file_is_not_kept_mapped(tmp_path, in_place):
    """A rule reading a weight left in the file gets its values for that use: the constant keeps
    its reference, not a mapping of the file (the graph is reference cycles: a mapping kept
    there holds its pages until the cyclic collector frees the whole graph)."""
    from onnx_graphsurgeon.ir.tensor import LazyValues

    from graphopt.opt.graph import ir

    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # 16 KiB: below UNCACHED_BYTES
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [vi("x", [2, 64])], [vi("y", [2, 64])], [const("w", w)])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    model = io.load_model(src, lazy_external=True, in_place=True)
    assert io.is_in_place(model.graph.initializer[0])
    graph_ir = ir.ModelIR(model, tmp_path)
    weight = next(t for t in graph_ir.graph.tensors().values() if t.name == "w")
    assert np.array_equal(ir.constant_value(weight), w)
    assert isinstance(weight._values, LazyValues)  # not replaced by the mapped array


@pytest.mark.parametrize("inline", [0, 1 << 30])
def test_weights_copied_from_their_file_through_two_buffers_hash_as_written(
    inline, tmp_path, in_place, monkeypatch
):
    """A weight left in its file is copied into the spooled output a block at a time, through
    two buffers in turn while the last block is hashed on the thread: the bytes and the sha256
    are the file's, whatever the weights' sizes against the block."""
    from graphopt.opt.graph import spool as spool_module

    monkeypatch.setattr(spool_module, "COPY_BLOCK", 4096)
    monkeypatch.setattr(spool_module, "INLINE_HASH", inline)
    rng = np.random.default_rng(0)
    sizes = [1000, 1024, 3000, 7777]  # under, at, over and across several blocks (floats)
    inits = [const(f"w{i}", rng.standard_normal(n).astype(np.float32)) for i, n in enumerate(sizes)]
    nodes = [helper.make_node("Neg", [f"w{i}"], [f"y{i}"]) for i in range(len(sizes))]
    outputs = [vi(f"y{i}", [n]) for i, n in enumerate(sizes)]
    m = helper.make_model(
        helper.make_graph(nodes, "g", [], outputs, inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    lazy = io.load_model(path, lazy_external=True, in_place=True)
    assert sum(io.is_in_place(t) for t in lazy.graph.initializer) == 4
    written = spool_module.spool(lazy, tmp_path)
    data = written.path.read_bytes()
    assert written.sha256 == hashlib.sha256(data).hexdigest()
    assert onnx.load_model_from_string(data) == onnx.load(path)

"""Weights stay where they are: external tensors are memory-mapped on use; a model without
external data skips the mapping walk altogether."""

from __future__ import annotations

import numpy as np
from onnx import helper

from conftest import const, model, vi
from graphopt.opt import ir as irmod
from graphopt.opt.io import load_model, save_model
from graphopt.opt.ir import ExternalValues, ModelIR


def small():
    return model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [vi("x", [2, 64])],
        [vi("y", [2, 64])],
        [const("W", np.arange(64 * 64).reshape(64, 64) / 4096)],
    )


def test_external_weights_are_mapped_lazily(tmp_path):
    save_model(small(), tmp_path / "m.onnx", external=True)
    m = load_model(tmp_path / "m.onnx", lazy_external=True)
    ir = ModelIR(m, tmp_path)
    w = ir.graph.tensors()["W"]
    assert isinstance(w._values, ExternalValues)
    assert np.allclose(np.asarray(w.values), np.arange(64 * 64).reshape(64, 64) / 4096)


def test_inline_weights_skip_the_mapping_walk(tmp_path, monkeypatch):
    def refuse(*_a):
        raise AssertionError("walked every tensor of a model without external data")

    monkeypatch.setattr(irmod, "_map_external_values", refuse)
    save_model(small(), tmp_path / "m.onnx", external=False)
    m = load_model(tmp_path / "m.onnx", lazy_external=True)
    ir = ModelIR(m, tmp_path)
    assert ir.graph.tensors()["W"].values.shape == (64, 64)


def test_files_are_hashed_while_written(tmp_path):
    import hashlib

    from graphopt.opt.io import write_model_files

    for external in (False, True):
        out = tmp_path / ("ext" if external else "inline")
        out.mkdir()
        hashes = write_model_files(small(), out / "model.onnx", external=external)
        names = {"model.onnx", "model.onnx.data"} if external else {"model.onnx"}
        assert set(hashes) == names == {p.name for p in out.iterdir()}
        for name, digest in hashes.items():
            assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    # streamed again from the external file it now references: same weights, same data file
    m = load_model(tmp_path / "ext" / "model.onnx", lazy_external=True)
    again = write_model_files(m, tmp_path / "again.onnx", external=True, base_dir=tmp_path / "ext")
    assert again["again.onnx.data"] == hashes["model.onnx.data"]

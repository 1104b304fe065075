"""Weights stay where they are: external tensors are memory-mapped on use; a model without
external data skips the mapping walk altogether."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from conftest import const, model, vi
from graphopt.opt.graph import ir as irmod
from graphopt.opt.graph.io import load_model, save_model
from graphopt.opt.graph.ir import ExternalValues, ModelIR


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

    from graphopt.opt.graph.io import write_model_files

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


def _two_weights():
    rng = np.random.default_rng(0)
    return model(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("MatMul", ["h", "V"], ["y"]),
        ],
        [vi("x", [2, 64])],
        [vi("y", [2, 64])],
        [const("W", rng.standard_normal((64, 64))), const("V", rng.standard_normal((64, 64)))],
    )


@pytest.mark.parametrize("kernel", ["copies", "cannot", "copies part", "no call"])
def test_external_data_copied_by_the_kernel_or_by_hand_alike(tmp_path, monkeypatch, kernel):
    """External regions go through copy_file_range where it works and by reads and writes for
    what it did not copy: the same file and the same sha256 either way."""
    import hashlib
    import os

    from graphopt.opt.graph.io import write_model_files

    src = tmp_path / "src"
    src.mkdir()
    write_model_files(_two_weights(), src / "model.onnx", external=True)
    m = load_model(src / "model.onnx", lazy_external=True)
    real = os.copy_file_range
    if kernel == "cannot":
        monkeypatch.setattr(
            os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(18, "x"))
        )
    elif kernel == "copies part":  # 1000 bytes, then the file system refuses

        def part(s, d, n, o, p, calls=[]):  # noqa: B006 - counts the calls
            calls.append(n)
            if len(calls) > 1:
                raise OSError(18, "cross-device")
            return real(s, d, min(n, 1000), o, p)

        monkeypatch.setattr(os, "copy_file_range", part)
    elif kernel == "no call":
        monkeypatch.delattr(os, "copy_file_range")
    out = tmp_path / "out"
    out.mkdir()
    hashes = write_model_files(m, out / "model.onnx", external=True, base_dir=src)
    data = (out / "model.onnx.data").read_bytes()
    assert hashes["model.onnx.data"] == hashlib.sha256(data).hexdigest()
    assert data == (src / "model.onnx.data").read_bytes()
    again = load_model(out / "model.onnx")
    assert {t.name for t in again.graph.initializer} == {"W", "V"}

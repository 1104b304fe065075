"""Generated kernels are on by default for the fusion presets on cpu/cuda: a machine without a
compiler gets a remark, never an error; --no-kernels and GRAPHOPT_NO_KERNELS turn them off."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import EXAMPLES, const, model, vi
from graphopt.cli import app
from graphopt.opt.rewrite.pipeline import preset, with_kernels
from graphopt.targets.codegen import NO_KERNELS_ENV, kernel_pipeline, kernels_by_default

runner = CliRunner()


def gated(tmp_path):
    """x·σ(x·s+t) after a Conv, per-channel s and t: one element-wise region of four nodes."""
    rng = np.random.default_rng(0)
    inits = [
        const("W", rng.standard_normal((8, 8, 1, 1)) * 0.3),
        const("s", rng.standard_normal((8, 1, 1))),
        const("t", rng.standard_normal((8, 1, 1))),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        helper.make_node("Mul", ["c", "s"], ["m"], name="mul_s"),
        helper.make_node("Add", ["m", "t"], ["a"], name="add_t"),
        helper.make_node("Sigmoid", ["a"], ["g"], name="sig"),
        helper.make_node("Mul", ["c", "g"], ["y"], name="gate"),
    ]
    p = tmp_path / "gated.onnx"
    onnx.save(model(nodes, [vi("x", [1, 8, 8, 8])], [vi("y", [1, 8, 8, 8])], inits), p)
    return p


def optimize(src, out, *flags):
    res = runner.invoke(app, ["optimize", str(src), "-o", str(out), "-q", *flags])
    assert res.exit_code == 0, res.output
    return json.loads((out / "report.json").read_text())


def test_kernel_pipeline_default_and_flags(default_on, monkeypatch):
    with_pass = with_kernels(preset(2))
    assert kernel_pipeline("cpu", 2, None, None) == with_pass
    assert kernel_pipeline("cuda", 3, None, None) == with_kernels(preset(3))
    assert kernel_pipeline("tensorrt", 2, None, None) is None  # no generator for it
    assert kernel_pipeline("cpu", 1, None, None) is None  # exact cleanups only
    assert kernel_pipeline("cpu", 2, "cse,legalize", None) == "cse,legalize"  # as written
    assert kernel_pipeline("cpu", 2, "cse,legalize", True) == "cse,fuse-elementwise,legalize"
    assert kernel_pipeline("cpu", 2, None, False) is None
    monkeypatch.setenv(NO_KERNELS_ENV, "1")
    assert not kernels_by_default("cpu", 2)
    assert kernel_pipeline("cpu", 2, None, None) is None
    assert kernel_pipeline("cpu", 2, None, True) == with_pass


def test_no_compiler_is_a_remark_never_an_error(default_on, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHOPT_NO_COMPILER", "1")
    report = optimize(gated(tmp_path), tmp_path / "b")
    assert "fuse-elementwise" in report["pipeline"]
    missed = [r for r in report["remarks"] if r["rule"] == "fuse-elementwise"]
    assert missed and {r["code"] for r in missed} == {"no-compiler"}
    assert not (tmp_path / "b" / "kernels").exists()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_kernels_by_default_and_no_kernels(default_on, faster, tmp_path):
    src = gated(tmp_path)
    report = optimize(src, tmp_path / "on")
    assert any(op.startswith("graphopt.fused.") for op in report["ops_after"])
    assert (tmp_path / "on" / "kernels" / "kernels.json").is_file()
    report = optimize(src, tmp_path / "off", "--no-kernels")
    assert "fuse-elementwise" not in report["pipeline"]
    assert not (tmp_path / "off" / "kernels").exists()


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.onnx")))
def test_every_example_optimizes_with_kernels_on(default_on, tmp_path, name):
    """The shipped examples as users run them: kernels on (their gates' models must load)."""
    report = optimize(EXAMPLES / f"{name}.onnx", tmp_path / "b", "--target", "cpu", "--no-check")
    assert report["passes"]

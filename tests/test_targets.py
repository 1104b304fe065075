"""Target profiles as data: the four targets, their tables and documents, `graphopt targets`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx
import pytest

from cli_runner import CliRunner
from graphopt.cli import app
from graphopt.opt.rewrite.target import TARGETS, get_target
from graphopt.targets.describe import describe_target
from graphopt.targets.profiles import DOCUMENTS, pinned_document

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "targets" / "data"
NAMES = ["cpu", "cuda", "tensorrt", "npu"]

# Default-domain ops in TensorRT's support matrix that current ONNX no longer defines (removed
# experimental ops TensorRT's parser still accepts).
TRT_NON_ONNX = {"ImageScaler", "ParametricSoftplus", "ScaledTanh"}


@pytest.mark.parametrize("name", NAMES)
def test_profile_is_complete(name):
    t = get_target(name)
    assert t.runtime and t.runtime_version and t.kernels_source and t.description
    assert t.kernels(), "empty kernel table"
    assert t.tolerances["float32"] and t.tolerances["float16"]
    assert t.prefers.get("pixel-shuffle") == "DepthToSpace"
    assert isinstance(t.disabled_rules, frozenset) and isinstance(t.approximations, frozenset)


def test_the_four_targets_are_registered():
    assert set(NAMES) <= set(TARGETS)


def test_tensorrt_table_is_standard_onnx_only():
    trt = get_target("tensorrt")
    domains = {d for (_, d) in trt.kernels()}
    assert domains == {""}
    for op in ("Conv", "LayerNormalization", "DepthToSpace", "Erf", "Gelu", "Attention"):
        assert trt.has_kernel(op, "", 17 if op not in ("Gelu", "Attention") else 24), op
    assert not trt.has_kernel("Gelu", "com.microsoft", 1)
    assert not trt.has_kernel("Conv", "", 25)  # the document's range is opset 9..24
    assert trt.has_kernel("Add", "", 17, "tensor(int64)")
    assert not trt.has_kernel("Add", "", 17, "tensor(double)")  # cast down, not a kernel type


def test_tensorrt_document_records_its_source():
    doc = pinned_document("tensorrt_ops.json")
    assert "onnx/onnx-tensorrt" in doc["source"] and "docs/operators.md" in doc["source"]
    assert doc["runtime_version"] == "TensorRT 10.15" and "commit" in doc
    ops = [k["op"] for k in doc["kernels"]]
    assert len(ops) == len(set(ops)) == 158
    unsupported = {u["op"] for u in doc["unsupported"]}
    assert not unsupported & set(ops)
    assert {"NonZero", "TopK"} <= set(ops) and {"Unique", "Det"} <= unsupported
    for op in ops:
        assert onnx.defs.has(op) or op in TRT_NON_ONNX, op
    for k in doc["kernels"]:
        assert (k["since"], k["end"]) == (9, 24) and k["domain"] == ""
        assert all(t.startswith("tensor(") for t in k["types"])


def test_npu_table():
    npu = get_target("npu")
    assert npu.static_shapes and not npu.providers
    for op in ("Conv", "DepthToSpace", "Resize", "HardSwish", "BatchNormalization", "Softmax"):
        assert npu.has_kernel(op, "", 17, "tensor(float16)"), op
        assert npu.has_kernel(op, "", 17, "tensor(int8)"), op
    for op in ("Erf", "LayerNormalization", "Gather", "Shape", "Gelu"):
        assert not npu.has_kernel(op, "", 17), op
    assert not npu.has_kernel("Conv", "", 10) and not npu.has_kernel("Conv", "", 22)
    assert not npu.has_kernel("Conv", "", 17, "tensor(double)")
    doc = pinned_document("npu_ops.json")
    assert doc["source"].startswith("synthetic")


def test_cuda_falls_back_to_cpu_and_cpu_measures_its_preference():
    assert get_target("cuda").fallback == "cpu"
    cpu = get_target("cpu")
    assert "measured" in cpu.prefers_why["pixel-shuffle"]
    # The session level is a load-time setting (the saved model stays portable).
    assert cpu.session["graph_optimization_level"] == "ORT_ENABLE_ALL"


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_documents_exist_for_pinned_tables(name):
    doc = pinned_document(DOCUMENTS[name])
    assert {"source", "notes", "kernels"} <= set(doc)
    assert (DATA / DOCUMENTS[name]).exists()


def test_describe_target():
    d = describe_target("tensorrt")
    assert d["profile"]["providers"] == ["TensorrtExecutionProvider"]
    resize = next(k for k in d["kernels"] if k["op"] == "Resize")
    assert "nearest" in resize["restrictions"]
    d = describe_target("cpu")
    assert any(k["domain"] == "com.microsoft" for k in d["kernels"]) and not d["document"]


def test_cli_lists_targets():
    res = runner.invoke(app, ["targets", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert [r["name"] for r in json.loads(res.output)][:4] == NAMES


def test_cli_shows_one_target():
    res = runner.invoke(app, ["targets", "show", "cuda", "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["name"] == "cuda" and data["document"]["commit"]
    assert any(k["op"] == "BiasGelu" and k["domain"] == "com.microsoft" for k in data["kernels"])
    res = runner.invoke(app, ["targets", "show", "npu"])
    assert res.exit_code == 0 and "DepthToSpace" in res.output and "static_shapes" in res.output


@pytest.mark.parametrize("args", [["targets", "show", "nope"], ["targets", "bogus"]])
def test_cli_targets_usage_errors(args):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output


def test_a_fusion_runs_in_float16_where_the_runtime_casts_around_what_it_replaces():
    """onnxruntime cpu runs a float16 node with only a float kernel inside casts to float: a
    fused node may take the place of one that ran that way, never of one with a float16
    kernel (that would add casts), and a runtime that does not cast needs the kernel itself."""
    cpu = get_target("cpu")
    f16 = "tensor(float16)"
    assert cpu.fp16_via_float and not cpu.has_kernel("FusedConv", "com.microsoft", 1, f16)
    assert cpu.runs_via_float("Conv", "", 17, f16)
    assert cpu.runs_fused("FusedConv", "com.microsoft", 1, f16, ("Conv", "", 17))
    assert cpu.runs_fused("FusedConv", "com.microsoft", 1, "tensor(float)", ("Conv", "", 17))
    assert cpu.has_kernel("LayerNormalization", "", 17, f16)
    assert not cpu.runs_via_float("LayerNormalization", "", 17, f16)
    assert not cpu.runs_via_float("Conv", "", 17, "tensor(bfloat16)")  # float16 only
    assert not cpu.runs_fused("Gelu", "com.microsoft", 1, f16, ("LayerNormalization", "", 17))
    native = dataclasses.replace(cpu, fp16_via_float=False)
    assert not native.runs_fused("FusedConv", "com.microsoft", 1, f16, ("Conv", "", 17))

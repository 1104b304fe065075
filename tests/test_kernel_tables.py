"""The pinned onnxruntime kernel tables in targets/data, checked against what we can check here.

* ``cuda_kernels.json``: the CUDAExecutionProvider section of onnxruntime's docs/OperatorKernels.md.
  No CUDA build of onnxruntime is available, so it is checked for shape, for op names that
  ONNX / onnxruntime actually define, and for facts the document states.
* ``cpu_kernels_doc.json``: the CPUExecutionProvider section of the same document, compared with
  the live CPU registry of the installed onnxruntime.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import onnx
import pytest

DATA = Path(__file__).resolve().parents[1] / "targets" / "data"
INT_MAX = 2**31 - 1
TOP_LEVEL = {"source", "onnxruntime_version", "commit", "provider", "notes", "kernels"}
ENTRY_FIELDS = {"op", "domain", "since", "end", "types"}

# Default-domain ops in onnxruntime's document that ONNX itself does not define (or no longer
# defines). onnxruntime registers kernels for them in the ai.onnx domain, with its own schemas:
# removed experimental ops, its internal Memcpy ops, and its SimplifiedLayerNormalization.
ORT_DEFINED_DEFAULT_DOMAIN_OPS = {
    "Affine",
    "Crop",
    "DynamicSlice",
    "ImageScaler",
    "MemcpyFromHost",
    "MemcpyToHost",
    "ParametricSoftplus",
    "Scale",
    "ScaledTanh",
    "SimplifiedLayerNormalization",
}


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cuda() -> dict:
    return _load("cuda_kernels.json")


@pytest.fixture(scope="module")
def cpu_doc() -> dict:
    return _load("cpu_kernels_doc.json")


def _ops(table: dict, domain: str) -> set[str]:
    return {k["op"] for k in table["kernels"] if k["domain"] == domain}


def _ort_schemas() -> set[tuple[str, str]]:
    from onnxruntime.capi import _pybind_state as C

    schemas = C.get_all_operator_schema()
    return {("" if s.domain == "ai.onnx" else s.domain, s.name) for s in schemas}


def _live_cpu_kernels():
    from onnxruntime.capi import _pybind_state as C

    return [k for k in C.get_all_opkernel_def() if k.provider == "CPUExecutionProvider"]


@pytest.mark.parametrize(
    "name, provider",
    [
        ("cuda_kernels.json", "CUDAExecutionProvider"),
        ("cpu_kernels_doc.json", "CPUExecutionProvider"),
    ],
)
def test_table_shape(name: str, provider: str) -> None:
    table = _load(name)
    assert set(table) == TOP_LEVEL
    assert table["source"] == "microsoft/onnxruntime docs/OperatorKernels.md"
    assert table["provider"] == provider
    assert len(table["commit"]) == 40 and int(table["commit"], 16) >= 0
    assert table["onnxruntime_version"] and table["notes"]
    assert table["kernels"]
    for k in table["kernels"]:
        assert set(k) == ENTRY_FIELDS, k
        assert isinstance(k["op"], str) and k["op"], k
        assert isinstance(k["domain"], str), k
        assert k["domain"] != "ai.onnx", "the default domain is written ''"
        assert isinstance(k["since"], int) and k["since"] >= 1, k
        assert k["end"] is None or (isinstance(k["end"], int) and k["end"] >= k["since"]), k
        assert k["types"] and all(isinstance(t, str) and t.endswith(")") for t in k["types"]), k
        assert k["types"] == sorted(set(k["types"])), k


@pytest.mark.parametrize("name", ["cuda_kernels.json", "cpu_kernels_doc.json"])
def test_version_ranges_are_consistent(name: str) -> None:
    """Per op, the document lists ranges newest first, and bounded ranges do not overlap."""
    rows = defaultdict(list)
    for k in _load(name)["kernels"]:
        rows[(k["domain"], k["op"])].append((k["since"], k["end"]))
    for key, ranges in rows.items():
        starts = [s for s, _ in ranges]
        assert starts == sorted(starts, reverse=True) and len(set(starts)) == len(starts), key
        for (newer_since, _), (_, end) in zip(ranges, ranges[1:], strict=False):
            if end is not None:
                assert end < newer_since, (key, ranges)


def test_cuda_version_interpretation(cuda: dict) -> None:
    """'N+' is open-ended, '[a, b]' is closed and a bare 'N' is exactly opset N (see notes)."""
    rng = defaultdict(set)
    for k in cuda["kernels"]:
        rng[(k["domain"], k["op"])].add((k["since"], k["end"]))
    assert rng[("", "Add")] == {(14, None), (13, 13), (7, 12)}
    # A bare number on an op's newest row is still a single opset: Upsample is deprecated at 10.
    assert rng[("", "Upsample")] == {(9, 9), (7, 8)}
    # The document really does list ThresholdedRelu as both "10+" and "1+".
    assert rng[("", "ThresholdedRelu")] == {(10, None), (1, None)}


def test_cuda_default_domain_ops_are_real(cuda: dict) -> None:
    ops = _ops(cuda, "")
    not_onnx = {op for op in ops if not onnx.defs.has(op)}
    # Anything ONNX does not define must be one of onnxruntime's own default-domain ops, and the
    # notes must say so; nothing is dropped from the table.
    unexpected = sorted(not_onnx - ORT_DEFINED_DEFAULT_DOMAIN_OPS)
    assert not unexpected, unexpected
    for op in not_onnx:
        assert op in cuda["notes"], op
    schemas = _ort_schemas()
    missing = sorted(op for op in not_onnx if ("", op) not in schemas)
    assert not missing, f"no onnxruntime schema in the default domain for {missing}"


def test_cuda_contrib_ops_have_onnxruntime_schemas(cuda: dict) -> None:
    schemas = _ort_schemas()
    for domain in {k["domain"] for k in cuda["kernels"]} - {""}:
        missing = sorted(op for op in _ops(cuda, domain) if (domain, op) not in schemas)
        assert not missing, (domain, missing)


def test_cuda_contrib_ops_as_documented(cuda: dict, cpu_doc: dict) -> None:
    ms = _ops(cuda, "com.microsoft")
    for op in (
        "FusedMatMul",
        "BiasGelu",
        "SkipLayerNormalization",
        "Attention",
        "MultiHeadAttention",
        "BiasAdd",
        "BiasSoftmax",
        "GroupNorm",
    ):
        assert op in ms, op
    # The document lists FusedGemm under the CPU provider only.
    assert "FusedGemm" not in ms
    assert "FusedGemm" in _ops(cpu_doc, "com.microsoft")
    assert {k["domain"] for k in cuda["kernels"]} == {"", "com.microsoft", "com.ms.internal.nhwc"}


def test_cpu_doc_matches_live_registry(cpu_doc: dict) -> None:
    live = _live_cpu_kernels()
    live_default = {k.op_name for k in live if k.domain in ("", "ai.onnx")}
    doc_default = _ops(cpu_doc, "")
    assert len(doc_default) > 150
    registered = doc_default & live_default
    assert len(registered) >= 0.9 * len(doc_default), sorted(doc_default - live_default)

    live_all = {("" if k.domain == "ai.onnx" else k.domain, k.op_name) for k in live}
    doc_all = {(k["domain"], k["op"]) for k in cpu_doc["kernels"]}
    assert len(doc_all & live_all) >= 0.9 * len(doc_all), sorted(doc_all - live_all)


def test_cuda_table_loads_as_a_target_kernel_table() -> None:
    from graphopt.targets.profiles import pinned_kernels

    table = pinned_kernels("cuda_kernels.json")
    assert (
        14,
        None,
        frozenset(
            {
                "tensor(bfloat16)",
                "tensor(double)",
                "tensor(float)",
                "tensor(float16)",
                "tensor(int16)",
                "tensor(int32)",
                "tensor(int64)",
                "tensor(int8)",
                "tensor(uint16)",
                "tensor(uint32)",
                "tensor(uint64)",
                "tensor(uint8)",
            }
        ),
    ) in table[("Add", "")]
    assert ("FusedGemm", "com.microsoft") not in table


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_no_lowering_picks_an_onnxruntime_defined_default_domain_op(target: str) -> None:
    """The tables list onnxruntime's own default-domain ops (SimplifiedLayerNormalization is
    where its CPU fusion puts an RMSNorm), but a model using one fails onnx.checker: the shared
    lowering never picks them and names the next choice or why there is none."""
    from types import SimpleNamespace

    from graphopt.opt.rewrite.engine import NoMatch
    from graphopt.opt.rewrite.target import TARGETS
    from graphopt.rules.activation import MS, lowering

    t = TARGETS[target]
    cx = SimpleNamespace(ir=SimpleNamespace(opset=17), target=t)
    listed = [op for op in sorted(ORT_DEFINED_DEFAULT_DOMAIN_OPS) if t.has_kernel(op, "", 17)]
    assert "SimplifiedLayerNormalization" in listed  # the tables do know them
    for op in listed:
        with pytest.raises(NoMatch):
            lowering(cx, [(op, "", None, {})], "tensor(float)", op)
    choices = [("SimplifiedLayerNormalization", "", None, {})]
    choices.append(("SkipSimplifiedLayerNormalization", MS, None, {}))
    assert lowering(cx, choices, "tensor(float)", "RMSNorm")[:2] == (
        "SkipSimplifiedLayerNormalization",
        MS,
    )

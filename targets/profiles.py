"""The target profiles, as data: which runtime, which kernels, which tolerances.

* ``cpu``: onnxruntime's CPU execution provider; its kernel table is read live from the
  installed onnxruntime's registry, so it is always the truth for this machine.
* ``cuda``: onnxruntime's CUDA execution provider; its kernel table is a pinned snapshot
  (``data/cuda_kernels.json``) transcribed from onnxruntime's documented kernel list.
"""

from __future__ import annotations

import json
from importlib import resources

import onnxruntime as ort

from graphopt.opt.errors import GraphoptError
from graphopt.opt.parity import DEFAULT_TOLERANCES
from graphopt.opt.target import KernelTable, Target, register_target


def _add(
    table: KernelTable, op: str, domain: str, since: int, end: int | None, types: frozenset[str]
) -> None:
    table.setdefault((op, "" if domain in ("", "ai.onnx") else domain), []).append(
        (since, end, types)
    )


def live_cpu_kernels() -> KernelTable:
    """The CPU provider's kernel registry of the installed onnxruntime."""
    from onnxruntime.capi import _pybind_state as C

    table: KernelTable = {}
    for k in C.get_all_opkernel_def():
        if k.provider != "CPUExecutionProvider":
            continue
        since, end = k.version_range
        types = frozenset(t for ts in k.type_constraints.values() for t in ts)
        _add(table, k.op_name, k.domain, since, None if end >= 2**31 - 1 else end, types)
    return table


def pinned_kernels(filename: str) -> KernelTable:
    """A kernel table transcribed from onnxruntime's documentation (see the file's 'source')."""
    try:
        data = json.loads(
            resources.files("graphopt.targets").joinpath("data", filename).read_text()
        )
    except FileNotFoundError:
        raise GraphoptError(f"kernel table {filename} is missing from the installation") from None
    table: KernelTable = {}
    for k in data["kernels"]:
        _add(
            table,
            k["op"],
            k["domain"],
            int(k["since"]),
            None if k.get("end") is None else int(k["end"]),
            frozenset(k.get("types", ())),
        )
    return table


CPU = register_target(
    Target(
        name="cpu",
        description="onnxruntime CPU execution provider",
        runtime=f"onnxruntime {ort.__version__}",
        providers=("CPUExecutionProvider",),
        kernels_source="live: onnxruntime.capi._pybind_state.get_all_opkernel_def()",
        load_kernels=live_cpu_kernels,
        tolerances=DEFAULT_TOLERANCES,
    )
)

CUDA = register_target(
    Target(
        name="cuda",
        description="onnxruntime CUDA execution provider",
        runtime=f"onnxruntime {ort.__version__} (CUDA EP)",
        providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
        kernels_source="pinned: targets/data/cuda_kernels.json "
        "(onnxruntime docs/OperatorKernels.md)",
        load_kernels=lambda: pinned_kernels("cuda_kernels.json"),
        tolerances=DEFAULT_TOLERANCES,
        fp32_accumulation={
            "Gemm": "onnxruntime's CUDA Gemm calls cublasGemmEx for fp16 with 32-bit compute "
            "(CUBLAS_COMPUTE_32F) unless ORT_CUDA_GEMM_OPTIONS selects 16-bit compute",
        },
        device_available="CUDAExecutionProvider" in ort.get_available_providers(),
    )
)

"""Build the custom-op libraries for a set of kernels, and write them into a bundle.

* :func:`cpu_library` / :func:`cuda_library`: generate, build (cached, see ``toolchain``) and
  report: which kernel loops gcc vectorized; registers and spills per CUDA kernel and arch.
* :func:`resolve` is registered with :mod:`graphopt.opt.verify.customops` for domain
  ``graphopt.fused``: any onnxruntime session graphopt opens on a model with fused nodes gets
  the CPU library of exactly those kernels (the same library whatever the target: a cuda model's
  fused nodes run their CPU semantics here).
* :func:`write_kernels` puts ``kernels/cpu/`` (and ``kernels/cuda/`` for cuda) into a bundle:
  source, the ABI header, ``build.sh``, the library built *there* by running ``build.sh``, the
  build log and a ``kernels.json`` report; returns the manifest section.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from graphopt.opt.errors import GraphoptError
from graphopt.opt.verify.customops import register_domain

from . import cpu, cuda
from .ort_abi import API_INDEX, ORT_API_VERSION
from .spec import DOMAIN, KernelSpec, specs_of
from .toolchain import Build, BuildError, build, cpu_march, find_compiler


class NoCompiler(GraphoptError):
    """No compiler for the kernels (none installed, or hidden by GRAPHOPT_NO_COMPILER)."""


@dataclass
class CpuLibrary:
    build: Build
    source: cpu.CSource
    march: str
    command: list[str]
    #: op type -> whether gcc vectorized its loop
    vectorized: dict[str, bool] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.build.library


@dataclass
class CudaLibrary:
    build: Build
    source: cuda.CudaSource
    command: list[str]
    #: op type -> {arch: {registers, spill_stores, spill_loads, stack_bytes}}
    resources: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.build.library


def cpu_command(compiler: str, source: cpu.CSource, march: str, *, selftest: bool = False):
    return [
        compiler,
        *source.flags,
        f"-march={march}",
        "-fopt-info-vec-optimized",
        *(["-DGO_ABI_SELFTEST"] if selftest else []),
        "-o",
        cpu.LIBRARY,
        cpu.SOURCE,
        "-lm",
    ]


def cpu_library(
    specs: list[KernelSpec], *, math: str = "own", selftest: bool = False
) -> CpuLibrary:
    cc = find_compiler("cc")
    if cc is None:
        raise NoCompiler("no C compiler (gcc) found to build generated kernels")
    source = cpu.generate(specs, math=math)
    march = cpu_march()
    command = cpu_command(cc.path, source, march, selftest=selftest)
    files = {cpu.SOURCE: source.text, cpu.ABI_HEADER: cpu.header()}
    b = build(files, command, cpu.LIBRARY, cc)
    lines = cpu.vectorized_loops(b.log)
    vec = {op: line in lines for op, line in source.loop_lines.items()}
    return CpuLibrary(b, source, march, command, vec)


def cuda_library(specs: list[KernelSpec]) -> CudaLibrary:
    nvcc = find_compiler("nvcc")
    if nvcc is None:
        raise NoCompiler("no CUDA compiler (nvcc) found to build generated kernels")
    source = cuda.generate(specs)
    command = [nvcc.path, *cuda.flags(), "-o", cuda.LIBRARY, cuda.SOURCE]
    files = {cuda.SOURCE: source.text, cuda.ABI_HEADER: cuda.header()}
    b = build(files, command, cuda.LIBRARY, nvcc)
    by_symbol = cuda.ptxas_resources(b.log)
    res = {op: by_symbol.get(sym, {}) for op, sym in source.symbols.items()}
    return CudaLibrary(b, source, command, res)


# ------------------------------------------------------------------ session resolver
def resolve(model: onnx.ModelProto, provider: str) -> list[str]:
    """The CPU library of the model's fused kernels (built or cached)."""
    specs = specs_of(model)
    if not specs:
        return []
    try:
        return [str(cpu_library(specs).path)]
    except BuildError as e:
        raise GraphoptError(f"cannot build the model's graphopt.fused kernels: {e}") from None


register_domain(DOMAIN, resolve)


# ---------------------------------------------------------------------- bundle files
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _place_library(made: Build, folder: Path, library: str) -> tuple[float, str]:
    """The library and its build log into the bundle's ``folder``: copied from the build
    cache, where the same source, command and compiler made it (what ``build.sh`` runs; the
    cache key is exactly those), instead of compiling once more.  Returns (the build's seconds,
    its log)."""
    shutil.copyfile(made.library, folder / library)
    (folder / "build.log").write_text(made.log)
    return made.seconds, made.log


def _script(command: list[str], env_var: str) -> str:
    argv = [f'"${{{env_var}:-{Path(command[0]).name}}}"'] + [shlex.quote(a) for a in command[1:]]
    return (
        "#!/usr/bin/env bash\n"
        "# Rebuilds this folder's custom-op library (written by graphopt; run from this folder).\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n' + " ".join(argv) + " 2>&1 | tee build.log\n"
    )


def gate_results(remarks) -> dict[str, dict[str, Any]]:
    """Per op type: the gate numbers the fusion pass recorded in its passed remarks."""
    out: dict[str, dict[str, Any]] = {}
    for r in remarks or ():
        if r.rule == "fuse-elementwise" and r.kind == "passed" and "op_type" in r.args:
            entry = out.setdefault(r.args["op_type"], {"nodes": []})
            entry["nodes"].append(r.nodes[0] if r.nodes else None)
            entry.update({k: v for k, v in r.args.items() if k in ("gates", "expr")})
    return out


def write_kernels(out_dir: Path, model: onnx.ModelProto, target: str, remarks=()) -> dict:
    """Write and build ``kernels/`` for the model's fused nodes; the manifest's ``kernels``
    section ({} when the model has none).  Raises BuildError/NoCompiler on failure."""
    specs = specs_of(model)
    if not specs:
        return {}
    gates = gate_results(remarks)
    section: dict[str, Any] = {
        "domain": DOMAIN,
        "ort_api_version": ORT_API_VERSION,
        "ort_api_entries": dict(sorted(API_INDEX.items(), key=lambda kv: kv[1])),
        "libraries": {},
        "kernels": [],
    }
    # cpu: always (the cpu target runs it; a cuda bundle uses it to run its semantics here)
    lib = cpu_library(specs)
    folder = out_dir / "kernels" / "cpu"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / cpu.SOURCE).write_text(lib.source.text)
    (folder / cpu.ABI_HEADER).write_text(cpu.header())
    (folder / "build.sh").write_text(_script(lib.command, "CC"))
    os.chmod(folder / "build.sh", 0o755)
    seconds, log = _place_library(lib.build, folder, cpu.LIBRARY)
    vec_lines = cpu.vectorized_loops(log)
    section["libraries"]["CPUExecutionProvider"] = {
        "path": f"kernels/cpu/{cpu.LIBRARY}",
        "sha256": _sha256(folder / cpu.LIBRARY),
        "source": f"kernels/cpu/{cpu.SOURCE}",
        "build": "kernels/cpu/build.sh",
        "build_log": "kernels/cpu/build.log",
        "compiler": lib.build.command[0],
        "flags": list(lib.command[1:]),
        "march": lib.march,
        "build_seconds": round(seconds, 3),
        "role": "runs the kernels" if target == "cpu" else "runs the kernels' semantics on CPU",
    }
    cuda_lib = None
    if target == "cuda":
        cuda_lib = cuda_library(specs)
        cfolder = out_dir / "kernels" / "cuda"
        cfolder.mkdir(parents=True, exist_ok=True)
        (cfolder / cuda.SOURCE).write_text(cuda_lib.source.text)
        (cfolder / cuda.ABI_HEADER).write_text(cuda.header())
        (cfolder / "build.sh").write_text(_script(cuda_lib.command, "NVCC"))
        os.chmod(cfolder / "build.sh", 0o755)
        cseconds, clog = _place_library(cuda_lib.build, cfolder, cuda.LIBRARY)
        by_symbol = cuda.ptxas_resources(clog)
        cuda_lib.resources = {op: by_symbol.get(s, {}) for op, s in cuda_lib.source.symbols.items()}
        (cfolder / "resources.json").write_text(
            json.dumps(cuda_lib.resources, indent=2, sort_keys=True)
        )
        section["libraries"]["CUDAExecutionProvider"] = {
            "path": f"kernels/cuda/{cuda.LIBRARY}",
            "sha256": _sha256(cfolder / cuda.LIBRARY),
            "source": f"kernels/cuda/{cuda.SOURCE}",
            "build": "kernels/cuda/build.sh",
            "build_log": "kernels/cuda/build.log",
            "resources": "kernels/cuda/resources.json",
            "compiler": cuda_lib.build.command[0],
            "flags": list(cuda_lib.command[1:]),
            "archs": list(cuda.ARCHS) + [cuda.PTX_ARCH + " (PTX)"],
            "build_seconds": round(cseconds, 3),
            "device": "not-run",
        }
    for spec in specs:
        g = gates.get(spec.op_type, {})
        entry: dict[str, Any] = {
            "op_type": spec.op_type,
            "expr": spec.expr.text(),
            "dtype": spec.dtype,
            "channel_axis": spec.channel_axis,
            "nodes": g.get("nodes", []),
            "cpu": {
                "loop_line": lib.source.loop_lines[spec.op_type],
                "vectorized": lib.source.loop_lines[spec.op_type] in vec_lines,
            },
            "gates": g.get("gates"),
        }
        if cuda_lib is not None:
            entry["cuda"] = {
                "device": "not-run",
                "variants": {
                    v.dtype: {
                        "op_type": v.op_type,
                        "symbol": cuda_lib.source.symbols[v.op_type],
                        "resources": cuda_lib.resources.get(v.op_type, {}),
                        "launch": {"block": cuda.BLOCK, "grid": "min(ceil(n/256), 4096)"},
                    }
                    for v in cuda.variants([spec])
                },
            }
        section["kernels"].append(entry)
    (out_dir / "kernels" / "kernels.json").write_text(json.dumps(section, indent=2, sort_keys=True))
    return section

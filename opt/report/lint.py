"""``graphopt lint``: the pitfalls of real exports, each with the fix.

Checks (codes are stable):
  initializer-as-input   weights listed as graph inputs (keep_initializers_as_inputs=True): they
                         become runtime inputs and block Conv+BN and other folds
  unknown-domain         a custom-domain op without an opset import, or without any schema
  old-opset              opset below what the target's fused ops need (LayerNormalization: 17)
  unused-initializer     initializers nothing reads
  duplicate-weights      identical initializers stored more than once
  fp16-subnormal         fp16 weights below 6.1e-5 (subnormal: slow on some hardware, imprecise)
  fp16-saturated         fp16 weights at ±65504 or infinite
  cast-ping-pong         Cast→Cast chains (a narrowing round trip loses values; an exact one is
                         dead weight)
  dynamic-dims           dynamic dims that block a fusion (from the optimizer's missed remarks)
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..graph.compat import weights_as_inputs
from ..graph.domains import is_default
from ..graph.ir import all_graphs

FP16_TINY = float(np.finfo(np.float16).tiny)  # smallest normal fp16, 6.1e-5
FP16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str  # "error" | "warning" | "info"
    message: str
    fix: str
    where: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lint(model: onnx.ModelProto, *, missed_remarks: list | None = None) -> list[Finding]:
    g = model.graph
    findings: list[Finding] = []
    inits = {t.name: t for t in g.initializer}
    inputs = [i.name for i in g.input]

    if not g.output:
        findings.append(
            Finding(
                "no-outputs",
                "error",
                "the graph declares no outputs: onnxruntime refuses to load it and every node "
                "of it is dead code",
                "declare the tensors the model computes as graph outputs when exporting",
                [],
            )
        )
    as_inputs = [n for n in inputs if n in inits]
    if as_inputs and model.ir_version >= 4:
        findings.append(
            Finding(
                "initializer-as-input",
                "warning",
                f"{len(as_inputs)} initializers are also graph inputs (exported with "
                "keep_initializers_as_inputs=True): they can be overridden at run time, "
                "so they are "
                "not constants and Conv+BN, MatMul+Add and other folds cannot use them",
                (
                    "graphopt optimize makes them constants itself (every initializer is listed: "
                    "the exporter flag's signature; --keep-initializer-inputs keeps them), or "
                    if weights_as_inputs(model)
                    else ""
                )
                + "graphopt lint MODEL --freeze-initializers -o FROZEN.onnx (changes the model's "
                "interface: those inputs disappear), or re-export with keep_initializers_as_inputs="
                "False",
                as_inputs[:20],
            )
        )

    imported = {o.domain or "" for o in model.opset_import}
    for graph in all_graphs(g):
        for n in graph.node:
            domain = n.domain or ""
            if is_default(domain):
                continue
            if domain not in imported:
                findings.append(
                    Finding(
                        "unknown-domain",
                        "error",
                        f"{n.op_type} '{n.name}' is in domain '{domain}', "
                        "which has no opset import",
                        f"add opset_import {{domain: '{domain}', version: N}} when exporting",
                        [n.name],
                    )
                )
            elif not _has_schema(n.op_type, domain):
                findings.append(
                    Finding(
                        "unknown-domain",
                        "warning",
                        f"{n.op_type} '{n.name}' ({domain}) has no schema known to onnx or "
                        "onnxruntime; it is passed through untouched and needs its custom-op "
                        "library at run time",
                        "register the op's schema/library with the runtime, or replace it",
                        [n.name],
                    )
                )

    opset = next((o.version for o in model.opset_import if is_default(o.domain)), 0)
    if opset < 17:
        findings.append(
            Finding(
                "old-opset",
                "info",
                f"default-domain opset {opset} predates LayerNormalization (17); normalization "
                "fusions will use onnxruntime's contrib ops or stay decomposed",
                "re-export with opset_version=17 or newer (or onnx.version_converter)",
                [],
            )
        )

    used = {i for graph in all_graphs(g) for n in graph.node for i in n.input}
    used |= {o.name for o in g.output}
    unused = [name for name in inits if name not in used]
    if unused:
        findings.append(
            Finding(
                "unused-initializer",
                "info",
                f"{len(unused)} initializers are never read "
                f"({sum(inits[n].ByteSize() for n in unused) / 2**20:.2f} MiB)",
                "graphopt optimize removes them (dce)",
                unused[:20],
            )
        )

    by_hash: dict[tuple, list[str]] = {}
    for t in g.initializer:
        if t.raw_data and len(t.raw_data) >= 1024:
            key = (t.data_type, tuple(t.dims), hashlib.sha1(t.raw_data).hexdigest())
            by_hash.setdefault(key, []).append(t.name)
    dups = [names for names in by_hash.values() if len(names) > 1]
    if dups:
        wasted = sum((len(n) - 1) * int(np.prod(k[1])) for k, n in by_hash.items() if len(n) > 1)
        findings.append(
            Finding(
                "duplicate-weights",
                "info",
                f"{sum(len(d) - 1 for d in dups)} initializers duplicate another "
                f"({wasted:,} elements stored twice), e.g. {', '.join(dups[0][:3])}",
                "share one initializer (tied embeddings exported twice are common)",
                [n for d in dups for n in d][:20],
            )
        )

    sub, sat = [], []
    for t in g.initializer:
        if t.data_type != onnx.TensorProto.FLOAT16:
            continue
        v = np.abs(numpy_helper.to_array(t).astype(np.float32))
        if np.any((v > 0) & (v < FP16_TINY)):
            sub.append(t.name)
        if np.any(v >= FP16_MAX):
            sat.append(t.name)
    if sub:
        findings.append(
            Finding(
                "fp16-subnormal",
                "warning",
                f"{len(sub)} fp16 initializers hold subnormal values (< {FP16_TINY:.2g})",
                "keep these tensors in fp32 (onnxconverter-common's node/op block lists) "
                "or rescale",
                sub[:20],
            )
        )
    if sat:
        findings.append(
            Finding(
                "fp16-saturated",
                "error",
                f"{len(sat)} fp16 initializers reach ±65504 or infinity (saturated in conversion)",
                "keep these tensors in fp32, or fix the overflowing values before conversion",
                sat[:20],
            )
        )

    findings += _cast_ping_pong(g)
    blocked = [r for r in (missed_remarks or []) if r.code in ("dynamic-shape", "dynamic-heads")]
    if blocked:
        findings.append(
            Finding(
                "dynamic-dims",
                "info",
                f"{len(blocked)} fusion attempts were blocked by dynamic dims "
                f"(rules: {', '.join(sorted({r.rule for r in blocked}))})",
                "pass static shapes for the deployment (--shape) or re-export with fixed axes "
                "where the deployment is static",
                [r.nodes[0] for r in blocked if r.nodes][:20],
            )
        )
    return findings


def _cast_ping_pong(g: onnx.GraphProto) -> list[Finding]:
    producer = {o: n for n in g.node for o in n.output}
    chains = []
    for n in g.node:
        if n.op_type != "Cast":
            continue
        p = producer.get(n.input[0])
        if p is not None and p.op_type == "Cast":
            chains.append(f"{p.name or p.output[0]}→{n.name or n.output[0]}")
    if not chains:
        return []
    return [
        Finding(
            "cast-ping-pong",
            "info",
            f"{len(chains)} Cast→Cast chains",
            "graphopt optimize fuses exact ones; a narrowing round trip (float→int→"
            "float) changes values and is kept: check it is intended",
            chains[:20],
        )
    ]


def _has_schema(op: str, domain: str) -> bool:
    try:
        onnx.defs.get_schema(op, domain=domain)
        return True
    except onnx.defs.SchemaError:
        return (op, domain) in _runtime_ops()


@functools.cache
def _runtime_ops() -> frozenset[tuple[str, str]]:
    from onnxruntime.capi import _pybind_state as C

    return frozenset((k.op_name, k.domain) for k in C.get_all_opkernel_def())


def freeze_initializers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Drop initializers from the graph inputs, making them constants (changes the interface)."""
    inits = {t.name for t in model.graph.initializer}
    frozen = [i.name for i in model.graph.input if i.name in inits]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    kept = [i for i in m.graph.input if i.name not in inits]
    del m.graph.input[:]
    m.graph.input.extend(kept)
    m.ir_version = max(m.ir_version, 4)
    return m, frozen

"""Custom-op libraries onnxruntime needs for models with nodes in generated domains.

Code generators (``graphopt.targets.codegen``) register a resolver per domain: given a model and
an execution provider, it returns the shared libraries implementing that domain's nodes (built
or found in its cache).  Every onnxruntime session graphopt opens on a model it may have
rewritten (parity, benchmarks, the runtime-load safety net) calls :func:`register_libraries`, so
a model with ``graphopt.fused`` nodes runs wherever graphopt runs it.  ``opt`` owns only the
registry; it knows nothing of how libraries are made.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import onnxruntime as ort

from ..graph.ir import all_graphs

#: (model, provider) -> paths of custom-op libraries to register
Resolver = Callable[[onnx.ModelProto, str], list[str]]

_RESOLVERS: dict[str, Resolver] = {}


def register_domain(domain: str, resolver: Resolver) -> None:
    _RESOLVERS[domain] = resolver


def domains_used(model: onnx.ModelProto) -> set[str]:
    return {n.domain for g in all_graphs(model.graph) for n in g.node}


def libraries_for(model: onnx.ModelProto, provider: str = "CPUExecutionProvider") -> list[str]:
    """Libraries to register for ``model`` on ``provider`` (empty for plain models)."""
    wanted = domains_used(model) & set(_RESOLVERS)
    paths: list[str] = []
    for domain in sorted(wanted):
        for p in _RESOLVERS[domain](model, provider):
            if p not in paths:
                paths.append(p)
    return paths


def register_libraries(
    so: ort.SessionOptions, model: onnx.ModelProto, provider: str = "CPUExecutionProvider"
) -> list[str]:
    """Register on ``so`` every library ``model`` needs; returns their paths."""
    paths = libraries_for(model, provider)
    for p in paths:
        so.register_custom_ops_library(p)
    return paths

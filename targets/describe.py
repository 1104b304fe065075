"""One target, described for people: its profile and its kernel table (`graphopt targets show`)."""

from __future__ import annotations

from typing import Any

from graphopt.opt.rewrite.target import get_target
from graphopt.targets.profiles import DOCUMENTS, pinned_document


def describe_target(name: str) -> dict[str, Any]:
    t = get_target(name)
    profile = {
        "description": t.description,
        "runtime": t.runtime,
        "runtime_version": t.runtime_version,
        "providers": list(t.providers),
        "kernels_source": t.kernels_source,
        "layout": t.layout,
        "static_shapes": t.static_shapes,
        "expands_functions": t.expands_functions,
        "fallback": t.fallback,
        "prefers": dict(t.prefers),
        "prefers_why": dict(t.prefers_why),
        "approximations": sorted(t.approximations),
        "disabled_rules": sorted(t.disabled_rules),
        "tolerances": {k: list(v) for k, v in sorted(t.tolerances.items())},
        "fp32_accumulation": dict(t.fp32_accumulation),
        "measured_slower": dict(t.measured_slower),
        "slower_below": {k: list(v) for k, v in sorted(t.slower_below.items())},
        "session": dict(t.session),
        "device_available": t.device_available,
    }
    document: dict[str, Any] = {}
    restrictions: dict[tuple[str, str], str] = {}
    if t.name in DOCUMENTS:
        doc = pinned_document(DOCUMENTS[t.name])
        document = {
            k: doc.get(k)
            for k in (
                "source",
                "runtime_version",
                "onnxruntime_version",
                "commit",
                "provider",
                "notes",
            )
            if k in doc
        }
        document["unsupported"] = [u["op"] for u in doc.get("unsupported", [])]
        for k in doc["kernels"]:
            if k.get("restrictions"):
                restrictions[(k["op"], k["domain"])] = k["restrictions"]
    kernels = [
        {
            "op": op,
            "domain": domain,
            "since": since,
            "end": end,
            "types": sorted(types),
            "restrictions": restrictions.get((op, domain)),
        }
        for (op, domain), entries in sorted(
            t.kernels().items(), key=lambda kv: (kv[0][1], kv[0][0])
        )
        for since, end, types in sorted(entries, key=lambda e: e[0])
    ]
    return {"name": t.name, "profile": profile, "document": document, "kernels": kernels}

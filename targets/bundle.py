"""The per-target bundle: what will run, how to run it, and what was verified here.

:func:`write_bundle` (what ``optimize`` calls) writes the portable ``model.onnx``, the cpu fast
path ``model.machine.onnx``, ``manifest.json``, ``session_config.json``, ``report.json``,
``golden/``, ``memory_plan.json`` and ``kernels/`` into one staging folder, checks the bundle
with the session :func:`load_session` builds, then renames it into place. :func:`load_session`
builds the session exactly as the manifest and session config say, after checking the model
files' sizes and fingerprints and every library's sha256. The files and their fields:
docs/bundle.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import external_data_helper

from graphopt.opt.errors import GraphoptError, ModelSaveError, UsageError
from graphopt.opt.graph.domains import norm_domain
from graphopt.opt.graph.io import (
    OutputDirKind,
    _all_tensors,
    check_external_data,
    check_output_dir,
    discard,
    external_data_files,
    file_sha256,
    needs_external_data,
    non_regular_kind,
    replace_dir,
    staging_dir,
    write_model_files,
)
from graphopt.opt.graph.spool import session_skeleton
from graphopt.opt.optimizer import NOT_MEASURED, run_of
from graphopt.opt.rewrite.target import Target, get_target, register_session_settings
from graphopt.opt.verify.feeds import read_npz
from graphopt.opt.verify.generation import report_generation
from graphopt.opt.verify.parity import (
    OwnNoise,
    ParityReport,
    Session,
    check_written,
    compare_outputs,
    compute_dtype,
    judge_by_noise,
    make_inputs,
    own_noise,
    runtime_noise,
    too_large,
)
from graphopt.opt.verify.perf import FAST_MODEL, save_optimized
from graphopt.targets.kernels import Resolution, model_opsets, primary_slots, resolve
from graphopt.targets.memory import (
    dtype_name,
    measured_view,
    memory_plan,
    nbytes,
    schema_elem_types,
    shape_view,
)

SCHEMA = "graphopt.bundle/1"
MANIFEST = "manifest.json"
SESSION_CONFIG = "session_config.json"
MEMORY_PLAN = "memory_plan.json"
GOLDEN_INPUTS = "golden/inputs.npz"
GOLDEN_OUTPUTS = "golden/outputs.npz"
#: its weights, stored beside it so that onnxruntime maps them instead of parsing them (session
#: creation of ResNet-50 0.35x -> 0.07x of the original's at ALL, BERT-base 0.71x -> 0.39x)
FAST_DATA = "model.machine.onnx.data"
FAST_FILES = [FAST_MODEL, FAST_DATA]
#: why verify="full" loads the portable model: the fast path's files record no full sha256
FULL_VERIFY_WHY = (
    "verify='full' checks every byte against a sha256, and the fast path's files (a copy "
    "derived where the bundle was written) record only their size and fingerprint"
)
#: integrity at load: the size and a sha256 over the head, the tail and evenly spaced blocks
FINGERPRINT_BLOCK = 64 * 1024
FINGERPRINT_SAMPLES = 16
VERIFY_MODES = ("fingerprint", "full", "none")

#: a folder graphopt writes whole: replaced only when its manifest says it is a bundle and it
#: holds nothing else (the patterns are everything the writer may put there)
BUNDLE_KIND = OutputDirKind(
    "graphopt bundle",
    MANIFEST,
    SCHEMA,
    (
        "model.onnx",
        "model.onnx.data*",
        FAST_MODEL,
        FAST_DATA,
        "report.json",
        MANIFEST,
        SESSION_CONFIG,
        MEMORY_PLAN,
        "golden",
        GOLDEN_INPUTS,
        GOLDEN_OUTPUTS,
        "kernels",
        "kernels/*",
    ),
)

#: onnxruntime graph transformers by the op they produce: (transformer name as onnxruntime
#: spells it, ops it fuses from).  SkipLayerNormFusion and ConvBNFusion are checked to take effect
#: through disabled_optimizers / the session config entry (tests/test_bundle.py).
ORT_FUSION_FOR_OP = {
    "SkipLayerNormalization": ("SkipLayerNormFusion", {"Add", "LayerNormalization"}),
    "BiasGelu": ("BiasGeluFusion", {"Add"}),
    "FastGelu": ("FastGeluFusion", {"Tanh"}),
    "Gelu": ("GeluFusion", {"Erf"}),
}
#: ops the tensors of which keep NCHW layout semantics (manifest "layout")
SPATIAL_OPS = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "BatchNormalization",
        "InstanceNormalization",
        "Resize",
        "Upsample",
        "DepthToSpace",
        "SpaceToDepth",
        "LpPool",
        "GridSample",
        "FusedConv",
        "NhwcConv",
    }
)
ELEMENTWISE = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "LeakyRelu",
        "Sigmoid",
        "Tanh",
        "Clip",
        "Erf",
        "Sqrt",
        "Pow",
        "Exp",
        "Log",
        "Neg",
        "Abs",
        "HardSigmoid",
        "HardSwish",
        "PRelu",
        "Min",
        "Max",
        "Where",
        "Equal",
        "Not",
        "And",
        "Or",
        "Cast",
        "Reshape",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Identity",
        "Transpose",
        "Concat",
        "Slice",
        "Gather",
        "Shape",
        "Softmax",
    }
)
LATENCY_BUDGET_S = 2.0
LATENCY_RUNS = 20


# ------------------------------------------------------------------------------ writing
#: JSON files are laid out with ``indent`` this many levels deep; deeper values (a manifest's
#: per-node entry, a memory plan's per-tensor entry) stay on one line each
JSON_DEPTH = 2
_ENCODER = json.JSONEncoder(sort_keys=True)


def dumps_json(obj: Any, depth: int = JSON_DEPTH, indent: int = 2) -> str:
    """``json.dumps(obj, indent=indent, sort_keys=True)``'s content, with everything nested
    deeper than ``depth`` on one line: an indented dump goes through Python's pure-Python
    encoder (seconds per 10k nodes), while each line here is one call of the C encoder.
    ``json.loads`` of the text equals ``json.loads`` of the fully indented dump."""
    return "".join(_chunks(obj, depth, indent, 0))


def write_json(path: str | os.PathLike, obj: Any, depth: int = JSON_DEPTH) -> None:
    """:func:`dumps_json`'s text written to ``path`` as it is made: a manifest of a million
    nodes is never held whole as one string."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(_chunks(obj, depth, 2, 0))


def _chunks(obj: Any, depth: int, indent: int, level: int) -> Iterator[str]:
    """The pieces of :func:`dumps_json`'s text, in order."""
    if level >= depth or not isinstance(obj, (dict, list, tuple)) or not obj:
        yield _ENCODER.encode(obj)
        return
    pad = " " * (indent * (level + 1))
    items = sorted(obj.items()) if isinstance(obj, dict) else [(None, v) for v in obj]
    yield "{" if isinstance(obj, dict) else "["
    for i, (k, v) in enumerate(items):
        yield (",\n" if i else "\n") + pad
        if isinstance(obj, dict):
            yield f"{_ENCODER.encode(_key(k))}: "
        yield from _chunks(v, depth, indent, level + 1)
    yield "\n" + pad[indent:] + ("}" if isinstance(obj, dict) else "]")


def _key(k: Any) -> str:
    """A dict key as the json encoder writes it (numbers, booleans and None as their JSON)."""
    return k if isinstance(k, str) else _ENCODER.encode(k)


def default_bundle_dir(model: str | os.PathLike, target: str) -> Path:
    """``<stem>.<target>.graphopt`` beside the input model."""
    path = Path(model)
    return path.with_name(f"{path.stem}.{target}.graphopt")


def protected_paths(model: str | os.PathLike) -> list[Path]:
    """The input model and its external-data files: no bundle may replace or contain them."""
    path = Path(model).resolve()
    return [path, *external_data_files(path)] if path.is_file() else [path]


def write_bundle(
    model: onnx.ModelProto,
    report,
    out_dir: str | os.PathLike | None = None,
    *,
    protected: Sequence[Path] | None = None,
    fast_path: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the bundle of an optimization (``model, report = graphopt.optimize(...)``) into
    ``out_dir`` (default: ``<stem>.<target>.graphopt`` beside the input) and return its path.

    Everything is written in a staging folder beside ``out_dir`` and renamed into place: nothing
    is half-written, and the staging folder never survives.  ``out_dir`` may replace only an
    empty folder or a bundle holding nothing graphopt did not write (else UsageError), and never
    a ``protected`` path (default: the input model and its external data).  ``fast_path``
    (default: cpu bundles) adds onnxruntime's optimized form of the model for this machine
    (:data:`FAST_MODEL`), used by :func:`load_session` only on a matching machine."""
    if out_dir is None:
        if not report.model or not Path(report.model).is_file():
            raise UsageError("out_dir is needed when the model was not read from a file")
        out_dir = default_bundle_dir(report.model, report.target)
    if protected is None:
        protected = protected_paths(report.model) if report.model else []
    dest = check_output_dir(Path(out_dir), BUNDLE_KIND, protected)
    try:
        staging = staging_dir(dest)
    except OSError as e:
        raise ModelSaveError(f"cannot write to {dest.parent}: {e.strerror or e}") from None
    held, run = None, run_of(report)
    try:
        source_sha256 = _in_background(_source_sha256, report.model)  # beside the writing
        with run.clock.phase("write"):
            held = run.take_serialized(model)  # what the validity check wrote and loaded
            written = write_model_files(
                model,
                staging / "model.onnx",
                external=needs_external_data(model),
                base_dir=run.context.get("base_dir"),
                serialized=held.data if held else None,
                spooled=held.spooled.path if held and held.spooled else None,
                spooled_sha256=held.spooled.sha256 if held and held.spooled else None,
            )
        with run.clock.phase("bundle"):
            files = write_bundle_files(
                staging,
                model,
                report,
                progress=progress,
                fast_path=fast_path,
                sha256=written,
                source_sha256=source_sha256,
            )
            # decoders with a KV cache: the model as written, its weights mapped from the file
            mapped = _as_written(model, held, written, staging / "model.onnx")
            report.generation = report_generation(report, run.context, model, mapped)
        report.seconds = run.clock.seconds()  # report.json: every phase up to here
        report.outputs = {k: str(dest / v) for k, v in files.items()}
        report.outputs["report"] = str(dest / "report.json")
        write_json(staging / "report.json", report.to_dict())
        check_output_dir(dest, BUNDLE_KIND, protected)  # again: minutes may have passed
        replace_dir(staging, dest)
    except OSError as e:
        raise ModelSaveError(f"cannot write {dest}: {e.strerror or e}") from None
    finally:
        discard(staging)
        if held is not None and held.spooled is not None:
            discard(held.spooled.path)  # moved into place, unless the write failed first
    return dest


def _as_written(model, held, written: dict[str, str], path: Path):
    """(a copy of ``model`` whose weights are external data in ``path``, its folder) when
    ``path`` is the validity check's spooled file moved into place (its spans known), else
    None."""
    spooled = held.spooled if held is not None else None
    if spooled is None or written.get(path.name) != spooled.sha256 or not path.is_file():
        return None
    return session_skeleton(model, dataclasses.replace(spooled, path=path)), path.parent


def write_bundle_files(
    out_dir: Path,
    model: onnx.ModelProto,
    report,
    progress=None,
    fast_path: bool | None = None,
    sha256: dict[str, str] | None = None,
    source_sha256: Future | None = None,
) -> dict[str, str]:
    """Write manifest, session config, golden files, memory plan and (cpu by default) the
    machine-specific fast path into ``out_dir`` (where model.onnx already is).  Returns {kind:
    file name relative to the bundle}.  ``progress(msg)`` is told each phase; ``sha256``: the
    model files' digests taken while writing them (else they are read back); ``source_sha256``:
    the input model's sha256 under way (else started here)."""
    say = progress or (lambda _msg: None)
    target = get_target(report.target)
    ctx = run_of(report).context
    original = ctx.get("original")
    shapes = dict(ctx.get("shapes") or {})
    given = ctx.get("inputs")
    seed = int(ctx.get("seed", 0) or 0)
    files = {
        "model": "model.onnx",
        "manifest": MANIFEST,
        "session_config": SESSION_CONFIG,
        "memory_plan": MEMORY_PLAN,
    }

    # the input's sha256 reads the whole file: it runs beside the writing and the sessions
    source_sha256 = source_sha256 or _in_background(_source_sha256, report.model)
    say("bundle: golden inputs and outputs")
    golden = _write_golden(out_dir, original, shapes, given, seed, report, ctx)
    if golden.get("written"):
        files.update(golden_inputs=GOLDEN_INPUTS, golden_outputs=GOLDEN_OUTPUTS)
    verified_shapes = golden.get("shapes") or dict(report.parity.inputs or {})
    view = shape_view(model, verified_shapes)
    say("bundle: memory plan")
    known = report.parity.shapes  # parity ran this model in pieces on the golden inputs
    measured = _measure_unknown(out_dir, model, view, golden, ctx.get("base_dir"), known)
    plan = memory_plan(model, view, verified_shapes)
    plan["measured_shapes"] = measured
    write_json(out_dir / MEMORY_PLAN, plan)
    session = session_config(target, model)
    kernels = _write_kernels(out_dir, model, target, report)
    if kernels:
        files["kernels"] = "kernels/kernels.json"
        session["custom_op_libraries"] = {
            provider: lib["path"] for provider, lib in sorted(kernels["libraries"].items())
        }
        session["reasons"]["custom_op_libraries"] = (
            "the machine tier: load_session registers the library of the provider it runs on "
            "(register_custom_ops_library) where it can run (its sha256 matches, this CPU has "
            "the features it was built for); elsewhere, and in any bare onnxruntime session, "
            "each graphopt.fused node runs its model-local function of standard ops"
        )
        session["kernel_threads"] = 1
        session["reasons"]["kernel_threads"] = (
            "OpenMP team size of the generated cpu kernels (GRAPHOPT_KERNEL_THREADS while "
            "load_session creates the session; 0 = OpenMP's default): a team beside "
            "onnxruntime's intra-op pool oversubscribes the cores (measured in "
            "examples/kernels/README.md)"
        )
    write_json(out_dir / SESSION_CONFIG, session)
    nodes, coverage = _node_kernels(target, model, view)
    manifest: dict[str, Any] = {
        "schema": SCHEMA,
        "target": target.name,
        "description": target.description,
        "runtime": {
            "name": target.runtime,
            "version": target.runtime_version,
            "providers": list(target.providers),
            "kernels": target.kernels_source,
        },
        "model": "model.onnx",
        "external_data": (data := sorted(p.name for p in out_dir.glob("model.onnx.data*"))),
        # the full hashes are taken here, once; load_session checks sizes and fingerprints
        "integrity": _integrity(out_dir, ["model.onnx", *data], sha256),
        "source_model": report.model,
        "source_model_sha256": None,  # below, once its background hash is done
        "pipeline": report.pipeline,
        "level": report.level,
        "declared": report.declared,
        "layout": target.layout,
        "session_config": SESSION_CONFIG,
        "golden": {k: v for k, v in golden.items() if k != "shapes"},
        "verified_shape_range": {
            k: {"min": v, "max": v} for k, v in sorted(verified_shapes.items())
        },
        "coverage": coverage,
        "memory_plan": {
            k: plan[k]
            for k in (
                "sum_bytes",
                "no_reuse_bytes",
                "peak_bytes",
                "exact_size_reuse_bytes",
                "weights_bytes",
            )
        }
        | {"file": MEMORY_PLAN},
        "latency": None,
        # the performance safety net (graphopt.opt.verify.perf): the bundle against the original
        # here
        "performance": getattr(report, "performance", None),
        "verified": {},
        "nodes": nodes,
        "fallbacks": fallback_section(target, report.remarks),
        "kernels": kernels or None,
    }
    manifest["model_sha256"] = manifest["integrity"]["files"]["model.onnx"]["sha256"]
    _kernel_latencies(nodes, kernels)
    write_json(out_dir / MANIFEST, manifest)
    whole = too_large(original) if original is not None else None  # no whole-model session
    refusal = whole or _fast_path_refusal(manifest, session, target, fast_path)
    save_to = None if refusal else out_dir / FAST_MODEL
    say(
        "bundle: verifying model.onnx in pieces"
        if whole
        else "bundle: verifying it as load_session runs it"
        + (", saving onnxruntime's optimized model (the fast path)" if save_to else "")
    )
    presaved = _presaved_fast_path(ctx.get("fast_path"), model, session) if save_to else None
    verified, latency, ran = _verify(out_dir, manifest, session, target, report, save_to, presaved)
    if kernels and manifest["golden"].get("written"):
        say("bundle: running model.onnx in a bare onnxruntime session (no kernel library)")
        verified["bare_session"] = _bare_session_check(out_dir, target, ctx, report.parity)
    manifest["verified"], manifest["latency"] = verified, latency
    if refusal:
        manifest["fast_path"] = {"written": False, "why": refusal}
    else:
        say("bundle: checking the machine-specific fast path")
        manifest["fast_path"] = _write_fast_path(out_dir, manifest, session, target, ran)
        if manifest["fast_path"].get("written") and (ran or {}).get("saved_by"):
            manifest["fast_path"]["saved_by"] = ran["saved_by"]
    if manifest["fast_path"].get("written"):
        files["fast_path"] = FAST_MODEL
        kept = [f for f in FAST_FILES if (out_dir / f).is_file()]
        # a copy derived here: size and fingerprint, no full sha256 (verify="full" loads the
        # portable model, whose every byte is hashed)
        manifest["integrity"]["files"].update(_integrity(out_dir, kept, full=False)["files"])
        manifest["fast_path"]["files"] = kept
    manifest["source_model_sha256"] = source_sha256.result()
    manifest["tiers"] = _tiers(out_dir, manifest)
    write_json(out_dir / MANIFEST, manifest)
    return files


def _tiers(out_dir: Path, manifest: dict) -> dict[str, Any]:
    """The bundle's bytes per tier: the portable model (what ships and runs anywhere) and the
    machine tier (onnxruntime's optimized form for this machine, the generated kernels'
    library), and whether the machine tier holds a second copy of the weights."""

    def size(names: list[str]) -> int:
        return sum((out_dir / n).stat().st_size for n in names if (out_dir / n).is_file())

    portable = ["model.onnx", *manifest.get("external_data", [])]
    fast = list((manifest.get("fast_path") or {}).get("files") or [])
    libs = ((manifest.get("kernels") or {}).get("libraries")) or {}
    machine = fast + sorted(lib["path"] for lib in libs.values() if lib.get("path"))
    return {
        "portable": {"files": portable, "bytes": size(portable)},
        "machine": {
            "files": machine,
            "bytes": size(machine),
            "weights_copied": bool(fast),
            "why": (
                "the fast path is onnxruntime's own save of the optimized graph: it writes "
                "every weight into the fast path's own data file (some re-laid-out for its "
                "kernels), none shared with model.onnx; --no-machine-tier leaves it out, and "
                "model.onnx then runs at the session config's level everywhere"
            )
            if fast
            else None,
        },
    }


def _bare_session_check(out_dir: Path, target: Target, ctx: dict, parity) -> dict[str, Any]:
    """model.onnx as anyone may run it: an onnxruntime session with no kernel library (each
    fused node runs its function body of standard ops), optimizations off so that the graph is
    computed as written, on the golden inputs, against the golden outputs — judged as parity
    judged the model with its kernels (the original's own drift included).  A model.onnx that
    does not load or agree there is an error: it is what users ship."""
    feeds, expected = _golden(out_dir)
    try:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        path = str(out_dir / "model.onnx")
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs() if o.name in expected]
        got = sess.run(names, _feeds_for(sess, feeds))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GraphoptError(
            f"model.onnx does not run in a bare onnxruntime session: {text}"
        ) from None
    original = ctx.get("original")
    dtype = compute_dtype(original) if original is not None else None
    expect = [expected[n] for n in names]
    diffs = compare_outputs(names, expect, got, target.tolerances, ctx.get("per_output"), dtype)
    diffs = judge_by_noise(diffs, expect, got, _parity_noise(parity))
    if not all(d.ok for d in diffs) and original is not None and not too_large(original):
        # parity passed within tolerance, so it measured no drift: measure it now
        noise = runtime_noise(original, ctx.get("base_dir"), feeds, names, expect)
        diffs = judge_by_noise(diffs, expect, got, noise)
    if not all(d.ok for d in diffs):
        bad = ", ".join(d.name for d in diffs if not d.ok)
        raise GraphoptError(
            f"model.onnx in a bare onnxruntime session (the kernels' function bodies) misses "
            f"the golden outputs ({bad}); nothing was written"
        )
    return {
        "ok": True,
        "max_abs": {d.name: d.max_abs for d in diffs},
        "within_own_noise": _within_own_noise(diffs),
        "what": "model.onnx in an onnxruntime session with no kernel library (each generated "
        "kernel's node runs its model-local function of standard ops), optimizations off",
    }


def _within_own_noise(diffs) -> dict | None:
    """The outputs a check passed against the original's own drift: name → how, and the drift."""
    passed = {
        d.name: {"judged": d.judged, "own_noise": d.own_noise}
        for d in diffs
        if d.judged != "tolerance"
    }
    return passed or None


def _parity_noise(parity) -> OwnNoise:
    """The original's own drift as parity measured it (its floor, and the selections it judged
    against that drift), for later checks against the same golden outputs."""
    outputs = parity.outputs if parity is not None and parity.ran else []
    picked = [d for d in outputs if d.judged == "selection-near-ties"]
    return OwnNoise(
        dict(parity.runtime_floor or {}) if outputs else {},
        {d.name: d.own_noise for d in picked if d.own_noise is not None},
        frozenset(d.name for d in picked if d.own_noise is None),
    )


def _in_background(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a thread of its own (hashlib and onnxruntime release the GIL, so a
    file's hash overlaps with sessions); ``.result()`` waits for it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphopt-bundle")
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def _source_sha256(model: str | None) -> str | None:
    """The sha256 of the input model file (None when it was not read from a file)."""
    path = Path(model) if model else None
    return file_sha256(path) if path is not None and path.is_file() else None


def _write_kernels(out_dir: Path, model: onnx.ModelProto, target: Target, report) -> dict:
    """``kernels/`` for the model's generated (graphopt.fused) kernels: built here, listed in
    the manifest; per fused node, the latency its gate measured."""
    from graphopt.targets.codegen.library import write_kernels
    from graphopt.targets.codegen.toolchain import BuildError

    try:
        section = write_kernels(out_dir, model, target.name, report.remarks)
    except BuildError as e:
        raise GraphoptError(f"cannot build the bundle's generated kernels: {e}") from None
    return section


def _kernel_latencies(nodes: list[dict], kernels: dict | None) -> None:
    for entry in nodes:
        if entry["domain"] != "graphopt.fused" or not kernels:
            continue
        for k in kernels["kernels"]:
            bench = ((k.get("gates") or {}).get("benchmark")) or {}
            if k["op_type"] == entry["op"] and bench:
                entry["latency_us"] = bench.get("fused_us")
                entry["latency_note"] = (
                    f"generated kernel, measured by its gate at {k['gates'].get('shape')} "
                    f"(1 thread; unfused chain {bench.get('unfused_us')} us)"
                )


def _measure_unknown(
    out_dir: Path, model: onnx.ModelProto, view, golden: dict, base_dir=None, known=None
) -> int:
    """Fill the shapes static inference left unknown: from ``known`` (the shapes parity's run
    measured on the golden inputs; element types from static inference, else that run, else
    the ops' schemas), the rest from an onnxruntime run on them (none when ``known`` has them
    all); returns how many were filled."""
    unknown = [o for n in model.graph.node for o in n.output if o and nbytes(view.get(o)) is None]
    if not unknown or not golden.get("written"):
        return 0
    # dims as run; the element type static inference gave, where it did (onnxruntime may run a
    # node in another type between casts it inserted), else the run's, else the schema's
    filled = {}
    elems = {name: info[0] for name, info in view.items() if info and info[0]}
    elems |= {
        name: info[0] for name, info in (known or {}).items() if info[0] and name not in elems
    }
    elems |= schema_elem_types(model, elems)
    for o in unknown:
        if known and o in known and elems.get(o):
            filled[o] = (elems[o], known[o][1])
    view.update(filled)
    missing = [o for o in unknown if o not in filled]
    if not missing:
        return len(filled)
    feeds, _ = _golden(out_dir)
    try:
        measured = measured_view(model, feeds, missing, base_dir)
    except GraphoptError:
        return len(filled)
    view.update(measured)
    return len(filled) + len(measured)


# ---------------------------------------------------------------------------- integrity
def sampled_blocks(size: int) -> list[tuple[int, int]]:
    """(offset, length) of what a fingerprint reads in a file of ``size`` bytes: all of it when
    it is small, else its first and last ``FINGERPRINT_BLOCK`` bytes and ``FINGERPRINT_SAMPLES``
    blocks evenly spaced between."""
    block = FINGERPRINT_BLOCK
    if size <= block * (FINGERPRINT_SAMPLES + 2):
        return [(0, size)]
    span = size - block
    steps = FINGERPRINT_SAMPLES + 1
    return [(span * i // steps, block) for i in range(steps + 1)]


def fingerprint(path: Path) -> str:
    """sha256 over a file's size and its :func:`sampled_blocks` (about 1 MiB read, whatever the
    size): cheap enough for every load, catches truncation and most corruption."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"graphopt.fingerprint/1 {size}\n".encode())
    with open(path, "rb") as f:
        for offset, length in sampled_blocks(size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


FINGERPRINT_TEXT = (
    f"sha256 over the size, the first and last {FINGERPRINT_BLOCK // 1024} KiB and "
    f"{FINGERPRINT_SAMPLES} evenly spaced {FINGERPRINT_BLOCK // 1024} KiB blocks (the whole file "
    f"up to {(FINGERPRINT_SAMPLES + 2) * FINGERPRINT_BLOCK // 1024} KiB)"
)


def _integrity(
    out_dir: Path, names: list[str], known: dict | None = None, full: bool = True
) -> dict[str, Any]:
    """Per model file: size, full sha256 (taken once: ``known`` digests from writing, else
    read here; None with ``full=False``) and the load-time fingerprint."""
    files = {
        name: {
            "size": (out_dir / name).stat().st_size,
            "sha256": ((known or {}).get(name) or file_sha256(out_dir / name)) if full else None,
            "fingerprint": fingerprint(out_dir / name),
        }
        for name in names
    }
    return {
        "files": files,
        "fingerprint": FINGERPRINT_TEXT,
        "at_load": "size and fingerprint (load_session verify='fingerprint', the default); "
        "verify='full' (graphopt run --verify full) recomputes every sha256; the fast path's "
        "files, a copy onnxruntime derived here, record no sha256, so verify='full' loads the "
        "portable model",
    }


def check_integrity(path: Path, manifest: dict, names: list[str], verify: str = "fingerprint"):
    """The bundle's model files against its manifest: ``fingerprint`` (size + sampled blocks),
    ``full`` (size + sha256 of every byte) or ``none``.  A mismatch is a GraphoptError."""
    if verify not in VERIFY_MODES:
        raise UsageError(f"verify must be one of {', '.join(VERIFY_MODES)} (got {verify!r})")
    if verify == "none":
        return
    files = (manifest.get("integrity") or {}).get("files")
    if not files:  # a bundle without the integrity section: its model's sha256 only
        want = manifest.get("model_sha256")
        if want and file_sha256(path / names[0]) != want:
            raise GraphoptError(f"{path / names[0]} does not match the manifest's model_sha256")
        return
    for name in names:
        _check_file(path / name, files.get(name), verify)


def _check_file(file: Path, record: dict | None, verify: str) -> None:
    if record is None:
        raise GraphoptError(f"{file.name} is not listed in the manifest's integrity section")
    try:
        size = file.stat().st_size
    except OSError as e:
        raise GraphoptError(f"{file}: cannot read ({e.strerror or e})") from None
    if size != record.get("size"):
        raise GraphoptError(
            f"{file} does not match the manifest: {size} bytes, {record.get('size')} recorded"
        )
    if verify == "full":
        if not record.get("sha256"):
            raise GraphoptError(f"{file.name} has no sha256 in the manifest to verify in full")
        if file_sha256(file) != record.get("sha256"):
            raise GraphoptError(f"{file} does not match the manifest's sha256")
    elif fingerprint(file) != record.get("fingerprint"):
        raise GraphoptError(
            f"{file} does not match the manifest's fingerprint (sampled blocks differ)"
        )


def _write_golden(out_dir, original, shapes, given, seed, report, ctx) -> dict[str, Any]:
    """The parity inputs (the very arrays parity ran on) and the original model's outputs on
    them; external data resolves beside the original, whatever the working directory."""
    if original is None:
        return {"written": False, "why": "the original model is not available"}
    if not report.parity.ran:
        return {"written": False, "why": f"parity did not run ({report.parity.error})"}
    try:
        known = ctx.get("reference_outputs")
        if ctx.get("feeds") and known:  # parity ran the original on these very inputs
            feeds = ctx["feeds"]
            names, outs = list(known), list(known.values())
        else:
            sess = Session(original, base_dir=ctx.get("base_dir"))
            feeds = ctx.get("feeds") or make_inputs(sess.sess, shapes, seed, given)
            names = [o.name for o in sess.sess.get_outputs()]
            outs = sess.run(feeds, names)
    except GraphoptError as e:
        return {"written": False, "why": str(e)}
    (out_dir / "golden").mkdir(exist_ok=True)
    # strings as fixed-width text (no pickles); sequence/map outputs (ZipMap) are not golden
    np.savez(out_dir / GOLDEN_INPUTS, **{k: _plain(v) for k, v in feeds.items()})
    tensors = {n: o for n, o in zip(names, outs) if isinstance(o, np.ndarray) and o.dtype != object}
    np.savez(out_dir / GOLDEN_OUTPUTS, **tensors)
    return {
        "written": True,
        "inputs": GOLDEN_INPUTS,
        "outputs": GOLDEN_OUTPUTS,
        "reference": "the original model, onnxruntime CPU, graph optimizations disabled",
        "seed": seed,
        "shapes": {k: list(v.shape) for k, v in feeds.items()},
    }


# ------------------------------------------------------------------------ session config
@register_session_settings
def session_config(target: Target, model: onnx.ModelProto) -> dict[str, Any]:
    """The onnxruntime session settings of the bundle, each decision with its reason."""
    if not target.session:
        return {
            "runtime": target.runtime,
            "onnxruntime": False,
            "why": f"{target.name} bundles are compiled by the target's toolchain, not run by "
            "onnxruntime",
            "graph_optimization_level": "ORT_DISABLE_ALL",
            "providers": [],
            "disabled_optimizers": [],
            "reasons": {},
            "session_config_entries": {},
        }
    ops = {n.op_type for n in model.graph.node}
    disabled: dict[str, str] = {}
    for op, why in sorted(target.measured_slower.items()):
        fusion, sources = ORT_FUSION_FOR_OP.get(op, (None, set()))
        if fusion and sources <= ops:
            disabled[fusion] = f"produces {op}, measured slower on {target.name}: {why}"
    if _fp16_batchnorm(model):
        disabled["ConvBNFusion"] = (
            "the fp16 model keeps a BatchNormalization that graphopt's precision guard did not "
            "fold; onnxruntime would fold it into the Conv in fp16 anyway"
        )
    names = sorted(disabled)
    entries = {"optimization.disable_specified_optimizers": ",".join(names)} if names else {}
    return {
        "runtime": f"onnxruntime {ort.__version__}",
        "onnxruntime": True,
        "graph_optimization_level": target.session.get(
            "graph_optimization_level", "ORT_ENABLE_EXTENDED"
        ),
        "why": target.session.get("why", ""),
        "providers": list(target.providers),
        "disabled_optimizers": names,
        "reasons": disabled,
        "session_config_entries": entries,
        "intra_op_num_threads": 0,
    }


def _fp16_batchnorm(model: onnx.ModelProto) -> bool:
    types = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    }
    types.update({t.name: t.data_type for t in model.graph.initializer})
    for n in model.graph.node:
        if n.op_type == "BatchNormalization" and len(n.input) > 1:
            if types.get(n.input[1]) == onnx.TensorProto.FLOAT16:
                return True
    return False


# --------------------------------------------------------------------------- manifest
def _node_kernels(target: Target, model: onnx.ModelProto, view) -> tuple[list, dict]:
    opsets = model_opsets(model.opset_import)
    entries, counts = [], {"ok": 0, "fallback": 0, "unsupported": 0}
    unsupported: dict[str, int] = {}
    # one resolution (and its dict, shared by the entries) per kind of node: a model of a
    # million nodes has a few dozen kinds
    resolved: dict[tuple, tuple[Resolution, dict | None]] = {}
    names = _DtypeNames()
    for idx, node in enumerate(model.graph.node):
        dom = norm_domain(node.domain)
        dtype = _primary(node, view, opsets.get(dom))
        kind = (node.op_type, dom, opsets.get(dom), dtype)
        if kind not in resolved:
            res = resolve(target, *kind)
            resolved[kind] = res, res.to_dict() if res.runs else None
        res, kernel = resolved[kind]
        key = (
            "ok"
            if res.status == "ok"
            else ("fallback" if res.status == "fallback" else "unsupported")
        )
        counts[key] += 1
        if key == "unsupported":
            label = f"{dom + '.' if dom else ''}{node.op_type}"
            unsupported[label] = unsupported.get(label, 0) + 1
        outs = [
            {
                "name": o,
                "dtype": names[view[o][0]] if o in view else None,
                "shape": view[o][1] if o in view else None,
            }
            for o in node.output
            if o
        ]
        entries.append(
            {
                "index": idx,
                "name": node.name or f"{node.op_type}@{node.output[0] if node.output else idx}",
                "op": node.op_type,
                "domain": dom or "ai.onnx",
                "status": res.status,
                "kernel": kernel,
                "why_not": None if res.runs else res.message,
                "dtype": dtype,
                "layout": target.layout if node.op_type in SPATIAL_OPS else "row-major",
                "outputs": outs,
                "workspace_bytes": _workspace(target, node, view),
                "latency_us": None,
            }
        )
    total = len(entries)
    coverage = {
        "nodes": total,
        "with_kernel": counts["ok"],
        "fallback": counts["fallback"],
        "unsupported": counts["unsupported"],
        "fraction": round(counts["ok"] / total, 6) if total else 1.0,
        "unsupported_ops": dict(sorted(unsupported.items())),
        "per_node_latency": "not measured (null): the bundle records whole-model latency only",
    }
    return entries, coverage


class _DtypeNames(dict):
    """element type -> :func:`dtype_name`, each name made once."""

    def __missing__(self, elem_type: int) -> str:
        self[elem_type] = name = dtype_name(elem_type)
        return name


def fallback_section(target: Target, remarks) -> dict[str, Any]:
    """``manifest.json`` -> ``fallbacks``: the nodes that run on the fallback provider (cuda ->
    CPU), island by island as legalize found them: each node's op, domain, dtype and origin
    (``original``: the input model ran it there too; ``introduced``: graphopt's rewrites did),
    the tensors copied between device and host and how many copies per inference."""
    islands = sorted(
        (r for r in remarks if r.pass_name == "legalize" and r.code == "fallback-island"),
        key=lambda r: r.args.get("island", 0),
    )
    entries = [
        {
            "island": r.args.get("island"),
            "provider": r.args.get("provider"),
            "nodes": list(r.args.get("entries", [])),
            "copied_in": list(r.args.get("copied_in", [])),
            "copied_out": list(r.args.get("copied_out", [])),
            "copies_per_inference": r.args.get("copies", 0),
        }
        for r in islands
    ]
    placed = [n for e in entries for n in e["nodes"]]
    return {
        "target": target.name,
        "fallback_target": target.fallback,
        "strict": any(r.args.get("strict") for r in islands),
        "nodes": len(placed),
        "original": sum(n.get("origin") == "original" for n in placed),
        "introduced": sum(n.get("origin") != "original" for n in placed),
        "copies_per_inference": sum(e["copies_per_inference"] for e in entries),
        "islands": entries,
    }


def _primary(node: onnx.NodeProto, view, opset: int | None) -> str | None:
    """The kernel-selecting element type, as targets.kernels.primary_dtype finds it."""
    for kind, i, _takes in primary_slots(node.op_type, norm_domain(node.domain), opset):
        names = node.input if kind == "input" else node.output
        if i >= len(names) or not names[i]:
            continue
        name = dtype_name(view[names[i]][0]) if names[i] in view else None
        return f"tensor({name})" if name and "tensor" in _takes else None
    return None


def _workspace(target: Target, node: onnx.NodeProto, view) -> int | None:
    """Scratch memory of a kernel, where it is cheap to know: 0 for element-wise and layout ops;
    the im2col buffer of an onnxruntime CPU (MLAS) Conv or FusedConv; None otherwise."""
    if node.op_type in ELEMENTWISE:
        return 0
    conv = (node.op_type, node.domain or "") in (("Conv", ""), ("FusedConv", "com.microsoft"))
    if not conv or "CPUExecutionProvider" not in target.providers[:1]:
        return None
    w = view.get(node.input[1]) if len(node.input) > 1 else None
    y = view.get(node.output[0])
    if w is None or y is None or w[1] is None or y[1] is None:
        return None
    wd, yd = w[1], y[1]
    if any(not isinstance(d, int) for d in list(wd) + list(yd)):
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    kernel = wd[2:]
    pointwise = (
        all(k == 1 for k in kernel)
        and all(s == 1 for s in attrs.get("strides", [1]))
        and not any(attrs.get("pads", []))
    )
    if pointwise:
        return 0
    size = nbytes((y[0], [1])) or 4
    return int(wd[1] * np.prod(kernel) * np.prod(yd[2:])) * size


# --------------------------------------------------------------------------- verification
def _verify(
    out_dir: Path,
    manifest: dict,
    session: dict,
    target: Target,
    report,
    save_to: Path | None = None,
    presaved: Path | None = None,
) -> tuple[dict, dict | None, dict | None]:
    """Run the bundle as load_session builds it; never claim what did not run.  With
    ``save_to``, the portable model's session saves onnxruntime's optimized model there (the
    fast path; moved there from ``presaved`` instead when the performance net's session of the
    same model at the same settings saved it) and the fast path, loaded as load_session loads
    it on this machine, is what runs (its graph is that session's); where it does not load or
    agree, the portable model runs instead and the fast path goes.  Returns the manifest's
    ``verified`` and ``latency`` and what ran (None when nothing did): ``fast`` (the fast
    path's verdict: :func:`_fast_run`, :func:`_portable_instead`), ``save_error`` (why
    onnxruntime could not save it) and ``saved_by`` (which session saved it)."""
    on_device = (
        target.device_available
        and bool(session.get("providers"))
        and all(p in ort.get_available_providers() for p in session["providers"])
    )
    verified: dict[str, Any] = {
        "machine": os.uname().machine if hasattr(os, "uname") else "unknown",
        "parity": {
            "ran": report.parity.ran,
            "ok": report.parity.ok if report.parity.ran else None,
            "where": "this machine, onnxruntime CPUExecutionProvider, optimizations disabled",
            "inputs": report.parity.inputs,
        },
        "legal": report.legal,
        "device": "not-run",
    }
    latency = None
    if not manifest["golden"].get("written"):
        verified["bundle_session"] = f"not-run: {manifest['golden'].get('why')}"
        return verified, latency, None
    ctx = run_of(report).context
    if ctx.get("original") is not None and (why := too_large(ctx["original"])):
        feeds, expected = _golden(out_dir)
        tolerances, per_output = target.tolerances, ctx.get("per_output")
        lean = check_written(out_dir / "model.onnx", feeds, expected, tolerances, per_output)
        verified["bundle_session"] = lean | {"as_deployed": f"not-run: {why}"}
        return verified, latency, None  # no whole-model session: no latency, no fast path
    providers = session["providers"] if on_device else ["CPUExecutionProvider"]
    if providers != list(session.get("providers") or []):
        save_to = None  # the fast path is built for the session config's providers only
    per_output = ctx.get("per_output")
    # the tolerance parity held the model to (an fp16 model's, whatever its outputs' dtype)
    dtype = compute_dtype(ctx["original"]) if ctx.get("original") is not None else None
    fast: dict[str, Any] = {}
    saved_by = None
    try:
        if save_to is not None and presaved is not None and _moved_in(presaved.path, save_to):
            sess, created, save_error = None, None, None
            saved_by = PRESAVED_BY
        else:
            presaved = None
            sess, created, save_error = _bundle_session(out_dir, providers, save_to)
            saved_by = SAVED_BY if save_to is not None and save_error is None else None
        feeds, expected = _golden(out_dir)
        parity_feeds = ctx.get("feeds")
        if save_to is not None and save_error is None:
            sess = None  # its graph is the fast path's: that runs in its stead, as load_session
            # the net's session of the fast path ran it on the golden inputs (parity's)
            if (
                presaved is not None
                and presaved.outputs is not None
                and presaved.feeds is parity_feeds
            ):
                fast = _reload_problem(out_dir, providers) or _fast_ran(
                    presaved.outputs, expected, target, per_output, dtype
                )
            else:
                fast = _fast_run(out_dir, providers, feeds, expected, target, per_output, dtype)
            if not fast.get("ok"):
                sess, created, fast = _portable_instead(out_dir, providers, feeds, fast, target)
            else:
                sess, created = fast["session"], fast["created"]
        every = fast["names"] if "names" in fast else [o.name for o in sess.get_outputs()]
        outs = fast["outputs"] if "names" in fast else sess.run(every, _feeds_for(sess, feeds))
    except Exception as e:  # noqa: BLE001 - reported in the manifest, never a crash
        _remove(out_dir, FAST_FILES)
        verified["bundle_session"] = (
            f"failed: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        )
        return verified, latency, None
    names = [n for n in every if n in expected]
    got = [o for n, o in zip(every, outs) if n in expected]
    if "diffs" in fast:  # the fast path's outputs, compared with the golden ones already
        diffs = fast["diffs"]
    else:
        expect = [expected[n] for n in names]
        diffs = compare_outputs(names, expect, got, target.tolerances, per_output, dtype)
    ok = all(d.ok for d in diffs)
    inputs = fast["inputs"] if "names" in fast else [i.name for i in sess.get_inputs()]
    deployed = _deploy_parity(inputs, session, feeds, names, got, target, report)
    verified["deploy_parity"] = deployed
    verified["bundle_session"] = {
        "providers": providers,
        "graph_optimization_level": session.get("graph_optimization_level"),
        "golden_ok": ok,
        "max_abs": {d.name: d.max_abs for d in diffs},
        "what": "the bundle loaded with load_session (its session config) on "
        + ("the target's device" if on_device else "this machine's CPU (semantics only)")
        + (": its fast path, onnxruntime's optimized form of model.onnx" if "names" in fast else "")
        + (f" ({NET_RUN})" if fast.get("by_net") else ""),
    }
    if on_device:
        verified["device"] = "pass" if ok else "fail"
    if (target.name == "cpu" or on_device) and (
        latency := _bundle_latency(sess, feeds, created, report)
    ):
        latency["providers"] = providers
    return verified, latency, {"fast": fast, "save_error": save_error, "saved_by": saved_by}


#: the manifest's ``fast_path.saved_by``: which onnxruntime session wrote the fast path
SAVED_BY = "the bundle's verification session (model.onnx at the session config's settings)"
PRESAVED_BY = (
    "the performance safety net's session of the final model (the session config's settings), "
    "which saved it for the net to time it as it deploys: the same graph, not built twice"
)
#: the bundle's verification when the performance net's session of the fast path ran it
NET_RUN = "run by the performance safety net's session that timed it, 1 intra-op thread"


def _presaved_fast_path(saved, model: onnx.ModelProto, session: dict):
    """The fast path the performance net's session saved (``saved``: perf.Saved) when it is of
    this very ``model`` at the session config's settings and providers, else None."""
    if saved is None or saved.model is not model or not saved.path.is_file():
        return None
    if list(session.get("providers") or []) != ["CPUExecutionProvider"]:
        return None
    level = session.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
    theirs = saved.config.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
    if _settings(saved.config, theirs) != _settings(session, level):
        return None
    return saved


def _moved_in(presaved: Path, save_to: Path) -> bool:
    """Move the presaved fast path (and its weights) to ``save_to``; False (nothing moved)
    when it cannot be."""
    data = presaved.with_name(presaved.name + ".data")
    try:
        if data.is_file():
            shutil.move(data, save_to.with_name(save_to.name + ".data"))
        shutil.move(presaved, save_to)
        return True
    except OSError:
        _remove(save_to.parent, [save_to.name, save_to.name + ".data"])
        return False


def _fast_run(
    out_dir, providers, feeds, expected, target, per_output, dtype=None
) -> dict[str, Any]:
    """The fast path onnxruntime just saved, loaded as load_session loads it here (weights
    pre-packed: some kernels compute otherwise without, e.g. MatMulNBits) and run on the golden
    inputs: {session, created (seconds), names, outputs, ok (they agree with the golden ones),
    max_abs, off (the outputs that do not)}, or {why} when it did not load or run."""
    path, manifest, config = read_bundle(out_dir)
    try:
        t0 = time.perf_counter()
        sess = _session(path, manifest, config, FAST_MODEL, providers, "ORT_DISABLE_ALL", "none")
        created = time.perf_counter() - t0
        every = [o.name for o in sess.get_outputs()]
        outs = sess.run(every, _feeds_for(sess, feeds))
    except Exception as e:  # noqa: BLE001 - not reloaded or not run: no fast path
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"why": f"onnxruntime could not reload or run it: {text}"}
    inputs = [i.name for i in sess.get_inputs()]
    return {"session": sess, "created": created, "inputs": inputs} | _checked(
        every, outs, expected, target, per_output, dtype
    )


def _reload_problem(out_dir: Path, providers: list[str]) -> dict[str, str] | None:
    """{why} when the fast path does not load from the bundle's own files as load_session
    loads it (its session config, the bundle's kernel library checked and registered; weights
    not pre-packed, as it is not run here: the performance net ran it pre-packed), else None."""
    path, manifest, config = read_bundle(out_dir)
    try:
        _session(
            path,
            manifest,
            config,
            FAST_MODEL,
            providers,
            "ORT_DISABLE_ALL",
            "fingerprint",
            once=True,
        )
    except GraphoptError as e:
        return {"why": f"onnxruntime could not reload it from the bundle: {e}"}
    return None


def _fast_ran(outputs: dict, expected, target, per_output, dtype=None) -> dict[str, Any]:
    """:func:`_fast_run`'s verdict from the outputs the performance net's session of the fast
    path gave on the golden inputs (loaded as load_session loads it, 1 thread: the session that
    timed it): {session (None: not kept), created (None), inputs, by_net, names, outputs, ok,
    ...}."""
    names = list(outputs)
    return {"session": None, "created": None, "inputs": None, "by_net": True} | _checked(
        names, [outputs[n] for n in names], expected, target, per_output, dtype
    )


def _checked(every, outs, expected, target, per_output, dtype) -> dict[str, Any]:
    """The fast path's outputs (``every``: their names) against the golden ones."""
    names = [n for n in every if n in expected]
    got = [o for n, o in zip(every, outs) if n in expected]
    expect = [expected[n] for n in names]
    diffs = compare_outputs(names, expect, got, target.tolerances, per_output, dtype)
    return {
        "names": every,
        "outputs": outs,
        "ok": all(d.ok for d in diffs),
        "max_abs": {d.name: d.max_abs for d in diffs},
        "off": [d.name for d in diffs if not d.ok],
        "diffs": diffs,
    }


def _portable_instead(out_dir, providers, feeds, fast: dict, target: Target):
    """(session, seconds to create it, the fast path's verdict) when the fast path did not
    agree with the golden outputs or did not run: model.onnx as load_session loads it without
    one.  A fast path that ran is kept when it agrees with that session, output for output
    (both then differ from the golden outputs alike: the runtime's own numerics at that level,
    e.g. int4 kernels), and answers for the bundle; else it goes."""
    portable, created, _ = _bundle_session(out_dir, providers, None)
    if "session" not in fast:
        _remove(out_dir, FAST_FILES)
        return portable, created, fast
    names = fast["names"]
    theirs = portable.run(names, _feeds_for(portable, feeds))
    diffs = compare_outputs(names, theirs, fast["outputs"], target.tolerances)
    if all(d.ok for d in diffs):
        fast["against_portable"] = {d.name: d.max_abs for d in diffs}
        return fast["session"], fast["created"], fast
    _remove(out_dir, FAST_FILES)
    bad = ", ".join(d.name for d in diffs if not d.ok)
    return portable, created, {"why": f"its outputs differ from the portable model's ({bad})"}


def _bundle_session(out_dir: Path, providers: list[str], save_to: Path | None):
    """(session, seconds to create it or None, why onnxruntime could not save): the bundle as
    :func:`load_session` builds it from the portable model; with ``save_to`` a session that
    writes onnxruntime's optimized model there (the fast path) instead, which is not run: its
    weights are not pre-packed (the graph onnxruntime optimizes and saves is the same)."""
    if save_to is not None:
        path, manifest, config = read_bundle(out_dir)
        level = config.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
        try:
            sess = _session(
                path, manifest, config, "model.onnx", providers, level, "none", save_to, True
            )
            if not save_to.is_file():
                raise GraphoptError("onnxruntime wrote no optimized model")
            return sess, None, None  # its creation time includes writing the fast path
        except GraphoptError as e:
            _remove(out_dir, FAST_FILES)
            error = str(e)
    else:
        error = None
    t0 = time.perf_counter()
    sess = load_session(out_dir, providers=providers, verify="none", fast_path=False)
    return sess, time.perf_counter() - t0, error


def _bundle_latency(sess, feeds, created: float | None, report) -> dict[str, Any] | None:
    """The manifest's latency: the performance safety net's own times of the final model (its
    rounds just timed it at the bundle's session settings, 1 thread), else timed here; None
    when the user turned timing off (``--no-measure``)."""
    performance = getattr(report, "performance", None) or {}
    if performance.get("latency"):
        where = "this machine: the performance safety net's rounds (the bundle's settings)"
        return dict(performance["latency"]) | {"where": where}
    if performance.get("why") == NOT_MEASURED or sess is None:
        return None
    return _latency(sess, feeds, created)


def _deploy_parity(inputs, session: dict, feeds, names, got, target: Target, report) -> dict:
    """The bundle as it will be loaded (``got``: its outputs ``names``; ``inputs``: its input
    names, None when they are the golden inputs') against the original under the same settings.

    Parity proper runs both graphs as written (optimizations off); what deploys runs at the
    session config's level, where onnxruntime's own transformers may treat the two graphs
    differently (e.g. re-quantizing weights a rewrite made float).  A disagreement here is a
    parity failure (``report.parity_deployed``) naming the setting."""
    ctx = run_of(report).context
    level = session.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
    setting = f"graph_optimization_level={level}"
    if session.get("disabled_optimizers"):
        setting += f", disabled_optimizers={','.join(session['disabled_optimizers'])}"
    if inputs is not None:
        feeds = {k: v for k, v in feeds.items() if k in set(inputs)}
    try:
        ran = (ctx.get("original_outputs") or {}).get(level) or {}
        if names and all(n in ran for n in names):  # the performance net ran it at this level
            ref = [ran[n] for n in names]
        else:
            original = Session(
                ctx["original"],
                level=getattr(ort.GraphOptimizationLevel, level),
                base_dir=ctx.get("base_dir"),
                # weights pre-packed, as deployed: some kernels compute otherwise without (the
                # MatMulNBits onnxruntime fuses from int4 DequantizeLinear + MatMul at ALL)
            )
            ref = original.run(feeds, names)
    except (GraphoptError, KeyError, AttributeError) as e:
        report.parity_deployed = ParityReport.not_run(f"the original at {setting}: {e}")
        return {"ran": False, "setting": setting, "why": str(e)}
    diffs = compare_outputs(
        names,
        ref,
        got,
        target.tolerances,
        per_output=ctx.get("per_output"),
        compute_dtype=compute_dtype(ctx["original"]),
    )
    ok = all(d.ok for d in diffs)
    floor = None
    written = ctx.get("reference_outputs") or {}
    if not ok and all(n in written for n in names):
        # the original's own drift between the same two levels: as written against as deployed
        noise = own_noise(names, [written[n] for n in names], ref)
        floor = dict(noise.floats)
        diffs = judge_by_noise(diffs, ref, got, noise)
        ok = all(d.ok for d in diffs)
    shapes = {k: list(np.shape(v)) for k, v in feeds.items()}
    report.parity_deployed = ParityReport(
        ok,
        True,
        diffs,
        shapes,
        int(ctx.get("seed", 0) or 0),
        f"original at {setting}",
        None
        if ok
        else (f"at the bundle's session settings ({setting}) the bundle and the original disagree"),
        runtime_floor=floor,
    )
    return {
        "ran": True,
        "ok": ok,
        "setting": setting,
        "max_abs": {d.name: d.max_abs for d in diffs},
        "within_own_noise": _within_own_noise(diffs),
        "what": "the bundle (load_session) against the original model under the same session "
        "settings, on this machine's CPU",
    }


def _latency(sess, feeds, created_s: float | None) -> dict[str, Any]:
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
    sess.run(None, feeds)  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < LATENCY_RUNS and (
        time.perf_counter() - start < LATENCY_BUDGET_S or len(times) < 3
    ):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "median_ms": round(statistics.median(times) * 1e3, 4),
        "p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))] * 1e3, 4),
        "runs": len(times),
        # None when that session also wrote the fast path: its creation time says nothing
        # (the fast path's session, when it is the one timed, is created as load_session does)
        "session_create_ms": None if created_s is None else round(created_s * 1e3, 2),
        "threads": "onnxruntime default",
        "where": "this machine (measured while writing the bundle)",
    }


def _plain(value: np.ndarray) -> np.ndarray:
    return value.astype(str) if value.dtype == object else value


def describe_value(value) -> dict[str, Any]:
    """dtype and shape of an output of a run; a sequence (ZipMap's maps) as seq(...), length."""
    if isinstance(value, np.ndarray):
        return {"dtype": str(value.dtype), "shape": list(value.shape)}
    first = value[0] if len(value) else None
    inner = "map" if isinstance(first, dict) else describe_value(np.asarray(first))["dtype"]
    return {"dtype": f"seq({inner})", "shape": [len(value)]}


def _golden(bundle: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    return _golden_arrays(bundle, GOLDEN_INPUTS), _golden_arrays(bundle, GOLDEN_OUTPUTS)


def _golden_arrays(bundle: Path, name: str) -> dict[str, np.ndarray]:
    """The arrays of the golden file ``name``: an .npz of plain arrays (never pickled objects);
    anything else is a GraphoptError (exit 1: a corrupt bundle) naming the file."""
    file = _bundle_file(bundle, name, name)
    try:
        return read_npz(file)
    except (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile, zlib.error) as e:
        raise GraphoptError(f"{file}: corrupt bundle file ({_reason(e)})") from None


def _reason(e: BaseException) -> str:
    """An error's reason in one line: an OSError's strerror, else its text's first line."""
    text = str(getattr(e, "strerror", None) or e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ------------------------------------------------------------------------------ loading
def read_bundle(bundle: str | os.PathLike) -> tuple[Path, dict, dict]:
    """The bundle folder (or its manifest.json), its manifest and its session config."""
    path = Path(bundle)
    if path.is_file() and path.name == MANIFEST:
        path = path.parent
    elif path.is_file():
        raise UsageError(
            f"{path} is a model file, not a bundle: `graphopt optimize {path}` writes one, "
            "and `graphopt run` runs that folder"
        )
    name = MANIFEST
    try:
        manifest = json.loads(_bundle_file(path, name, name).read_text())
        name = SESSION_CONFIG
        config = json.loads(_bundle_file(path, name, name).read_text())
    except FileNotFoundError as e:
        raise UsageError(
            f"{path} is not a graphopt bundle: {Path(e.filename).name} is missing"
        ) from None
    except json.JSONDecodeError as e:
        raise GraphoptError(f"{path}: corrupt bundle file ({e})") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise GraphoptError(f"{path}: corrupt bundle: {name} is nested too deep") from None
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise GraphoptError(f"{path}: cannot read the bundle ({why})") from None
    _check_shapes(path, MANIFEST, manifest, _MANIFEST_FIELDS)
    if manifest.get("schema") != SCHEMA:
        raise GraphoptError(f"{path}: unknown bundle schema {manifest.get('schema')!r}")
    _check_shapes(path, SESSION_CONFIG, config, _CONFIG_FIELDS)
    _check_settings(path, config)
    for where, name in _named_files(manifest, config):
        _bundle_file(path, name, where)
    return path, manifest, config


#: files a bundle holds under fixed names, checked (when there) like those its JSON names
_FIXED_FILES = (
    "model.onnx",
    *FAST_FILES,
    "report.json",
    MEMORY_PLAN,
    GOLDEN_INPUTS,
    GOLDEN_OUTPUTS,
)


def _named_files(manifest: dict, config: dict) -> list[tuple[str, Any]]:
    """(where it is named, name) of every file of the bundle that loading it may read."""
    fast = manifest.get("fast_path") or {}
    libs = (manifest.get("kernels") or {}).get("libraries") or {}
    named = [(name, name) for name in _FIXED_FILES]
    named.append((f"{MANIFEST} 'model'", manifest.get("model", "model.onnx")))
    named += [(f"{MANIFEST} 'external_data'", n) for n in manifest.get("external_data", [])]
    named += [(f"{MANIFEST} 'fast_path.files'", n) for n in fast.get("files") or []]
    if "model" in fast:
        named.append((f"{MANIFEST} 'fast_path.model'", fast["model"]))
    for provider, lib in sorted(libs.items()):
        if "path" in lib:
            named.append((f"{MANIFEST} 'kernels.libraries.{provider}.path'", lib["path"]))
    for provider, name in sorted((config.get("custom_op_libraries") or {}).items()):
        named.append((f"{SESSION_CONFIG} 'custom_op_libraries.{provider}'", name))
    return named


def _bundle_file(path: Path, name: Any, where: str) -> Path:
    """``path / name``, a file of the bundle named by ``where`` (a JSON entry, or the bundle's
    layout): refused (GraphoptError, exit 1: a corrupt bundle) when the name is absolute, holds
    ``..`` or resolves (symlinks followed) outside the bundle, or when something other than a
    regular file is there (a FIFO, a device or a folder would block or fail the read).  A file
    not there is not refused here: what reads it says it is missing."""
    shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
    if not isinstance(name, str) or not name or "\x00" in name:
        raise GraphoptError(f"{path}: corrupt bundle: {where} names {shown}, not a file name")
    file = path / name
    try:
        inside = file.resolve().is_relative_to(path.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long
        inside = False
    if Path(name).is_absolute() or ".." in Path(name).parts or not inside:
        raise GraphoptError(
            f"{path}: corrupt bundle: refused {where} {shown}: it is outside the bundle "
            "(absolute, '..' or a link out of it)"
        )
    kind = non_regular_kind(file)
    if kind is not None:
        raise GraphoptError(f"{path}: corrupt bundle: {shown} is {kind}, not a regular file")
    return file


#: the JSON type of each entry of manifest.json and session_config.json that reading a bundle
#: relies on, by dotted path (``*``: every entry of an object), checked where present; a list
#: is a list of names; null where an entry may be null (read as absent)
_NULL = type(None)
_MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,),
    "target": (str,),
    "model": (str,),
    "external_data": (list,),
    "integrity": (dict, _NULL),
    "integrity.files": (dict,),
    "integrity.files.*": (dict,),
    "integrity.files.*.size": (int,),
    "integrity.files.*.fingerprint": (str, _NULL),
    "integrity.files.*.sha256": (str, _NULL),
    "fast_path": (dict, _NULL),
    "fast_path.files": (list,),
    "fast_path.model": (str,),
    "fast_path.graph_optimization_level": (str,),
    "fast_path.disabled_optimizers": (list,),
    "fast_path.session_config_entries": (dict,),
    "fast_path.built_for": (dict,),
    "fast_path.built_for.cpu_features": (list, _NULL),
    "fast_path.built_for.providers": (list,),
    "fast_path.built_for.machine": (str, _NULL),
    "fast_path.built_for.onnxruntime": (str, _NULL),
    "golden": (dict,),
    "kernels": (dict, _NULL),
    "kernels.libraries": (dict,),
    "kernels.libraries.*": (dict,),
    "kernels.libraries.*.path": (str,),
    "kernels.libraries.*.sha256": (str, _NULL),
    "kernels.libraries.*.march": (str, _NULL),
    "verified": (dict, _NULL),
}
_CONFIG_FIELDS: dict[str, tuple[type, ...]] = {
    "providers": (list, _NULL),
    "graph_optimization_level": (str,),
    "intra_op_num_threads": (int, _NULL),
    "inter_op_num_threads": (int, _NULL),
    "kernel_threads": (int, _NULL),
    "session_config_entries": (dict, _NULL),
    "session_config_entries.*": (str,),
    "disabled_optimizers": (list, _NULL),
    "custom_op_libraries": (dict, _NULL),
    "custom_op_libraries.*": (str,),
}
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", _NULL: "null"}


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a number"
    return next((n for t, n in _JSON_NAMES.items() if isinstance(value, t)), "a value")


def _entries(data: Any, parts: list[str], where: str):
    """(dotted name, value) of each entry of ``data`` at the path ``parts`` that is present."""
    if not parts:
        yield where, data
        return
    if not isinstance(data, dict):
        return  # the parent's own type is checked by its own path
    head, rest = parts[0], parts[1:]
    keys = sorted(data) if head == "*" else [head] if head in data else []
    for key in keys:
        yield from _entries(data[key], rest, f"{where}.{key}" if where else key)


def _check_shapes(path: Path, name: str, data: Any, fields: dict) -> None:
    """``data`` (the bundle file ``name``) is a JSON object whose known entries have their
    types; else a GraphoptError (exit 1: a bad bundle) naming the file and the entry."""
    if not isinstance(data, dict):
        raise GraphoptError(f"{path}: corrupt bundle: {name} is {_json_kind(data)}, not an object")
    for dotted, kinds in fields.items():
        for where, value in _entries(data, dotted.split("."), ""):
            if isinstance(value, bool) or not isinstance(value, kinds):
                said = " or ".join(_JSON_NAMES[k] for k in kinds)
                raise GraphoptError(
                    f"{path}: corrupt bundle: {name} '{where}' is {_json_kind(value)}, not {said}"
                )
            if isinstance(value, list) and not all(isinstance(v, str) for v in value):
                raise GraphoptError(
                    f"{path}: corrupt bundle: {name} '{where}' is not a list of names"
                )


#: the session config's thread counts (0: onnxruntime's or OpenMP's default) are at most this:
#: more threads than 4 per core only oversubscribe the cores, and onnxruntime's spinning pools
#: take minutes to start from a few hundred on 2 cores and crash from 10^5; 64 at least, so a
#: count tuned on a bigger machine still loads on a small one
MAX_THREADS = max(64, 4 * (os.cpu_count() or 1))
_THREAD_COUNTS = ("intra_op_num_threads", "inter_op_num_threads", "kernel_threads")
#: onnxruntime's limits on a session config entry (bytes of UTF-8), past which it refuses it
MAX_ENTRY_KEY = 1024
MAX_ENTRY_VALUE = 8192


#: session config keys that point onnxruntime at a file or folder (where external weights are
#: read from, where an EP context or an optimized model is written, a partition file)
_NAMES_A_PATH = re.compile(r"file|path|folder|dir", re.IGNORECASE)


def _check_settings(path: Path, config: dict) -> None:
    """The session config's thread counts and config entries are what onnxruntime takes (else
    a GraphoptError, exit 1: a corrupt bundle, naming the entry and its value)."""
    bad = f"{path}: corrupt bundle: {SESSION_CONFIG}"
    for key in _THREAD_COUNTS:
        value = config.get(key)
        if value is not None and not 0 <= value <= MAX_THREADS:
            raise GraphoptError(
                f"{bad} '{key}' is {value}, not a thread count from 0 to {MAX_THREADS}"
            )
    for key, value in (config.get("session_config_entries") or {}).items():
        shown = repr(key) if len(repr(key)) <= 60 else repr(key)[:57] + "..."
        if not key:
            raise GraphoptError(f"{bad} 'session_config_entries' has an empty key")
        where = f"'session_config_entries' key {shown}"
        checks = ((key, where, MAX_ENTRY_KEY), (value, f"{where}: its value", MAX_ENTRY_VALUE))
        for text, what, most in checks:
            size = _utf8_size(text)
            if size is None or "\x00" in text:
                raise GraphoptError(f"{bad} {what} is not plain text (a NUL or lone surrogate)")
            if size > most:
                raise GraphoptError(f"{bad} {what} is {size} bytes, more than onnxruntime's {most}")
        if _NAMES_A_PATH.search(key):
            raise GraphoptError(
                f"{bad} {where} names a file or folder for onnxruntime to read or write; a "
                "bundle's session reads only the bundle's own files"
            )


def _utf8_size(text: str) -> int | None:
    """The bytes of ``text`` in UTF-8, None when it has none (a lone surrogate)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def providers_problem(bundle: str | os.PathLike) -> str | None:
    """Why this machine cannot run the bundle with the providers it records (None: it can)."""
    _, _, config = read_bundle(bundle)
    wanted = list(config.get("providers") or [])
    missing = [p for p in wanted if p not in ort.get_available_providers()]
    if wanted and not missing:
        return None
    if missing:
        return f"needs {', '.join(missing)}, not available here"
    return f"is not run by onnxruntime ({config.get('why', '')})"


def load_session(
    bundle: str | os.PathLike,
    *,
    providers: list[str] | None = None,
    verify: str = "fingerprint",
    fast_path: bool = True,
    level: str | None = None,
    verify_hash: bool | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session for a bundle, built as its manifest and session config say.

    ``providers`` overrides the bundle's (e.g. ``["CPUExecutionProvider"]`` to run a cuda or npu
    bundle's semantics on a machine without the device); without it, a provider the bundle needs
    but this machine lacks is an error, never a silent fallback.  ``verify``: ``fingerprint``
    (size and sampled blocks of the model files, the default), ``full`` (every byte against the
    sha256 taken when the bundle was written) or ``none`` (``verify_hash=False`` is ``none``).
    ``level`` overrides the session config's graph optimization level.  On the machine that
    wrote the bundle (same onnxruntime, CPU features, providers and requested settings) the
    session loads the machine-specific fast path with graph optimizations off; anywhere else,
    with ``fast_path=False`` or with ``verify="full"`` (the fast path's files record no full
    sha256), the portable model.  :func:`open_session` also says which.
    """
    if verify_hash is not None and not verify_hash:
        verify = "none"
    return open_session(
        bundle, providers=providers, verify=verify, fast_path=fast_path, level=level
    )[0]


def open_session(
    bundle: str | os.PathLike,
    *,
    providers: list[str] | None = None,
    verify: str = "fingerprint",
    fast_path: bool = True,
    level: str | None = None,
    profile: str | None = None,
) -> tuple[ort.InferenceSession, dict[str, Any]]:
    """:func:`load_session`, and how it loaded: ``{"model", "fast_path", "why", "level",
    "verify"}`` (``why``: the reason the fast path was not used).  ``profile``: a file prefix;
    the session then records onnxruntime's profile (``enable_profiling``) there, its settings
    otherwise the same."""
    if verify not in VERIFY_MODES:
        raise UsageError(f"verify must be one of {', '.join(VERIFY_MODES)} (got {verify!r})")
    path, manifest, config = read_bundle(bundle)
    wanted = _providers(manifest, config, providers)
    level = level or config.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
    _level(level)
    why = fast_path_mismatch(manifest, config, wanted, level) if fast_path else "not asked for"
    portable = manifest.get("model", "model.onnx")
    info = {"model": portable, "fast_path": False, "why": why, "level": level, "verify": verify}
    files = [portable, *manifest.get("external_data", [])]
    fast_files = (manifest.get("fast_path") or {}).get("files") or [FAST_MODEL]
    if why is None and verify == "full" and not _hashed(manifest, fast_files):
        why = info["why"] = FULL_VERIFY_WHY
    check_integrity(path, manifest, files + (fast_files if why is None else []), verify)
    _check_model_data(path, portable)  # whichever model runs, the bundle's must stay inside it
    kernels: dict = {}
    if why is None:
        try:
            sess = _session(
                path,
                manifest,
                config,
                FAST_MODEL,
                wanted,
                "ORT_DISABLE_ALL",
                verify,
                None,
                kernels=kernels,
                profile=profile,
            )
            return sess, info | {"model": FAST_MODEL, "fast_path": True, **_said(kernels)}
        except GraphoptError as e:  # never worse than the portable model
            info["why"] = f"onnxruntime refused it ({e})"
    sess = _session(
        path, manifest, config, portable, wanted, level, verify, kernels=kernels, profile=profile
    )
    return sess, info | _said(kernels)


def _said(kernels: dict) -> dict:
    """open_session's account of the generated kernels: ``{"kernels": {"used", "why"}}`` for a
    bundle that has them, else nothing."""
    return {"kernels": kernels} if kernels else {}


def _hashed(manifest: dict, names: list[str]) -> bool:
    """Every one of ``names`` has a full sha256 in the manifest's integrity section."""
    files = (manifest.get("integrity") or {}).get("files") or {}
    return all((files.get(n) or {}).get("sha256") for n in names)


def _providers(manifest: dict, config: dict, providers: list[str] | None) -> list[str]:
    wanted = list(providers) if providers else list(config.get("providers") or [])
    if not wanted:
        raise UsageError(
            f"the {manifest.get('target')} bundle is not run by onnxruntime "
            f"({config.get('why', '')}); pass providers=['CPUExecutionProvider'] "
            "(graphopt run --provider CPUExecutionProvider) to run its semantics on CPU"
        )
    available = ort.get_available_providers()
    missing = [p for p in wanted if p not in available]
    if missing:
        raise UsageError(
            f"the bundle needs {', '.join(missing)}, not available here "
            f"(available: {', '.join(available)}); pass providers=['CPUExecutionProvider'] to "
            "run its semantics on CPU"
        )
    return wanted


def _level(name: str) -> ort.GraphOptimizationLevel:
    levels = ort.GraphOptimizationLevel.__members__
    if not isinstance(name, str) or name not in levels:
        raise GraphoptError(
            f"session config: unknown graph_optimization_level {name!r} "
            f"(one of {', '.join(levels)})"
        )
    return levels[name]


def _session(
    path: Path,
    manifest: dict,
    config: dict,
    model: str,
    wanted: list[str],
    level: str,
    verify: str,
    save_to: Path | None = None,
    once: bool = False,
    kernels: dict | None = None,
    profile: str | None = None,
) -> ort.InferenceSession:
    """The session of ``model`` (a file of the bundle) at ``level`` with the config's settings;
    ``profile``: a file prefix for onnxruntime's profile of the session's runs;
    ``save_to``: where onnxruntime writes the graph it optimized; ``once``: a session not run as
    deployed (it only saves that graph): its kernels do not pre-pack their weights;
    ``kernels``: filled with whether the generated-kernel library was registered, and why not."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = _level(level)
    if config.get("intra_op_num_threads"):
        so.intra_op_num_threads = int(config["intra_op_num_threads"])
    entries = dict(config.get("session_config_entries") or {})
    if once:
        entries.setdefault("session.disable_prepacking", "1")
    for key, value in sorted(entries.items()):
        so.add_session_config_entry(key, str(value))
    if save_to is not None:  # weights beside it, mapped at load rather than parsed
        save_optimized(so, save_to)
    if profile is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    why_not = _register_kernels(path, manifest, config, so, wanted)
    if kernels is not None and config.get("custom_op_libraries"):
        kernels.update(used=why_not is None, why=why_not)
    _check_model_data(path, model)
    try:
        with _kernel_threads(config.get("kernel_threads")):
            return ort.InferenceSession(
                str(path / model),
                so,
                providers=wanted,
                disabled_optimizers=list(config.get("disabled_optimizers") or []),
            )
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise GraphoptError(f"onnxruntime cannot load the bundle: {first}") from None


def _check_model_data(path: Path, model: str) -> None:
    """The bundle file ``model`` references external data only inside its own folder (the
    check :func:`load_model` makes of an input model; a ModelLoadError, exit 1, otherwise):
    onnxruntime would read an absolute or escaping location wherever it points."""
    file = path / model
    if not external_data_files(file):  # cheap: scanned or parsed without the weights
        return
    try:
        proto = onnx.load(str(file), load_external_data=False)
    except Exception:  # noqa: BLE001 - a model that does not parse: onnxruntime says why
        return
    stored = [t for t in _all_tensors(proto) if external_data_helper.uses_external_data(t)]
    check_external_data(stored, file.resolve().parent, file)


# ------------------------------------------------------------------------------ fast path
@lru_cache(maxsize=1)
def cpu_features() -> tuple[str, ...] | None:
    """This CPU's feature flags (``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``), or None
    where they cannot be read: onnxruntime picks its kernels and layouts by them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split())))
    return None


def machine_signature(providers: list[str]) -> dict[str, Any]:
    """What an onnxruntime-optimized graph depends on besides the settings."""
    features = cpu_features()
    return {
        "onnxruntime": ort.__version__,
        "machine": platform.machine(),
        "cpu_features": list(features) if features is not None else None,
        "providers": list(providers),
    }


def fast_path_mismatch(manifest: dict, config: dict, providers: list[str], level: str):
    """Why the bundle's fast path cannot serve this session (None when it can)."""
    fast = manifest.get("fast_path") or {}
    if not fast.get("written"):
        return f"the bundle has none ({fast.get('why') or 'written without one'})"
    built, here = fast.get("built_for") or {}, machine_signature(providers)
    for key, what in (
        ("onnxruntime", "onnxruntime"),
        ("machine", "CPU architecture"),
        ("providers", "execution providers"),
    ):
        if built.get(key) != here[key]:
            return f"built for {what} {built.get(key)}, this session has {here[key]}"
    if built.get("cpu_features") != here["cpu_features"]:
        was, now = set(built.get("cpu_features") or []), set(here["cpu_features"] or [])
        diff = sorted(f"-{f}" for f in was - now) + sorted(f"+{f}" for f in now - was)
        return f"built on a CPU with other features ({' '.join(diff[:8]) or 'unknown here'})"
    settings = _settings(config, level)
    for key, value in settings.items():
        if fast.get(key) != value:
            return f"built for {key} {fast.get(key)}, this session asks for {value}"
    return None


def _settings(config: dict, level: str) -> dict[str, Any]:
    """The requested settings an optimized graph was built under."""
    return {
        "graph_optimization_level": level,
        "disabled_optimizers": sorted(config.get("disabled_optimizers") or []),
        "session_config_entries": dict(
            sorted((config.get("session_config_entries") or {}).items())
        ),
    }


#: why a bundle without golden inputs (``--no-check``, or parity could not run) has no fast path
#: by default
NO_GOLDEN = (
    "not built without golden inputs (--no-check, or parity did not run): the fast path is "
    "kept only once it agrees with the portable model on them (write_bundle(..., "
    "fast_path=True) checks it on seeded random inputs instead)"
)


def _fast_path_refusal(
    manifest: dict, config: dict, target: Target, asked: bool | None
) -> str | None:
    """Why no fast path is built for this bundle (None: build one).  By default (``asked`` None)
    cpu bundles with golden inputs get one; ``asked`` True builds one whenever it can."""
    if asked is False:
        return "the machine tier was left out (--no-machine-tier; write_bundle fast_path=False)"
    if asked is None and target.name != "cpu":
        return f"not built for {target.name} bundles by default"
    if asked is None and not manifest["golden"].get("written"):
        return NO_GOLDEN
    return _fast_path_obstacle(manifest, config)


def _write_fast_path(
    out_dir: Path, manifest: dict, config: dict, target: Target, ran: dict | None
) -> dict[str, Any]:
    """Keep onnxruntime's optimized form of model.onnx for this machine only when it loads with
    optimizations off and its outputs agree, else remove it and say why.  ``ran``: what the
    bundle's verification ran (:func:`_verify`): the session that saved it, then the fast path
    itself on the golden inputs, checked against the golden outputs (:func:`_fast_run`).
    Without that (no golden inputs, or a session on other providers) it is saved and checked
    here against the portable model at the session config's level, on the golden inputs or
    seeded random ones."""
    providers = list(config["providers"])
    level = config.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
    if ran is not None and ran.get("save_error"):
        return _no_fast_path(out_dir, f"onnxruntime could not save it: {ran['save_error']}")
    if ran is None and manifest["golden"].get("written"):
        seen = (manifest.get("verified") or {}).get("bundle_session")
        seen = seen.get("as_deployed") if isinstance(seen, dict) else seen
        return _no_fast_path(out_dir, f"the bundle's whole-model session did not run ({seen})")
    fast = (ran or {}).get("fast") or {}
    if "why" in fast:
        return _no_fast_path(out_dir, fast["why"])
    if "against_portable" in fast:  # both off the golden outputs, alike (_portable_instead)
        against = (
            f"the portable model at {level} on the golden inputs (the run verifying the bundle; "
            f"neither agrees with the golden outputs on {', '.join(fast['off'])}: the runtime's "
            "own numerics at that level)"
        )
        return _fast_path_written(providers, config, level, against, fast["against_portable"])
    if "max_abs" in fast:  # it ran for the bundle's verification (_fast_run, _fast_ran)
        by = NET_RUN if fast.get("by_net") else "the run verifying the bundle"
        return _fast_path_written(
            providers,
            config,
            level,
            "the golden outputs (the original's) on the golden inputs, loaded as load_session "
            f"loads it ({by})",
            fast["max_abs"],
        )
    try:
        saved = out_dir / FAST_MODEL
        ref_sess = _session(
            out_dir, manifest, config, "model.onnx", providers, level, "none", saved
        )
        if not saved.is_file():
            raise GraphoptError("onnxruntime wrote no optimized model")
        golden = bool(manifest["golden"].get("written"))
        feeds = _golden(out_dir)[0] if golden else make_inputs(ref_sess, {}, 0)
        names = [o.name for o in ref_sess.get_outputs()]
        ref = ref_sess.run(names, _feeds_for(ref_sess, feeds))
        against = "the golden inputs" if golden else "seeded random inputs (no golden inputs)"
        sess = _session(out_dir, manifest, config, FAST_MODEL, providers, "ORT_DISABLE_ALL", "none")
        got = sess.run(names, _feeds_for(sess, feeds))
    except Exception as e:  # noqa: BLE001 - not saved, not reloaded or not run: no fast path
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _no_fast_path(out_dir, f"onnxruntime could not save, reload or run it: {text}")
    diffs = compare_outputs(names, ref, got, target.tolerances)
    if not all(d.ok for d in diffs):
        bad = ", ".join(d.name for d in diffs if not d.ok)
        return _no_fast_path(out_dir, f"its outputs differ from the portable model's ({bad})")
    against = f"the portable model at {level} on {against}"
    return _fast_path_written(providers, config, level, against, {d.name: d.max_abs for d in diffs})


def _fast_path_written(providers, config: dict, level: str, against: str, max_abs: dict) -> dict:
    """The manifest's record of a fast path kept, checked ``against`` that."""
    return {
        "written": True,
        "model": FAST_MODEL,
        "built_for": machine_signature(providers),
        **_settings(config, level),
        "loaded_with": "ORT_DISABLE_ALL (the graph is already optimized)",
        "verified": {"ok": True, "against": against, "max_abs": max_abs},
        "note": "used by load_session only on a machine with the same onnxruntime, CPU "
        "architecture and features, providers and requested settings; elsewhere model.onnx",
    }


def _no_fast_path(out_dir: Path, why: str) -> dict[str, Any]:
    _remove(out_dir, FAST_FILES)
    return {"written": False, "why": why}


def _feeds_for(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}


def _remove(out_dir: Path, names: list[str]) -> None:
    for name in names:
        (out_dir / name).unlink(missing_ok=True)


def _fast_path_obstacle(manifest: dict, config: dict) -> str | None:
    """What rules a fast path out before trying to build it."""
    if not config.get("onnxruntime"):
        return "the bundle is not run by onnxruntime"
    missing = [p for p in config.get("providers") or [] if p not in ort.get_available_providers()]
    if missing or not config.get("providers"):
        return f"its providers are not available here ({', '.join(missing) or 'none'})"
    if manifest.get("external_data"):
        return "the model keeps its weights in external data (an optimized copy would double them)"
    if cpu_features() is None:
        return "this machine's CPU features are unknown, so a matching machine could not be told"
    return None


def _kernel_threads(n):
    """Generated kernels read their thread count when onnxruntime creates them."""
    from contextlib import nullcontext

    from graphopt.targets.codegen.gates import kernel_threads

    return nullcontext() if n is None else kernel_threads(int(n))


def _register_kernels(path: Path, manifest: dict, config: dict, so, wanted) -> str | None:
    """Register the bundle's generated-kernel library for the provider the session runs on
    (the CUDA one when CUDAExecutionProvider is used, else the CPU one); returns why it was
    not registered (None when it was, or when the bundle has none).

    The library is the machine tier: every fused node is also a model-local function of
    standard ops, so where the library is absent or cannot run on this CPU the session runs
    those instead.  A library that is there but does not match the manifest's sha256 is
    refused (an error), whatever the reason."""
    from graphopt.targets.codegen.toolchain import march_missing

    libs = config.get("custom_op_libraries") or {}
    if not libs:
        return None
    provider = next((p for p in wanted if p in libs), "CPUExecutionProvider")
    rel = libs.get(provider)
    if rel is None:
        return f"the bundle has no generated-kernel library for {provider}"
    lib = _vouched_library(path, manifest, provider, rel)
    if not lib.is_file():
        return f"the kernel library {rel} is missing (its build.sh rebuilds it)"
    info = manifest["kernels"]["libraries"][provider]
    # a library is code, not data: its sha256 is checked whatever ``verify`` says
    if file_sha256(lib) != info["sha256"]:
        raise GraphoptError(
            f"refused to load {rel}: it does not match the sha256 manifest.json records for it"
        )
    if provider == "CPUExecutionProvider":
        why = march_missing(info.get("march"))
        if why is not None:
            return f"the kernel library {rel} cannot run here: {why}"
    try:
        so.register_custom_ops_library(str(lib))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own Fail, RuntimeError...
        raise GraphoptError(
            f"refused to load the library {lib}: onnxruntime cannot register it ({_reason(e)})"
        ) from None
    return None


def _vouched_library(path: Path, manifest: dict, provider: str, rel) -> Path:
    """The bundle file ``rel`` that session_config.json names as ``provider``'s kernel library,
    when manifest.json lists that very file with a sha256 and it lies inside the bundle (no
    absolute path, no ``..``, no link out of it); anything else is refused (GraphoptError)."""
    info = ((manifest.get("kernels") or {}).get("libraries") or {}).get(provider) or {}
    if not isinstance(rel, str) or not info.get("sha256") or info.get("path") != rel:
        raise GraphoptError(
            f"refused to load the library {rel!r} that session_config.json names: manifest.json "
            "does not list it with a sha256"
        )
    root = path.resolve()
    lib = path / rel
    if Path(rel).is_absolute() or ".." in Path(rel).parts or not lib.resolve().is_relative_to(root):
        raise GraphoptError(f"refused to load the library {rel!r}: it is outside the bundle")
    return lib


def run_bundle(
    bundle: str | os.PathLike,
    inputs: dict[str, np.ndarray] | None = None,
    *,
    providers: list[str] | None = None,
    repeat: int = 1,
    verify: str = "fingerprint",
    fast_path: bool = True,
) -> dict[str, Any]:
    """Run a bundle on ``inputs`` (default: its golden inputs, then compared with the golden
    outputs), its session built by :func:`open_session` (``verify``, ``fast_path``).  Returns
    outputs, timings, which model file ran and, for golden inputs, the comparison."""
    path, manifest, _ = read_bundle(bundle)
    t0 = time.perf_counter()
    sess, how = open_session(path, providers=providers, verify=verify, fast_path=fast_path)
    created = time.perf_counter() - t0
    golden = inputs is None
    expected = None
    if golden:
        if not (path / GOLDEN_INPUTS).exists():
            raise UsageError(f"{path} has no golden inputs; pass --inputs")
        inputs, expected = _golden(path)
    names_in = {i.name for i in sess.get_inputs()}
    missing = sorted(names_in - set(inputs))
    if missing:
        raise UsageError(
            f"inputs missing: {', '.join(missing)} (the bundle takes {', '.join(sorted(names_in))})"
        )
    feeds = {k: v for k, v in inputs.items() if k in names_in}
    names = [o.name for o in sess.get_outputs()]
    times = []
    outs = None
    for _ in range(max(1, repeat)):
        t1 = time.perf_counter()
        try:
            outs = sess.run(names, feeds)
        except Exception as e:  # noqa: BLE001
            text = str(e).strip()
            raise GraphoptError(
                f"onnxruntime failed to run the bundle: {text.splitlines()[0] if text else e}"
            ) from None
        times.append(time.perf_counter() - t1)
    result: dict[str, Any] = {
        "bundle": str(path),
        "target": manifest.get("target"),
        "providers": sess.get_providers(),
        "outputs": dict(zip(names, outs)),
        "session_create_ms": round(created * 1e3, 2),
        "session": how,
        "run_ms": [round(t * 1e3, 4) for t in times],
        "golden": None,
    }
    if expected is not None:
        target = get_target(manifest["target"])
        common = [n for n in names if n in expected]
        diffs = compare_outputs(
            common,
            [expected[n] for n in common],
            [result["outputs"][n] for n in common],
            target.tolerances,
        )
        result["golden"] = {"ok": all(d.ok for d in diffs), "outputs": [asdict(d) for d in diffs]}
    return result

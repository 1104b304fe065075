"""The per-target bundle (DESIGN.md §7): what will run, how to run it, and what was verified here.

``optimize`` writes ``OUT_DIR/model.onnx`` (+ ``model.onnx.data``) and ``report.json``; this
module adds, in the same staging directory (so the whole bundle appears in one rename):

* ``manifest.json``: every node → the kernel that runs it on the target (provider, op, domain,
  since-version, dtype; for cuda from the pinned table, for cpu from the live registry), with
  layout, output shapes and a workspace estimate where cheap, the verified shape range (the
  parity shapes), latency (measured on this machine for cpu, else null), ``performance`` (the
  bundle timed against the original by the performance safety net, or why it was not: a target
  whose device is not here) and a ``verified`` block
  saying what ran here and what did not (``"device": "not-run"`` when the target's device is not
  on this machine: a GPU or NPU result is never claimed).
* ``session_config.json``: how onnxruntime must build the session — graph optimization level
  (the profile's, EXTENDED or below: ALL adds machine-specific NCHWc layouts), providers, and the
  onnxruntime optimizers to disable, each with its reason: fusions the target measured slower
  (``Target.measured_slower``, e.g. SkipLayerNormFusion on cpu) and ConvBNFusion when an fp16
  model keeps a BatchNormalization graphopt's precision guard refused to fold (onnxruntime would
  fold it in fp16 anyway).  Names are passed both as ``disabled_optimizers`` and as the session
  config entry ``optimization.disable_specified_optimizers`` (onnxruntime ignores unknown names
  silently; the ones used here were checked to take effect).
* ``golden/inputs.npz`` and ``golden/outputs.npz``: the parity inputs and the *original* model's
  outputs on them (onnxruntime CPU, optimizations disabled).
* ``memory_plan.json``: activation memory at the parity shapes, with and without buffer reuse
  (:mod:`graphopt.targets.memory`).
* ``kernels/`` (models with ``graphopt.fused`` nodes, ``optimize --kernels``): the generated
  kernels' source, ABI header, ``build.sh``, the library built there, the build log and
  ``kernels.json`` (:mod:`graphopt.targets.codegen.library`); the manifest's ``kernels``
  section lists them with their gate numbers (cuda: ptxas resources, ``"device": "not-run"``),
  and the session config's ``custom_op_libraries`` names the library per provider, which
  :func:`load_session` registers.

:func:`load_session` builds the session exactly as the manifest and session config say; the
bundle is checked with it before it is moved into place (golden outputs within the target's
tolerances, on this machine's CPU when the target's device is absent).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphopt.opt.errors import GraphoptError, UsageError
from graphopt.opt.parity import ParityReport, Session, compare_outputs, compute_dtype, make_inputs
from graphopt.opt.target import Target, get_target
from graphopt.targets.kernels import model_opsets, norm_domain, primary_slots, resolve
from graphopt.targets.memory import dtype_name, measured_view, memory_plan, nbytes, shape_view

SCHEMA = "graphopt.bundle/1"
MANIFEST = "manifest.json"
SESSION_CONFIG = "session_config.json"
MEMORY_PLAN = "memory_plan.json"
GOLDEN_INPUTS = "golden/inputs.npz"
GOLDEN_OUTPUTS = "golden/outputs.npz"

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
def write_bundle_files(
    out_dir: Path, model: onnx.ModelProto, report, progress=None
) -> dict[str, str]:
    """Write manifest, session config, golden files and memory plan into ``out_dir`` (where
    model.onnx already is).  Returns {kind: file name relative to the bundle}.  ``progress(msg)``
    is told each phase."""
    say = progress or (lambda _msg: None)
    target = get_target(report.target)
    ctx = report.bundle_context or {}
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

    say("bundle: golden inputs and outputs")
    golden = _write_golden(out_dir, original, shapes, given, seed, report, ctx)
    if golden.get("written"):
        files.update(golden_inputs=GOLDEN_INPUTS, golden_outputs=GOLDEN_OUTPUTS)
    verified_shapes = golden.get("shapes") or dict(report.parity.inputs or {})
    view = shape_view(model, verified_shapes)
    say("bundle: memory plan")
    measured = _measure_unknown(out_dir, model, view, golden)
    plan = memory_plan(model, view, verified_shapes)
    plan["measured_shapes"] = measured
    (out_dir / MEMORY_PLAN).write_text(json.dumps(plan, indent=2, sort_keys=True))
    session = session_config(target, model)
    kernels = _write_kernels(out_dir, model, target, report)
    if kernels:
        files["kernels"] = "kernels/kernels.json"
        session["custom_op_libraries"] = {
            provider: lib["path"] for provider, lib in sorted(kernels["libraries"].items())
        }
        session["reasons"]["custom_op_libraries"] = (
            "the model has graphopt.fused nodes: load_session registers the library of the "
            "provider it runs on (register_custom_ops_library)"
        )
        session["kernel_threads"] = 1
        session["reasons"]["kernel_threads"] = (
            "OpenMP team size of the generated cpu kernels (GRAPHOPT_KERNEL_THREADS while "
            "load_session creates the session; 0 = OpenMP's default): a team beside "
            "onnxruntime's intra-op pool oversubscribes the cores (measured in "
            "examples/kernels/README.md)"
        )
    (out_dir / SESSION_CONFIG).write_text(json.dumps(session, indent=2, sort_keys=True))
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
        "external_data": sorted(p.name for p in out_dir.glob("model.onnx.data*")),
        "model_sha256": _sha256(out_dir / "model.onnx"),
        "source_model": report.model,
        "source_model_sha256": _sha256(Path(report.model))
        if Path(report.model).is_file()
        else None,
        "pipeline": report.pipeline,
        "level": report.level,
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
        # the performance safety net (graphopt.opt.perf): the bundle against the original here
        "performance": getattr(report, "performance", None),
        "verified": {},
        "nodes": nodes,
        "kernels": kernels or None,
    }
    _kernel_latencies(nodes, kernels)
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    say("bundle: verifying it as load_session runs it, then its latency")
    manifest["verified"], manifest["latency"] = _verify(out_dir, manifest, session, target, report)
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return files


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


def _measure_unknown(out_dir: Path, model: onnx.ModelProto, view, golden: dict) -> int:
    """Fill the shapes static inference left unknown from an onnxruntime run on the golden
    inputs; returns how many were measured."""
    unknown = [o for n in model.graph.node for o in n.output if o and nbytes(view.get(o)) is None]
    if not unknown or not golden.get("written"):
        return 0
    feeds, _ = _golden(out_dir)
    try:
        measured = measured_view(model, feeds, unknown)
    except GraphoptError:
        return 0
    view.update(measured)
    return len(measured)


def _sha256(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


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
    for idx, node in enumerate(model.graph.node):
        dom = norm_domain(node.domain)
        dtype = _primary(node, view, opsets.get(dom))
        res = resolve(target, node.op_type, dom, opsets.get(dom), dtype)
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
                "dtype": dtype_name(view[o][0]) if o in view else None,
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
                "kernel": res.to_dict() if res.runs else None,
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
def _verify(out_dir: Path, manifest: dict, session: dict, target: Target, report):
    """Run the bundle as load_session builds it; never claim what did not run."""
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
        return verified, latency
    providers = session["providers"] if on_device else ["CPUExecutionProvider"]
    try:
        t0 = time.perf_counter()
        sess = load_session(out_dir, providers=providers, verify_hash=False)
        created = time.perf_counter() - t0
        feeds, expected = _golden(out_dir)
        names = [o.name for o in sess.get_outputs() if o.name in expected]
        got = sess.run(
            names, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
        )
    except Exception as e:  # noqa: BLE001 - reported in the manifest, never a crash
        verified["bundle_session"] = (
            f"failed: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        )
        return verified, latency
    diffs = compare_outputs(names, [expected[n] for n in names], got, target.tolerances)
    ok = all(d.ok for d in diffs)
    verified["deploy_parity"] = _deploy_parity(sess, session, feeds, names, got, target, report)
    verified["bundle_session"] = {
        "providers": providers,
        "graph_optimization_level": session.get("graph_optimization_level"),
        "golden_ok": ok,
        "max_abs": {d.name: d.max_abs for d in diffs},
        "what": "the bundle loaded with load_session (its session config) on "
        + ("the target's device" if on_device else "this machine's CPU (semantics only)"),
    }
    if on_device:
        verified["device"] = "pass" if ok else "fail"
    if target.name == "cpu" or on_device:
        latency = _latency(sess, feeds, created)
        latency["providers"] = providers
    return verified, latency


def _deploy_parity(sess, session: dict, feeds, names, got, target: Target, report) -> dict:
    """The bundle as it will be loaded against the original under the same settings.

    Parity proper runs both graphs as written (optimizations off); what deploys runs at the
    session config's level, where onnxruntime's own transformers may treat the two graphs
    differently (e.g. re-quantizing weights a rewrite made float).  A disagreement here is a
    parity failure (``report.parity_deployed``) naming the setting."""
    ctx = report.bundle_context or {}
    level = session.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
    setting = f"graph_optimization_level={level}"
    if session.get("disabled_optimizers"):
        setting += f", disabled_optimizers={','.join(session['disabled_optimizers'])}"
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
    try:
        original = Session(
            ctx["original"],
            level=getattr(ort.GraphOptimizationLevel, level),
            base_dir=ctx.get("base_dir"),
        )
        ref = original.run(feeds, names)
    except (GraphoptError, KeyError, AttributeError) as e:
        report.parity_deployed = ParityReport.not_run(f"the original at {setting}: {e}")
        return {"ran": False, "setting": setting, "why": str(e)}
    diffs = compare_outputs(
        names, ref, got, target.tolerances, compute_dtype=compute_dtype(ctx["original"])
    )
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
    )
    return {
        "ran": True,
        "ok": ok,
        "setting": setting,
        "max_abs": {d.name: d.max_abs for d in diffs},
        "what": "the bundle (load_session) against the original model under the same session "
        "settings, on this machine's CPU",
    }


def _latency(sess, feeds, created_s: float) -> dict[str, Any]:
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
        "session_create_ms": round(created_s * 1e3, 2),
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
    with np.load(bundle / GOLDEN_INPUTS, allow_pickle=False) as f:
        feeds = {k: f[k] for k in f.files}
    with np.load(bundle / GOLDEN_OUTPUTS, allow_pickle=False) as f:
        outs = {k: f[k] for k in f.files}
    return feeds, outs


# ------------------------------------------------------------------------------ loading
def read_bundle(bundle: str | os.PathLike) -> tuple[Path, dict, dict]:
    path = Path(bundle)
    if path.is_file() and path.name == MANIFEST:
        path = path.parent
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        config = json.loads((path / SESSION_CONFIG).read_text())
    except FileNotFoundError as e:
        raise UsageError(
            f"{path} is not a graphopt bundle: {Path(e.filename).name} is missing"
        ) from None
    except json.JSONDecodeError as e:
        raise GraphoptError(f"{path}: corrupt bundle file ({e})") from None
    if manifest.get("schema") != SCHEMA:
        raise GraphoptError(f"{path}: unknown bundle schema {manifest.get('schema')!r}")
    return path, manifest, config


def load_session(
    bundle: str | os.PathLike,
    *,
    providers: list[str] | None = None,
    verify_hash: bool = True,
) -> ort.InferenceSession:
    """An onnxruntime session for a bundle, built as its manifest and session config say.

    ``providers`` overrides the bundle's (e.g. ``["CPUExecutionProvider"]`` to run a cuda or npu
    bundle's semantics on a machine without the device); without it, a provider the bundle needs
    but this machine lacks is an error, never a silent fallback.
    """
    path, manifest, config = read_bundle(bundle)
    model_path = path / manifest.get("model", "model.onnx")
    if verify_hash and manifest.get("model_sha256"):
        if _sha256(model_path) != manifest["model_sha256"]:
            raise GraphoptError(f"{model_path} does not match the manifest's model_sha256")
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
    so = ort.SessionOptions()
    so.log_severity_level = 3
    level = config.get("graph_optimization_level", "ORT_ENABLE_EXTENDED")
    try:
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    except AttributeError:
        raise GraphoptError(f"session config: unknown graph_optimization_level {level!r}") from None
    if config.get("intra_op_num_threads"):
        so.intra_op_num_threads = int(config["intra_op_num_threads"])
    for key, value in sorted((config.get("session_config_entries") or {}).items()):
        so.add_session_config_entry(key, str(value))
    _register_kernels(path, manifest, config, so, wanted, verify_hash)
    try:
        with _kernel_threads(config.get("kernel_threads")):
            return ort.InferenceSession(
                str(model_path),
                so,
                providers=wanted,
                disabled_optimizers=list(config.get("disabled_optimizers") or []),
            )
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise GraphoptError(f"onnxruntime cannot load the bundle: {first}") from None


def _kernel_threads(n):
    """Generated kernels read their thread count when onnxruntime creates them."""
    from contextlib import nullcontext

    from graphopt.targets.codegen.gates import kernel_threads

    return nullcontext() if n is None else kernel_threads(int(n))


def _register_kernels(path: Path, manifest: dict, config: dict, so, wanted, verify_hash) -> None:
    """Register the bundle's generated-kernel library for the provider the session runs on
    (the CUDA one when CUDAExecutionProvider is used, else the CPU one)."""
    libs = config.get("custom_op_libraries") or {}
    if not libs:
        return
    provider = next((p for p in wanted if p in libs), "CPUExecutionProvider")
    rel = libs.get(provider)
    if rel is None:
        raise GraphoptError(f"the bundle has no generated-kernel library for {provider}")
    lib = path / rel
    if not lib.is_file():
        raise GraphoptError(f"the bundle's kernel library {rel} is missing (run its build.sh)")
    info = ((manifest.get("kernels") or {}).get("libraries") or {}).get(provider) or {}
    if verify_hash and info.get("sha256") and _sha256(lib) != info["sha256"]:
        raise GraphoptError(f"{rel} does not match the manifest's sha256 (rebuilt elsewhere?)")
    so.register_custom_ops_library(str(lib))


def run_bundle(
    bundle: str | os.PathLike,
    inputs: dict[str, np.ndarray] | None = None,
    *,
    providers: list[str] | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    """Run a bundle on ``inputs`` (default: its golden inputs, then compared with the golden
    outputs).  Returns outputs, timings and, for golden inputs, the comparison."""
    path, manifest, _ = read_bundle(bundle)
    t0 = time.perf_counter()
    sess = load_session(path, providers=providers)
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

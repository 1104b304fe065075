"""Optimize every model of the wild corpus and print what happened, one markdown table per target.

    python examples/wild/run_wild.py DIR [--targets cpu,tensorrt] [--level 2] [--graphopt CMD]
                                         [--json FILE] [--only NAME,...] [--timeout S]

For each DIR/<name>.onnx and target it runs ``graphopt optimize MODEL --target T -O L -o OUT
--format json`` (with ``--inputs DIR/<name>.inputs.npz`` when make_wild.py wrote one) as a
subprocess, and records: the exit code (and the stderr line when it is not 0), nodes before →
after, whether the written model is valid (``onnx.checker.check_model(full_check=True)`` and an
onnxruntime session created here, on the CPU provider, with the bundle's session settings),
parity ran / ok from the report, safety-net firings (remarks from the ``safety-net`` pass),
model + external data bytes in → out, whether the model is quantized (Q/DQ, QLinear*, integer
or n-bit MatMul ops) in → out, the optimized/original latency ratio
(ORT_ENABLE_ALL or the bundle's level, 1 thread, interleaved runs for about ``--bench-seconds``
on the bundle's golden inputs) and the wall time. A model graphopt rejects is a row, never a
crash. Needs onnx, onnxruntime and numpy (graphopt's own environment has them).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

QUANT_OPS = {
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "ConvInteger",
    "MatMulNBits",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
    "QAttention",
    "QGemm",
    "QOrderedMatMul",
    "GatherBlockQuantized",
}
LEVELS = {
    "ORT_DISABLE_ALL": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "ORT_ENABLE_BASIC": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "ORT_ENABLE_EXTENDED": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "ORT_ENABLE_ALL": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass
class Row:
    model: str
    target: str
    exit: int | str = "?"
    stderr: str = ""
    nodes_before: int | None = None
    nodes_after: int | None = None
    valid: str = "-"
    parity_ran: bool | None = None
    parity_ok: bool | None = None
    parity_note: str = ""
    safety_net: int = 0
    safety_notes: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int | None = None
    quant_in: bool = False
    quant_out: bool | None = None
    latency_ratio: float | None = None
    latency_note: str = ""
    wall_s: float = 0.0
    #: model.onnx in a bare onnxruntime session (no library, default settings): "ok" or why not
    bare: str = "-"
    #: outputs passed against the original's own drift (parity's ``judged``), by name
    noise: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- model facts


def graphs_of(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The main graph and every subgraph (If/Loop/Scan bodies), recursively."""
    found, todo = [], [model.graph]
    while todo:
        g = todo.pop()
        found.append(g)
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    todo.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    todo.extend(attr.graphs)
    return found


def all_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = [n for g in graphs_of(model) for n in g.node]
    return nodes + [n for f in model.functions for n in f.node]


def is_quantized(model: onnx.ModelProto) -> bool:
    return any(n.op_type in QUANT_OPS or n.op_type.startswith("QLinear") for n in all_nodes(model))


def external_files(model: onnx.ModelProto) -> set[str]:
    """Locations of the external data that the model's tensors point to."""
    tensors: list[onnx.TensorProto] = []
    for g in graphs_of(model):
        tensors.extend(g.initializer)
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    tensors.append(attr.t)
                elif attr.type == onnx.AttributeProto.TENSORS:
                    tensors.extend(attr.tensors)
    locs = set()
    for t in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            locs.update(e.value for e in t.external_data if e.key == "location")
    return locs


def model_bytes(path: Path) -> tuple[int, onnx.ModelProto]:
    """File size plus the external data files it references."""
    model = onnx.load(str(path), load_external_data=False)
    size = path.stat().st_size
    for loc in external_files(model):
        ext = path.parent / loc
        size += ext.stat().st_size if ext.exists() else 0
    return size, model


# ------------------------------------------------------------------------------ validity


def first_line(text: str, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:limit]


def session_options(config: dict, bundle: Path | None) -> tuple[ort.SessionOptions, list[str]]:
    """One thread, sequential, the bundle's level / entries / custom-op libraries if any."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.graph_optimization_level = LEVELS.get(
        config.get("graph_optimization_level", ""), LEVELS["ORT_ENABLE_ALL"]
    )
    for key, value in (config.get("session_config_entries") or {}).items():
        so.add_session_config_entry(str(key), str(value))
    if config.get("intra_op_num_threads"):
        so.intra_op_num_threads = int(config["intra_op_num_threads"])
    lib = (config.get("custom_op_libraries") or {}).get("CPUExecutionProvider")
    if lib and bundle is not None:
        so.register_custom_ops_library(str(bundle / lib))
    return so, list(config.get("disabled_optimizers") or [])


def make_session(path: Path, config: dict, bundle: Path | None) -> ort.InferenceSession:
    so, disabled = session_options(config, bundle)
    kwargs = {"disabled_optimizers": disabled} if disabled else {}
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"], **kwargs)


def check_output(bundle: Path, config: dict) -> tuple[str, ort.InferenceSession | None]:
    """onnx full check of the written model, then an onnxruntime session built here."""
    path = bundle / "model.onnx"
    if not path.exists():
        return "no model", None
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        return f"checker: {first_line(exc)}", None
    try:
        return "ok", make_session(path, config, bundle)
    except Exception as exc:
        return f"onnxruntime: {first_line(exc)}", None


def bare_session(bundle: Path) -> str:
    """model.onnx as anyone may run it: onnxruntime.InferenceSession with default settings."""
    try:
        ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
        return "ok"
    except Exception as exc:
        return f"onnxruntime: {first_line(exc)}"


# ------------------------------------------------------------------------------- latency


def random_feeds(sess: ort.InferenceSession, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: symbolic dims 1 on the first axis and 16 elsewhere, as graphopt does."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in sess.get_inputs():
        if not inp.type.startswith("tensor("):
            raise ValueError(f"input {inp.name} is {inp.type}")
        code = getattr(onnx.TensorProto, inp.type[len("tensor(") : -1].upper())
        dtype = onnx.helper.tensor_dtype_to_np_dtype(code)
        shape = [
            d if isinstance(d, int) and d > 0 else (1 if i == 0 else 16)
            for i, d in enumerate(inp.shape)
        ]
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[inp.name] = np.ones(shape, np.bool_)
        else:
            feeds[inp.name] = rng.integers(0, 100, shape).astype(dtype)
    return feeds


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def pick_feeds(
    bundle: Path, given: Path | None, sess: ort.InferenceSession
) -> dict[str, np.ndarray]:
    for path in (bundle / "golden" / "inputs.npz", given):
        if path is not None and path.exists():
            return load_npz(path)
    return random_feeds(sess)


def latency_ratio(
    original: ort.InferenceSession, optimized: ort.InferenceSession, feeds: dict, budget_s: float
) -> float:
    """Median optimized / median original over interleaved single runs (one warm-up each)."""
    names_o = {i.name for i in original.get_inputs()}
    names_p = {i.name for i in optimized.get_inputs()}
    feeds_o = {k: v for k, v in feeds.items() if k in names_o}
    feeds_p = {k: v for k, v in feeds.items() if k in names_p}
    original.run(None, feeds_o)
    optimized.run(None, feeds_p)
    times_o, times_p = [], []
    start = time.perf_counter()
    while len(times_o) < 3 or (time.perf_counter() - start < budget_s and len(times_o) < 2000):
        for sess, f, sink in ((original, feeds_o, times_o), (optimized, feeds_p, times_p)):
            t0 = time.perf_counter()
            sess.run(None, f)
            sink.append(time.perf_counter() - t0)
    return statistics.median(times_p) / statistics.median(times_o)


def measure(
    row: Row,
    model: Path,
    bundle: Path,
    config: dict,
    opt_sess: ort.InferenceSession,
    given: Path | None,
    budget_s: float,
) -> None:
    try:
        orig_sess = make_session(model, {"graph_optimization_level": "ORT_ENABLE_ALL"}, None)
    except Exception as exc:
        row.latency_note = f"original does not load: {first_line(exc)}"
        return
    try:
        feeds = pick_feeds(bundle, given, orig_sess)
        row.latency_ratio = latency_ratio(orig_sess, opt_sess, feeds, budget_s)
    except Exception as exc:
        row.latency_note = f"bench: {first_line(exc)}"


# -------------------------------------------------------------------------------- running


def read_report(stdout: str, bundle: Path) -> dict | None:
    try:
        report = json.loads(stdout)
        if isinstance(report, dict) and "nodes_before" in report:
            return report
    except ValueError:
        pass
    path = bundle / "report.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None
    return None


def fill_from_report(row: Row, report: dict) -> None:
    row.nodes_before = report.get("nodes_before")
    row.nodes_after = report.get("nodes_after")
    parity = report.get("parity") or {}
    row.parity_ran = parity.get("ran")
    row.parity_ok = parity.get("ok")
    row.parity_note = first_line(parity.get("error") or "")
    deployed = report.get("parity_deployed") or {}
    for d in (parity.get("outputs") or []) + (deployed.get("outputs") or []):
        if d.get("judged", "tolerance") != "tolerance":
            row.noise.append(f"{d['name']}: {d['judged']}")
    for remark in report.get("remarks") or []:
        if (
            remark.get("pass") in ("safety-net", "verify")
            or remark.get("code") == "runtime-rejects"
        ):
            row.safety_net += 1
            row.safety_notes.append(first_line(remark.get("message", ""), 160))


def run_one(model: Path, target: str, args: argparse.Namespace, work: Path) -> Row:
    row = Row(model.stem, target)
    row.bytes_in, original = model_bytes(model)
    row.quant_in = is_quantized(original)
    bundle = work / f"{model.stem}.{target}.graphopt"
    given = model.with_suffix(".inputs.npz")
    given = given if given.exists() and not args.no_inputs else None
    cmd = [
        *shlex.split(args.graphopt),
        "optimize",
        str(model),
        "--target",
        target,
        "-O",
        str(args.level),
        "-o",
        str(bundle),
        "--format",
        "json",
    ]
    cmd += ["--inputs", str(given)] if given else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        row.exit = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        row.exit, stdout, stderr = "timeout", "", f"no answer in {exc.timeout:.0f} s"
    except OSError as exc:
        row.exit, stdout, stderr = "not run", "", str(exc)
    row.wall_s = time.perf_counter() - t0
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    row.stderr = (lines[-1] if lines else "")[:300] if row.exit != 0 else ""
    report = read_report(stdout, bundle)
    if report:
        fill_from_report(row, report)
    finish_bundle(row, model, bundle, given, args)
    return row


def finish_bundle(
    row: Row, model: Path, bundle: Path, given: Path | None, args: argparse.Namespace
) -> None:
    if not (bundle / "model.onnx").exists():
        return
    config_path = bundle / "session_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    row.bytes_out, optimized = model_bytes(bundle / "model.onnx")
    row.quant_out = is_quantized(optimized)
    row.valid, sess = check_output(bundle, config)
    row.bare = bare_session(bundle)
    if sess is not None and args.bench_seconds > 0:
        measure(row, model, bundle, config, sess, given, args.bench_seconds)


# ------------------------------------------------------------------------------- printing


def mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def yes(flag: bool | None) -> str:
    return {True: "yes", False: "no", None: "-"}[flag]


COLUMNS = (
    "model",
    "exit",
    "nodes",
    "valid",
    "bare",
    "parity ran/ok",
    "safety net",
    "MB in→out",
    "quantized in→out",
    "latency opt/orig",
    "wall s",
)


def cells(r: Row) -> list[str]:
    return [
        r.model,
        str(r.exit),
        "-" if r.nodes_before is None else f"{r.nodes_before}→{r.nodes_after}",
        r.valid if r.valid in ("ok", "-") else "NO",
        r.bare if r.bare in ("ok", "-") else "NO",
        f"{yes(r.parity_ran)}/{yes(r.parity_ok)}" + ("*" if r.noise else ""),
        str(r.safety_net),
        f"{mb(r.bytes_in)}→{mb(r.bytes_out)}"
        + (f" ({r.bytes_out / r.bytes_in:.3f}x)" if r.bytes_out and r.bytes_in else ""),
        f"{yes(r.quant_in)}→{yes(r.quant_out)}",
        f"{r.latency_ratio:.2f}" if r.latency_ratio is not None else "-",
        f"{r.wall_s:.1f}",
    ]


def table(rows: list[Row], target: str, level: int) -> str:
    out = [f"### target {target}, -O{level}", "", "| " + " | ".join(COLUMNS) + " |"]
    out.append("|" + "---|" * len(COLUMNS))
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    out += ["", summary(rows), *notes(rows)]
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    codes: dict[str, int] = {}
    for r in rows:
        codes[str(r.exit)] = codes.get(str(r.exit), 0) + 1
    spread = ", ".join(f"exit {k}: {v}" for k, v in sorted(codes.items()))
    ran, ok = sum(bool(r.parity_ran) for r in rows), sum(bool(r.parity_ok) for r in rows)
    return (
        f"{len(rows)} models; {spread}; valid output {sum(r.valid == 'ok' for r in rows)}; "
        f"bare session {sum(r.bare == 'ok' for r in rows)}; "
        f"parity ran {ran}, ok {ok}; safety-net firings {sum(r.safety_net for r in rows)}"
    )


def notes(rows: list[Row]) -> list[str]:
    lines = []
    for r in rows:
        why = []
        if r.stderr:
            why.append(f"exit {r.exit}: {r.stderr}")
        if r.valid not in ("ok", "-"):
            why.append(f"output invalid: {r.valid}")
        if r.bare not in ("ok", "-"):
            why.append(f"bare session: {r.bare}")
        if r.noise:
            why.append("within the model's own noise: " + ", ".join(r.noise))
        if r.parity_ran is False and r.parity_note:
            why.append(f"parity not run: {r.parity_note}")
        if r.safety_notes:
            why.append("safety net: " + "; ".join(r.safety_notes[:3]))
        if r.latency_note:
            why.append(r.latency_note)
        if why:
            lines.append(f"- {r.model}: " + " | ".join(why))
    return ["", *lines] if lines else []


# ----------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="folder written by make_wild.py")
    ap.add_argument("--targets", default="cpu,tensorrt")
    ap.add_argument("--level", type=int, default=2)
    ap.add_argument(
        "--graphopt",
        default="graphopt",
        help="command that runs graphopt (default: graphopt on PATH)",
    )
    ap.add_argument("--json", type=Path, help="also write every row as JSON here")
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per optimize run")
    ap.add_argument(
        "--bench-seconds", type=float, default=1.0, help="latency budget per model (0: skip)"
    )
    ap.add_argument("--work", type=Path, help="where bundles go (default: a temporary folder)")
    ap.add_argument("--no-inputs", action="store_true", help="ignore the <name>.inputs.npz files")
    args = ap.parse_args()
    models = sorted(args.dir.glob("*.onnx"))
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    models = [m for m in models if not only or m.stem in only]
    if not models:
        print(f"error: no .onnx models in {args.dir}", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="wild-run-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = {t: [progress(run_one(m, t, args, work)) for m in models] for t in targets}
    for target, rows in results.items():
        print(table(rows, target, args.level) + "\n")
    if args.json:
        payload = {
            "level": args.level,
            "graphopt": args.graphopt,
            "onnxruntime": ort.__version__,
            "rows": [asdict(r) for t in targets for r in results[t]],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def progress(row: Row) -> Row:
    print(
        f"{row.target:9s} {row.model:32s} exit {row.exit!s:8s} {row.wall_s:6.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return row


if __name__ == "__main__":
    sys.exit(main())

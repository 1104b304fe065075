#!/usr/bin/env python3
"""Per-model attention table: what `graphopt optimize -O2` fuses on each transformer model.

    python examples/transformers/run_attention.py MODELS_DIR [--targets cpu,cuda]
        [--names a,b] [--latency] [--json FILE]

For every NAME.onnx with a NAME.json sidecar in MODELS_DIR (as written by
examples/make_models.py) and every target, run `graphopt optimize MODEL --target T -O 2` in its
own process, feeding NAME.npz (the test inputs, padded attention masks included) when present,
else the sidecar's test shapes; each NAME.VARIANT.npz beside it is one more row, NAME.VARIANT
(a merged decoder's first step, the If's other branch). From the bundle's report.json and the
models (their If bodies included), tabulate:

- layers: Softmax nodes in the original (every graph: an If's branches count);
- fused: attention ops created, by type (MultiHeadAttention, Attention, GroupQueryAttention...);
- missed: `fuse-attention*` (and the rules respelling for it) missed remarks by code, and for the
  first one its stage and tensor (or its message);
- parity: ok / FAILED / not run, and the exit code when not 0;
- nodes: before -> after (every graph).

With --latency (cpu only), each model also goes through the benchmark's rivals and its timing
worker (examples/benchmark/bench.py: one latency process, onnxruntime ORT_ENABLE_ALL,
1 thread, interleaved rounds): graphopt's output (with its bundle's session config) against the
original, and against the fastest rival whose output matched (a head-to-head ratio with its
95 % interval); a second table gives every tool's ratio to the original (graphopt -O2, its
bundle, each rival, or why it has none). Markdown to stdout; --json FILE writes the rows;
--render FILE... prints the tables of saved rows (several files merged; with --json, the
merged rows are written there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from graphopt.rules.attention.census import RULE, UNFOLD

HERE = Path(__file__).resolve().parent
BENCH_DIR = HERE.parent / "benchmark"

#: the attention rules whose missed remarks the table counts: fuse-attention and the rules
#: that respell an attention for it
ATTENTION_RULES = (RULE, *UNFOLD)
#: the benchmark tools compared with --latency (graphopt's own rows and the rivals)
MINE = ["none", "graphopt-O2", "graphopt-O2-bundle"]
EXIT_CODES = {1: "error", 2: "usage", 3: "parity failed", 4: "cannot run", 5: "regression"}


def discover(models_dir: Path, names: list[str] | None) -> list[Path]:
    """NAME.onnx files with a NAME.json sidecar, sorted; `names` filters (unknown names exit 2)."""
    found = {
        p.stem: p for p in sorted(models_dir.glob("*.onnx")) if p.with_suffix(".json").exists()
    }
    if names is None:
        return list(found.values())
    unknown = [n for n in names if n not in found]
    if unknown:
        raise SystemExit(f"error: no NAME.onnx + NAME.json for: {', '.join(unknown)}")
    return [found[n] for n in names]


def input_sets(model: Path) -> list[tuple[str, Path | None]]:
    """(row name, inputs file) per set of test inputs: NAME.npz (or the sidecar's shapes when
    there is none), then each NAME.VARIANT.npz as its own row NAME.VARIANT (a merged decoder's
    first step beside its decoding step)."""
    main = model.with_suffix(".npz")
    sets = [(model.stem, main if main.exists() else None)]
    for extra in sorted(model.parent.glob(f"{model.stem}.*.npz")):
        sets.append((extra.name[: -len(".npz")], extra))
    return sets


def all_ops(path: Path) -> Counter:
    """Op counts of the model's graph and of every body inside it (an If's branches), short
    op names; the weights are not read."""
    import onnx

    counts: Counter = Counter()
    graphs = [onnx.load(str(path), load_external_data=False).graph]
    while graphs:
        g = graphs.pop()
        for node in g.node:
            counts[node.op_type] += 1
            for a in node.attribute:
                graphs += ([a.g] if a.HasField("g") else []) + list(a.graphs)
    return counts


def optimize_cmd(
    model: Path, out: Path, target: str, measure: bool, inputs: Path | None = None
) -> list[str]:
    """The graphopt command line for one model and target, fed ``inputs`` (default: NAME.npz
    when present, else the sidecar's shapes)."""
    cmd = [
        sys.executable,
        "-m",
        "graphopt.cli",
        "optimize",
        str(model),
        "-o",
        str(out),
        "--target",
        target,
        "-O",
        "2",
        "--quiet",
    ]
    if inputs is None and model.with_suffix(".npz").exists():
        inputs = model.with_suffix(".npz")
    if inputs is not None:
        cmd += ["--inputs", str(inputs)]
    else:
        shapes = json.loads(model.with_suffix(".json").read_text()).get("inputs", {})
        for name, dims in shapes.items():
            cmd += ["--shape", f"{name}={','.join(str(d) for d in dims)}"]
    if not measure:
        cmd.append("--no-measure")
    return cmd


def short_op(op: str) -> str:
    """'com.microsoft.MultiHeadAttention' -> 'MultiHeadAttention'."""
    return op.rsplit(".", 1)[-1]


def fused_attention(report: dict) -> dict[str, int]:
    """Attention ops the optimization added, by short op name."""
    before, after = report.get("ops_before", {}), report.get("ops_after", {})
    fused = {
        short_op(op): n - before.get(op, 0)
        for op, n in after.items()
        if "Attention" in short_op(op) and n > before.get(op, 0)
    }
    return dict(sorted(fused.items()))


def missed_attention(report: dict) -> tuple[dict[str, int], str]:
    """Missed fuse-attention* remarks by code, and where the first one stopped."""
    missed = [
        r
        for r in report.get("remarks", [])
        if r.get("kind") == "missed" and str(r.get("rule", "")).startswith(ATTENTION_RULES)
    ]
    codes = Counter(r.get("code", "?") for r in missed)
    if not missed:
        return {}, ""
    first = missed[0]
    args = first.get("args") or {}
    where = ", ".join(f"{k} {args[k]}" for k in ("stage", "tensor") if args.get(k))
    if not where:
        node = first.get("nodes", [""])[0] if first.get("nodes") else ""
        where = (f"at {node}: " if node else "") + str(first.get("message", ""))[:90]
    return dict(codes.most_common()), f"{first.get('code')}: {where}"


def parity_cell(report: dict | None, rc: int) -> str:
    parity = (report or {}).get("parity") or {}
    if not parity.get("ran"):
        text = "not run"
    else:
        text = "ok" if parity.get("ok") else "FAILED"
    if rc:
        text += f" (exit {rc}: {EXIT_CODES.get(rc, '?')})"
    return text


def row_from_report(
    name: str,
    target: str,
    report: dict | None,
    rc: int,
    error: str,
    ops: tuple[Counter, Counter] | None = None,
) -> dict:
    """One table row (a dict, as --json writes it); ``ops``: the op counts of the original and
    the output over all their graphs (bodies included; nodes too), else the report's
    main-graph counts."""
    row: dict = {"model": name, "target": target, "rc": rc}
    if report is None:
        row["error"] = error or f"exit {rc}, no report.json"
        return row
    codes, first = missed_attention(report)
    if ops is not None:
        report = dict(report, ops_before=dict(ops[0]), ops_after=dict(ops[1]))
        report.update(nodes_before=sum(ops[0].values()), nodes_after=sum(ops[1].values()))
    row.update(
        layers=report.get("ops_before", {}).get("Softmax", 0),
        softmax_after=report.get("ops_after", {}).get("Softmax", 0),
        fused=fused_attention(report),
        missed=codes,
        first_missed=first,
        parity=parity_cell(report, rc),
        nodes_before=report.get("nodes_before"),
        nodes_after=report.get("nodes_after"),
        seconds=(report.get("seconds") or {}).get("total"),
    )
    if error and rc:
        row["error"] = error
    return row


def run_one(
    model: Path,
    target: str,
    work: Path,
    measure: bool,
    timeout: float,
    keep: bool,
    name: str | None = None,
    inputs: Path | None = None,
) -> dict:
    """Optimize one model for one target in a child process (fed ``inputs``) and read its
    report; the row is called ``name`` (default: the model's)."""
    name = name or model.stem
    out = work / f"{name}.{target}.graphopt"
    shutil.rmtree(out, ignore_errors=True)
    cmd = optimize_cmd(model, out, target, measure, inputs)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        rc, stderr = 124, f"timed out after {timeout:.0f} s"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    error = lines[-1].strip()[:300] if lines else ""
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    written = out / "model.onnx"
    ops = (all_ops(model), all_ops(written)) if report and written.exists() else None
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return row_from_report(name, target, report, rc, error, ops)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "—"


def render(rows: list[dict], latency: bool) -> str:
    head = [
        "model",
        "target",
        "layers",
        "fused",
        "missed fuse-attention*",
        "first miss",
        "parity",
        "nodes",
    ]
    if latency:
        head += ["ALL vs original", "vs best rival"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "layers" not in r:
            cells = [r["model"], r["target"], "", "", "", "", r.get("error", ""), ""]
        else:
            nodes = f"{r['nodes_before']} → {r['nodes_after']}"
            first = r["first_missed"].replace("|", "/")
            cells = [
                r["model"],
                r["target"],
                str(r["layers"]),
                _counts(r["fused"]),
                _counts(r["missed"]),
                first,
                r["parity"],
                nodes,
            ]
        if latency:
            cells += [r.get("latency_vs_original", ""), r.get("latency_vs_rival", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ latency


def _bench():
    """examples/benchmark/bench.py as a module (its rival runners and latency worker)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    import bench

    return bench


def tool_cell(r: dict) -> str:
    """One tool's latency at ENABLE_ALL over the original's (median of per-round ratios,
    p10-p90), or why there is none."""
    if r.get("na"):
        return "n/a"
    if r.get("opt_error"):
        return "failed: " + str(r["opt_error"]).replace("|", "/")[:60]
    if r.get("session_error_ENABLE_ALL"):
        return "no session"
    if "parity" in r and not r["parity"].get("ok"):
        return "outputs differ"
    e = r.get("ENABLE_ALL", {})
    if "ratio" not in e:
        return "not timed"
    lo, hi = e.get("ratio_p10_p90", [e["ratio"], e["ratio"]])
    return f"{e['ratio']:.3f} [{lo:.2f}–{hi:.2f}]"


def latency_cells(result: dict) -> tuple[str, str, dict]:
    """From bench.bench_model's result: graphopt/original at ENABLE_ALL (median of per-round
    ratios, p10-p90) and graphopt/best rival (the head-to-head, else the ratio of ratios); the
    detail keeps every tool's cell (:func:`tool_cell`) under ``cells``."""
    tools = result.get("tools", {})
    cells = {t: tool_cell(r) for t, r in tools.items() if t != "none"}

    def usable(tool: str) -> dict | None:
        r = tools.get(tool, {})
        ok = r.get("parity", {}).get("ok") and r.get("ENABLE_ALL", {}).get("ratio")
        return r if ok and not r.get("session_error_ENABLE_ALL") else None

    mine_tool = next((t for t in ("graphopt-O2-bundle", "graphopt-O2") if usable(t)), None)
    if mine_tool is None:
        return "no usable graphopt output", "", {"cells": cells}
    mine = tools[mine_tool]["ENABLE_ALL"]
    lo, hi = mine["ratio_p10_p90"]
    vs_orig = f"{mine['ratio']:.3f} [{lo:.2f}–{hi:.2f}]"
    rivals = {t: r["ENABLE_ALL"]["ratio"] for t in tools if t not in MINE and (r := usable(t))}
    if not rivals:
        return vs_orig, "no matching rival", {"mine": mine_tool, "cells": cells}
    best = min(rivals, key=rivals.get)
    duel = result.get("duel") or {}
    if duel.get("rival") == best and "ratio" in duel:
        lo, hi = duel["ci95"]
        vs_rival = f"{duel['ratio']:.3f} [{lo:.3f}–{hi:.3f}] vs {best}"
    else:
        vs_rival = f"{mine['ratio'] / rivals[best]:.3f} vs {best}"
    return vs_orig, vs_rival, {"mine": mine_tool, "rivals": rivals, "duel": duel, "cells": cells}


def render_latency(rows: list[dict]) -> str:
    """The latency table: per cpu row with --latency, graphopt -O2 and its bundle, each rival
    (ENABLE_ALL over the original), and the head-to-head against the fastest matching rival."""
    rows = [r for r in rows if r.get("target") == "cpu" and "latency_vs_original" in r]
    cells = [(r.get("latency") or {}).get("cells", {}) for r in rows]
    rivals = list(dict.fromkeys(t for c in cells for t in c if t not in MINE))
    head = ["model", "graphopt -O2", "bundle", *rivals, "bundle vs fastest rival"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, c in zip(rows, cells):
        tools = [c.get("graphopt-O2", ""), c.get("graphopt-O2-bundle", "")]
        tools += [c.get(t, "") for t in rivals]
        duel = r.get("latency_vs_rival") or r.get("latency_vs_original", "")
        lines.append("| " + " | ".join([r["model"], *tools, duel]) + " |")
    return "\n".join(lines)


def add_latency(rows: list[dict], models: dict[str, Path], args) -> None:
    """Run the benchmark on each model once (cpu rows get the cells)."""
    bench = _bench()
    tools = MINE + [t for t in args.rivals.split(",") if t]
    opts = argparse.Namespace(
        runs=args.runs,
        warmup=2,
        min_time=args.min_time,
        max_runs=1000,
        duel_time=args.duel_time,
        create_reps=1,
        timeout=args.timeout,
        latency_timeout=3600.0,
        mem_factor=2.0,
        work=args.work / "bench",
        keep=False,
    )
    cpu = bench.os.cpu_count() - 1 if bench.os.cpu_count() else 0
    for name, path in models.items():
        result = bench.bench_model(name, path, path.with_suffix(".json"), tools, opts, cpu)
        vs_orig, vs_rival, detail = latency_cells(result)
        for row in rows:
            if row["model"] == name and row["target"] == "cpu":
                row.update(latency_vs_original=vs_orig, latency_vs_rival=vs_rival, latency=detail)


def merge_rows(paths: list[Path]) -> list[dict]:
    """Rows of several --json files, one per (model, target), a later file's row winning;
    sorted by model, targets in first-seen order."""
    merged: dict[tuple[str, str], dict] = {}
    for path in paths:
        for row in json.loads(path.read_text()):
            merged[(row["model"], row["target"])] = row
    order = {t: i for i, t in enumerate(dict.fromkeys(t for _, t in merged))}
    return [merged[k] for k in sorted(merged, key=lambda k: (k[0], order[k[1]]))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "models_dir", type=Path, nargs="?", help="folder of NAME.onnx + NAME.json (+ NAME.npz)"
    )
    ap.add_argument("--targets", default="cpu", help="comma-separated graphopt targets")
    ap.add_argument("--names", help="comma-separated model names (default: every model)")
    ap.add_argument(
        "--no-measure",
        action="store_true",
        help="pass --no-measure (skip graphopt's performance safety net)",
    )
    ap.add_argument(
        "--latency",
        action="store_true",
        help="add ENABLE_ALL latency ratios (cpu) against the original and rivals",
    )
    ap.add_argument(
        "--rivals",
        default="ort-transformers,onnxscript,onnxslim,ort-extended",
        help="benchmark tools compared with --latency",
    )
    ap.add_argument("--runs", type=int, default=30, help="--latency: rounds (at least)")
    ap.add_argument(
        "--min-time",
        type=float,
        default=2.0,
        help="--latency: seconds of timed runs per variant (at least)",
    )
    ap.add_argument(
        "--duel-time",
        type=float,
        default=10.0,
        help="--latency: seconds per side of the head-to-head; 0 skips it",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="per optimize run, s")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "graphopt-attention",
        help="scratch folder for the bundles",
    )
    ap.add_argument("--keep", action="store_true", help="keep the bundles in --work")
    ap.add_argument(
        "--json", type=Path, help="also write the rows as JSON here (rewritten after each row)"
    )
    ap.add_argument(
        "--render",
        type=Path,
        nargs="+",
        help="print the tables of rows saved with --json and run nothing (a later file's row "
        "replaces an earlier one of the same model and target; --json writes the merged rows)",
    )
    args = ap.parse_args(argv)

    if args.render:
        rows = merge_rows(args.render)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(render(rows, latency=False))
        if any("latency_vs_original" in r for r in rows):
            print("\n" + render_latency(rows))
        return 0
    if args.models_dir is None or not args.models_dir.is_dir():
        ap.error(f"{args.models_dir} is not a folder")
    names = [n.strip() for n in args.names.split(",") if n.strip()] if args.names else None
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets:
        ap.error("--targets names no target")
    models = discover(args.models_dir, names)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    measure = not args.no_measure
    for model in models:
        for name, inputs in input_sets(model):
            for target in targets:
                row = run_one(
                    model, target, args.work, measure, args.timeout, args.keep, name, inputs
                )
                print(f"{name} {target}: {json.dumps(row)}", file=sys.stderr, flush=True)
                rows.append(row)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.latency:
        add_latency(rows, {m.stem: m for m in models}, args)
    print(render(rows, args.latency))
    if args.latency:
        print("\n" + render_latency(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

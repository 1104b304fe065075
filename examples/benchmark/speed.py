"""``bench.py --speed``: how long each optimizer takes and how much memory it needs.

Per model, every tool runs as a whole process under bench.py's measuring wrapper (wall time and
peak RSS of the process): ``graphopt optimize --no-check`` (the optimizer and the bundle, no
parity; generated kernels and their gates where a compiler is present, as by default), graphopt's
default run (parity, the performance safety net and generated kernels where
a compiler is present; ``--shape`` from the sidecar), onnxruntime's offline optimization in a
Python script (ORT_ENABLE_EXTENDED, the optimized model written by the session), onnxsim,
onnxslim, onnxscript's optimizer and onnxoptimizer.  The model (and its data) is read once
before the first round, so that no tool pays alone for reading it from disk.  With
``--speed-rounds N`` the tools run N
times, interleaved round by round (the order rotates), and the median wall time is kept (peak
RSS: the largest).  The table gives each tool's wall time and RSS and both as multiples of
``graphopt --no-check``, plus graphopt's own phase times (report.json → ``seconds``).

    python examples/benchmark/bench.py --speed --only resnet50,bert_base --speed-rounds 3
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import bench

NO_CHECK = "graphopt --no-check"
DEFAULT = "graphopt (default run)"
#: shown name → bench.py tool name
RIVALS = {
    "onnxruntime offline": "ort-extended",
    "onnxsim": "onnxsim",
    "onnxslim": "onnxslim",
    "onnxscript": "onnxscript",
    "onnxoptimizer": "onnxoptimizer",
}
TOOLS = [NO_CHECK, DEFAULT, *RIVALS]
#: graphopt's phases in the order a run goes through them (graphopt.opt.clock.ORDER)
PHASES = ("startup", "load", "calibration", "passes", "validity", "parity", "measure", "write")


def _command(tool: str, src: Path, out_dir: Path, sidecar: dict) -> list[str]:
    """The process that optimizes ``src`` with ``tool``, writing into ``out_dir``."""
    if tool in (NO_CHECK, DEFAULT):
        cmd, _ = bench._optimize_cmd("graphopt-O2", src, out_dir, {})
        cmd = [c for c in cmd if c not in ("--no-measure", "--no-kernels")]
        if tool == DEFAULT:  # as a user runs it: parity, safety net, kernels
            return cmd + bench._shape_flags(sidecar.get("inputs"))
        return cmd + ["--no-check"]  # as typed: generated kernels (and their gates) included
    cmd, _ = bench._optimize_cmd(RIVALS[tool], src, out_dir, sidecar)
    return cmd


def _phases(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / "report.json").read_text()).get("seconds")
    except (OSError, ValueError):
        return None


def speed_model(
    name: str, path: Path, side: Path, rounds: int, timeout: float, work: Path, tools=TOOLS
):
    """Every tool (of ``tools``) on one model, ``rounds`` interleaved rounds; one row per
    tool."""
    sidecar = json.loads(side.read_text()) if side else {}
    _read_through(path)
    runs: dict[str, list[dict]] = {t: [] for t in tools}
    for r in range(rounds):
        order = tools[r % len(tools) :] + tools[: r % len(tools)]
        for tool in order:
            out_dir = work / name / tool.split()[0] / f"r{r}"
            rec = bench._run_measured(_command(tool, path, out_dir, sidecar), timeout)
            if tool in (NO_CHECK, DEFAULT):
                rec["phases"] = _phases(out_dir)
            shutil.rmtree(out_dir, ignore_errors=True)  # (all of them: over 30 GB for the set)
            runs[tool].append(rec)
            ok = "ok" if rec.get("rc") == 0 else rec.get("error", "failed")
            print(f"  {name} round {r + 1}: {tool}: {rec.get('wall_s', 0):.2f} s, {ok}", flush=True)
    return {tool: _row(recs) for tool, recs in runs.items()}


def _read_through(path: Path) -> None:
    """Read the model file and its external data once before the rounds, so that the first
    tool does not pay alone for reading them from disk (a 500 MB model read cold took 10-20 s
    on a stalling disk, once, whichever tool came first)."""
    import onnx

    files = [path]
    try:
        m = onnx.load(str(path), load_external_data=False)
        for t in m.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    files.append(path.parent / e.value)
    except Exception:  # noqa: BLE001 - a model the tools will fail on themselves
        pass
    for f in dict.fromkeys(files):
        try:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        except OSError:
            pass


def _without_measure(row: dict) -> float:
    """A row's wall time without graphopt's safety-net timing (results written before rows
    kept it: the phases of one round subtracted from the median)."""
    if "wall_without_measure_s" in row:
        return row["wall_without_measure_s"]
    return row["wall_s"] - ((row.get("phases") or {}).get("measure") or 0.0)


def _row(recs: list[dict]) -> dict:
    good = [r for r in recs if r.get("rc") == 0]
    if not good:
        return {"ok": False, "error": recs[0].get("error", "failed") if recs else "not run"}
    middle = sorted(good, key=lambda r: r["wall_s"])[(len(good) - 1) // 2]
    return {
        "ok": True,
        "wall_s": statistics.median(r["wall_s"] for r in good),
        "walls": [round(r["wall_s"], 3) for r in good],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in good),
        "phases": middle.get("phases"),  # of the round with the median wall time
        # graphopt's wall time without its safety net's timing, round by round, then the median
        "wall_without_measure_s": statistics.median(
            r["wall_s"] - ((r.get("phases") or {}).get("measure") or 0.0) for r in good
        ),
    }


def render(meta: dict, results: dict) -> str:
    lines = [
        "# Optimizer speed and memory",
        "",
        f"`{meta['command']}` — {meta['date']}, {meta['machine']}; "
        f"{meta['rounds']} interleaved round(s) per tool, median wall time, largest peak RSS.",
        "Ratios are each tool's figure divided by `graphopt --no-check`'s on the same model in "
        "the same run (< 1: the tool is faster / smaller).",
        "",
    ]
    lines += summary(results)
    for name, rows in results.items():
        base = rows.get(NO_CHECK, {})
        lines += [
            f"## {name}",
            "",
            "| tool | wall s | peak RSS MB | wall ÷ graphopt | RSS ÷ graphopt |",
            "|---|---:|---:|---:|---:|",
        ]
        for tool in TOOLS:
            row = rows.get(tool, {})
            if not row.get("ok"):
                lines.append(f"| {tool} | failed: {row.get('error', '?')} | | | |")
                continue
            wr = row["wall_s"] / base["wall_s"] if base.get("ok") else None
            mr = row["peak_rss_mb"] / base["peak_rss_mb"] if base.get("ok") else None
            lines.append(
                f"| {tool} | {row['wall_s']:.2f} | {row['peak_rss_mb']:.0f} | "
                f"{bench._fmt(wr)} | {bench._fmt(mr)} |"
            )
        for tool in (NO_CHECK, DEFAULT):
            phases = rows.get(tool, {}).get("phases")
            if phases:
                keys = [k for k in PHASES if k in phases]
                keys += sorted(k for k in phases if k not in keys and k != "total")
                shown = ", ".join(f"{k} {phases[k]:.2f}" for k in keys)
                lines.append(f"\n{tool} phases (report.json, s): {shown}; total {phases['total']}")
        lines.append("")
    return "\n".join(lines)


def summary(results: dict) -> list[str]:
    """One row per model against onnxruntime's offline optimizer and onnxsim, then the medians:
    graphopt --no-check's wall time and peak RSS over onnxruntime's, whether it is below
    onnxsim's, and the default run over --no-check without the performance safety net's
    timing (``measure``, which has a budget of its own)."""
    ort_name = "onnxruntime offline"
    lines = [
        "## Summary",
        "",
        "| model | --no-check s | onnxruntime s | ÷ onnxruntime | onnxsim s | below onnxsim "
        "| default (no measure) ÷ --no-check | --no-check RSS MB | onnxruntime RSS MB "
        "| RSS ÷ onnxruntime |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    walls, rss, defaults, below = [], [], [], []
    for name, rows in results.items():
        g, o, sim, d = (rows.get(t, {}) for t in (NO_CHECK, ort_name, "onnxsim", DEFAULT))
        if not g.get("ok"):
            lines.append(f"| {name} | failed | | | | | | | | |")
            continue
        wr = mr = dr = None
        if o.get("ok"):
            wr, mr = g["wall_s"] / o["wall_s"], g["peak_rss_mb"] / o["peak_rss_mb"]
            walls.append(wr)
            rss.append(mr)
        faster = "n/a"
        if sim.get("ok"):
            faster = "yes" if g["wall_s"] < sim["wall_s"] else "no"
            below.append(faster == "yes")
        if d.get("ok"):
            dr = _without_measure(d) / g["wall_s"]
            defaults.append(dr)
        cells = [
            name,
            f"{g['wall_s']:.2f}",
            f"{o['wall_s']:.2f}" if o.get("ok") else "failed" if o else "not run",
            bench._fmt(wr),
            f"{sim['wall_s']:.2f}" if sim.get("ok") else "failed" if sim else "not run",
            faster,
            bench._fmt(dr),
            f"{g['peak_rss_mb']:.0f}",
            f"{o['peak_rss_mb']:.0f}" if o.get("ok") else "",
            bench._fmt(mr),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    parts = []
    if walls:
        parts.append(
            f"--no-check ÷ onnxruntime median {statistics.median(walls):.2f} (max "
            f"{max(walls):.2f}, {sum(w > 3 for w in walls)} above 3x)"
        )
    if below:
        parts.append(f"below onnxsim on {sum(below)}/{len(below)}")
    if defaults:
        parts.append(
            f"default (without measure) ÷ --no-check median {statistics.median(defaults):.2f} "
            f"(max {max(defaults):.2f})"
        )
    if rss:
        parts.append(
            f"peak RSS ÷ onnxruntime median {statistics.median(rss):.2f} (max {max(rss):.2f}, "
            f"at or below on {sum(r <= 1 for r in rss)}/{len(rss)})"
        )
    if parts:
        lines += ["", f"{len(results)} models: " + "; ".join(parts) + "."]
    return lines + [""]


def run_speed(args, models_dir: Path, only: list[str] | None) -> int:
    """bench.py --speed: the table for every model found (see the module docstring)."""
    if args.graphopt_source == "snapshot":
        snap = bench._snapshot_graphopt(args.work / "_graphopt_snapshot")
        bench.GRAPHOPT_PYTHONPATH = str(snap)
    elif args.graphopt_source != "installed":
        bench.GRAPHOPT_PYTHONPATH = str(Path(args.graphopt_source).resolve())
    tools = TOOLS
    if args.speed_tools:
        tools = [t.strip() for t in args.speed_tools.split(",") if t.strip()]
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            print(f"unknown --speed-tools {unknown}; known: {TOOLS}", file=sys.stderr)
            return 2
    queue = bench._discover(models_dir, only)
    if not queue:
        print(f"no models found in {models_dir}", file=sys.stderr)
        return 1
    date = _dt.datetime.now().strftime("%Y-%m-%d")
    out_md = args.out or (bench.HERE / "results" / f"SPEED-{date}.md")
    meta = {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python", "examples/benchmark/bench.py"] + sys.argv[1:]),
        "machine": bench._machine(),
        "versions": bench._versions(),
        "models_dir": bench._shown(models_dir),
        "graphopt_checkout": bench._git_state(),
        "rounds": args.speed_rounds,
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=args.work if args.work.is_dir() else None) as tmp:
        for name, path, side in queue:
            print(f"[speed] {name}", flush=True)
            results[name] = speed_model(
                name, path, side, args.speed_rounds, args.timeout, Path(tmp), tools
            )
            out_md.parent.mkdir(parents=True, exist_ok=True)
            out_md.write_text(render(meta, results))
            out_md.with_suffix(".json").write_text(
                json.dumps({"meta": meta, "results": results}, indent=1)
            )
    print(out_md.read_text())
    print(f"results: {out_md}")
    return 0

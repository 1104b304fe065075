"""Session creation as a deployed process pays it: once, in a fresh process.

Per model: graphopt's default run writes a bundle (``graphopt optimize MODEL -o WORK/NAME
--target cpu``); then, round by round in an order that alternates, fresh Python processes each
create one session and print how long the creation took (the interpreter's start and imports are
not counted):

* ``original``: ``onnxruntime.InferenceSession(MODEL)`` at ORT_ENABLE_ALL, one thread;
* ``bundle``: ``graphopt.load_session(BUNDLE)`` as users load it (its integrity check, and the
  machine-specific fast path where the bundle was built on this machine);
* ``elsewhere``: ``load_session`` with the machine's CPU features faked to differ, as on a
  machine that does not match the fast path's record: the portable model.onnx.

and, in one more process each, the same creations repeated (``warm``: the median of the
repetitions after the first, when the allocator already holds the memory a previous session
freed).  Medians over the rounds; ratios to the original's.

    python examples/benchmark/creation.py --models examples/benchmark/models \\
        --only resnet50,bert_base,gpt2 --rounds 5 --work $WORK --out results/CREATION-latest.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

#: the child: create one kind of session ``reps`` times, print the times (ms) as JSON
CHILD = r"""
import gc, json, sys, time
kind, path, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
import onnxruntime as ort
if kind == "original":
    def create():
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]), None
else:
    import graphopt
    from graphopt.targets import bundle
    if kind == "elsewhere":
        bundle.cpu_features = lambda: ("sse2", "a-feature-this-machine-lacks")
    def create():
        return graphopt.open_session(path)
times, how = [], None
for _ in range(reps):
    t0 = time.perf_counter()
    session, how = create()
    times.append((time.perf_counter() - t0) * 1e3)
    del session
    gc.collect()
print(json.dumps({"ms": times, "model": (how or {}).get("model")}))
"""

KINDS = ("original", "bundle", "elsewhere")


def _create(kind: str, path: Path, reps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(path), str(reps)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{kind} session of {path.name}: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bundle(model: Path, out_dir: Path) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "graphopt.cli", "optimize", str(model), "-o", str(out_dir)]
    subprocess.run(cmd + ["--target", "cpu", "--quiet"], check=True)


def measure(model: Path, bundle_dir: Path, rounds: int, warm_reps: int) -> dict:
    """Cold (fresh process) and warm creation times of the three kinds, interleaved."""
    paths = {"original": model, "bundle": bundle_dir, "elsewhere": bundle_dir}
    cold: dict[str, list[float]] = {k: [] for k in KINDS}
    loaded: dict[str, str | None] = {}
    for r in range(rounds):
        order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
        for kind in order:
            got = _create(kind, paths[kind], 1)
            cold[kind] += got["ms"]
            loaded[kind] = got["model"]
    warm = {k: statistics.median(_create(k, paths[k], warm_reps + 1)["ms"][1:]) for k in KINDS}
    med = {k: statistics.median(v) for k, v in cold.items()}
    return {
        "cold_ms": cold,
        "cold_median_ms": med,
        "warm_median_ms": warm,
        "loaded": loaded,
        "cold_ratio": {k: med[k] / med["original"] for k in ("bundle", "elsewhere")},
        "warm_ratio": {k: warm[k] / warm["original"] for k in ("bundle", "elsewhere")},
    }


def render(results: dict, command: str) -> str:
    lines = [
        "# Session creation: the bundle through load_session vs the original at ORT_ENABLE_ALL\n",
        f"`{command}` — {_dt.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, "
        f"onnxruntime {_ort_version()}, graphopt {_revision()}.\n",
        "Cold: one creation per fresh process, median over the rounds (order alternating); "
        "warm: one process creating the same session again, median after the first. "
        "`elsewhere`: load_session with the CPU features faked to differ from the fast path's "
        "record (the portable model.onnx is loaded).\n",
        "| model | original cold ms | bundle cold ms | ÷ original | elsewhere cold ms | "
        "÷ original | bundle loaded | elsewhere loaded | warm ÷ original (bundle, elsewhere) |",
        "|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for name, r in results.items():
        m = r["cold_median_ms"]
        lines.append(
            f"| {name} | {m['original']:.0f} | {m['bundle']:.0f} | "
            f"{r['cold_ratio']['bundle']:.2f} | {m['elsewhere']:.0f} | "
            f"{r['cold_ratio']['elsewhere']:.2f} | {r['loaded']['bundle']} | "
            f"{r['loaded']['elsewhere']} | {r['warm_ratio']['bundle']:.2f}, "
            f"{r['warm_ratio']['elsewhere']:.2f} |"
        )
    lines.append("\nPer-round cold times (ms):\n")
    for name, r in results.items():
        cells = "; ".join(f"{k} {[round(x) for x in r['cold_ms'][k]]}" for k in KINDS)
        lines.append(f"- {name}: {cells}")
    return "\n".join(lines) + "\n"


def _revision() -> str:
    """The checkout's commit (and whether it has changes), or "unknown"."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(here), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev or "unknown"


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, required=True, help="folder of NAME.onnx files")
    ap.add_argument("--only", default="resnet50,bert_base,gpt2", help="comma-separated names")
    ap.add_argument("--rounds", type=int, default=5, help="fresh processes per kind (median)")
    ap.add_argument("--warm-reps", type=int, default=3, help="repeated creations after the first")
    ap.add_argument("--work", type=Path, required=True, help="where the bundles are written")
    ap.add_argument("--out", type=Path, help="write the table (markdown) and a .json beside it")
    args = ap.parse_args(argv)
    command = "python examples/benchmark/creation.py " + " ".join(
        a if a != str(args.work) else "$WORK" for a in (argv or sys.argv[1:])
    )
    results = {}
    for name in [n for n in args.only.split(",") if n]:
        model = args.models / f"{name}.onnx"
        bundle_dir = args.work / name
        _bundle(model, bundle_dir)
        results[name] = measure(model, bundle_dir, args.rounds, args.warm_reps)
        print(f"{name}: {json.dumps(results[name]['cold_ratio'])}", flush=True)
    text = render(results, command)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

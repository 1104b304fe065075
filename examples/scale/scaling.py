"""Print the optimizer's scaling table: -O2 time and peak RSS on synthetic models of growing size.

    python examples/scale/scaling.py --nodes 1000 10000 50000 200000 [--models DIR] [--json F]

Each size is generated once by make_synthetic.py (into --models, default a temporary folder;
an existing synth_<N>.onnx there is reused), then optimized by `graphopt optimize --no-check
--no-kernels` in its own process: wall time and that process's own peak RSS (os.wait4), and
graphopt's phase times from report.json (startup, load, passes, validity, write, bundle), and
the process's CPU time (user + system: on a loaded machine the wall time also counts the
waits for a core, the CPU time much less).  The last columns say how near-linear the growth is:
seconds per 1k nodes of the pipeline (passes), of the whole wait and of the CPU time, which
stay flat when the cost is linear in the node count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("startup", "load", "passes", "validity", "write", "bundle")


# Linux counts the parent's peak RSS in a child's ru_maxrss (exec records the old address
# space's high-water mark, and a forked child starts from the parent's): a large parent (a test
# run) would inflate every figure.  So the command is started by a small Python process, whose
# child's own peak is what gets reported.
_RUNNER = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); "
    "_, st, ru = os.wait4(p.pid, 0); "
    "open(sys.argv[1], 'w').write(f'{st} {ru.ru_maxrss} {ru.ru_utime + ru.ru_stime}')"
)


def timed(cmd: list[str]) -> tuple[int, float, float, str, float]:
    """Run ``cmd``; its exit code, wall seconds, peak RSS in MB (its own, not its siblings' nor
    this process's), stdout and CPU seconds (user + system, its children's included)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryDirectory() as tmp:
        usage_file = Path(tmp) / "usage"
        runner = [sys.executable, "-c", _RUNNER, str(usage_file), *cmd]
        subprocess.run(runner, stdout=out, stderr=subprocess.DEVNULL, check=True)
        wall = time.perf_counter() - t0
        status, maxrss_kb, cpu = usage_file.read_text().split()
        out.seek(0)
        text = out.read().decode()
    return os.waitstatus_to_exitcode(int(status)), wall, int(maxrss_kb) / 1024, text, float(cpu)


def row(n: int, models: Path, work: Path) -> dict:
    model = models / f"synth_{n}.onnx"
    if not model.exists():
        gen = [sys.executable, str(HERE / "make_synthetic.py"), "--nodes", str(n)]
        subprocess.run(gen + ["--out", str(model)], check=True, capture_output=True)
    cmd = [sys.executable, "-m", "graphopt.cli", "optimize", str(model), "-o", str(work / f"{n}")]
    code, wall, rss, out, cpu = timed(cmd + ["--no-check", "--no-kernels", "--format", "json"])
    if code != 0:
        return {"nodes": n, "error": f"exit {code}"}
    report = json.loads(out)
    return {
        "nodes": report["nodes_before"],
        "nodes_after": report["nodes_after"],
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_mb": rss,
        "seconds": report["seconds"],
    }


def line(r: dict) -> str:
    if "error" in r:
        return f"| {r['nodes']} | {r['error']} |"
    s = r["seconds"]
    k = r["nodes"] / 1000
    phases = " | ".join(f"{s.get(p, 0.0):.1f}" for p in PHASES)
    return (
        f"| {r['nodes']} | {r['nodes_after']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {phases} | "
        f"{r['peak_rss_mb']:.0f} | {s.get('passes', 0.0) / k:.3f} | {r['wall_s'] / k:.3f} | "
        f"{r['cpu_s'] / k:.3f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 50000, 200000])
    ap.add_argument("--models", type=Path, default=None, help="where synth_<N>.onnx are kept")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    cols = " | ".join(f"{p} s" for p in PHASES)
    print(
        f"| nodes | nodes after | wall s | CPU s | {cols} | peak RSS MB | passes s/1k | "
        "wall s/1k | CPU s/1k |"
    )
    print("|---:" * (len(PHASES) + 8) + "|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or Path(tmp)
        models.mkdir(parents=True, exist_ok=True)
        for n in args.nodes:
            rows.append(row(n, models, Path(tmp)))
            print(line(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

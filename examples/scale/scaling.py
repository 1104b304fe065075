"""Print the optimizer's scaling table: -O2 time and peak RSS on synthetic models of growing size.

    python examples/scale/scaling.py --nodes 10000 50000 200000
Each size runs `graphopt optimize --no-check` in its own process (peak RSS from getrusage).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[10000, 50000, 200000])
    args = ap.parse_args()
    print("| nodes | nodes after | optimize s | wall s | s per 1k nodes | peak RSS MB |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nodes:
            model = Path(tmp) / f"synth_{n}.onnx"
            subprocess.run([sys.executable, str(HERE / "make_synthetic.py"), "--nodes", str(n),
                            "--out", str(model)], check=True, capture_output=True)
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(model),
                                  "-o", str(Path(tmp) / f"out_{n}"), "--no-check",
                                  "--format", "json"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            report = json.loads(out.stdout)
            secs = report["seconds"]["total"]
            print(f"| {report['nodes_before']} | {report['nodes_after']} | {secs:.1f} | "
                  f"{wall:.1f} | {1000 * secs / report['nodes_before']:.2f} | "
                  f"{max(rss, before) / 1024:.0f} |", flush=True)


if __name__ == "__main__":
    main()

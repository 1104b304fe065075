"""Profile bundles with ``graphopt profile`` and print one table of how their time adds up.

    python examples/profile/profile_table.py BUNDLE [BUNDLE ...] [--runs 50] [--top 3]
        [--graphopt CMD]

For each bundle: the measured run (session.run, median of the profiled runs), the sum of the
table's rows (the nodes' spans and the rows that belong to no node), their ratio and the
residual, the run with the profiler off, the mapping coverage (share of the nodes' time, and of
the run, owned by the model's nodes) and the top missed-fusion rows ranked by measured time.
``--graphopt``: the command that runs graphopt (default: this Python, ``-m graphopt.cli``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys


def profile(cmd: list[str], bundle: str, runs: int) -> dict:
    out = subprocess.run(
        [*cmd, "profile", bundle, "--runs", str(runs), "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--graphopt", default=f"{shlex.quote(sys.executable)} -m graphopt.cli")
    args = ap.parse_args()
    cmd = shlex.split(args.graphopt)
    results = [(b, profile(cmd, b, args.runs)) for b in args.bundles]
    head = (
        f"{'bundle':<28} {'nodes':>5} {'measured ms':>11} {'rows ms':>9} {'ratio':>6} "
        f"{'residual':>8} {'kernels ms':>10} {'unprofiled':>10} {'coverage':>8} {'of run':>6}"
    )
    print(head)
    for b, d in results:
        a = d["account"]
        print(
            f"{b[-28:]:<28} {d['node_count']:>5} {a['measured_ms']:>11.3f} {a['rows_ms']:>9.3f} "
            f"{d['ratio']:>6.3f} {a['residual_share'] * 100:>7.1f}% {d['kernel_ms']:>10.3f} "
            f"{d['unprofiled_run_ms']:>10.3f} {d['coverage'] * 100:>7.1f}% "
            f"{d['run_coverage'] * 100:>5.1f}%"
        )
    for b, d in results:
        print(f"\n{b}: rows of the run")
        for g in d["ops"][:8]:
            print(f"  {g['op']:<44} {g['count']:>4} {g['ms']:>9.3f} ms {g['share'] * 100:6.1f} %")
        rest = d["ops"][8:]
        if rest:
            ms = sum(g["ms"] for g in rest)
            print(f"  {f'({len(rest)} other op types)':<44} {'':>4} {ms:>9.3f} ms")
        for o in d["account"]["other"]:
            print(f"  {o['row']:<49} {o['ms']:>9.3f} ms {o['share'] * 100:6.1f} %")
        a = d["account"]
        print(f"  {'sum of the rows':<49} {a['rows_ms']:>9.3f} ms")
        print(f"  {'residual':<49} {a['residual_ms']:>+9.3f} ms {a['residual_share'] * 100:6.1f} %")
        print(f"  {'measured run (' + a['measured_by'] + ')':<49} {a['measured_ms']:>9.3f} ms")
        print(f"  top missed fusions by measured time ({len(d['missed'])} rows):")
        for m in d["missed"][: args.top]:
            print(
                f"    {m['share'] * 100:5.1f} % {m['ms']:8.3f} ms  {m['rule']}: {m['code']} "
                f"({m['nodes']} node(s), e.g. {m['sites'][0]})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

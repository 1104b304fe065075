#!/usr/bin/env python3
"""Does the cpu profile's key-length bound for MultiHeadAttention hold on whole models?

    python examples/benchmark/attention_bound.py MODELS_DIR --names wav2vec2,hubert,mobilevit \\
        [--rounds 40] [--min-round 0.05] [--json out.json]

For each NAME.onnx of MODELS_DIR (fed NAME.npz, the test inputs examples/make_models.py writes),
graphopt -O2 writes two models for cpu: as the cpu profile decides (attentions over fewer static
keys than its ``slower_below`` bound stay unfused: ``slower-on-target``) and with that bound
removed (every attention the rule recognizes fused).  The performance safety net is off for both,
so the difference is the bound alone.  The original and the two outputs then run in
onnxruntime's CPU provider, 1 intra-op thread, ORT_ENABLE_ALL, in interleaved rounds (the order
rotating each round; each model repeated until its part of the round lasts ``--min-round``
seconds).  The table gives each model's median time per run and the medians of the per-round
ratios with their bootstrap 95 % intervals: all fused over the bound's choice (above 1: the
bound is right to refuse), and each over the original.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import graphopt
from graphopt.opt.graph.ir import op_histogram
from graphopt.opt.rewrite.target import TARGETS, get_target
from graphopt.opt.verify.perf import ratio_interval

UNBOUNDED = "cpu-without-attention-bound"


def register_unbounded() -> None:
    """The cpu profile less its MultiHeadAttention key-length bound."""
    cpu = get_target("cpu")
    bounds = {k: v for k, v in cpu.slower_below.items() if k != "MultiHeadAttention"}
    TARGETS[UNBOUNDED] = dataclasses.replace(cpu, name=UNBOUNDED, slower_below=bounds)


def feeds_for(path: Path) -> dict[str, np.ndarray] | None:
    npz = path.with_suffix(".npz")
    return dict(np.load(npz)) if npz.exists() else None


def attention_count(m: onnx.ModelProto) -> tuple[int, int]:
    """(attention kernels, Softmax nodes) of the main graph."""
    ops = op_histogram(m.graph.node)
    fused = sum(n for op, n in ops.items() if op.endswith("Attention"))
    return fused, ops.get("Softmax", 0)


def session(m: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def timed_rounds(sessions: dict, feeds: dict, rounds: int, min_round: float) -> dict:
    """Per-round seconds per run of each session, in interleaved rounds."""
    names = list(sessions)
    for s in sessions.values():  # warm-up
        s.run(None, feeds)
    reps = {}
    for n, s in sessions.items():
        t0 = time.perf_counter()
        s.run(None, feeds)
        reps[n] = max(1, int(min_round / max(time.perf_counter() - t0, 1e-6)))
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            s, k = sessions[n], reps[n]
            t0 = time.perf_counter()
            for _ in range(k):
                s.run(None, feeds)
            times[n].append((time.perf_counter() - t0) / k)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("--names", required=True, help="comma-separated model names")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--min-round", type=float, default=0.05, help="seconds per model per round")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    register_unbounded()
    bound = get_target("cpu").slower_below.get("MultiHeadAttention", (0, ""))[0]
    print(
        f"onnxruntime {ort.__version__}, CPU, 1 thread, ORT_ENABLE_ALL, {args.rounds} "
        f"interleaved rounds; cpu bound: MultiHeadAttention from {bound} keys\n"
    )
    head = (
        "| model | attention fused (bound / none) | original ms | bound ms | all fused ms "
        "| all fused / bound | bound / original | all fused / original |"
    )
    print(head + "\n|" + "---|" * 8)
    rows = []
    for name in [n.strip() for n in args.names.split(",") if n.strip()]:
        path = args.models_dir / f"{name}.onnx"
        feeds = feeds_for(path)
        if feeds is None:
            raise SystemExit(f"{name}: needs {name}.npz (the test inputs)")
        outs, counts = {}, {}
        for label, target in (("bound", "cpu"), ("all fused", UNBOUNDED)):
            m, report = graphopt.optimize(
                str(path), target=target, level=2, inputs=feeds, measure=False
            )
            if not (report.parity.ran and report.parity.ok):
                print(f"{name} {label}: parity failed", file=sys.stderr)
                return 1
            outs[label], counts[label] = m, attention_count(m)
        original = onnx.load(str(path))
        sessions = {
            "original": session(original),
            "bound": session(outs["bound"]),
            "all fused": session(outs["all fused"]),
        }
        times = timed_rounds(sessions, feeds, args.rounds, args.min_round)
        t = {k: np.asarray(v) for k, v in times.items()}
        ratios = {
            "all fused / bound": ratio_interval(t["all fused"] / t["bound"]),
            "bound / original": ratio_interval(t["bound"] / t["original"]),
            "all fused / original": ratio_interval(t["all fused"] / t["original"]),
        }
        layers = counts["all fused"][0] + counts["all fused"][1]
        row = {
            "model": name,
            "layers": layers,
            "fused_bound": counts["bound"][0],
            "fused_unbounded": counts["all fused"][0],
            "ms": {k: float(np.median(v) * 1e3) for k, v in t.items()},
            "ratios": ratios,
            "rounds": args.rounds,
        }
        rows.append(row)
        cells = [f"{m:.3f} [{lo:.3f}–{hi:.3f}]" for m, lo, hi in ratios.values()]
        ms = row["ms"]
        print(
            f"| {name} | {row['fused_bound']} / {row['fused_unbounded']} of {layers} "
            f"| {ms['original']:.2f} | {ms['bound']:.2f} | {ms['all fused']:.2f} | "
            + " | ".join(cells)
            + " |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"onnxruntime": ort.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Latency of the original and the optimized model, measured together, and the CI baseline rule.

Both models get onnxruntime sessions with the same options (default: ORT_ENABLE_ALL, one
intra-op thread, what users get) and run interleaved — A B A B … — after a warm-up, so that
machine noise hits both alike.  The regression rule of the source document (reject a change more
than 5 % slower than the baseline) is applied to the *normalized* latency, optimized p95 divided
by original p95 in the same run (the median over five interleaved slices, so one burst of
background load does not decide): a baseline written on one machine stays meaningful on a busier
or faster one.  Absolute times are reported too.  A model onnxruntime cannot load or run is one
GraphoptError line (exit 1), checked with one run of each model before the timing starts.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import GraphoptError, UsageError
from .customops import register_libraries
from .parity import Session, make_inputs


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p95_ms: float
    mean_ms: float
    session_ms: float
    runs: int


@dataclass(frozen=True)
class BenchResult:
    original: Latency
    optimized: Latency
    ratio_p50: float
    ratio_p95: float
    threads: int
    level: str
    inputs: dict[str, list[int]]
    baseline: dict[str, Any] | None = None
    regression: float | None = None
    max_regression: float | None = None
    regressed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def _session(model: onnx.ModelProto, level: str, threads: int, which: str) -> tuple[Any, float]:
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    t0 = time.perf_counter()
    with _runtime_errors(f"onnxruntime cannot load the {which} model"):
        register_libraries(so, model)
        t0 = time.perf_counter()
        sess = ort.InferenceSession(
            model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
    return sess, (time.perf_counter() - t0) * 1000


@contextmanager
def _runtime_errors(what: str):
    """onnxruntime raises several unrelated types: one GraphoptError line (exit 1)."""
    try:
        yield
    except GraphoptError:
        raise
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GraphoptError(f"{what}: {first}") from None


def measure(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    runs: int = 50,
    warmup: int = 5,
    threads: int = 1,
    level: str = "all",
    shapes: dict[str, list[int]] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    min_seconds: float = 2.0,
) -> BenchResult:
    """At least ``runs`` interleaved rounds, and more until ``min_seconds`` of measuring have
    passed (a 0.1 ms model needs thousands of rounds for a stable p95)."""
    if level not in LEVELS:
        raise UsageError(f"--ort-level must be one of {', '.join(LEVELS)}")
    feeds = make_inputs(Session(original).sess, shapes or {}, seed, inputs)
    sessions, created = [], []
    for m, which in ((original, "original"), (optimized, "optimized")):
        s, ms = _session(m, level, threads, which)
        names = {i.name for i in s.get_inputs()}
        sessions.append((s, {k: v for k, v in feeds.items() if k in names}))
        created.append(ms)
    for which, (s, f) in zip(("original", "optimized"), sessions):  # one checked run each
        with _runtime_errors(f"onnxruntime cannot run the {which} model"):
            s.run(None, f)
    for _ in range(warmup):
        for s, f in sessions:
            s.run(None, f)
    times: list[list[float]] = [[], []]
    start = time.perf_counter()
    rounds = 0
    while rounds < runs or (time.perf_counter() - start < min_seconds and rounds < 100_000):
        for k, (s, f) in enumerate(sessions):
            t0 = time.perf_counter()
            s.run(None, f)
            times[k].append((time.perf_counter() - t0) * 1000)
        rounds += 1
    lat = [
        Latency(
            float(np.percentile(t, 50)),
            float(np.percentile(t, 95)),
            float(np.mean(t)),
            created[k],
            rounds,
        )
        for k, t in enumerate(times)
    ]
    return BenchResult(
        lat[0],
        lat[1],
        lat[1].p50_ms / lat[0].p50_ms,
        _blocked_ratio(times[0], times[1], 95),
        threads,
        level,
        {k: list(v.shape) for k, v in feeds.items()},
    )


def _blocked_ratio(base: list[float], new: list[float], q: float, blocks: int = 5) -> float:
    """The median over ``blocks`` consecutive slices of percentile-q(new) / percentile-q(base).

    Runs are interleaved, so each slice saw the same machine conditions for both models; taking
    the median across slices discards a slice a burst of background load spoiled."""
    n = min(len(base), len(new))
    blocks = max(1, min(blocks, n // 10))
    edges = np.linspace(0, n, blocks + 1).astype(int)
    ratios = [
        np.percentile(new[a:b], q) / np.percentile(base[a:b], q)
        for a, b in zip(edges[:-1], edges[1:])
    ]
    return float(np.median(ratios))


def parse_regression(text: str) -> float:
    """'5%' or '0.05' → 0.05."""
    try:
        return float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"--max-regression expects a percentage like 5% (got '{text}')") from None


def baseline_payload(result: BenchResult, model: str, target: str) -> dict[str, Any]:
    return {
        "schema": "graphopt.baseline/1",
        "model": model,
        "target": target,
        "onnxruntime": ort.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "threads": result.threads,
        "level": result.level,
        "inputs": result.inputs,
        "ratio_p95": result.ratio_p95,
        "original_p95_ms": result.original.p95_ms,
        "optimized_p95_ms": result.optimized.p95_ms,
    }


def apply_baseline(result: BenchResult, path: Path, max_regression: float) -> BenchResult:
    try:
        base = json.loads(Path(path).read_text())
        base_ratio = float(base["ratio_p95"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise UsageError(f"--baseline {path}: not a graphopt baseline file ({e})") from None
    regression = result.ratio_p95 / base_ratio - 1.0
    return BenchResult(
        **{
            **asdict(result),
            "original": result.original,
            "optimized": result.optimized,
            "baseline": base,
            "regression": regression,
            "max_regression": max_regression,
            "regressed": regression > max_regression,
        }
    )

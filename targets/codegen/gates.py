"""The gates a generated kernel passes before a fusion is kept.

For one candidate (a chain of ONNX nodes and the kernel that replaces it) at a concrete shape:

1. numerics: the fused node (custom-op library in onnxruntime) against the unfused chain run by
   onnxruntime as written (optimizations off), and against a float64 numpy evaluation of the
   expression, both within the target's tolerance for the dtype;
2. vectorization: gcc reported the kernel's loop vectorized (cpu, float32);
3. benchmark: the fused model is faster than the unfused chain in onnxruntime at
   ``ORT_ENABLE_ALL`` with one intra-op thread (and one kernel thread), medians of interleaved
   runs -- onnxruntime's own fusions of the chain (e.g. x·σ(x) -> QuickGelu) are in the baseline;
   the pass runs it on the chain alone and on the chain with its neighbours (see
   ``passes/fuse_elementwise.py``), the latter deciding -- unless onnxruntime runs the same
   neighbour kernels either way (:func:`same_neighbour_kernels`: no fusion across the chain's
   boundary lost), when the chain's own benchmark decides.  Rounds go on for up to
   ``BENCH_BUDGET_S`` each, fewer once they have decided (:func:`decided`).

Each gate says why it failed with the numbers; the pass turns that into a missed remark.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphopt.opt.verify.parity import compare_outputs
from graphopt.opt.verify.perf import ratio_interval

from .expr import evaluate
from .spec import KernelSpec

BENCH_BUDGET_S = 0.6
BENCH_MIN_PAIRS = 7
BENCH_MAX_PAIRS = 60
#: the benchmark stops before its budget once its rounds have decided: the 95 % interval of
#: the median per-pair ratio (fused / unfused) lies on one side of 1, or within this relative
#: difference of it (a tie: no win to measure more closely).  One pair of sessions cannot
#: resolve less: where a session's buffers land moves its speed by up to 3 % for its whole life
#: (a model timed against itself, two sessions, 400 interleaved rounds: 0.986-1.029)
BENCH_TIE = 0.03
#: warm-up runs per session before the timed pairs: up to this many, while they take less than
#: ``WARMUP_S`` together (the first run allocates; a heavy model's second run is already warm)
WARMUP_RUNS = 3
WARMUP_S = 0.02


@dataclass
class GateResult:
    ok: bool
    code: str = "fired"
    message: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)


@contextmanager
def kernel_threads(n: int):
    """Generated kernels read GRAPHOPT_KERNEL_THREADS when onnxruntime creates them."""
    old = os.environ.get("GRAPHOPT_KERNEL_THREADS")
    os.environ["GRAPHOPT_KERNEL_THREADS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GRAPHOPT_KERNEL_THREADS", None)
        else:
            os.environ["GRAPHOPT_KERNEL_THREADS"] = old


def session(
    model: onnx.ModelProto, level: str, threads: int = 1, library: str | None = None
) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    if library:
        so.register_custom_ops_library(library)
        with kernel_threads(threads):
            return ort.InferenceSession(model.SerializeToString(), so, ["CPUExecutionProvider"])
    return ort.InferenceSession(model.SerializeToString(), so, ["CPUExecutionProvider"])


def make_feeds(names: list[str], shape: list[int], dtype, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: np.asarray(rng.standard_normal(shape) * 3, dtype=dtype) for n in names}


def numerics(
    spec: KernelSpec,
    unfused: onnx.ModelProto,
    fused: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    params: list[np.ndarray],
    library: str,
    tolerances: dict[str, tuple[float, float]],
) -> GateResult:
    out = unfused.graph.output[0].name
    ref = session(unfused, "ORT_DISABLE_ALL").run([out], feeds)[0]
    got = session(fused, "ORT_DISABLE_ALL", library=library).run(None, feeds)[0]
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in fused.graph.initializer}
    xs = [feeds.get(n, consts.get(n)) for n in fused.graph.node[0].input[: spec.inputs]]
    f64 = evaluate(
        spec.expr, [x.astype(np.float64) for x in xs], [p.astype(np.float64) for p in params]
    )
    d_ort = compare_outputs(["y"], [ref], [got], tolerances)[0]
    d_f64 = compare_outputs(["y"], [f64], [got], tolerances)[0]
    d_base = compare_outputs(["y"], [f64], [ref], tolerances)[0]
    numbers = {
        "max_abs_vs_onnxruntime": d_ort.max_abs,
        "max_abs_vs_float64": d_f64.max_abs,
        "onnxruntime_max_abs_vs_float64": d_base.max_abs,
        "rtol": d_ort.rtol,
        "atol": d_ort.atol,
    }
    if not d_ort.ok:
        return GateResult(
            False,
            "numerics",
            f"differs from the unfused chain in onnxruntime: max abs {d_ort.max_abs:.3g} "
            f"(tolerance {d_ort.atol:g} + {d_ort.rtol:g}·scale)",
            numbers,
        )
    if not d_f64.ok:
        return GateResult(
            False,
            "numerics",
            f"differs from the float64 reference: max abs {d_f64.max_abs:.3g} "
            f"(onnxruntime's chain: {d_base.max_abs:.3g})",
            numbers,
        )
    return GateResult(True, numbers=numbers)


def benchmark(
    unfused: onnx.ModelProto,
    fused: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    library: str,
    *,
    budget_s: float = BENCH_BUDGET_S,
    unfused_kernels: list[str] | None = None,
) -> GateResult:
    """Medians of interleaved runs at ORT_ENABLE_ALL, one thread each; ``unfused_kernels``:
    :func:`kernels_after_ort` of ``unfused`` when the caller has it."""
    base = session(unfused, "ORT_ENABLE_ALL")
    mine = session(fused, "ORT_ENABLE_ALL", library=library)
    if unfused_kernels is None:
        unfused_kernels = kernels_after_ort(unfused)
    base_ops = [k.rpartition(":")[2] for k in unfused_kernels]
    runs: list[list[float]] = [[], []]
    sessions = [base, mine]
    for s in sessions:
        _warm_up(s, feeds)
    t_start = time.perf_counter()
    while len(runs[0]) < BENCH_MAX_PAIRS and (
        len(runs[0]) < BENCH_MIN_PAIRS
        or (time.perf_counter() - t_start < budget_s and not decided(runs[0], runs[1]))
    ):
        for k, s in enumerate(sessions):
            t0 = time.perf_counter()
            s.run(None, feeds)
            runs[k].append(time.perf_counter() - t0)
    unfused_us = statistics.median(runs[0]) * 1e6
    fused_us = statistics.median(runs[1]) * 1e6
    numbers = {
        "unfused_us": round(unfused_us, 2),
        "fused_us": round(fused_us, 2),
        "speedup": round(unfused_us / fused_us, 3) if fused_us else None,
        "runs": len(runs[0]),
        "onnxruntime_level": "ORT_ENABLE_ALL",
        "threads": 1,
        "onnxruntime_ops": base_ops,
    }
    if not fused_us < unfused_us:
        return GateResult(
            False,
            "slower",
            f"generated kernel {fused_us:.1f} us vs {unfused_us:.1f} us for the unfused chain in "
            f"onnxruntime ({' + '.join(base_ops) or 'no ops'}; ORT_ENABLE_ALL, 1 thread, median "
            f"of {len(runs[0])})",
            numbers,
        )
    return GateResult(True, numbers=numbers)


def _warm_up(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> None:
    """Run ``sess`` up to :data:`WARMUP_RUNS` times, stopping once :data:`WARMUP_S` is spent."""
    t0 = time.perf_counter()
    for _ in range(WARMUP_RUNS):
        sess.run(None, feeds)
        if time.perf_counter() - t0 >= WARMUP_S:
            return


def decided(unfused: list[float], fused: list[float]) -> bool:
    """Whether paired timings settle the benchmark: the bootstrap 95 % interval of the median
    per-pair ratio (fused / unfused, :func:`~graphopt.opt.verify.perf.ratio_interval`) excludes 1,
    or lies within ``1 ± BENCH_TIE``."""
    if len(unfused) < BENCH_MIN_PAIRS or not all(u > 0 for u in unfused):
        return False
    _, low, high = ratio_interval([f / u for u, f in zip(unfused, fused)], resamples=500)
    return low > 1.0 or high < 1.0 or (1.0 - BENCH_TIE < low and high < 1.0 + BENCH_TIE)


def kernels_after_ort(model: onnx.ModelProto, library: str | None = None) -> list[str]:
    """The ops onnxruntime runs for ``model`` at ORT_ENABLE_ALL, its own fusions and layout
    changes applied, as ``domain:op`` (plain ``op`` in the ONNX domain); ``library``: the
    generated kernels' library the model needs; empty when onnxruntime does not load it."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="graphopt-ortopt-") as d:
        path = Path(d) / "opt.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = 1
        so.log_severity_level = 4
        so.optimized_model_filepath = str(path)
        try:
            if library:
                so.register_custom_ops_library(library)
            ort.InferenceSession(model.SerializeToString(), so, ["CPUExecutionProvider"])
            nodes = onnx.load(str(path)).graph.node
        except Exception:  # noqa: BLE001 - not loaded: nothing known
            return []
        return [f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in nodes]


def same_neighbour_kernels(
    unfused: list[str], fused: list[str], chain: list[str], kernel: str
) -> bool:
    """Whether onnxruntime runs the same kernels around the chain with and without the fusion
    (``unfused``, ``fused``: :func:`kernels_after_ort` of the chain with its neighbours): every
    op of the chain still runs unfused (none was fused into a neighbour or converted with one)
    and the fused model runs exactly the rest plus the kernel.  Then no fusion across the
    chain's boundary is lost, the neighbours cost the same either way, and the chain's own
    benchmark decides."""
    if not unfused or not fused:
        return False
    ran, ops = Counter(unfused), Counter(chain)
    if any(ran[op] < n for op, n in ops.items()):
        return False
    return ran - ops + Counter({kernel: 1}) == Counter(fused)


def median_us(sess: ort.InferenceSession, feeds: dict[str, np.ndarray], runs: int = 30) -> float:
    for _ in range(3):
        sess.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6

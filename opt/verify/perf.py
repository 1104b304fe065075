"""The performance safety net: the bundle, loaded as it deploys, is never slower than the original.

After the pipeline, :class:`Duel` times the optimized model under the bundle's own session
settings (``targets.bundle.session_config``: level, disabled onnxruntime optimizers; one intra-op
thread; on cpu its fast path, onnxruntime's saved form of it loaded back as the bundle loads it)
against the original under ``ORT_ENABLE_ALL`` (what users get without graphopt), on the parity
feeds, in paired rounds on this machine:

* each round runs both models back to back, the order flipping every round, each run repeated
  so that a round lasts at least :data:`ROUND_S` (small models need many rounds); the round's
  ratio is t(optimized) / t(original);
* the estimate is the median of the per-round ratios with a bootstrap 95 % interval
  (:func:`ratio_interval`, also used by ``examples/benchmark/bench.py``'s duel); a measurement
  stops early once its interval is clear of ``1 + margin`` on either side.  A first measurement
  slower by its median but not beyond noise gets a second one, pooled with it.  The original's
  session is created first (about 0.5-1 % slower here for that alone): the bias, if any, is
  towards keeping the optimized model.

When the interval's lower bound is above ``1 + margin`` the optimized model is slower beyond
noise: :func:`find_slow_rules` bisects over the rules that fired (in order of first firing),
enabling a prefix of them and reverting the rest, to the first rule whose prefix is slower;
reverting that rule is kept when it lowers the ratio, and the search repeats (at most
:data:`MAX_REVERTS` times) while the model is still slower.  Everything runs within one budget
(``max(MIN_BUDGET_S, the optimization's own time)``, pipeline re-runs included); a search the
budget cuts short says so.  The decision logic takes the measurement as a function, so it is
tested on synthetic timings.

The final measurement also keeps the optimized model's own seconds per run and its session's
creation time: :func:`summary`'s ``latency`` (median and p95 over rounds, 1 thread), which the
bundle's manifest reports as its latency instead of timing the same model once more.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import GraphoptError
from ..graph.io import discard, serialize, write_model_files
from .customops import register_libraries

#: the machine-specific fast path: model.onnx as onnxruntime optimized it at the session
#: config's level on the machine that wrote the bundle (loaded there with optimizations off)
FAST_MODEL = "model.machine.onnx"


#: slower beyond noise: the interval's lower bound above 1 + MARGIN
MARGIN = 0.015
#: the budget is max(MIN_BUDGET_S, the optimization's own time)
MIN_BUDGET_S = 10.0
#: each round repeats a model's run until it lasts at least this long
ROUND_S = 0.002
#: a first (warm-up) run this long means one run per round, whatever a steady run takes: the
#: runs that estimate the repeat count of small models are skipped (4 runs of BERT-base)
ONE_RUN_S = 10 * ROUND_S
#: rounds before a measurement may stop early; at least MIN_FLOOR even past its time share
MIN_ROUNDS = 20
MIN_FLOOR = 5
MAX_ROUNDS = 20_000
#: rules reverted at most, per model
MAX_REVERTS = 3
BASELINE = "ORT_ENABLE_ALL"
#: the environment variable generated kernels read for their OpenMP team size
KERNEL_THREADS = "GRAPHOPT_KERNEL_THREADS"


@dataclass(frozen=True)
class Timing:
    """t(candidate) / t(original): median of per-round ratios, bootstrap 95 % interval."""

    ratio: float
    low: float
    high: float
    rounds: int
    seconds: float
    #: the per-round ratios (pooled when a measurement is extended; not in the report)
    samples: tuple[float, ...] = field(default=(), repr=False, compare=False)
    #: the candidate's own seconds per run, one per round (its latency: :func:`latency`)
    runs_s: tuple[float, ...] = field(default=(), repr=False, compare=False)
    #: seconds to create the candidate's session (None when not timed)
    created_s: float | None = field(default=None, repr=False, compare=False)

    def slower(self, margin: float = MARGIN) -> bool:
        return self.low > 1.0 + margin

    def suspect(self, margin: float = MARGIN) -> bool:
        """Slower by its median but not beyond noise: worth more rounds."""
        return self.ratio > 1.0 + margin and not self.slower(margin)

    def pooled(self, other: Timing) -> Timing:
        """Both measurements' rounds as one (each ran on a fresh candidate session)."""
        samples = self.samples + other.samples
        ratio, low, high = ratio_interval(samples) if samples else (other.ratio,) * 3
        seconds = self.seconds + other.seconds
        rounds, runs = self.rounds + other.rounds, self.runs_s + other.runs_s
        created = other.created_s if other.created_s is not None else self.created_s
        return Timing(ratio, low, high, rounds, seconds, samples, runs, created)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratio": round(self.ratio, 4),
            "low": round(self.low, 4),
            "high": round(self.high, 4),
            "rounds": self.rounds,
            "seconds": round(self.seconds, 3),
        }


def median_interval(x: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """Median of ``x`` and its distribution-free confidence interval (order statistics: the
    number of values below the median is Binomial(n, ½), normal approximation)."""
    v = np.sort(np.asarray(x, dtype=float))
    n = len(v)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    k = max(0, math.floor((n - z * math.sqrt(n)) / 2))
    return float(np.median(v)), float(v[k]), float(v[n - 1 - k])


def ratio_interval(
    ratios: np.ndarray | list[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(median, low, high): the median of per-round ratios and its bootstrap 95 % interval."""
    r = np.asarray(ratios, dtype=np.float64)
    if r.size == 0:
        raise ValueError("no rounds")
    n = min(resamples, max(200, 2_000_000 // r.size))
    boot = np.random.default_rng(seed).integers(0, r.size, (n, r.size))
    low, high = np.percentile(np.median(r[boot], axis=1), [2.5, 97.5])
    return float(np.median(r)), float(low), float(high)


def verdict(low: float, high: float, margin: float = 0.0) -> str:
    """``slower`` / ``faster`` when the interval excludes 1 + margin / 1, else ``tie``."""
    return "slower" if low > 1.0 + margin else "faster" if high < 1.0 else "tie"


# ----------------------------------------------------------------------------- decision
#: (rules reverted, time share in seconds) -> Timing of that candidate against the original
Measure = Callable[[frozenset[str], float], Timing]


@dataclass
class NetResult:
    """What the search measured and decided; ``reverted`` in the order decided."""

    first: Timing
    final: Timing
    reverted: list[tuple[str, Timing]] = field(default_factory=list)
    #: why the search stopped before the model was no longer slower (None when it did not)
    stopped: str | None = None
    measurements: int = 1
    #: wall time of the whole search (pipeline re-runs included)
    seconds: float = 0.0


def find_slow_rules(
    rules: list[str],
    measure: Measure,
    budget_s: float,
    *,
    margin: float = MARGIN,
    clock: Callable[[], float] = time.perf_counter,
    max_reverts: int = MAX_REVERTS,
) -> NetResult:
    """Measure the model with every rule, and when it is slower, find and revert the rules
    responsible (``rules`` in order of first firing).  Never past ``budget_s`` except to finish
    the measurement under way; never more than ``max_reverts`` reverts."""
    deadline = clock() + budget_s
    first = cur = measure(frozenset(), budget_s / 3)
    extended = first.suspect(margin) and bool(first.samples) and clock() < deadline
    if extended:
        first = cur = first.pooled(measure(frozenset(), (deadline - clock()) / 3))
    out = NetResult(first, first, measurements=1 + extended)
    reverted: list[str] = []
    while cur.slower(margin):
        live = [r for r in rules if r not in reverted]
        if len(reverted) >= max_reverts:
            out.stopped = f"still slower after reverting {len(reverted)} rule(s), the most tried"
            break
        if not live:
            out.stopped = "still slower with every rule reverted: not from a rewrite"
            break
        steps = math.ceil(math.log2(len(live))) + 1 if len(live) > 1 else 1
        lo, hi = 1, len(live)
        while lo < hi and clock() < deadline:
            mid = (lo + hi) // 2
            share = max(0.0, deadline - clock()) / (steps + 1)
            t = measure(frozenset(reverted) | frozenset(live[mid:]), share)
            out.measurements += 1
            steps = max(1, steps - 1)
            if t.ratio > _midway(cur.ratio, margin):
                hi = mid
            else:
                lo = mid + 1
        if lo < hi or clock() >= deadline:
            out.stopped = f"the budget ({budget_s:.1f} s) ran out while searching"
            break
        culprit = live[lo - 1]
        t = measure(frozenset(reverted) | {culprit}, max(0.0, deadline - clock()) / 2)
        out.measurements += 1
        if t.ratio > cur.ratio - margin / 2 or t.high >= cur.low:  # faster beyond noise only
            out.stopped = f"reverting {culprit} did not make it faster ({t.ratio:.3f})"
            break
        reverted.append(culprit)
        out.reverted.append((culprit, t))
        cur = out.final = t
        if cur.slower(margin) and clock() < deadline:
            # still slower: confirm in a fresh session before reverting more, since one session
            # can run a tiny model a few % slower throughout (its allocations, not the graph)
            again = measure(frozenset(reverted), max(0.0, deadline - clock()) / 3)
            out.measurements += 1
            cur = out.final = t.pooled(again) if t.samples else again
            if not again.slower(margin):
                break
    out.seconds = clock() - (deadline - budget_s)
    return out


def _midway(slow: float, margin: float) -> float:
    """Bisection threshold: a measurement counts as still slow above the midpoint between 1 and
    the slow ratio (never below ``1 + margin``), so noise on a tiny model cannot pass for the
    slowdown when the slowdown is large."""
    return max(1.0 + margin, (1.0 + slow) / 2)


# ----------------------------------------------------------------------------- measuring
def _options(level: str, disabled_entries: dict[str, str], base_dir) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 4
    for key, value in sorted(disabled_entries.items()):
        so.add_session_config_entry(key, str(value))
    if base_dir is not None:
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(base_dir)
        )
    return so


def save_optimized(so: ort.SessionOptions, path: Path) -> None:
    """Make the session ``so`` configures write the graph onnxruntime optimized to ``path``,
    its weights beside it in ``<name>.data`` (mapped at load rather than parsed)."""
    so.optimized_model_filepath = str(path)
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", f"{path.name}.data"
    )
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
    )


@dataclass
class Saved:
    """onnxruntime's optimized form of ``model`` (its graph at ``config``'s settings), written
    by a session made only to save it: ``path`` and ``<path>.data``.  The candidate timed is
    that file loaded back as the bundle loads its fast path (optimizations off, weights
    pre-packed, 1 thread); ``outputs`` (name → array): its outputs on ``feeds``, the inputs it
    was timed on, once it has run."""

    model: onnx.ModelProto
    path: Path
    config: dict[str, Any]
    feeds: dict[str, np.ndarray] | None = None
    outputs: dict[str, Any] | None = None


class _Loaded:
    """An onnxruntime session at given settings (spilled to a temp dir when over 2 GB);
    ``save_to``: where onnxruntime writes the graph it optimized (:func:`save_optimized`; the
    session only saves it, so its kernels do not pre-pack weights); ``written``: the model as it
    was written already, (bytes or a model whose weights are external data, the folder they
    resolve in), loaded instead of serializing it again; ``fast``: onnxruntime's saved form of
    ``model`` to load instead, as the bundle loads its fast path (optimizations off: they ran
    when it was saved)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        config: dict[str, Any],
        base_dir,
        save_to: Path | None = None,
        written: tuple[Any, Path | None] | None = None,
        fast: Path | None = None,
    ) -> None:
        level = config.get("graph_optimization_level", BASELINE)
        if fast is not None:
            level, base_dir = "ORT_DISABLE_ALL", None  # its weights lie beside it
        elif written is not None and written[1] is not None:  # a skeleton: its weights' folder
            base_dir = written[1]
        entries = dict(config.get("session_config_entries") or {})
        if save_to is not None:
            entries.setdefault("session.disable_prepacking", "1")
        so = _options(level, entries, base_dir)
        if save_to is not None:
            save_optimized(so, save_to)
        disabled = list(config.get("disabled_optimizers") or [])
        self._tmp = None
        try:
            kernels = register_libraries(so, model)
            if fast is not None:
                src: Any = str(fast)
            else:
                src = written[0] if written is not None else serialize(model)
            if src is None:  # over 2 GB: a file with its weights beside it
                self._tmp = tempfile.TemporaryDirectory(prefix="graphopt-perf-")
                src = str(Path(self._tmp.name) / "model.onnx")
                write_model_files(model, Path(src), external=True, base_dir=base_dir)
            with _one_kernel_thread(bool(kernels)):
                self.sess = ort.InferenceSession(
                    src, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
                )
        except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
            text = str(e).strip()
            what = "its saved optimized form" if fast is not None else "the model"
            raise GraphoptError(
                f"onnxruntime cannot load {what} at {level}: "
                + (text.splitlines()[0] if text else type(e).__name__)
            ) from None
        self.names = [o.name for o in self.sess.get_outputs()]

    def runner(self, feeds: dict[str, np.ndarray]) -> Callable[[], list]:
        wanted = {i.name for i in self.sess.get_inputs()}
        f = {k: v for k, v in feeds.items() if k in wanted}
        sess = self.sess

        def run() -> list:
            try:
                return sess.run(None, f)
            except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
                text = str(e).strip()
                raise GraphoptError(
                    "onnxruntime failed to run the model while timing it: "
                    + (text.splitlines()[0] if text else type(e).__name__)
                ) from None

        return run


@contextmanager
def _one_kernel_thread(active: bool):
    """Generated kernels read their team size when the session creates them: one thread, as the
    bundle's session config sets it (and as the original runs)."""
    old = os.environ.get(KERNEL_THREADS)
    if active:
        os.environ[KERNEL_THREADS] = "1"
    try:
        yield
    finally:
        if active and old is None:
            os.environ.pop(KERNEL_THREADS, None)
        elif active:
            os.environ[KERNEL_THREADS] = old


def _time(run: Callable[[], object], k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        run()
    return time.perf_counter() - t0


class Duel:
    """The original at ORT_ENABLE_ALL (loaded once) against candidates at their bundle settings.

    With ``save_into`` (a folder), a session made for each candidate writes onnxruntime's
    optimized form of it there (``<save_into>/fast-*/<save_as>``; :attr:`saved`, the latest
    candidate's only), and the candidate timed is that file loaded back as the bundle loads its
    fast path: the bundle as it deploys.  When that candidate is the final model, the bundle
    moves the file in and checks the outputs this session gave on the parity inputs
    (:attr:`Saved.outputs`) instead of building and running the same session again.  A
    candidate whose saved form cannot be saved or loaded back is timed as the model itself at
    its bundle settings."""

    def __init__(
        self,
        original: onnx.ModelProto,
        feeds: dict[str, np.ndarray],
        config: Callable[[onnx.ModelProto], dict[str, Any]],
        base_dir=None,
        margin: float = MARGIN,
        save_into: Path | None = None,
        save_as: str = "model.optimized.onnx",
        written: Callable[[onnx.ModelProto], tuple[Any, Path | None] | None] | None = None,
    ) -> None:
        self.feeds, self.config, self.base_dir, self.margin = feeds, config, base_dir, margin
        self.save_into, self.save_as = save_into, save_as
        #: a candidate as it was written already (:class:`_Loaded`'s ``written``), or None
        self.written = written or (lambda _model: None)
        self.saved: Saved | None = None
        loaded = _Loaded(original, {"graph_optimization_level": BASELINE}, base_dir)
        self.base = loaded.runner(feeds)
        #: the original's outputs on ``feeds`` by level (name → array): what a later check of
        #: the bundle at that level compares with, without loading the original once more
        self.outputs = {BASELINE: dict(zip(loaded.names, self.base()))}

    def measure(self, model: onnx.ModelProto, seconds: float) -> Timing:
        start = time.perf_counter()
        loaded, fast, created = self._load(model)
        cand = loaded.runner(self.feeds)
        first: list = []  # the candidate's outputs, from its warm-up run

        def warm_up() -> None:
            first.append(cand())

        runs = (cand, self.base)
        warm = min(_time(warm_up, 1), _time(self.base, 1))  # the first run allocates
        if fast and first and self.saved is not None:
            self.saved.feeds, self.saved.outputs = self.feeds, dict(zip(loaded.names, first[0]))
        if warm >= ONE_RUN_S:  # a run alone is a round: no estimate needed
            k = 1
        else:
            est = min(min(_time(r, 1) for _ in range(2)) for r in runs)
            k = max(1, math.ceil(ROUND_S / est)) if est > 0 else 1
        end = start + seconds
        ratios: list[float] = []
        own: list[float] = []  # the candidate's seconds per run, per round
        while len(ratios) < MAX_ROUNDS:
            order = runs if len(ratios) % 2 == 0 else runs[::-1]
            t = {id(r): _time(r, k) for r in order}
            ratios.append(t[id(cand)] / max(t[id(self.base)], 1e-12))
            own.append(t[id(cand)] / k)
            n = len(ratios)
            if n < MIN_FLOOR or (n < MIN_ROUNDS and time.perf_counter() < end):
                continue
            if time.perf_counter() >= end:
                break
            if n % 10 == 0:
                _, low, high = ratio_interval(ratios, resamples=500)
                if low > 1.0 + self.margin or high < 1.0 + self.margin:
                    break
        ratio, low, high = ratio_interval(ratios)
        seconds = time.perf_counter() - start
        return Timing(ratio, low, high, len(ratios), seconds, tuple(ratios), tuple(own), created)

    def _load(self, model: onnx.ModelProto) -> tuple[_Loaded, bool, float]:
        """(the candidate's session, whether it is of its saved form, seconds to create it).
        With ``save_into``: a fresh session of this model's saved form (saved first when it has
        none)."""
        config, written = self.config(model), self.written(model)
        if self.save_into is not None and (self.saved is None or self.saved.model is not model):
            folder = Path(tempfile.mkdtemp(prefix="fast-", dir=self.save_into))
            path = folder / self.save_as
            try:
                _Loaded(model, config, self.base_dir, path, written)  # saves it; never run
            except GraphoptError:
                pass
            if path.is_file():
                self.discard_saved()
                self.saved = Saved(model, path, config)
            else:
                discard(folder)
        t0 = time.perf_counter()
        if self.save_into is not None and self.saved is not None and self.saved.model is model:
            try:
                fast = _Loaded(model, config, self.base_dir, fast=self.saved.path)
                return fast, True, time.perf_counter() - t0
            except GraphoptError:  # saved, but not loaded back: no fast path to time or keep
                self.discard_saved()
                t0 = time.perf_counter()
        loaded = _Loaded(model, config, self.base_dir, written=written)
        return loaded, False, time.perf_counter() - t0

    def discard_saved(self) -> None:
        """Remove the optimized graph saved last (when it will not be used)."""
        if self.saved is not None:
            discard(self.saved.path.parent)
            self.saved = None


def latency(t: Timing) -> dict[str, Any] | None:
    """The candidate's own latency from a measurement's rounds (None when it kept no times):
    median and p95 over rounds of the seconds per run (a round of a small model averages its
    repeated runs), as the bundle's manifest reports it."""
    if not t.runs_s:
        return None
    runs = sorted(t.runs_s)
    return {
        "median_ms": round(float(np.median(runs)) * 1e3, 4),
        "p95_ms": round(runs[min(len(runs) - 1, int(0.95 * len(runs)))] * 1e3, 4),
        "runs": len(runs),
        "session_create_ms": None if t.created_s is None else round(t.created_s * 1e3, 2),
        "threads": 1,
    }


# ----------------------------------------------------------------------------- reporting
def summary(net: NetResult, budget_s: float) -> dict[str, Any]:
    """report.json's ``performance``: the final model against the original, and what was
    reverted (each with the model's numbers before and after)."""
    out: dict[str, Any] = {"measured": True, **net.final.to_dict()}
    out["seconds"] = round(net.seconds, 3)
    out["latency"] = latency(net.final)  # the final model's own times: the manifest's latency
    before = net.first
    reverted = []
    for rule, after in net.reverted:
        reverted.append({"rule": rule, "before": before.to_dict(), "after": after.to_dict()})
        before = after
    out.update(
        reverted=reverted,
        first=net.first.to_dict(),
        verdict=verdict(net.final.low, net.final.high, MARGIN),
        margin=MARGIN,
        budget_s=round(budget_s, 3),
        measurements=net.measurements,
        stopped=net.stopped,
        baseline=f"the original at {BASELINE}, 1 thread",
        candidate="the optimized model at the bundle's session settings, 1 thread",
    )
    return out


def remarks(net: NetResult, applied: list[tuple[int, str, str]], budget_s: float) -> list:
    """A ``missed`` remark (``slower-on-target``) per reverted rule, with the numbers, and one
    ``analysis`` remark for the measurement (and for a search that stopped short)."""
    from ..remarks import Remark

    out = []
    before = net.first
    for rule, after in net.reverted:
        nodes = tuple(n for _, r, n in applied if r == rule)
        out.append(
            Remark(
                "missed",
                "performance",
                rule,
                "slower-on-target",
                nodes,
                f"{rule} made the bundle slower on this machine: {_said(before)}; its "
                f"{len(nodes)} rewrite(s) were reverted, now {_said(after)}",
                {"before": before.to_dict(), "after": after.to_dict()},
            )
        )
        before = after
    f = net.final
    text = f"the bundle runs {_said(f)} ({verdict(f.low, f.high, MARGIN)})"
    if net.stopped:
        text += f"; search stopped: {net.stopped}"
    out.append(
        Remark(
            "analysis",
            "performance",
            "performance",
            "budget-exhausted" if net.stopped and "budget" in net.stopped else "measured",
            (),
            text,
            {**f.to_dict(), "budget_s": round(budget_s, 3), "measurements": net.measurements},
        )
    )
    return out


def _said(t: Timing) -> str:
    return (
        f"{t.ratio:.3f}x the original at {BASELINE} (95 % interval {t.low:.3f}-{t.high:.3f}, "
        f"{t.rounds} rounds)"
    )

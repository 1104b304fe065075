"""CI gate pieces: op-count expectations, JUnit XML and the paired latency comparison.

``--expect "MultiHeadAttention>=12,LayerNormalization>=25"`` asserts on the optimized model's
op histogram, so a CI notices when an exporter change silently breaks a fusion.  JUnit XML holds
one test case per parity output and per expectation, for CI systems that render test reports.
Op names are ``domain.op`` outside the default domain (the keys of ``ops_after``); the short form
(``FusedConv`` for ``com.microsoft.FusedConv``) is accepted when it names one op, and a name that
is no op at all is a usage error that suggests the nearest names.

Latency (``graphopt gate``): original and optimized run interleaved (A B, then B A), one pair per
round, and the statistic is the median over rounds of optimized/original time in the same round
— each pair saw the same machine state, so background load cancels, and the median ignores the
slow tail that made p95 ratios flake on sub-millisecond models.  Its confidence interval is
distribution-free (order statistics of the paired ratios).  Rounds continue until the interval is
narrower than the precision asked for (or the time budget ends).  A baseline is saved only from
a run whose interval is narrower than the allowed regression; a later run regressed only when
its whole interval lies above the baseline interval's upper end × (1 + allowed regression).
:func:`gate_latency` builds the two sessions as ``graphopt bench`` does and measures them;
:func:`gate_verdict` turns the measurement, the baseline and the optimization's own verdict into
the gate's exit code and lines.  :func:`bench_junit_xml` is ``graphopt bench``'s JUnit file.
"""

from __future__ import annotations

import difflib
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EXIT_PERF, EXIT_TARGET, GraphoptError, UsageError
from ..graph.domains import is_default
from .parity import ParityReport
from .perf import median_interval

_EXPECT = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|==|!=|>|<)\s*(\d+)\s*$")
_OPS = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


@dataclass(frozen=True)
class Expectation:
    op: str
    cmp: str
    count: int
    actual: int = 0
    ok: bool = False

    @property
    def text(self) -> str:
        return f"{self.op}{self.cmp}{self.count}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.text}


def parse_expectations(specs: list[str] | None) -> list[Expectation]:
    out = []
    for spec in specs or []:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = _EXPECT.match(part)
            if not m:
                raise UsageError(f"--expect: '{part}' is not OP>=N (also <=, ==, !=, >, <)")
            out.append(Expectation(m.group(1), m.group(2), int(m.group(3))))
    return out


def op_vocabulary(*histograms: dict[str, int], kernels: Iterable[tuple[str, str]] = ()) -> set[str]:
    """Every op name an expectation may use: the models' ops, the target's kernels (as
    ``domain.op`` outside the default domain) and the standard ONNX ops."""
    import onnx.defs

    names = {k for h in histograms for k in h}
    names |= {f"{d}.{op}" if d else op for op, d in kernels}
    names |= {
        s.name if is_default(s.domain) else f"{s.domain}.{s.name}"
        for s in onnx.defs.get_all_schemas()
    }
    return names


def resolve_op(name: str, vocabulary: set[str], flag: str) -> str:
    """``name`` itself when known, else the one ``domain.name`` it abbreviates; a usage error
    naming the candidates (ambiguous) or the nearest names (unknown) otherwise."""
    if name in vocabulary:
        return name
    full = sorted(v for v in vocabulary if v.rsplit(".", 1)[-1] == name)
    if len(full) == 1:
        return full[0]
    if full:
        raise UsageError(f"{flag}: '{name}' is ambiguous: {', '.join(full)}")
    raise UsageError(f"{flag}: unknown op '{name}'{suggest(name, vocabulary)}")


def suggest(name: str, names: Iterable[str], n: int = 3) -> str:
    """``"; did you mean A, B?"`` with the nearest names (short forms compared too)."""
    names = sorted(set(names))
    short = {v.rsplit(".", 1)[-1].lower(): v for v in names}
    near = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    near += [short[k] for k in difflib.get_close_matches(name.lower(), list(short), n=n)]
    near = list(dict.fromkeys(near))[:n]
    return f"; did you mean {', '.join(near)}?" if near else ""


def resolve_expectations(
    expectations: list[Expectation], vocabulary: set[str]
) -> list[Expectation]:
    return [replace(e, op=resolve_op(e.op, vocabulary, "--expect")) for e in expectations]


def evaluate_expectations(
    expectations: list[Expectation], ops: dict[str, int]
) -> list[Expectation]:
    return [
        Expectation(e.op, e.cmp, e.count, ops.get(e.op, 0), _OPS[e.cmp](ops.get(e.op, 0), e.count))
        for e in expectations
    ]


def junit_xml(
    suite: str,
    parity: list[ParityReport],
    expectations: list[Expectation],
    latency: dict[str, Any] | None = None,
) -> str:
    """One <testcase> per parity output and per expectation, and one for the latency gate
    (``latency``: ``{"text": ..., "failure": str | None}``)."""
    cases = []
    for p in parity:
        if not p.ran:
            cases.append(_case(f"parity[{p.reference}]", "parity", skipped=p.error or "not run"))
            continue
        if p.error:
            cases.append(_case(f"parity[{p.reference}]", "parity", failure=p.error))
        for d in p.outputs:
            detail = (
                f"max_abs={d.max_abs:.3g} max_rel={d.max_rel:.3g} mismatch={d.mismatch:.3%}"
                f" cosine={d.cosine:.6f} nonfinite_mismatch={d.nonfinite_mismatch}"
            )
            cases.append(
                _case(
                    f"parity[{p.reference}].{d.name}",
                    "parity",
                    failure=None if d.ok else detail,
                    out=detail,
                )
            )
    for e in expectations:
        cases.append(
            _case(
                f"expect.{e.text}",
                "expectations",
                failure=None if e.ok else f"{e.op} count is {e.actual}, expected {e.cmp}{e.count}",
            )
        )
    if latency is not None:
        cases.append(
            _case("latency", "latency", failure=latency.get("failure"), out=latency.get("text"))
        )
    failures = sum("<failure" in c for c in cases)
    skipped = sum("<skipped" in c for c in cases)
    quoteattr, _ = _xml()
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<testsuite name={quoteattr(suite)} tests="{len(cases)}" '
        f'failures="{failures}" skipped="{skipped}">\n' + "".join(cases) + "</testsuite>\n"
    )


def _xml():
    """(quoteattr, escape) from xml.sax.saxutils, imported when a report is written: it imports
    urllib.request, http.client and ssl (~50 ms of every command's start otherwise)."""
    from xml.sax.saxutils import escape, quoteattr

    return quoteattr, escape


def _case(
    name: str,
    classname: str,
    *,
    failure: str | None = None,
    skipped: str | None = None,
    out: str | None = None,
) -> str:
    quoteattr, escape = _xml()
    body = ""
    if failure is not None:
        body += f"<failure message={quoteattr(failure)}>{escape(failure)}</failure>"
    if skipped is not None:
        body += f"<skipped message={quoteattr(skipped)}/>"
    if out:
        body += f"<system-out>{escape(out)}</system-out>"
    return (
        f"  <testcase classname={quoteattr('graphopt.' + classname)} name={quoteattr(name)}>"
        f"{body}</testcase>\n"
    )


GATE_BASELINE = "graphopt.gate-baseline/1"


class IntervalTooWide(GraphoptError):
    """The latency interval is too wide to be saved as a baseline (noisy machine, short budget)."""

    exit_code = EXIT_TARGET


@dataclass(frozen=True)
class PairedLatency:
    """Median over interleaved rounds of optimized/original time, with its interval."""

    ratio: float
    low: float
    high: float
    confidence: float
    rounds: int
    original_ms: float
    optimized_ms: float
    seconds: float

    @property
    def width(self) -> float:
        """Relative width of the interval: high/low − 1."""
        return self.high / self.low - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "width": self.width}


def paired_rounds(
    run_a: Callable[[], None],
    run_b: Callable[[], None],
    *,
    precision: float,
    confidence: float = 0.95,
    min_rounds: int = 30,
    min_seconds: float = 1.0,
    max_seconds: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> PairedLatency:
    """Run A and B in alternating order until the interval of median(B/A) is narrower than
    ``precision`` (relative) after ``min_rounds`` and ``min_seconds``, or ``max_seconds``."""
    say = progress or (lambda _m: None)
    a_ms: list[float] = []
    b_ms: list[float] = []
    start = last_said = time.perf_counter()
    while True:
        first, second = (run_a, run_b) if len(a_ms) % 2 == 0 else (run_b, run_a)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        a, b = (t1 - t0, t2 - t1) if first is run_a else (t2 - t1, t1 - t0)
        a_ms.append(a * 1000)
        b_ms.append(b * 1000)
        now = time.perf_counter()
        n, elapsed = len(a_ms), now - start
        out_of_time = elapsed >= max_seconds and n >= 3
        if not out_of_time and (n < min_rounds or elapsed < min_seconds or n % 10):
            continue
        ratio, lo, hi = median_interval(np.array(b_ms) / np.array(a_ms), confidence)
        if now - last_said > 1.0:
            say(f"latency: {n} paired rounds, ratio {ratio:.3f} [{lo:.3f}, {hi:.3f}]")
            last_said = now
        if hi / lo - 1.0 <= precision or out_of_time:
            return PairedLatency(
                ratio,
                lo,
                hi,
                confidence,
                n,
                float(np.median(a_ms)),
                float(np.median(b_ms)),
                elapsed,
            )


def gate_baseline(latency: PairedLatency, max_regression: float, **meta: Any) -> dict[str, Any]:
    """The baseline to save; refused when the interval is wider than the allowed regression
    (such a baseline could not tell a regression from noise)."""
    if latency.width > max_regression:
        raise IntervalTooWide(
            f"latency interval too wide to save as a baseline: ratio {latency.ratio:.3f} "
            f"[{latency.low:.3f}, {latency.high:.3f}] is ±{latency.width / 2:.1%} after "
            f"{latency.rounds} rounds ({latency.seconds:.0f}s), the gate needs it within "
            f"{max_regression:.1%}; give it more time (--max-seconds) or a quieter machine"
        )
    return {"schema": GATE_BASELINE, **meta, **latency.to_dict()}


def compare_baseline(latency: PairedLatency, path: Path, max_regression: float) -> dict[str, Any]:
    """The latency against a saved baseline: regressed only when the whole interval lies above
    the baseline's upper bound × (1 + max_regression) (both runs are estimates; a baseline
    without an interval counts as exact)."""
    try:
        base = json.loads(Path(path).read_text())
        if base.get("schema") != GATE_BASELINE:
            raise ValueError(f"schema {base.get('schema')!r}, not {GATE_BASELINE}")
        base_ratio = float(base["ratio"])
        base_high = float(base.get("high", base_ratio))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise UsageError(f"--baseline {path}: not a graphopt gate baseline ({e})") from None
    return {
        "baseline": base,
        "baseline_ratio": base_ratio,
        "change": latency.ratio / base_ratio - 1.0,
        "change_low": latency.low / base_ratio - 1.0,
        "change_high": latency.high / base_ratio - 1.0,
        "max_regression": max_regression,
        "regressed": latency.low / max(base_ratio, base_high) - 1.0 > max_regression,
    }


#: an op type's change below this share of the baseline run is noise, not a regression of the
#: model (a 3 µs Reshape 40 % slower)
OP_FLOOR = 0.01


def read_op_baseline(path: Path) -> dict[str, Any]:
    """A per-op-type baseline: a ``graphopt profile --format json`` document (or the one
    ``gate --save-op-baseline`` writes), whose op rows carry intervals."""
    from .profile import SCHEMA as PROFILE_SCHEMA

    try:
        base = json.loads(Path(path).read_text())
        if not isinstance(base, dict) or base.get("schema") != PROFILE_SCHEMA:
            got = base.get("schema") if isinstance(base, dict) else type(base).__name__
            raise ValueError(f"schema {got!r}, not {PROFILE_SCHEMA}")
        for g in base["ops"]:
            float(g["low_ms"]), float(g["high_ms"]), str(g["op"])
        float(base["account"]["measured_ms"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise UsageError(
            f"--op-baseline {path}: not a graphopt profile with op intervals ({e})"
        ) from None
    return base


def compare_op_baseline(
    current: dict[str, Any], base: dict[str, Any], max_regression: float
) -> dict[str, Any]:
    """Each op type's time against a per-op baseline.  An op type regressed only when its
    whole interval lies above the baseline's upper end × (1 + max_regression) and the excess is
    more than :data:`OP_FLOOR` of the baseline run; an op type the baseline lacks starts from
    zero (a fusion that stopped firing shows as its ops' time)."""
    now = {g["op"]: g for g in current["ops"]}
    before = {g["op"]: g for g in base["ops"]}
    floor = OP_FLOOR * float(base["account"]["measured_ms"])
    rows = []
    for op in sorted(set(now) | set(before)):
        a, b = now.get(op), before.get(op)
        low, high = (a["low_ms"], a["high_ms"]) if a else (0.0, 0.0)
        b_high = float(b["high_ms"]) if b else 0.0
        limit = b_high * (1.0 + max_regression)
        rows.append(
            {
                "op": op,
                "ms": a["ms"] if a else 0.0,
                "low_ms": low,
                "high_ms": high,
                "baseline_ms": b["ms"] if b else 0.0,
                "baseline_low_ms": b["low_ms"] if b else 0.0,
                "baseline_high_ms": b_high,
                "regressed": low > limit and low - b_high > floor,
            }
        )
    rows.sort(key=lambda r: (not r["regressed"], -(r["low_ms"] - r["baseline_high_ms"]), r["op"]))
    return {
        "max_regression": max_regression,
        "floor_ms": round(floor, 4),
        "ops": rows,
        "regressed": [r["op"] for r in rows if r["regressed"]],
    }


def op_regression_line(cmp: dict[str, Any]) -> str:
    """One line for the op types that regressed (empty: none did)."""
    parts = [
        f"{r['op']} {r['ms']:.3f} ms [{r['low_ms']:.3f}, {r['high_ms']:.3f}] vs baseline "
        f"{r['baseline_ms']:.3f} [{r['baseline_low_ms']:.3f}, {r['baseline_high_ms']:.3f}]"
        for r in cmp["ops"]
        if r["regressed"]
    ]
    return "; ".join(parts)


def gate_latency(
    original_path: Path,
    optimized,
    parity_inputs: dict[str, list[int]] | None,
    feeds: dict[str, np.ndarray] | None,
    seed: int,
    *,
    threads: int,
    precision: float,
    max_seconds: float,
    progress: Callable[[str], None] | None = None,
) -> PairedLatency:
    """:func:`paired_rounds` of the original model (read from ``original_path``) and
    ``optimized``, each in a session as ``bench`` builds it (ORT_ENABLE_ALL, CPU, ``threads``),
    on inputs of the sizes parity used (``parity_inputs``) or the user's ``feeds``."""
    from ..graph.io import load_model
    from .bench import _session
    from .parity import Session, make_inputs

    original = load_model(original_path)
    inputs = make_inputs(Session(original).sess, dict(parity_inputs or {}), seed, feeds)
    runs = []
    for model, which in ((original, "original"), (optimized, "optimized")):
        sess, _ = _session(model, "all", threads, which)
        names = {i.name for i in sess.get_inputs()}
        feed = {k: v for k, v in inputs.items() if k in names}
        sess.run(None, feed)  # warm-up
        runs.append(lambda s=sess, f=feed: s.run(None, f))
    return paired_rounds(*runs, precision=precision, max_seconds=max_seconds, progress=progress)


@dataclass
class GateVerdict:
    """The gate's exit code and one line (``reason``), the latency line and its JUnit failure,
    the comparison with the baseline and the baseline to save (when asked and narrow enough)."""

    code: int
    reason: str
    line: str = ""
    failure: str | None = None
    comparison: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = field(default=None, repr=False)

    def junit_case(self) -> dict[str, Any]:
        """The latency test case for :func:`junit_xml`."""
        return {"text": self.line, "failure": self.failure}


def gate_verdict(
    latency: PairedLatency | None,
    code: int,
    reason: str,
    *,
    baseline: Path | None = None,
    save_baseline: bool = False,
    max_regression: float,
    meta: dict[str, Any] | None = None,
) -> GateVerdict:
    """The optimization's verdict (``code``, ``reason``) first; then, when latency was
    measured, a regression against ``baseline`` (exit 5), and the baseline to save with
    ``meta`` (refused, exit 4, when the interval is wider than ``max_regression``)."""
    verdict = GateVerdict(code, reason)
    if latency is None:
        return verdict
    verdict.line = (
        f"optimized/original {latency.ratio:.3f} [{latency.low:.3f}, {latency.high:.3f}] "
        f"({latency.rounds} paired rounds, {latency.seconds:.1f}s)"
    )
    if baseline:
        cmp = compare_baseline(latency, baseline, max_regression)
        verdict.comparison = cmp
        verdict.line += (
            f"; vs baseline {cmp['baseline_ratio']:.3f}: {cmp['change']:+.1%} "
            f"[{cmp['change_low']:+.1%}, {cmp['change_high']:+.1%}] "
            f"(limit {max_regression:.1%})"
        )
        if cmp["regressed"]:
            verdict.failure = verdict.reason = f"latency regression: {verdict.line}"
            verdict.code = EXIT_PERF
            return verdict
    if save_baseline:
        try:
            verdict.baseline = gate_baseline(latency, max_regression, **(meta or {}))
        except IntervalTooWide as e:
            verdict.code, verdict.reason, verdict.failure = e.exit_code, str(e), str(e)
    return verdict


def bench_junit_xml(name: str, result) -> str:
    """``graphopt bench --junit``: one test case, failed when the normalized p95 regressed
    past the limit against the baseline."""
    quoteattr, _ = _xml()
    body = ""
    if result.regression is not None and result.regressed:
        msg = (
            f"normalized p95 {result.ratio_p95:.3f} is {result.regression:+.1%} vs baseline "
            f"(limit {result.max_regression:.1%})"
        )
        body = f"<failure message={quoteattr(msg)}/>"
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<testsuite name="graphopt.bench" tests="1" failures="{int(result.regressed)}">\n'
        f'  <testcase classname="graphopt.bench" name={quoteattr(name)}>{body}</testcase>\n'
        "</testsuite>\n"
    )

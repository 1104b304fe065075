"""bench.py's latency interval: session generations widen it (no tool is run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmark"))
bench = pytest.importorskip("bench")


def _rounds(offsets: list[float], n: int = 200) -> list[float]:
    rng = np.random.default_rng(1)
    return [float(o + e) for o in offsets for e in rng.normal(0.0, 0.004, n)]


def test_one_generation_is_the_plain_bootstrap_of_the_rounds():
    paired = _rounds([1.0])
    low, high = bench._ratio_ci95(paired, [len(paired)])
    assert low < float(np.median(paired)) < high
    assert high - low < 0.003


def test_sessions_placed_differently_widen_the_interval():
    """Three session generations 1.5 % apart: pooling the rounds alone claims a tight interval
    around their median; resampling the generations does not."""
    paired = _rounds([0.99, 1.005, 1.02])
    naive = bench._ratio_ci95(paired, [len(paired)])
    low, high = bench._ratio_ci95(paired, [200, 200, 200])
    assert naive[1] - naive[0] < 0.005
    assert low <= 0.992 and high >= 1.018


def test_slower_beyond_interval_counts_only_matching_outputs_with_an_interval():
    def tool(ratio, ci, ok=True):
        return {"parity": {"ok": ok}, "ENABLE_ALL": {"ratio": ratio, "ratio_ci95": ci}}

    results = {
        "a": {"tools": {"graphopt-O2-bundle": tool(1.02, [1.01, 1.03])}},
        "b": {"tools": {"graphopt-O2-bundle": tool(1.01, [0.99, 1.02])}},
        "c": {"tools": {"graphopt-O2-bundle": tool(1.05, [1.04, 1.06], ok=False)}},
        "d": {"tools": {"graphopt-O2-bundle": {"parity": {"ok": True}, "ENABLE_ALL": {}}}},
    }
    slow, n = bench._slower_beyond_interval(results, "graphopt-O2-bundle")
    assert n == 2 and slow == ["a 1.020 [1.010, 1.030]"]

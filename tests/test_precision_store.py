"""require_representable measures the rounding error only where its half-ulp bound could
exceed the tolerance: the same verdicts and values as measuring it everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from graphopt.opt.numerics.precision import FLUSH_TOLERANCE, STORE_TOLERANCE, require_representable
from graphopt.opt.rewrite.engine import NoMatch

BF16 = None
try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - onnx depends on ml_dtypes
    pass


def measured_everywhere(exact: np.ndarray, dtype: np.dtype) -> str | np.ndarray:
    """Every check on every value: the verdict code, or the stored values."""
    exact = np.asarray(exact, np.float64)
    if not np.all(np.isfinite(exact)):
        return "precision-nonfinite"
    if dtype.kind != "f":
        return exact.astype(dtype)
    info = np.finfo(dtype)
    peak = float(np.max(np.abs(exact))) if exact.size else 0.0
    if peak > float(info.max):
        return "precision-overflow"
    with np.errstate(over="ignore", under="ignore"):
        stored = exact.astype(dtype)
    nonzero = exact != 0
    flushed = int(np.count_nonzero(nonzero & (stored == 0)))
    if nonzero.any() and flushed / int(nonzero.sum()) > FLUSH_TOLERANCE:
        return "precision-underflow"
    if peak > 0:
        err = np.abs(stored.astype(np.float64) - exact) / peak
        if float(err.max()) > STORE_TOLERANCE.get(dtype.name, 1e-6):
            return "precision-loss"
    return stored


def cases():
    rng = np.random.default_rng(0)
    out = []
    for scale in (1.0, 1e-3, 1e-30, 1e-40, 1e-6, 1e4, 6e4, 1e5, 3e38, 1e-300):
        out.append(rng.standard_normal(257) * scale)
    spread = rng.standard_normal(300) * np.exp(rng.uniform(-120, 5, 300))
    out += [spread, np.zeros(5), np.array([]), np.array([1.0, np.nan]), np.array([np.inf, 1])]
    mixed = np.concatenate([rng.standard_normal(100), rng.standard_normal(100) * 1e-9])
    tiny = np.concatenate([np.full(10, 1e-8), np.ones(10)])  # fp16: flushes 10 of 20
    out += [mixed, tiny, np.array([65504.0, 65519.0]), np.array([1e-45, 1.0])]
    out += [rng.uniform(1e-6, 2e-6, 50), rng.uniform(1e-40, 2e-40, 50)]  # subnormal peaks
    return out


DTYPES = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)]
DTYPES += [BF16] if BF16 is not None else []


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_same_verdicts_and_values_as_measuring_everywhere(dtype):
    seen = set()
    for exact in cases():
        try:
            with np.errstate(invalid="ignore", over="ignore"):  # huge values cast to int64
                want = measured_everywhere(exact, dtype)
                got = require_representable(exact, dtype, "w")
        except NoMatch as e:
            assert e.code == want, (exact[:4], dtype)
            seen.add(e.code)
            continue
        assert not isinstance(want, str), (want, exact[:4], dtype)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
        seen.add("kept")
    assert "kept" in seen and "precision-nonfinite" in seen
    if dtype in (np.float16, np.float32):
        assert {"precision-overflow", "precision-underflow", "precision-loss"} <= seen

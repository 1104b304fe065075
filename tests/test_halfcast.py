"""opt/halfcast: onnxruntime's Cast converts float16 exactly as numpy does, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from graphopt.opt.numerics import halfcast


def every_float16() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, NaN payloads aside (processors quiet signalling NaNs)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))) and np.array_equal(
        a[~nan].view(np.uint8), b[~nan].view(np.uint8)
    )


def test_widen_every_float16():
    h = every_float16()
    assert h.size >= halfcast.SMALL  # the onnxruntime path
    for dtype in (np.float32, np.float64):
        got = halfcast.widen(h, dtype)
        assert got.dtype == dtype and got.shape == h.shape
        assert same_bits(got, h.astype(dtype))


def test_to_float16_rounds_as_numpy_at_ties_subnormals_and_overflow():
    h = every_float16()
    finite = h[np.isfinite(h)].astype(np.float64)
    finite = np.unique(finite)
    mid = (finite[:-1] + finite[1:]) / 2  # every tie: exact in float32
    mid32 = mid.astype(np.float32)
    assert np.array_equal(mid32.astype(np.float64), mid)
    up = np.nextafter(mid32, np.float32(np.inf))
    down = np.nextafter(mid32, np.float32(-np.inf))
    rng = np.random.default_rng(0)
    spread = [rng.standard_normal(20000).astype(np.float32) * s for s in (1e-9, 1e-6, 1e-3, 1, 1e4)]
    edge = np.array([65504, 65519, 65520, 65536, 1e30, np.inf, -np.inf, 0, -0.0], np.float32)
    x = np.concatenate([finite.astype(np.float32), mid32, up, down, *spread, edge, -edge])
    assert x.size >= halfcast.SMALL
    got = halfcast.to_float16(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert got.dtype == np.float16 and same_bits(got, want)
    # a shaped array keeps its shape; a small one takes numpy's cast
    w = rng.standard_normal((256, 3, 3, 40)).astype(np.float32)
    assert halfcast.to_float16(w).shape == w.shape
    assert np.array_equal(halfcast.to_float16(w), w.astype(np.float16))
    assert np.array_equal(halfcast.to_float16(w[:1, :1]), w[:1, :1].astype(np.float16))


def test_float64_of_any_float():
    h = np.linspace(-3, 3, halfcast.SMALL + 5).astype(np.float16)
    assert np.array_equal(halfcast.float64(h), h.astype(np.float64))
    f = np.arange(5, dtype=np.float32)
    assert halfcast.float64(f).dtype == np.float64


def test_wrong_dtype_is_refused():
    with pytest.raises(TypeError):
        halfcast.to_float16(np.zeros(3))
    with pytest.raises(TypeError):
        halfcast.widen(np.zeros(3, np.float32))

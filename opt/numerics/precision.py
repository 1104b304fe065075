"""Precision guards: is a value computed in float64 still faithful in the dtype it is stored in?

Folding rules (Conv+BN, Conv+Mul, ...) compute in float64, cast to the stored dtype, and call
:func:`require_representable`, which refuses -- with the worst value and its error in the
remark -- when a value overflows the dtype, when non-zero values flush to zero, or when the
relative error of the stored tensor exceeds the tolerance for that dtype.

Folding a per-channel affine op (BatchNormalization, Mul, Add) into fp16/bf16 Conv weights
re-rounds every weight.  :func:`require_refold_no_worse` decides from measured error, not from
the level: it runs the folded and the unfused layer on seeded probe inputs (the
BatchNormalization's running statistics set each channel's scale and offset) and compares both
with the exact float64 result; the fold is kept when neither its worst nor its systematic error
is worse than the unfused graph's.

Weight-only quantization (opt-in, ``rules/weights_int4.py``) keeps, in the pass options under
:data:`QUANTIZED_REFERENCE`, the model's outputs before its first weight was quantized and the
error limit it was held to; :func:`quantized_weight_tolerances` turns them into parity's
per-output tolerances (``atol = limit × max |reference|``, the guard's own measure), so parity
checks the stated int4 tolerance instead of fp32's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from ..rewrite.engine import NoMatch

try:  # the optional C extension (setup.py)
    from . import _rounding as native
except ImportError:
    native = None

#: max relative error (vs the tensor's largest magnitude) tolerated when storing folded values
STORE_TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}
#: fraction of non-zero values allowed to flush to zero
FLUSH_TOLERANCE = 1e-3
#: pass-options key: {"feeds", "outputs", "limit"} of a model whose weights were quantized
QUANTIZED_REFERENCE = "_quantized_weights_reference"


def quantized_weight_tolerances(
    options: dict, given: dict[str, tuple[float, float]] | None
) -> dict[str, tuple[float, float]] | None:
    """Parity's per-output tolerances once weights were quantized: ``(0, limit × max
    |reference|)`` for each float output the user gave none for; ``given`` unchanged otherwise."""
    ref = options.get(QUANTIZED_REFERENCE)
    if not ref or not ref.get("quantized"):
        return given
    out = {
        name: (0.0, float(ref["limit"]) * float(np.max(np.abs(v))))
        for name, v in ref["outputs"].items()
        if np.asarray(v).dtype.kind == "f" and np.asarray(v).size
    }
    return out | dict(given or {})


def require_representable(exact: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Return ``exact`` cast to ``dtype``; raise NoMatch(precision-...) if that loses too much.
    Few passes over the values: rounding to ``dtype`` errs by at most half an ulp (relative
    eps/2, or half the smallest subnormal below the normal range), so the error is measured
    only where that bound exceeds the tolerance, and flushes only where values are that tiny."""
    dtype = np.dtype(dtype)
    exact = np.asarray(exact, dtype=np.float64)
    hi, lo = (float(exact.max()), float(exact.min())) if exact.size else (0.0, 0.0)
    if not (math.isfinite(hi) and math.isfinite(lo)):
        bad = exact[~np.isfinite(exact)][0]
        raise NoMatch(
            "precision-nonfinite", f"folded {what} contains {bad} (in float64)", worst=float(bad)
        )
    peak = max(hi, -lo)  # the largest magnitude, without an array of magnitudes
    if dtype.kind != "f":
        return exact.astype(dtype)
    info = np.finfo(dtype)
    if peak > float(info.max):
        raise NoMatch(
            "precision-overflow",
            f"folded {what} reaches {peak:.6g}, beyond {dtype.name}'s max {float(info.max):.6g}",
            worst=peak,
            limit=float(info.max),
        )
    with np.errstate(over="ignore", under="ignore"):
        stored = exact.astype(dtype)
    # a value stored as zero is zero or flushed (nothing else rounds to zero): counting the
    # non-zeros on each side finds the flushed ones without comparing element by element
    nonzero = int(np.count_nonzero(exact))
    flushed = nonzero - nonzero_values(stored)
    if flushes_too_many(flushed, nonzero):
        smallest = float(np.min(np.abs(exact[exact != 0])))
        raise NoMatch(
            "precision-underflow",
            f"{flushed} non-zero values of folded {what} flush to zero in {dtype.name} "
            f"(smallest {smallest:.3g})",
            flushed=flushed,
            worst=smallest,
        )
    if not rounds_within_tolerance(peak, dtype):
        tol = STORE_TOLERANCE.get(dtype.name, 1e-6)
        err = np.abs(stored.astype(np.float64) - exact) / peak
        worst = float(err.max())
        if worst > tol:
            raise NoMatch(
                "precision-loss",
                f"storing folded {what} in {dtype.name} loses {worst:.3g} of its scale "
                f"(tolerance {tol:g})",
                worst=worst,
                tolerance=tol,
            )
    return stored


def representable_scaled_rows(
    rows: np.ndarray, scale: np.ndarray, dtype: np.dtype
) -> np.ndarray | None:
    """:func:`require_representable` of float32 ``rows`` times ``scale`` (one per row) in one
    pass without float64 temporaries, natively (``opt/numerics/_rounding.c``; the same values), when
    the extension is built and every guard passes; else None, and the float64 path checks
    the fold and says what fails."""
    if native is None or np.dtype(dtype) != np.float32 or rows.dtype != np.float32:
        return None
    if rows.ndim != 2 or rows.size == 0 or scale.shape != (rows.shape[0],):
        return None
    rows = np.ascontiguousarray(rows)
    out = np.empty_like(rows)
    hi, lo, nonzero, flushed = native.scale_rows(
        rows, np.ascontiguousarray(scale, dtype=np.float64), out, rows.shape[1]
    )
    peak = max(hi, -lo)
    if not (math.isfinite(hi) and math.isfinite(lo)) or peak > float(np.finfo(np.float32).max):
        return None
    if flushes_too_many(flushed, nonzero) or not rounds_within_tolerance(peak, np.float32):
        return None
    return out


def flushes_too_many(flushed: int, nonzero: int) -> bool:
    """Whether ``flushed`` of ``nonzero`` folded values rounding to zero is beyond
    :data:`FLUSH_TOLERANCE`."""
    return bool(flushed) and flushed / nonzero > FLUSH_TOLERANCE


def rounds_within_tolerance(peak: float, dtype: np.dtype) -> bool:
    """Whether rounding values of magnitude up to ``peak`` (finite, within range) to float
    ``dtype`` errs by at most its :data:`STORE_TOLERANCE` of ``peak`` without measuring: half an
    ulp (relative eps/2, or half the smallest subnormal below the normal range)."""
    if peak <= 0:
        return True
    info = np.finfo(dtype)
    bound = max(float(info.eps) / 2, float(info.smallest_subnormal) / 2 / peak)
    return bound <= STORE_TOLERANCE.get(np.dtype(dtype).name, 1e-6)


def nonzero_values(a: np.ndarray) -> int:
    """Non-zero values of a float array; float16 on its bits without the sign (numpy counts
    float16 one value at a time: 40x slower)."""
    if a.dtype == np.float16:
        return int(np.count_nonzero(a.view(np.uint16) & np.uint16(0x7FFF)))
    return int(np.count_nonzero(a))


def require_refold_allowed(cx, dtype: np.dtype, what: str, count: int) -> None:
    """Folding into fp16/bf16 weights re-rounds every one of them: a numerics change that
    compounds through deep networks (measured: 1.3 % of the logits' scale on a 53-layer fp16
    ResNet-50).  Allowed at -O3 only, where the other precision guards still apply."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize <= 2 and cx.level < 3:
        raise NoMatch(
            "precision-refold",
            f"folding into {dtype.name} {what} re-rounds {count} stored values (up to 2^-11 "
            "relative each), which compounds across layers; allowed at -O3",
            dtype=dtype.name,
            values=count,
        )


#: seeded probe patches per refold measurement
PROBE_PATCHES = 32
#: slack on "no worse": the probes are random, so equal errors measure within a few percent
REFOLD_SLACK = 1.05


def _round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)


@functools.lru_cache(maxsize=16)
def _probe_patches(k: int) -> np.ndarray:
    """The seeded half-normal probe patches of length ``k`` (the same for every layer of that
    length; read-only)."""
    x = np.abs(np.random.default_rng(0).standard_normal((PROBE_PATCHES, k)))
    x.flags.writeable = False
    return x


def refold_probe(
    rows: np.ndarray,
    bias: np.ndarray,
    scale: np.ndarray,
    shift: np.ndarray,
    dtype: np.dtype,
    stats: tuple[np.ndarray, np.ndarray] | None = None,
) -> Callable[[np.ndarray, np.ndarray], dict[str, float]]:
    """Error of folded vs. the unfused low-precision layer against float64, on probes: returns
    ``errors(stored_rows, stored_bias)`` for candidate folds of the same layer (the probes, the
    exact and the unfused layer's outputs are computed once).  :class:`ProbedRows` holds the
    measurement of some of the output channels, for layers measured in blocks."""
    probed = ProbedRows(rows, bias, scale, shift, dtype, stats)
    return lambda stored_rows, stored_bias: probe_errors(
        [probed.unfused], [probed.folded(stored_rows, stored_bias)]
    )


class ProbedRows:
    """The refold measurement of some output channels of a layer, as sums that add up across
    blocks of channels (:func:`probe_errors` turns them into the errors).

    ``rows`` are the Conv's weights as one row per output channel (C, K) and ``bias`` its bias,
    both as stored; the op after it computes ``z = scale·y + shift`` per channel.  The unfused
    graph rounds ``y`` to ``dtype``, then ``z`` (the op itself computed in fp32); the folded one
    computes ``stored_rows``·x + ``stored_bias`` and rounds once.  Probe patches x are seeded
    half-normal; with ``stats`` (the BatchNormalization's running mean and variance of ``y``) each
    channel's probe is scaled and shifted so that ``y`` has about that mean and variance, as in
    the data the statistics were gathered on.  Probes are non-negative (as after an activation),
    so that weight errors show their systematic part.  Errors are relative to each channel's
    RMS of the exact ``z``; the sums are the worst, the total and the systematic error (the
    worst channel's error averaged over the probes) with the number of values, for the unfused
    layer (``unfused``) and a candidate fold (``folded``).
    """

    def __init__(self, rows, bias, scale, shift, dtype, stats=None):
        self.dtype = np.dtype(dtype)
        self.rows = rows
        self.x = x = _probe_patches(rows.shape[1])
        norm2 = np.einsum("ck,ck->c", rows, rows)
        self.safe = safe = np.where(norm2 > 0, norm2, 1.0)
        if stats is not None:
            mean, var = (np.asarray(v, dtype=np.float64).reshape(-1) for v in stats)
            self.sigma = np.sqrt(np.maximum(var, 0.0) / safe)
            self.offset = np.where(norm2 > 0, mean - bias, 0.0)
        else:
            self.sigma, self.offset = 1.0 / np.sqrt(safe), np.zeros(rows.shape[0])
        # channel c's probe is sigma_c·x + offset_c·W_c/|W_c|²: its product with a row V is
        # sigma_c·(x·V) + offset_c·(W_c·V)/|W_c|²
        y = self.sigma * (x @ rows.T) + self.offset + bias
        self.exact = exact = scale * y + shift
        unfused = _round(scale * _round(y, self.dtype) + shift, self.dtype)
        rms = np.sqrt(np.mean(exact**2, axis=0))
        self.rms = np.where(rms > 0, rms, 1.0)
        self.unfused = self._sums(unfused)

    def folded(self, stored_rows: np.ndarray, stored_bias: np.ndarray) -> np.ndarray:
        """The sums for a candidate fold: its rows and bias as stored (float64)."""
        dot = self.sigma * (self.x @ stored_rows.T)
        dot += self.offset * np.einsum("ck,ck->c", self.rows, stored_rows) / self.safe
        return self._sums(_round(dot + stored_bias, self.dtype))

    def _sums(self, out: np.ndarray) -> np.ndarray:
        e = np.abs(out - self.exact) / self.rms
        # systematic part: the error's mean over the probes, per channel (what pooling keeps)
        b = np.abs(np.mean(out - self.exact, axis=0)) / self.rms
        return np.array([e.max(), e.sum(), b.max(), e.size], dtype=np.float64)


def probe_errors(unfused: list[np.ndarray], folded: list[np.ndarray]) -> dict[str, float]:
    """The errors of :func:`refold_probe` from the :class:`ProbedRows` sums of every block of
    channels: the worst, the mean and the systematic error, folded and unfused."""
    out = {}
    for side, parts in (("folded", folded), ("unfused", unfused)):
        a = np.stack(parts)
        out |= {
            f"{side}_max": a[:, 0].max(),
            f"{side}_mean": a[:, 1].sum() / a[:, 3].sum(),
            f"{side}_bias": a[:, 2].max(),
        }
    return {k: float(np.nan_to_num(v, nan=np.inf)) for k, v in out.items()}


def refold_measured(cx, dtype: np.dtype) -> bool:
    """Whether :func:`require_refold_no_worse` measures a fold into ``dtype`` weights here:
    fp16/bf16 below -O3."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" and dtype.itemsize <= 2 and cx.level < 3


def require_refold_no_worse(cx, dtype: np.dtype, what: str, measure) -> None:
    """Folding into fp16/bf16 weights re-rounds them: kept when the measured error of the folded
    layer (``measure()`` → :func:`refold_probe`) is no worse than the unfused graph's (within
    ``REFOLD_SLACK``) in both the worst error and the systematic error (each channel's error
    averaged over the probes).  The systematic part matters: re-rounded weights err the same way
    on every input, and pooling keeps that while it averages the unfused graph's rounding noise
    away.  Measured on ResNet-50 fp16 with non-trivial BN statistics: folded layers'
    systematic error is 3.1-7.1x the unfused ones' (worst error 0.56-1.23x), and folding all 53
    made the logits' error against float64 4x larger (mean 3.03 vs 0.74, onnxruntime cpu) than
    the unfused graph at ORT_DISABLE_ALL.  This guard alone refuses that; on onnxruntime targets
    ``rules/conv.py`` still keeps a fold no worse than onnxruntime's own fp16 Conv+BN fold, which
    users get at ORT_ENABLE_BASIC and above anyway.  A fold that re-rounds nothing (scales that
    are powers of two, fresh BN statistics) is kept.  -O3 folds regardless (the other precision
    guards still apply).  A refusal (``precision-refold``) carries the numbers."""
    if not refold_measured(cx, dtype):
        return
    dtype = np.dtype(dtype)
    e = measure()
    worse = e["folded_max"] > REFOLD_SLACK * e["unfused_max"] or (
        e["folded_bias"] > REFOLD_SLACK * e["unfused_bias"]
    )
    if worse:
        raise NoMatch(
            "precision-refold",
            f"folding into {dtype.name} {what} is less accurate than the unfused graph against "
            f"float64: worst error {e['folded_max']:.3g} vs {e['unfused_max']:.3g}, "
            f"systematic {e['folded_bias']:.3g} vs {e['unfused_bias']:.3g} (of each channel's "
            "RMS, on probe inputs); allowed at -O3",
            dtype=dtype.name,
            **e,
        )


def require_accumulation_in_range(
    cx,
    x_name: str,
    weights: np.ndarray,
    bias: np.ndarray,
    dtype: np.dtype,
    op: str,
    out_axis: int = 0,
) -> None:
    """With calibration ranges, bound what a fused fp16/bf16 kernel accumulates.

    For each output channel the accumulator is at most ``‖W'_c‖₁ · max|x| + |b'_c|``; if that
    can exceed the dtype's range and the target does not declare fp32 accumulation for ``op``,
    the fusion is refused (``precision-range``).  Without calibration data nothing is assumed.
    """
    dtype = np.dtype(dtype)
    if dtype.kind != "f" or dtype.itemsize > 2 or not cx.ranges:
        return
    if cx.target.accumulates_fp32(op) or x_name not in cx.ranges:
        return
    x_max = cx.ranges[x_name]
    w = np.moveaxis(np.abs(np.asarray(weights, dtype=np.float64)), out_axis, 0)
    l1 = w.reshape(w.shape[0], -1).sum(axis=1)
    bound = l1 * x_max + np.abs(np.asarray(bias, dtype=np.float64)).reshape(-1)[: l1.size]
    worst = float(bound.max()) if bound.size else 0.0
    limit = float(np.finfo(dtype).max)
    if worst > limit:
        raise NoMatch(
            "precision-range",
            f"fused {op} may accumulate up to {worst:.6g} in {dtype.name} (‖W‖₁ "
            f"{float(l1.max()):.4g} × measured max|{x_name}| {x_max:.4g}), beyond {limit:.6g}; "
            f"target {cx.target.name} does not declare fp32 accumulation for {op}",
            worst=worst,
            limit=limit,
            input_range=x_max,
        )

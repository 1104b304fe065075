"""Precision guards: is a value computed in float64 still faithful in the dtype it is stored in?

Folding rules (Conv+BN, Conv+Mul, ...) compute in float64, cast to the stored dtype, and call
:func:`require_representable`, which refuses -- with the worst value and its error in the
remark -- when a value overflows the dtype, when non-zero values flush to zero, or when the
relative error of the stored tensor exceeds the tolerance for that dtype.
"""

from __future__ import annotations

import numpy as np

from .rewrite import NoMatch

#: max relative error (vs the tensor's largest magnitude) tolerated when storing folded values
STORE_TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}
#: fraction of non-zero values allowed to flush to zero
FLUSH_TOLERANCE = 1e-3


def require_representable(exact: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Return ``exact`` cast to ``dtype``; raise NoMatch(precision-...) if that loses too much."""
    dtype = np.dtype(dtype)
    exact = np.asarray(exact, dtype=np.float64)
    if not np.all(np.isfinite(exact)):
        bad = exact[~np.isfinite(exact)][0]
        raise NoMatch(
            "precision-nonfinite", f"folded {what} contains {bad} (in float64)", worst=float(bad)
        )
    if dtype.kind != "f":
        return exact.astype(dtype)
    info = np.finfo(dtype)
    peak = float(np.max(np.abs(exact))) if exact.size else 0.0
    if peak > float(info.max):
        raise NoMatch(
            "precision-overflow",
            f"folded {what} reaches {peak:.6g}, beyond {dtype.name}'s max {float(info.max):.6g}",
            worst=peak,
            limit=float(info.max),
        )
    with np.errstate(over="ignore", under="ignore"):
        stored = exact.astype(dtype)
    nonzero = exact != 0
    flushed = int(np.count_nonzero(nonzero & (stored == 0)))
    if nonzero.any() and flushed / int(nonzero.sum()) > FLUSH_TOLERANCE:
        smallest = float(np.min(np.abs(exact[nonzero])))
        raise NoMatch(
            "precision-underflow",
            f"{flushed} non-zero values of folded {what} flush to zero in {dtype.name} "
            f"(smallest {smallest:.3g})",
            flushed=flushed,
            worst=smallest,
        )
    if peak > 0:
        err = np.abs(stored.astype(np.float64) - exact) / peak
        worst = float(err.max())
        tol = STORE_TOLERANCE.get(dtype.name, 1e-6)
        if worst > tol:
            raise NoMatch(
                "precision-loss",
                f"storing folded {what} in {dtype.name} loses {worst:.3g} of its scale "
                f"(tolerance {tol:g})",
                worst=worst,
                tolerance=tol,
            )
    return stored


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

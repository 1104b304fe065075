"""Folding a per-channel affine op into float16 Conv weights: compensated rounding,
onnxruntime's own fold of Conv+BatchNormalization, and the fold measured in blocks of output
channels.

float16 weights are stored with compensated rounding (:func:`compensated_rows`): each output
channel's row is rounded to nearest, then the values nearest to half-way are rounded the other
way while each such move cuts the row's summed rounding error by at least twice what it adds to
its own value's error, so that the errors cancel in the channel's response to inputs of a common
mean (after an activation) instead of adding up to a systematic error.

onnxruntime folds Conv+BatchNormalization itself at session level BASIC (``ConvBNFusion``, any
provider), in the weights' dtype and rounding every step to it: :func:`runtime_bn_fold` gives
the same weights and bias bit for bit (onnxruntime 1.32).

:func:`fold_rows` folds a Conv's float16 weights and measures the fold
(``opt/precision.ProbedRows``) one block of output channels at a time, on the rounding threads:
every step of the fold is per channel, so a block's float64 temporaries stay in the core's cache
and both cores work, where the same steps over whole layers spend most of their time in memory
and page faults.

A block's steps but its probes (widening, scaling, rounding, the compensated rounding,
onnxruntime's own fold) run natively where the optional C extension (``opt/numerics/_rounding.c``)
was built at install, and in numpy otherwise: the same values bit for bit.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from ..rewrite.engine import NoMatch
from .halfcast import float64, to_float16, widen
from .precision import REFOLD_SLACK, ProbedRows, nonzero_values, probe_errors

try:  # built at install where a C compiler is present (setup.py)
    from . import _rounding as native
except ImportError:  # numpy computes the same rows
    native = None

#: values per block of rows :func:`compensated_rows` works on at once (its float64 temporaries
#: stay in the core's cache: ~25 % faster than whole layers); blocks run on up to
#: :data:`ROUNDING_THREADS` threads (numpy releases the GIL in its loops)
ROUNDING_BLOCK = 65536
ROUNDING_THREADS = max(1, min(4, os.cpu_count() or 1))
#: values per block of output channels :func:`fold_rows` folds and measures at once: larger
#: than :data:`ROUNDING_BLOCK`, as its threads hand the interpreter lock to each other between
#: numpy calls (measured on ResNet-50 fp16, 2 cores: 131072 values 1.53 s for the whole run,
#: 65536 1.72 s, whole layers 1.70 s)
FOLD_BLOCK = 131072
_rounding_pool: ThreadPoolExecutor | None = None


def compensated_rows(exact: np.ndarray, nearest: np.ndarray) -> np.ndarray:
    """Float16 rows whose rounding errors cancel: ``nearest`` (``exact`` rounded to nearest)
    with, in each row, the values whose other neighbour costs least (those nearest to
    half-way) moved to that neighbour, as many as minimize the row's summed rounding error
    plus twice what the moves add to the values' own errors (all in absolute value): a move
    must cut the sum by at least twice what it costs, so a row whose errors already cancel
    keeps its nearest values.  Each value stays one of the two float16 neighbours of its exact
    value.  Rows are independent: they are re-rounded in blocks of about
    :data:`ROUNDING_BLOCK` values, on threads when there are several blocks."""
    return compensated_rows_started(exact, nearest)()


def _pool() -> ThreadPoolExecutor:
    global _rounding_pool
    if _rounding_pool is None:
        _rounding_pool = ThreadPoolExecutor(ROUNDING_THREADS, thread_name_prefix="graphopt-round")
    return _rounding_pool


def compensated_rows_started(exact: np.ndarray, nearest: np.ndarray) -> Callable[[], np.ndarray]:
    """:func:`compensated_rows`, its blocks started on the rounding threads (when there are
    several): returns what waits for them and gives the rows."""
    rows, n = exact.shape
    per = max(1, ROUNDING_BLOCK // max(n, 1))
    if rows <= per and ROUNDING_THREADS > 1:  # one block, still beside the caller's work
        return _pool().submit(_compensated_block, exact, nearest).result
    if rows <= per:
        out = _compensated_block(exact, nearest)
        return lambda: out
    spans = [(i, min(i + per, rows)) for i in range(0, rows, per)]
    out = np.empty_like(nearest)

    def block(span: tuple[int, int]) -> None:
        a, b = span
        out[a:b] = _compensated_block(exact[a:b], nearest[a:b])

    if ROUNDING_THREADS == 1:
        for span in spans:
            block(span)
        return lambda: out
    futures = [_pool().submit(block, span) for span in spans]

    def wait() -> np.ndarray:
        for f in futures:
            f.result()
        return out

    return wait


def _compensated_block(exact: np.ndarray, nearest: np.ndarray) -> np.ndarray:
    """:func:`compensated_rows` of a few rows, at once: natively (``opt/numerics/_rounding.c``, the
    same values bit for bit, without the interpreter lock; ResNet-50 fp16's folds: 0.16 s of CPU
    against 0.46 s) where it was built, but for rows whose summed error is not finite."""
    if native is not None and exact.size and nearest.dtype == np.float16:
        out = np.empty_like(nearest)
        exact64 = np.ascontiguousarray(exact, dtype=np.float64)
        bits = np.ascontiguousarray(nearest).view(np.uint16)
        if native.compensate(exact64, bits, out.view(np.uint16), exact.shape[1]):
            return out
    other, total, cost, step, useful = rounding_moves(exact, nearest)
    rows, cols = _cheapest_flips(total, cost, step, useful)
    out = nearest.copy()
    out[rows, cols] = other[rows, cols]
    return out


def rounding_moves(exact: np.ndarray, nearest: np.ndarray) -> tuple:
    """Per value of float16 rows: (its other float16 neighbour, the row's summed rounding
    error [rows, 1], what moving there adds to its own error (inf where a move does not help
    the row's sum), the move (meaningful where it helps), whether it helps)."""
    exact = np.asarray(exact, dtype=np.float64)
    near64 = float64(nearest)
    resid = near64 - exact
    above = resid > 0  # the other neighbour lies below (toward -inf), else above
    other = _neighbour(nearest, above)
    step = float64(other)
    step -= near64
    total = resid.sum(axis=1, keepdims=True)
    # a move goes against its value's error (toward the exact value), so it helps the row's sum
    # where that error has the sign of the sum: sign(step) == -sign(total)
    useful = above == (total > 0)
    useful &= resid != 0
    useful &= total != 0
    finite = np.isfinite(step)
    if not finite.all():  # a move out of the largest finite float16
        useful &= finite
    cost = resid + step
    np.abs(cost, out=cost)
    cost -= np.abs(resid)
    _infinite_where_not(cost, useful)
    return other, total, cost, step, useful


_INF_BITS = np.float64(np.inf).view(np.int64)


def _infinite_where_not(values: np.ndarray, keep: np.ndarray) -> None:
    """``values[~keep] = inf`` (float64, in place), on the bits: a masked store branches on
    every value and runs 3x slower on a mask as irregular as which moves help."""
    drop = keep.view(np.int8).astype(np.int64)
    drop -= 1  # all bits set where not kept, none where kept
    bits = values.view(np.int64)
    bits &= ~drop
    drop &= _INF_BITS
    bits |= drop


def _neighbour(values: np.ndarray, down: np.ndarray) -> np.ndarray:
    """``np.nextafter(values, -inf if down else +inf)`` of float16 values, on their bits: a
    float16's neighbours are the integers beside its bits (magnitude up or down by one unit),
    but for a zero (the smallest subnormal of the direction's sign) and an infinity moving
    outward (itself)."""
    bits = values.view(np.uint16)
    outward = down == (bits >= 0x8000)  # away from zero: the magnitude's bits go up by one
    out = outward.view(np.uint8).astype(np.uint16)
    out <<= 1
    out += bits
    out -= np.uint16(1)  # bits + 1 or bits - 1, mod 2**16
    magnitude = bits & np.uint16(0x7FFF)
    zero = magnitude == 0
    if zero.any():
        out[zero] = np.where(down[zero], np.uint16(0x8001), np.uint16(0x0001))
    infinite = magnitude == 0x7C00
    if infinite.any():
        stays = infinite & outward
        out[stays] = bits[stays]
    return out.view(np.float16)


#: candidates per row put in order first (at least; 4·sqrt(length) for long rows): a row
#: needs about sqrt(its length) flips (ResNet-50 fp16: median 1.0, at most 4.2·sqrt), and a row
#: whose best count could lie beyond is sorted whole (4 instead of 8·sqrt: 20 % less time, the
#: same flips)
FLIP_PREFIX = 32


def _cheapest_flips(total, cost, step, useful) -> tuple[np.ndarray, np.ndarray]:
    """Which values :func:`compensated_rows` moves, as (rows, columns): per row, the first
    ``count`` in the order of a stable sort by cost, ``count`` minimizing |total + their steps|
    + 2·their costs.  Only the :data:`FLIP_PREFIX` cheapest are sorted; a row whose best count
    could lie beyond them (costs never decrease along the order, so none can once twice the
    prefix's costs reach the best found) is sorted whole, so the result is the whole sort's."""
    rows, n = cost.shape
    if n == 0:
        return np.empty(0, np.intp), np.empty(0, np.intp)
    k = _prefix_length(n)
    part = (
        np.argpartition(cost, k - 1, axis=1)[:, :k] if k < n else np.tile(np.arange(n), (rows, 1))
    )
    part.sort(axis=1)  # a stable sort by cost then keeps equal costs in the order of the row
    order = np.take_along_axis(part, np.argsort(np.take_along_axis(cost, part, 1), 1, "stable"), 1)
    sorted_cost = np.take_along_axis(cost, order, axis=1)
    kth = sorted_cost[:, -1:]
    # the prefix as the whole sort has it: values cheaper than the k-th (ties may differ there)
    safe = (sorted_cost < kth).sum(axis=1) if k < n else np.full(rows, n)
    sorted_step = _helping(sorted_cost, np.take_along_axis(step, order, 1))
    count, best, added = _best_count(total, sorted_cost, sorted_step, safe)
    whole = ~((2.0 * added >= best) | ~np.isfinite(kth[:, 0]) | (k == n))
    r, c = _firsts(order, np.where(whole, 0, count))
    if whole.any():
        idx = np.flatnonzero(whole)
        order = np.argsort(cost[idx], axis=1, kind="stable")
        whole_cost = np.take_along_axis(cost[idx], order, 1)
        whole_step = _helping(whole_cost, np.take_along_axis(step[idx], order, 1))
        count, _, _ = _best_count(total[idx], whole_cost, whole_step, np.full(idx.size, n))
        rw, cw = _firsts(order, count)
        r, c = np.concatenate([r, idx[rw]]), np.concatenate([c, cw])
    keep = useful[r, c]
    return r[keep], c[keep]


def _firsts(order: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of the first ``count[i]`` columns ``order[i]`` lists, per row i."""
    r, j = np.nonzero(np.arange(order.shape[1])[None, :] < count[:, None])
    return r, order[r, j]


def _helping(cost: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The moves, 0 where a move does not help (infinite cost)."""
    return np.where(np.isfinite(cost), step, 0.0)


def _prefix_length(n: int) -> int:
    """How many of a row's ``n`` candidates :func:`_cheapest_flips` sorts first."""
    return min(n, max(FLIP_PREFIX, 4 * math.isqrt(n)))


def _best_count(total, sorted_cost, sorted_step, limit):
    """(count, its objective, the costs of the first ``limit``) per row, counts up to
    ``limit``: the objective |total + Σ steps| + 2·Σ costs over the first ``count`` values."""
    finite_cost = np.where(np.isfinite(sorted_cost), sorted_cost, 0.0)
    zero = np.zeros_like(total)
    reach = np.abs(total + np.concatenate([zero, np.cumsum(sorted_step, axis=1)], axis=1))
    added = np.concatenate([zero, np.cumsum(finite_cost, axis=1)], axis=1)
    objective = reach + 2.0 * added
    beyond = np.arange(objective.shape[1])[None, :] > limit[:, None]
    objective = np.where(beyond, np.inf, objective)
    count = np.argmin(objective, axis=1)
    rows = np.arange(count.size)
    return count, objective[rows, count], added[rows, np.minimum(limit, added.shape[1] - 1)]


def runtime_bn_fold(w, b, gamma, beta, mean, var, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The weights and bias onnxruntime's ConvBNFusion stores for a float16 Conv+BN: each step
    computed in float32 and rounded to float16 (scale = gamma / sqrt(var + eps); W·scale;
    bias (B - mean)·scale + beta, or beta - mean·scale without B)."""
    scale, bias = runtime_bn_scale(b, gamma, beta, mean, var, eps)
    return runtime_scaled(w, scale), bias


def runtime_bn_scale(b, gamma, beta, mean, var, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`runtime_bn_fold`'s per-channel scale (float32 holding float16 values) and its
    float16 bias."""

    def r(a) -> np.ndarray:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)

    g, bt, mu, v = (r(np.asarray(t).reshape(-1)) for t in (gamma, beta, mean, var))
    scale = r(g / r(np.sqrt(r(v + np.float32(eps)))))
    if b is None:
        bias = r(bt - r(mu * scale))
    else:
        bias = r(r(r(r(np.asarray(b).reshape(-1)) - mu) * scale) + bt)
    return scale, bias.astype(np.float16)


def runtime_scaled(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float16 weights (output channels first) times :func:`runtime_bn_scale`'s scale, as
    onnxruntime stores them: float16 weights widen exactly, the product is rounded once."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return to_float16(widen(w) * scale.reshape((-1,) + (1,) * (np.ndim(w) - 1)))


def runtime_folds(target) -> bool:
    """Whether ``target`` runs models with onnxruntime at level BASIC or above, where
    ConvBNFusion folds a constant Conv+BatchNormalization itself."""
    level = target.session.get("graph_optimization_level", "")
    return target.runtime.startswith("onnxruntime") and level in (
        "ORT_ENABLE_BASIC",
        "ORT_ENABLE_EXTENDED",
        "ORT_ENABLE_ALL",
    )


def require_no_worse_than_runtime(dt, ours: dict[str, float], theirs: dict[str, float]) -> None:
    """Keep a float16 refold the unfused graph measured better than (``precision-refold``) when
    it is no worse (within ``REFOLD_SLACK``) than the fold the runtime makes of the unfused
    graph, in both the worst and the systematic error; else refuse with both comparisons."""
    if ours["folded_max"] <= REFOLD_SLACK * theirs["folded_max"] and (
        ours["folded_bias"] <= REFOLD_SLACK * theirs["folded_bias"]
    ):
        return
    raise NoMatch(
        "precision-refold",
        f"folding into {np.dtype(dt).name} Conv weights is less accurate than the unfused graph "
        f"against float64 (worst error {ours['folded_max']:.3g} vs {ours['unfused_max']:.3g}, "
        f"systematic {ours['folded_bias']:.3g} vs {ours['unfused_bias']:.3g}) and than "
        f"onnxruntime's own fold of it ({theirs['folded_max']:.3g}, systematic "
        f"{theirs['folded_bias']:.3g}), of each channel's RMS on probe inputs; allowed at -O3",
        dtype=np.dtype(dt).name,
        runtime_max=theirs["folded_max"],
        runtime_bias=theirs["folded_bias"],
        **ours,
    )


class FoldedRows(NamedTuple):
    """What :func:`fold_rows` made of a layer."""

    weights: np.ndarray  #: float16, compensated, one row per output channel
    nonzero: int  #: non-zero folded values (float64)
    flushed: int  #: of which float16 rounds to zero
    ours: dict[str, float]  #: ``probe_errors`` of the compensated fold
    theirs: dict[str, float] | None  #: of onnxruntime's own fold, when asked for


def fold_rows(
    rows: np.ndarray,
    scale: np.ndarray,
    shift: np.ndarray,
    bias: np.ndarray,
    stored_bias: np.ndarray,
    stats: tuple[np.ndarray, np.ndarray] | None = None,
    runtime: tuple[np.ndarray, np.ndarray] | None = None,
) -> FoldedRows:
    """Fold ``z = scale·y + shift`` (per output channel) into float16 Conv weights ``rows``
    (one row per output channel) with compensated rounding, and measure the fold against the
    unfused layer (``ProbedRows``; ``bias``: the Conv's bias as float64, ``stored_bias``: the
    folded bias as stored, ``stats``: the BatchNormalization's running mean and variance), and
    onnxruntime's own fold with ``runtime`` (:func:`runtime_bn_scale`'s scale and bias).  The
    same values as folding whole layers, computed in blocks of about :data:`FOLD_BLOCK`
    values on the rounding threads."""
    c, k = rows.shape
    out = _empty_mapped(rows.shape, rows.dtype)
    folded_bias = float64(stored_bias)
    their_bias = float64(runtime[1]) if runtime is not None else None

    def block(span: tuple[int, int]):
        a, b = span
        their_scale = runtime[0][a:b] if runtime is not None else None
        made = _native_block(rows[a:b], scale[a:b], their_scale, out[a:b])
        if made is not None:
            w, compensated, theirs_rows, nonzero, flushed = made
        else:
            w = float64(rows[a:b])
            exact = w * scale[a:b, None]
            with np.errstate(over="ignore", under="ignore"):
                nearest = exact.astype(np.float16)
            nonzero = int(np.count_nonzero(exact))
            flushed = nonzero - nonzero_values(nearest)
            out[a:b] = _compensated_block(exact, nearest)
            compensated = float64(out[a:b])
            theirs_rows = None
            if runtime is not None:
                theirs_rows = float64(runtime_scaled(rows[a:b], runtime[0][a:b]))
        probed = ProbedRows(
            w,
            bias[a:b],
            scale[a:b],
            shift[a:b],
            np.float16,
            None if stats is None else (stats[0][a:b], stats[1][a:b]),
        )
        ours = probed.folded(compensated, folded_bias[a:b])
        theirs = None
        if runtime is not None:
            theirs = probed.folded(theirs_rows, their_bias[a:b])
        return nonzero, flushed, probed.unfused, ours, theirs

    per = max(1, FOLD_BLOCK // max(k, 1))
    spans = [(i, min(i + per, c)) for i in range(0, c, per)]
    if ROUNDING_THREADS == 1 or len(spans) == 1:
        parts = [block(span) for span in spans]
    else:
        parts = list(_pool().map(block, spans))
    unfused = [p[2] for p in parts]
    return FoldedRows(
        out,
        sum(p[0] for p in parts),
        sum(p[1] for p in parts),
        probe_errors(unfused, [p[3] for p in parts]),
        probe_errors(unfused, [p[4] for p in parts]) if runtime is not None else None,
    )


def _native_block(rows, scale, their_scale, out: np.ndarray):
    """:func:`fold_rows`'s steps for some rows but the probes, natively
    (``opt/numerics/_rounding.c``:
    the same values bit for bit, in one pass per row, without the interpreter lock): writes
    the compensated weights into ``out``; returns (the weights, the compensated weights, and
    onnxruntime's fold of them with ``their_scale``, when given, each as float64; the non-zero
    products; those that round to zero), or None where the extension is not built or a row's
    summed rounding error is not finite (numpy makes the block then)."""
    if native is None or rows.size == 0 or rows.dtype != np.float16:
        return None
    shape = rows.shape
    wide, folded = np.empty(shape), np.empty(shape)
    theirs = np.empty(shape) if their_scale is not None else None
    if their_scale is not None:
        their_scale = np.ascontiguousarray(their_scale, dtype=np.float32)
    ok, nonzero, flushed = native.fold_block(
        np.ascontiguousarray(rows).view(np.uint16),
        np.ascontiguousarray(scale, dtype=np.float64),
        their_scale,
        out.view(np.uint16),
        wide,
        folded,
        theirs,
        shape[1],
    )
    return (wide, folded, theirs, nonzero, flushed) if ok else None


def largest_magnitude_bits(rows: np.ndarray) -> np.ndarray:
    """Each row's largest magnitude of float16 ``rows`` as uint16 bits without the sign
    (ordered like the magnitudes; an infinity is 0x7C00, a NaN above it): in one pass,
    natively where the extension was built."""
    bits = np.ascontiguousarray(rows).view(np.uint16)
    if native is None or bits.size == 0:
        return (bits & np.uint16(0x7FFF)).max(axis=1)
    out = np.empty(bits.shape[0], np.uint16)
    native.largest(bits, out, bits.shape[1])
    return out


#: folded weights of at least this many bytes get a mapping of their own (:func:`_empty_mapped`)
MAPPED_ABOVE = 256 << 10


def _empty_mapped(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized array for a layer's folded weights, in an anonymous mapping of its own
    when it is large: they live until the model is exported, which copies them one by one and
    lets each go; from the heap, each would leave a hole that the next copy (of another size)
    does not fit, and the heap would grow by the copies (ResNet-50 fp16 ``--no-check`` peak
    186-198 -> 178-180 MB); a mapping goes back to the system when its array does."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    if count * dtype.itemsize < MAPPED_ABOVE:
        return np.empty(shape, dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize)
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)

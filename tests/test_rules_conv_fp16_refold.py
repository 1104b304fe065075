"""fp16 Conv+BatchNormalization on onnxruntime targets: compensated rounding of the folded
weights, and the refold kept where it is no worse than onnxruntime's own fold of the graph."""

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import assert_optimized, codes, const, model, ops, run, vi
from graphopt.opt.numerics.float16_fold import compensated_rows, rounding_moves, runtime_bn_fold

F16 = TensorProto.FLOAT16


def conv_bn16(rng, *, bias=True, c_in=16, c_out=8, gamma=None, var=None, eps=1e-5, w_scale=0.2):
    """fp16 Conv(3x3) + BatchNormalization with non-trivial statistics (beta and mean zero when
    gamma is given)."""
    w = rng.standard_normal((c_out, c_in, 3, 3)) * w_scale
    fresh = gamma is None
    inits = [
        const("W", w, np.float16),
        const("g", rng.random(c_out) + 0.5 if fresh else gamma, np.float16),
        const("b", rng.standard_normal(c_out) * 0.1 if fresh else np.zeros(c_out), np.float16),
        const("m", rng.standard_normal(c_out) * 0.3 if fresh else np.zeros(c_out), np.float16),
        const("v", rng.random(c_out) + 0.3 if var is None else var, np.float16),
    ]
    conv_in = ["x", "W"]
    if bias:
        inits.append(const("B", rng.standard_normal(c_out) * 0.1, np.float16))
        conv_in.append("B")
    nodes = [
        helper.make_node("Conv", conv_in, ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], epsilon=eps),
    ]
    return model(nodes, [vi("x", [1, c_in, 8, 8], F16)], [vi("y", None, F16)], inits)


def _inits(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def _session(m: onnx.ModelProto, level, path: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    if path:
        so.optimized_model_filepath = path
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _reference(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """Conv + BN of the model's fp16 parameters, in float64."""
    p = {k: v.astype(np.float64) for k, v in _inits(m).items()}
    eps = helper.get_attribute_value(m.graph.node[1].attribute[0])
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    h, w = x.shape[2:]
    patches = np.stack([xp[:, :, i : i + h, j : j + w] for i in range(3) for j in range(3)], 2)
    c_out = p["W"].shape[0]
    y = np.einsum("nckhw,ock->nohw", patches, p["W"].reshape(c_out, -1, 9))
    y = y + p.get("B", np.zeros(c_out))[None, :, None, None]
    s = p["g"] / np.sqrt(p["v"] + eps)
    return (y - p["m"][None, :, None, None]) * s[None, :, None, None] + p["b"][None, :, None, None]


def test_runtime_bn_fold_is_onnxruntime_fold_bit_for_bit(rng, tmp_path):
    """The emulation the guard compares with: onnxruntime's saved BASIC-level model holds
    exactly these float16 weights and bias, with and without a Conv bias."""
    for bias in (False, True):
        m = conv_bn16(rng, bias=bias, eps=1e-3)
        path = os.fspath(tmp_path / f"basic_{bias}.onnx")
        _session(m, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, path)
        saved = onnx.load(path)
        assert "BatchNormalization" not in ops(saved)
        got = _inits(saved)
        got_w = [v for v in got.values() if v.ndim == 4][0]
        got_b = [v for v in got.values() if v.ndim == 1][0]
        p = _inits(m)
        w, b = runtime_bn_fold(p["W"], p.get("B"), p["g"], p["b"], p["m"], p["v"], 1e-3)
        assert w.dtype == np.float16 and np.array_equal(w, got_w)
        assert np.array_equal(b, got_b)


def test_compensated_rows_cancel_rounding_errors(rng):
    exact = rng.standard_normal((64, 576)) * 0.05
    nearest = exact.astype(np.float16)
    comp = compensated_rows(exact, nearest)
    # every value is one of the two float16 neighbours of its exact value
    lo = np.minimum(nearest, comp).astype(np.float64)
    hi = np.maximum(nearest, comp).astype(np.float64)
    assert np.all((lo <= exact) & (exact <= hi) | (comp == nearest))
    assert np.all(np.abs(comp.astype(np.float64) - exact) <= np.spacing(np.abs(nearest)) * 1.0001)
    near_sum = np.abs((nearest.astype(np.float64) - exact).sum(axis=1))
    comp_sum = np.abs((comp.astype(np.float64) - exact).sum(axis=1))
    assert np.all(comp_sum <= near_sum)
    assert np.median(comp_sum) < 0.05 * np.median(near_sum)
    # a row whose errors already cancel (exactly representable) is left alone
    exact2 = nearest.astype(np.float64)
    assert np.array_equal(compensated_rows(exact2, nearest), nearest)


def test_fp16_conv_bn_folds_when_no_worse_than_onnxruntime_fold(rng):
    """Non-trivial statistics: the refold is less accurate than the unfused graph at
    ORT_DISABLE_ALL, but onnxruntime folds it itself (every step rounded to fp16) at the
    bundle's level: kept on cpu, and its output is no further from float64 than the original
    model's run at ORT_ENABLE_ALL; refused for TensorRT."""
    m = conv_bn16(rng, c_in=64)
    out, report = assert_optimized(m)
    assert ops(out) == {"Conv": 1}
    assert codes(report, "fuse-conv-bn", "passed") == ["fired"]
    folded = np.stack(
        [_inits(out)[n.input[1]] for n in out.graph.node if n.op_type == "Conv"]
    ).squeeze(0)
    assert folded.dtype == np.float16
    xs = [np.abs(rng.standard_normal((1, 64, 8, 8))).astype(np.float16) for _ in range(4)]
    all_level = _session(m, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    mine = _session(out, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    err_orig = err_mine = 0.0
    for x in xs:
        ref = _reference(m, x)
        err_orig += np.abs(all_level.run(None, {"x": x})[0] - ref).mean()
        err_mine += np.abs(mine.run(None, {"x": x})[0] - ref).mean()
    assert err_mine <= err_orig, (err_mine, err_orig)
    _, trt = run(m, target="tensorrt", check=False)
    assert codes(trt, "fuse-conv-bn") == ["precision-refold"]


def test_fp16_conv_bn_worse_than_onnxruntime_fold_is_refused_with_both_numbers():
    """A channel whose folded weights become fp16 subnormals (fixed spacing: rounding errs up to
    the weights' own size): with these weights (seed 0) worse than the unfused graph and than
    onnxruntime's fold; the remark carries both comparisons."""
    rng = np.random.default_rng(0)
    gamma = np.full(8, 1.0)
    gamma[3] = 1e-3
    var = np.full(8, 1.0)
    var[3] = 1e4
    m = conv_bn16(rng, gamma=gamma, var=var, c_in=4, w_scale=1.0)
    out, report = run(m)
    assert ops(out)["BatchNormalization"] == 1
    assert codes(report, "fuse-conv-bn") == ["precision-refold"]
    remark = [r for r in report.remarks if r.rule == "fuse-conv-bn"][0]
    assert {"runtime_max", "runtime_bias", "folded_max", "unfused_max"} <= set(remark.args)
    assert "onnxruntime's own fold" in remark.message


def test_fp32_conv_bn_weights_are_rounded_to_nearest(rng):
    """Compensated rounding is for float16 only: fp32 folds stay the nearest rounding."""
    m = conv_bn16(rng)
    m32 = onnx.ModelProto()
    m32.CopyFrom(m)
    for t in m32.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    for v in list(m32.graph.input) + list(m32.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT
    out, _ = assert_optimized(m32)
    p = {k: v.astype(np.float64) for k, v in _inits(m32).items()}
    s = p["g"] / np.sqrt(p["v"] + 1e-5)
    w = [v for v in _inits(out).values() if v.ndim == 4][0]
    assert np.array_equal(w, (p["W"] * s[:, None, None, None]).astype(np.float32))


def _sorted_whole(exact, nearest):
    """compensated_rows with every row sorted whole (the reference for the prefix sort)."""
    other, total, cost, step, useful = rounding_moves(exact, nearest)
    order = np.argsort(cost, axis=1, kind="stable")
    steps = np.take_along_axis(np.where(useful, step, 0.0), order, axis=1)
    costs = np.take_along_axis(np.where(useful, cost, 0.0), order, axis=1)
    zero = np.zeros_like(total)
    reach = np.abs(total + np.concatenate([zero, np.cumsum(steps, axis=1)], axis=1))
    added = np.concatenate([zero, np.cumsum(costs, axis=1)], axis=1)
    count = np.argmin(reach + 2.0 * added, axis=1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :], axis=1)
    return np.where(useful & (rank < count[:, None]), other, nearest)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("prefix", [None, 64, 4, 1])
def test_compensated_rows_sort_a_prefix_like_the_whole_row(rng, monkeypatch, prefix, native):
    """Sorting only the cheapest candidates gives what sorting every row gives: rows of every
    length and scale, few useful values, ties, and prefixes too short (rows sorted whole);
    natively and in numpy."""
    from graphopt.opt.numerics import float16_fold as conv

    if native and conv.native is None:
        pytest.skip("the native extension was not built here")
    if not native:
        monkeypatch.setattr(conv, "native", None)
    if prefix:
        monkeypatch.setattr(conv, "_prefix_length", lambda n: min(n, prefix))
    rows = [
        rng.standard_normal((64, 576)) * 0.05,
        rng.standard_normal((8, 9)) * 3.0,
        rng.standard_normal((16, 2304)) * np.exp(rng.uniform(-12, 2, (16, 1))),
        np.round(rng.standard_normal((32, 40)) * 512) / 1024 + 1 / 4096,  # many equal costs
        rng.standard_normal((4, 1)),
        np.zeros((3, 7)),
    ]
    for exact in rows:
        nearest = exact.astype(np.float16)
        assert np.array_equal(compensated_rows(exact, nearest), _sorted_whole(exact, nearest))


def _compensated_both_ways(exact, monkeypatch):
    from graphopt.opt.numerics import float16_fold

    with np.errstate(over="ignore"):
        nearest = exact.astype(np.float16)
    with np.errstate(invalid="ignore"):  # numpy's moves out of an infinity (beyond float16)
        got = float16_fold._compensated_block(exact, nearest)
        with monkeypatch.context() as patch:
            patch.setattr(float16_fold, "native", None)
            want = float16_fold._compensated_block(exact, nearest)
    return got, want


def test_native_compensated_rounding_is_numpy_bit_for_bit(rng, monkeypatch):
    """The C extension's rows are numpy's, bit for bit: every length (1 to 100,000 values),
    magnitudes from float16 subnormals to near its largest value, both signs, zeros, values
    exactly half-way between two float16s (moves that cost nothing), many equal costs, powers
    of two (a move toward zero lands in the binade below); rows with a value beyond float16's
    range fall back to numpy (their summed error is infinite) and still agree."""
    from graphopt.opt.numerics import float16_fold

    if float16_fold.native is None:
        pytest.skip("the native extension was not built here")
    halves = rng.integers(-30000, 30000, (40, 300)).astype(np.int16).view(np.float16)
    halves = halves[np.isfinite(halves).all(axis=1)].astype(np.float64)
    halfway = (halves[:, :-1] + halves[:, 1:]) / 2  # ties when neighbours are adjacent
    adjacent = np.arange(0x3C00, 0x3C00 + 257, dtype=np.uint16).view(np.float16).astype(float)
    cases = [
        rng.standard_normal((64, 576)) * 0.05,
        rng.standard_normal((7, 1)),
        rng.standard_normal((3, 100_000)) * 0.01,
        rng.standard_normal((20, 300)) * 1e-6,  # subnormal float16s
        rng.standard_normal((20, 300)) * 3e-8,  # around the smallest subnormal and zero
        rng.standard_normal((10, 200)) * 2e4,  # near the largest float16
        np.round(rng.standard_normal((32, 40)) * 512) / 1024 + 1 / 4096,
        halfway,
        ((adjacent[:-1] + adjacent[1:]) / 2)[None, :].repeat(3, 0),
        2.0 ** rng.integers(-20, 10, (16, 64)) * (1 + rng.standard_normal((16, 64)) * 1e-4),
        np.where(rng.random((16, 64)) < 0.5, 0.0, rng.standard_normal((16, 64))),
        np.zeros((3, 7)),
    ]
    for exact in cases:
        got, want = _compensated_both_ways(exact, monkeypatch)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), exact.shape
    beyond = rng.standard_normal((4, 50))
    beyond[1, 3] = 7e4  # rounds to infinity
    with np.errstate(over="ignore"):
        bits = beyond.astype(np.float16).view(np.uint16)
    assert not float16_fold.native.compensate(beyond, bits, np.empty_like(bits), 50)
    got, want = _compensated_both_ways(beyond, monkeypatch)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def _native_fold_of_ones(x, their_scale=None):
    """``fold_block`` of one-value rows of 1.0 scaled by ``x``: a row of one value keeps its
    nearest float16 (no move helps it), so ``out`` is ``x`` rounded to float16."""
    from graphopt.opt.numerics.float16_fold import native

    n = x.size
    w = np.full((n, 1), 0x3C00, np.uint16)
    out = np.empty((n, 1), np.uint16)
    theirs = np.empty((n, 1)) if their_scale is not None else None
    done = native.fold_block(w, x, their_scale, out, np.empty((n, 1)), np.empty((n, 1)), theirs, 1)
    return done, out.reshape(-1), theirs


def test_native_fold_rounds_to_float16_as_numpy(rng):
    """The extension's float64 -> float16 and float32 -> float16 roundings are numpy's casts bit
    for bit: every float16 value, every tie between two neighbours (to even) and the doubles
    beside each tie, random magnitudes from 2^-40 to 65519 of both signs, signed zeros, double
    subnormals; its flush count is the values that round to zero; a product beyond float16's
    range (infinite error) is left to numpy."""
    from graphopt.opt.numerics import float16_fold

    if float16_fold.native is None:
        pytest.skip("the native extension was not built here")
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    values = np.unique(halves[np.isfinite(halves)].astype(np.float64))
    ties = (values[:-1] + values[1:]) / 2
    random = np.exp2(rng.uniform(-40, 15.99, 100_000)) * rng.choice([-1.0, 1.0], 100_000)
    x = np.concatenate(
        [values, ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf), random]
        + [np.array([0.0, -0.0, 65519.99, 2.0**-25, 3 * 2.0**-26, 1e-300, 5e-324])]
    )
    x = x[np.abs(x) < 65520]
    (ok, nonzero, flushed), got, _ = _native_fold_of_ones(x)
    with np.errstate(over="ignore", under="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert ok and np.array_equal(got, want)
    assert nonzero == np.count_nonzero(x)
    assert flushed == nonzero - np.count_nonzero(want & 0x7FFF)
    f32 = x.astype(np.float32)
    f32 = f32[np.abs(f32) < 65504]
    (ok, _, _), _, theirs = _native_fold_of_ones(np.ones(f32.size), f32)
    with np.errstate(over="ignore", under="ignore"):
        want = f32.astype(np.float16).astype(np.float64)
    assert ok and np.array_equal(theirs.reshape(-1).view(np.uint64), want.view(np.uint64))
    (ok, _, _), _, _ = _native_fold_of_ones(np.array([1.0, 7e4]))
    assert not ok
    # onnxruntime's fold of long rows (eight values at a time where the processor converts
    # float16 itself, the rest one by one): float32 products rounded once, as numpy does
    rows, n = 64, 1003
    w = (rng.standard_normal((rows, n)) * np.exp2(rng.integers(-16, 4, (rows, 1)))).astype(
        np.float16
    )
    scale = np.exp2(rng.uniform(-12, 12, rows)).astype(np.float32)
    theirs = np.empty((rows, n))
    shape = (rows, n)
    float16_fold.native.fold_block(
        w.view(np.uint16),
        np.ones(rows),
        scale,
        np.empty(shape, np.uint16),
        np.empty(shape),
        np.empty(shape),
        theirs,
        n,
    )
    with np.errstate(over="ignore", under="ignore"):
        want = (w.astype(np.float32) * scale[:, None]).astype(np.float16).astype(np.float64)
    assert np.array_equal(theirs.view(np.uint64), want.view(np.uint64))


def test_largest_magnitude_bits_natively_and_in_numpy(rng, monkeypatch):
    """Each row's largest float16 magnitude (bits without the sign): both signs, zeros of both
    signs, subnormals, infinities and NaNs, rows of one value; natively as in numpy."""
    from graphopt.opt.numerics import float16_fold

    rows = rng.integers(0, 1 << 16, (50, 37)).astype(np.uint16)
    rows[3] = 0x8000  # negative zeros
    rows[4, 5] = 0xFC00  # -inf
    rows[5, 0] = 0x7E00  # a NaN
    cases = [rows.view(np.float16), rows[:, :1].view(np.float16), rows[:, :3] & 0x83FF]
    for case in cases:
        case = np.ascontiguousarray(case).view(np.float16)
        want = (case.view(np.uint16) & 0x7FFF).max(axis=1)
        assert np.array_equal(float16_fold.largest_magnitude_bits(case), want)
        with monkeypatch.context() as patch:
            patch.setattr(float16_fold, "native", None)
            assert np.array_equal(float16_fold.largest_magnitude_bits(case), want)


def test_float32_rows_scaled_in_one_pass_as_through_float64(rng):
    """float32 Conv weights scaled per output channel natively: the float64 path's stored
    weights bit for bit (magnitudes across the range, zeros, signs); None, leaving the float64
    path to say why, where a guard would refuse: a product beyond float32, a NaN, too many
    products flushed to zero; and for other dtypes."""
    from graphopt.opt.numerics import float16_fold
    from graphopt.opt.numerics.precision import representable_scaled_rows, require_representable

    if float16_fold.native is None:
        pytest.skip("the native extension was not built here")
    w = (rng.standard_normal((96, 147)) * np.exp2(rng.integers(-60, 60, (96, 1)))).astype(
        np.float32
    )
    w[3, :5] = 0.0
    scale = np.exp2(rng.uniform(-20, 20, 96)) * rng.choice([-1.0, 1.0], 96)
    got = representable_scaled_rows(w, scale, np.float32)
    want = require_representable(w.astype(np.float64) * scale[:, None], np.float32, "w")
    assert got is not None and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert representable_scaled_rows(w, scale * 1e200, np.float32) is None  # overflow
    nan = w.copy()
    nan[5, 7] = np.nan
    assert representable_scaled_rows(nan, scale, np.float32) is None
    tiny = np.full((4, 8), 1e-30, np.float32)
    assert representable_scaled_rows(tiny, np.full(4, 1e-20), np.float32) is None  # flushed
    half = (w[:, :4] * 0).astype(np.float16)
    assert representable_scaled_rows(half, scale, np.float16) is None


def test_native_widen_is_exact_on_every_float16():
    from graphopt.opt.numerics import float16_fold

    if float16_fold.native is None:
        pytest.skip("the native extension was not built here")
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size)
    float16_fold.native.widen(bits, out)
    want = bits.view(np.float16).astype(np.float64)
    nan = np.isnan(want)
    assert np.isnan(out[nan]).all()
    assert np.array_equal(out[~nan].view(np.uint64), want[~nan].view(np.uint64))


def test_native_extension_is_built_where_a_compiler_is_present():
    """The install builds ``opt/numerics/_rounding.c`` when the C compiler Python was built with is
    here: a change that breaks its build fails here, not silently (``optional=True`` lets the
    install go on without it, and numpy computes the same values, ~3x slower)."""
    import shutil
    import sysconfig

    from graphopt.opt.numerics import float16_fold

    compiler = (sysconfig.get_config_var("CC") or "").split()
    if not compiler or shutil.which(compiler[0]) is None:
        pytest.skip("no C compiler here: the extension is optional")
    assert float16_fold.native is not None, "opt/numerics/_rounding.c did not build: see pip"


def test_native_compensated_rounding_refuses_mismatched_buffers():
    from graphopt.opt.numerics import float16_fold

    if float16_fold.native is None:
        pytest.skip("the native extension was not built here")
    exact = np.zeros((2, 5))
    bits = np.zeros((2, 5), np.uint16)
    with pytest.raises(ValueError):
        float16_fold.native.compensate(exact, bits, np.zeros(9, np.uint16), 5)
    with pytest.raises(ValueError):
        float16_fold.native.compensate(exact, bits, np.zeros(10, np.uint16), 3)
    with pytest.raises(ValueError):
        float16_fold.native.compensate(exact.astype(np.float32), bits, bits.copy(), 5)
    with pytest.raises(ValueError):
        float16_fold.native.largest(bits, np.zeros(3, np.uint16), 5)
    with pytest.raises(ValueError):
        float16_fold.native.widen(bits, np.zeros(9))
    with pytest.raises(TypeError):  # a length missing
        float16_fold.native.largest(bits, np.zeros(2, np.uint16))
    scale, wide = np.ones(2), np.zeros((2, 5))
    with pytest.raises(ValueError):  # onnxruntime's scale without a place for its fold
        float16_fold.native.fold_block(
            bits, scale, np.ones(2, np.float32), bits.copy(), wide, wide.copy(), None, 5
        )
    with pytest.raises(ValueError):
        float16_fold.native.scale_rows(
            np.zeros((2, 5), np.float32), scale, np.zeros(9, np.float32), 5
        )


@pytest.mark.parametrize("down", [False, True])
def test_float16_neighbour_is_nextafter_on_every_value(down):
    """The bit-level neighbour rounding_moves uses equals np.nextafter on all 65,536 float16
    values but NaNs: zeros of both signs, subnormals, the largest finite, infinities."""
    from graphopt.opt.numerics.float16_fold import _neighbour

    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    with np.errstate(over="ignore"):
        expected = np.nextafter(values, np.float16(-np.inf if down else np.inf))
    got = _neighbour(values, np.full(values.shape, down))
    keep = ~np.isnan(values)
    assert np.array_equal(got[keep].view(np.uint16), expected[keep].view(np.uint16))


@pytest.mark.parametrize(
    "threads,mapped,native", [(1, False, True), (2, False, True), (2, True, True), (2, True, False)]
)
def test_fold_rows_in_blocks_is_the_whole_layer_fold(rng, monkeypatch, threads, mapped, native):
    """Folded and measured in blocks of channels (several here, on threads or not, into the
    heap or a mapping of their own, natively or in numpy): the same compensated weights and the
    same errors as the whole layer's fold and refold_probe (means summed in another order:
    equal to rounding)."""
    import mmap

    from graphopt.opt.numerics import float16_fold
    from graphopt.opt.numerics.float16_fold import fold_rows, runtime_bn_scale

    if not native:
        monkeypatch.setattr(float16_fold, "native", None)
    elif float16_fold.native is None:
        pytest.skip("the native extension was not built here")
    from graphopt.opt.numerics.precision import refold_probe

    monkeypatch.setattr(float16_fold, "FOLD_BLOCK", 1000)
    monkeypatch.setattr(float16_fold, "ROUNDING_THREADS", threads)
    monkeypatch.setattr(float16_fold, "MAPPED_ABOVE", 0 if mapped else 1 << 30)
    c, k = 37, 144
    w16 = (rng.standard_normal((c, k)) * 0.2).astype(np.float16)
    g, bt, mu, v = (
        (rng.random(c) + 0.5).astype(np.float16),
        (rng.standard_normal(c) * 0.1).astype(np.float16),
        (rng.standard_normal(c) * 0.3).astype(np.float16),
        (rng.random(c) + 0.3).astype(np.float16),
    )
    b16 = (rng.standard_normal(c) * 0.1).astype(np.float16)
    gamma, beta, mean, var, b = (a.astype(np.float64) for a in (g, bt, mu, v, b16))
    s = gamma / np.sqrt(var + 1e-5)
    shift = beta - mean * s
    stored_b = (b * s + shift).astype(np.float16)
    w = w16.astype(np.float64)
    probe = refold_probe(w, b, s, shift, np.float16, (mean, var))
    exact = w * s[:, None]
    whole = compensated_rows(exact, exact.astype(np.float16))
    rw, rb = runtime_bn_fold(w16, b16, g, bt, mu, v, 1e-5)
    ours = probe(whole.astype(np.float64), stored_b.astype(np.float64))
    theirs = probe(rw.astype(np.float64), rb.astype(np.float64))

    fold = fold_rows(
        w16, s, shift, b, stored_b, (mean, var), runtime_bn_scale(b16, g, bt, mu, v, 1e-5)
    )
    assert np.array_equal(fold.weights.view(np.uint16), whole.view(np.uint16))
    owner = fold.weights
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    owner = owner.obj if isinstance(owner, memoryview) else owner
    assert isinstance(owner, mmap.mmap) == mapped
    assert fold.nonzero == c * k and fold.flushed == 0
    for got, want in ((fold.ours, ours), (fold.theirs, theirs)):
        assert list(got) == list(want)
        for key in want:
            if key.endswith("_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-12)
            else:
                assert got[key] == want[key], key


def conv_mul16(rng, c_in=32, c_out=8):
    """fp16 Conv(3x3) times a per-channel constant."""
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Mul", ["c", "s"], ["y"]),
    ]
    inits = [
        const("W", rng.standard_normal((c_out, c_in, 3, 3)) * 0.2, np.float16),
        const("B", rng.standard_normal(c_out) * 0.1, np.float16),
        const("s", (rng.random((1, c_out, 1, 1)) + 0.5), np.float16),
    ]
    return model(nodes, [vi("x", [1, c_in, 8, 8], F16)], [vi("y", None, F16)], inits)


@pytest.mark.parametrize("case", ["fired", "refused", "no-bias", "tensorrt", "mul"])
def test_fp16_conv_folds_in_blocks_as_whole_layers(rng, monkeypatch, case):
    """The blocked float16 fold (``_store_rows``) writes the model and the remarks the
    whole-layer path writes."""
    from graphopt.rules.conv import ConvScaleBase

    if case == "mul":
        m = conv_mul16(rng)
    elif case == "refused":
        gamma, var = np.full(8, 1.0), np.full(8, 1.0)
        gamma[3], var[3] = 1e-3, 1e4
        m = conv_bn16(np.random.default_rng(0), gamma=gamma, var=var, c_in=4, w_scale=1.0)
    else:
        m = conv_bn16(rng, c_in=64, bias=case != "no-bias")
    target = "tensorrt" if case == "tensorrt" else "cpu"
    blocked, blocked_report = run(m, target=target, check=False)
    monkeypatch.setattr(ConvScaleBase, "_store_rows", lambda self, *a: False)
    whole, whole_report = run(m, target=target, check=False)
    assert blocked.SerializeToString() == whole.SerializeToString()

    def said(report):
        return [(r.rule, r.code, r.message) for r in report.remarks]

    assert said(blocked_report) == said(whole_report)

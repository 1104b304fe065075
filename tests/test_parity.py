"""Parity engine: metrics, NaN/Inf accounting, tolerances, float64 reference, localization."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from conftest import const, model, vi
from graphopt.opt.numerics.reference import upcast_to_float64
from graphopt.opt.rewrite.target import get_target
from graphopt.opt.verify.parity import check_parity, compare_outputs, parse_tolerances


def test_metrics():
    ref = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    got = ref + np.array([0, 0, 0, 1e-3], np.float32)
    (d,) = compare_outputs(["y"], [ref], [got])
    assert d.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert d.max_rel == pytest.approx(1e-3 / 4, rel=1e-3)
    assert d.mean_abs == pytest.approx(2.5e-4, rel=1e-3)
    assert d.mismatch == 0.25 and not d.ok
    assert 0.999 < d.cosine <= 1.0


def test_nonfinite_values_are_counted_not_measured():
    ref = np.array([1.0, np.nan, np.inf, 2.0], np.float32)
    same = compare_outputs(["y"], [ref], [ref.copy()])[0]
    assert same.ok and same.ref_nonfinite == 2 and same.nonfinite_mismatch == 0
    got = np.array([1.0, 5.0, np.inf, np.nan], np.float32)
    bad = compare_outputs(["y"], [ref], [got])[0]
    assert not bad.ok and bad.nonfinite_mismatch == 2 and bad.got_nonfinite == 2


def test_per_output_tolerance_override():
    ref = np.array([100.0], np.float32)
    got = np.array([100.5], np.float32)
    assert not compare_outputs(["y"], [ref], [got])[0].ok
    tol = parse_tolerances(["y=1e-2,0"])
    assert compare_outputs(["y"], [ref], [got], per_output=tol)[0].ok


def scale_model(factor, dtype=TensorProto.FLOAT16):
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    nodes = [helper.make_node("Mul", ["x", "k"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    return model(
        nodes, [vi("x", [4], dtype)], [vi("y", [4], dtype)], [const("k", [factor], np_dtype)]
    )


def test_float64_reference_upcasts_everything():
    m = scale_model(3.0)
    ref = upcast_to_float64(m, get_target("cpu"))
    assert ref.graph.output[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert {t.data_type for t in ref.graph.initializer} == {TensorProto.DOUBLE}
    report = check_parity(m, m, reference=ref, reference_name="float64")
    assert report.ok and report.reference == "float64"


def test_float64_reference_sees_fp16_overflow():
    """x·70000 overflows fp16 (max 65504): against float64 the Inf is a mismatch."""
    m = scale_model(60000.0)
    x = {"x": np.array([2.0, 1.0, 0.5, -1.0], np.float16)}
    ref = upcast_to_float64(m, get_target("cpu"))
    vs_f64 = check_parity(m, m, inputs=x, reference=ref, reference_name="float64")
    assert not vs_f64.ok and vs_f64.outputs[0].nonfinite_mismatch >= 1
    assert check_parity(m, m, inputs=x).ok  # vs itself, the overflow is invisible


def test_float64_reference_wraps_ops_without_double_kernel(rng):
    """CPU Conv has no float64 kernel: it runs in float32 inside the float64 reference."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"])]
    m = model(
        nodes,
        [vi("x", [1, 2, 5, 5])],
        [vi("y", None)],
        [const("W", rng.standard_normal((3, 2, 3, 3)))],
    )
    ref = upcast_to_float64(m, get_target("cpu"))
    assert [n.op_type for n in ref.graph.node] == ["Cast", "Cast", "Cast", "Conv", "Cast"]
    assert check_parity(m, m, reference=ref).ok


def test_optimize_reports_both_references(rng):
    _, report = graphopt.optimize(scale_model(3.0), reference="both")
    assert report.parity.reference == "original" and report.parity.ok
    assert report.parity_float64.reference == "float64" and report.parity_float64.ok


def _fp16_scale(factor: float) -> onnx.ModelProto:
    """y = x * w with w stored in float16 (fp32 I/O, as keep_io_types converts a model)."""
    w = numpy_helper.from_array(np.full(16, factor, np.float16), "w")
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("Mul", ["h", "w"], ["m"]),
        helper.make_node("Cast", ["m"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_fp16_model_is_held_to_how_far_onnxruntime_itself_moves_it(monkeypatch):
    """In float16 onnxruntime's own fusions round differently from the graph as written (the
    original at ORT_ENABLE_ALL): a difference no larger than twice that is not a failure."""
    from graphopt.opt.verify import parity as parity_module
    from graphopt.opt.verify.parity import NOISE_FACTOR, OwnNoise

    original, moved = _fp16_scale(1.0), _fp16_scale(1.03)  # 3 % off: over the 1 % tolerance
    monkeypatch.setattr(parity_module, "runtime_noise", lambda *a: OwnNoise({"y": 1e-9}))
    small = check_parity(original, moved, seed=0)
    assert not small.ok and small.runtime_floor == {"y": 1e-9}
    assert small.outputs[0].judged == "tolerance"
    monkeypatch.setattr(parity_module, "runtime_noise", lambda *a: OwnNoise({"y": 1.0}))
    wide = check_parity(original, moved, seed=0)
    assert wide.ok and wide.runtime_floor == {"y": 1.0}
    assert wide.outputs[0].judged == "own-noise" and wide.outputs[0].own_noise == 1.0
    assert wide.floor_tolerances() == {"y": (wide.outputs[0].rtol, NOISE_FACTOR * 1.0)}
    assert wide.to_dict()["runtime_floor"] == {"y": 1.0}


def _scaled(w: float):
    return model(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        [vi("x", [4, 16])],
        [vi("y", [4, 16])],
        [const("w", np.full(16, w))],
    )


def test_a_real_break_fails_where_the_original_does_not_move_itself():
    """The floor is the original's own drift: a float32 Mul does not move between session
    levels, so a wrong weight (a broken fold) still fails, with no widening."""
    report = check_parity(_scaled(1.0), _scaled(1.5), seed=0)
    assert not report.ok and report.runtime_floor == {"y": 0.0}
    assert report.outputs[0].judged == "tolerance"


def test_runtime_floor_measures_the_original_at_ort_enable_all():
    from graphopt.opt.verify.parity import runtime_noise

    m = _fp16_scale(1.0)
    feeds = {"x": np.ones((4, 16), np.float32)}
    ref = [np.ones((4, 16), np.float32) + 0.25]  # as if the graph as written gave this
    assert runtime_noise(m, None, feeds, ["y"], ref).floats == {"y": 0.25}


def test_own_noise_of_floats_integers_and_selection_counts():
    from graphopt.opt.verify.parity import own_noise

    names = ["f", "i", "n"]
    written = [np.zeros(4, np.float32), np.arange(10), np.zeros((3, 4), np.float32)]
    deployed = [np.full(4, 0.5, np.float32), np.r_[np.arange(9), 0], np.zeros((2, 4), np.float32)]
    noise = own_noise(names, written, deployed)
    assert noise.floats == {"f": 0.5} and noise.mismatch == {"i": 0.1}
    assert noise.reshaped == {"n"}


def test_selections_are_judged_by_how_often_the_original_changes_its_own():
    from graphopt.opt.verify.parity import OwnNoise, compare_outputs, judge_by_noise

    ref = [np.arange(20), np.zeros((5, 4), np.float32)]
    near = [np.r_[np.arange(19), 0], np.zeros((4, 4), np.float32)]  # 1 of 20 indices; one box
    far = [np.r_[np.arange(15), np.zeros(5, np.int64)], np.zeros((4, 4), np.float32)]
    noise = OwnNoise({}, {"idx": 0.05}, frozenset({"boxes"}))
    for got, ok in ((near, True), (far, False)):
        diffs = compare_outputs(["idx", "boxes"], ref, got)
        judged = judge_by_noise(diffs, ref, got, noise)
        assert judged[0].ok is ok and judged[1].ok
        assert judged[1].judged == "selection-near-ties"
        assert judged[0].judged == ("selection-near-ties" if ok else "tolerance")
    # an output the original keeps stable gets nothing
    diffs = compare_outputs(["idx", "boxes"], ref, near)
    assert not any(d.ok for d in judge_by_noise(diffs, ref, near, OwnNoise()))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_compare_outputs_in_place_gives_the_textbook_numbers(dtype):
    """The comparison computes in its float64 copies, without temporaries: bit for bit the
    numbers of the plain formulas (the largest |reference| of all-negative and signed-zero
    outputs too)."""
    from graphopt.opt.verify import parity

    rng = np.random.default_rng(5)
    r = rng.standard_normal(1001).astype(dtype)
    cases = [
        (r, (r + 1e-3 * rng.standard_normal(1001)).astype(dtype)),
        (np.full(9, -3, dtype), np.full(9, -2.5, dtype)),
        (-np.zeros(4, dtype), np.zeros(4, dtype)),
        (r, r.copy()),
    ]
    for ref, got in cases:
        (d,) = parity.compare_outputs(["y"], [ref], [got], per_output={"y": (1e-3, 1e-4)})
        a, b = ref.astype(np.float64), got.astype(np.float64)
        diff, scale = np.abs(a - b), float(np.max(np.abs(a)))
        norms = float(np.linalg.norm(a) * np.linalg.norm(b))
        assert d.max_abs == float(diff.max()) and d.mean_abs == float(diff.mean())
        assert d.max_rel == (d.max_abs / scale if scale else d.max_abs)
        assert d.mismatch == np.count_nonzero(diff > 1e-4 + 1e-3 * scale) / ref.size
        assert d.cosine == (float(np.dot(a, b) / norms) if norms else float(d.max_abs == 0))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_compare_outputs_of_finite_values_as_through_the_masks(monkeypatch, dtype):
    """Outputs without NaN or infinity skip the masks: the same numbers as the masked path,
    for every dtype, shape (a scalar too) and tolerance outcome."""
    from graphopt.opt.verify import parity

    rng = np.random.default_rng(3)
    cases = []
    for shape in [(2, 7, 33), (5,), ()]:
        ref = rng.standard_normal(shape).astype(dtype)
        for noise in (0.0, 1e-5, 1e-1):
            got = (ref + noise * rng.standard_normal(shape)).astype(dtype)
            cases.append((ref, got))
    fast = [parity.compare_outputs(["y"], [r], [g]) for r, g in cases]
    monkeypatch.setattr(parity, "_finite", lambda a: False)
    masked = [parity.compare_outputs(["y"], [r], [g]) for r, g in cases]
    assert fast == masked
    assert {d.ok for diffs in fast for d in diffs} == {True, False}

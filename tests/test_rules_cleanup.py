"""Level-1 cleanups and shape glue: identities, no-ops, Transpose/Reshape/Cast chains."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, codes, const, model, ops, run, vi


def chain(nodes, shape=(2, 3, 4), inits=(), out_elem=TensorProto.FLOAT, opset=17):
    return model(nodes, [vi("x", list(shape))], [vi("y", None, out_elem)], inits, opset=opset)


def test_identity_and_dropout_removed():
    m = chain(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Identity", ["a"], ["b"]),
            helper.make_node("Dropout", ["b"], ["c"]),
            helper.make_node("Relu", ["c"], ["y"]),
        ]
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Relu": 2}


def test_identity_between_input_and_output_stays():
    m = chain([helper.make_node("Identity", ["x"], ["y"])])
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Identity": 1}


def test_identity_feeding_output_keeps_output_name():
    m = chain([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])])
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Relu": 1} and out.graph.node[0].output[0] == "y"


def test_dropout_mask_used_is_missed():
    m = model(
        [helper.make_node("Dropout", ["x"], ["y", "mask"])],
        [vi("x", [2, 3])],
        [vi("y", [2, 3]), vi("mask", [2, 3], TensorProto.BOOL)],
    )
    out, report = run(m, level=1)
    assert codes(report, "eliminate-dropout") == ["mask-used"]


@pytest.mark.parametrize("op,value", [("Add", 0.0), ("Sub", 0.0), ("Mul", 1.0), ("Div", 1.0)])
def test_neutral_element_removed(op, value):
    m = chain(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node(op, ["a", "c"], ["b"]),
            helper.make_node("Relu", ["b"], ["y"]),
        ],
        inits=[const("c", [value])],
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Relu": 2}


def test_neutral_element_that_broadcasts_stays():
    """x[3] + zeros[2,3] grows the shape: not a no-op."""
    m = model(
        [helper.make_node("Add", ["x", "c"], ["y"])],
        [vi("x", [3])],
        [vi("y", None)],
        [const("c", np.zeros((2, 3)))],
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Add": 1}


def test_transposes_fuse_and_cancel():
    m = chain(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0, 2]),
            helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1]),
            helper.make_node("Relu", ["b"], ["c"]),
            helper.make_node("Transpose", ["c"], ["d"], perm=[2, 0, 1]),
            helper.make_node("Transpose", ["d"], ["y"], perm=[1, 2, 0]),
        ]
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Transpose": 1, "Relu": 1}


def convnext_boundary(k=1, op="Add", shared=False, residual_rank=4):
    """A block's branch permuted back to NCHW, the residual op, the next LayerNorm2d's permute."""
    res_shape = [1, 3, 4, 5][-residual_rank:]
    branch = helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 3, 1, 2], name="back")
    ins = ["r", "bt"] if k == 1 else ["bt", "r"]
    nodes = [
        branch,
        helper.make_node(op, ins, ["s"], name="residual"),
        helper.make_node("Transpose", ["s"], ["y"], perm=[0, 2, 3, 1], name="to_nhwc"),
    ]
    outputs = [vi("y", None)] + ([vi("s", None)] if shared else [])
    return model(nodes, [vi("r", res_shape), vi("b", [1, 4, 5, 3])], outputs)


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_transpose_moves_through_a_binary_op(k, op):
    out, report = assert_optimized(convnext_boundary(k, op), level=1)
    assert ops(out) == {"Transpose": 1, op: 1}
    assert out.graph.node[0].input == ["r"]  # the residual operand is permuted instead
    assert codes(report, "transpose-through-binary", "passed") == ["fired"]


def test_transpose_through_binary_guards():
    out, report = run(convnext_boundary(shared=True), level=1)
    assert ops(out)["Transpose"] == 2  # the sum is also a graph output
    out, report = run(convnext_boundary(residual_rank=1), level=1)
    assert codes(report, "transpose-through-binary") == ["rank-mismatch"]


def chunks(bounds, axis=1, step=None):
    """torch's chunk traced as Slices of x [2, 6, 4] along ``axis`` with folded bounds."""
    inits, nodes = [const("ax", [axis], np.int64)], []
    for i, (a, b) in enumerate(bounds):
        inits += [const(f"s{i}", [a], np.int64), const(f"e{i}", [b], np.int64)]
        ins = ["x", f"s{i}", f"e{i}", "ax"]
        if step:
            inits.append(const(f"st{i}", [step], np.int64))
            ins.append(f"st{i}")
        nodes.append(helper.make_node("Slice", ins, [f"p{i}"], name=f"slice{i}"))
        nodes.append(helper.make_node("Relu", [f"p{i}"], [f"y{i}"], name=f"relu{i}"))
    outputs = [vi(f"y{i}", None) for i in range(len(bounds))]
    return model(nodes, [vi("x", [2, 6, 4])], outputs, inits)


@pytest.mark.parametrize("bounds", [[(0, 3), (3, 6)], [(2, 6), (0, 2)], [(0, 1), (1, 4), (-2, 99)]])
def test_slices_that_tile_an_axis_become_one_split(bounds):
    out, report = assert_optimized(chunks(bounds), level=1)
    assert ops(out) == {"Split": 1, "Relu": len(bounds)}


@pytest.mark.parametrize(
    "bounds, step", [([(0, 3), (4, 6)], None), ([(0, 4), (3, 6)], None), ([(0, 6), (0, 6)], 2)]
)
def test_slices_with_a_gap_overlap_or_step_stay(bounds, step):
    out, _ = run(chunks(bounds, step=step), level=1)
    assert "Split" not in ops(out)


def test_reshape_chain_collapses():
    m = chain(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Unsqueeze", ["r", "ax"], ["a"]),
            helper.make_node("Reshape", ["a", "s1"], ["b"]),
            helper.make_node("Flatten", ["b"], ["c"], axis=1),
            helper.make_node("Reshape", ["c", "s2"], ["y"]),
        ],
        inits=[
            const("ax", [0], np.int64),
            const("s1", [6, 4], np.int64),
            const("s2", [4, 6], np.int64),
        ],
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Relu": 1, "Reshape": 1}


@pytest.mark.parametrize(
    "first, then, collapses",
    [
        ([-1, 6, 4], [0, 0, 2, 2], True),  # 0 copies the static 6; the batch dim becomes -1
        ([-1, 24], [0, 4, -1], False),  # the batch copy and a -1 of its own: nothing to infer it
    ],
)
def test_reshape_chain_with_copied_dims(first, then, collapses):
    """A 0 in the outer target copies the intermediate's dim: spelled out when static, -1 when it
    is the one dim left to infer (a flat Gemm's unflatten before an attention head split)."""
    m = model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Reshape", ["r", "s1"], ["a"]),
            helper.make_node("Reshape", ["a", "s2"], ["y"]),
        ],
        [vi("x", ["batch", 24])],
        [vi("y", None)],
        [const("s1", first, np.int64), const("s2", then, np.int64)],
    )
    x = np.random.default_rng(0).standard_normal((3, 24)).astype(np.float32)
    out, report = assert_optimized(m, inputs={"x": x}, level=1)
    assert ops(out)["Reshape"] == (1 if collapses else 2)


def test_squeeze_unsqueeze_cancels():
    m = chain(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Unsqueeze", ["r", "ax"], ["a"]),
            helper.make_node("Squeeze", ["a", "ax"], ["b"]),
            helper.make_node("Relu", ["b"], ["y"]),
        ],
        inits=[const("ax", [1], np.int64)],
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Relu": 2}


def test_widening_cast_pair_cancels():
    m = chain(
        [
            helper.make_node("Cast", ["x"], ["a"], to=TensorProto.DOUBLE),
            helper.make_node("Cast", ["a"], ["y"], to=TensorProto.FLOAT),
        ]
    )
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Identity": 1} or ops(out) == {}


def test_narrowing_cast_pair_is_kept_with_reason():
    m = chain(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Cast", ["r"], ["a"], to=TensorProto.INT32),
            helper.make_node("Cast", ["a"], ["y"], to=TensorProto.FLOAT),
        ]
    )
    out, report = run(m, level=1)
    assert ops(out)["Cast"] == 2
    assert codes(report, "fuse-casts") == ["narrowing-cast"]


@pytest.mark.parametrize("start", [0, 1, -3])
def test_dim_of_a_transpose_is_read_from_its_input(start):
    """T5: a Transpose kept only to measure the key length goes; the dim is the same one."""
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
            helper.make_node("Shape", ["t"], ["s"], start=start),
            helper.make_node("Gather", ["s", "i"], ["d"], axis=0),
            helper.make_node("Unsqueeze", ["d", "ax"], ["d1"]),
            helper.make_node("Concat", ["d1", "m1"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        [vi("x", ["a", "b", "c"])],
        [vi("y", None)],
        [
            const("i", 1 - (start > 0), np.int64),
            const("ax", [0], np.int64),
            const("m1", [-1], np.int64),
        ],
    )
    x = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    out, report = assert_optimized(m, level=1, inputs={"x": x})
    assert "Transpose" not in ops(out)
    assert codes(report, "shape-through-transpose", "passed") == ["fired"]


def test_dim_index_out_of_range_is_missed():
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
            helper.make_node("Shape", ["t"], ["s"], start=1),
            helper.make_node("Gather", ["s", "i"], ["y"], axis=0),
        ],
        [vi("x", ["a", "b"])],
        [vi("y", None, TensorProto.INT64)],
        [const("i", [0, 1], np.int64)],
    )
    out, report = run(m, level=1, check=False)
    assert codes(report, "shape-through-transpose") == ["index-out-of-range"]


@pytest.mark.parametrize(
    "starts, ends, steps, removed",
    [
        ([0, 0], [8, 2**63 - 1], [1, 1], True),  # Swin's crop after a zero pad: every element
        ([-8, 0], [8, 5], [1, 1], True),
        ([0, 0], [7, 5], [1, 1], False),  # drops a row
        ([0, 0], [8, 5], [2, 1], False),  # strided
    ],
)
def test_slice_keeping_every_element_is_removed(starts, ends, steps, removed):
    m = model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Slice", ["r", "st", "en", "ax", "sp"], ["s"]),
            helper.make_node("Relu", ["s"], ["y"]),
        ],
        [vi("x", ["n", 8, 5])],
        [vi("y", None)],
        [
            const("st", starts, np.int64),
            const("en", ends, np.int64),
            const("ax", [1, 2], np.int64),
            const("sp", steps, np.int64),
        ],
    )
    out, _ = assert_optimized(m, level=1)
    assert ("Slice" not in ops(out)) == removed


def test_range_one_element_inputs_become_scalars():
    """A [1] Range limit hidden behind an If (AffineGrid's expansion): once the If is inlined the
    shape shows, and the limit must become the scalar Range requires, or onnx.checker refuses."""
    branch = helper.make_graph(
        [helper.make_node("Identity", ["n"], ["w"])],
        "branch",
        [],
        [helper.make_tensor_value_info("w", TensorProto.INT64, None)],
    )
    m = model(
        [
            helper.make_node("If", ["cond"], ["limit"], then_branch=branch, else_branch=branch),
            helper.make_node("Range", ["zero", "limit", "one"], ["y"]),
        ],
        [vi("n", [1], TensorProto.INT64)],
        [vi("y", None, TensorProto.INT64)],
        [
            const("cond", True, np.bool_),
            const("zero", 0, np.int64),
            const("one", 1, np.int64),
        ],
    )
    out, report = assert_optimized(m, level=1)
    assert ops(out) == {"Reshape": 1, "Range": 1}
    assert "range-scalar-inputs" in {rule for _, rule, _ in report.applied}
    onnx.checker.check_model(out, full_check=True)


def test_concat_drops_inputs_empty_along_its_axis():
    """Partial rotary at 100 %: the pass-through slice is Split off with width 0 and
    concatenated back; the Concat of the rotated half alone is the same tensor."""
    m = chain(
        [
            helper.make_node("Split", ["x", "sizes"], ["a", "b", "e"], axis=2),
            helper.make_node("Neg", ["b"], ["nb"]),
            helper.make_node("Concat", ["nb", "a", "e"], ["c"], axis=-1),
            helper.make_node("Relu", ["c"], ["y"]),
        ],
        inits=[const("sizes", [2, 2, 0], np.int64)],
    )
    out, report = assert_optimized(m, level=1)
    (concat,) = [n for n in out.graph.node if n.op_type == "Concat"]
    assert len(concat.input) == 2, concat
    assert "concat-drop-empty" in {r.rule for r in report.remarks if r.kind == "passed"}


@pytest.mark.parametrize("value", [True, False])
def test_where_with_a_constant_uniform_condition_is_its_branch(value):
    """SEW-D on an unpadded input: its masks are constant, all false; the Where picks one
    branch everywhere (not when the other operands would broadcast it larger)."""
    cond = const("cond", np.full((2, 1, 1, 4), value), np.bool_)
    m = chain(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Where", ["cond", "a", "fill"], ["w"]),
            helper.make_node("Neg", ["w"], ["y"]),
        ],
        shape=(2, 3, 5, 4),
        inits=[cond, const("fill", np.float32(-1e4))],
    )
    out, report = assert_optimized(m, level=1)
    rule = "eliminate-where-true" if value else "eliminate-where-false"
    if value:
        assert "Where" not in ops(out) and rule in {r.rule for r in report.remarks}
    else:  # the fill, a scalar, would grow to the output's shape: kept
        assert ops(out).get("Where") == 1


def test_where_all_false_forwards_the_else_branch():
    cond = const("cond", np.zeros((1, 1, 1, 4), np.bool_), np.bool_)
    m = chain(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Where", ["cond", "fill", "a"], ["w"]),
            helper.make_node("Neg", ["w"], ["y"]),
        ],
        shape=(2, 3, 5, 4),
        inits=[cond, const("fill", np.float32(-1e4))],
    )
    out, report = assert_optimized(m, level=1)
    assert "Where" not in ops(out), ops(out)
    assert "eliminate-where-false" in {r.rule for r in report.remarks if r.kind == "passed"}


@pytest.mark.parametrize(
    "opset, axes, drops",
    [(18, [-1], True), (13, [2], True), (18, [1], False)],  # the last axis, or another one
)
def test_a_softmax_of_rows_shifted_by_their_max_reads_the_rows(opset, axes, drops):
    """MiMo-V2 spells a stabilized softmax out: Softmax(z − ReduceMax(z)) is Softmax(z), bit
    for bit; the shift by another axis's max is left alone (it changes nothing either, but
    is not the Softmax's own)."""
    reduce = (
        helper.make_node("ReduceMax", ["x", "ax"], ["m"], keepdims=1)
        if opset >= 18
        else helper.make_node("ReduceMax", ["x"], ["m"], keepdims=1, axes=axes)
    )
    nodes = [
        reduce,
        helper.make_node("Sub", ["x", "m"], ["z"]),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1),
    ]
    inits = [const("ax", axes, np.int64)] if opset >= 18 else []
    m = model(nodes, [vi("x", [2, 3, 5])], [vi("y", [2, 3, 5])], inits, opset=opset)
    x = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32) * 30
    out, report = run(m, inputs={"x": x})
    assert report.parity.ran and report.parity.ok, report.parity
    ops = [n.op_type for n in out.graph.node]
    assert (ops == ["Softmax"]) == drops, ops

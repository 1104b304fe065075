"""Folding guards: nothing folding evaluates may kill the process or blow up the model."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphopt
from conftest import codes, const, model, ops, run, vi
from graphopt.passes import fold_constants

MIB = 2**20


def _init_bytes(m) -> int:
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer)


def _division(op: str, a, b, dtype) -> object:
    """y = x + op(a, b) with constant integer a, b."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node(op, ["a", "b"], ["q"]),
        helper.make_node("Add", ["x", "q"], ["y"]),
    ]
    return model(
        nodes,
        [vi("x", [len(a)], elem)],
        [vi("y", [len(a)], elem)],
        [const("a", a, dtype), const("b", b, dtype)],
    )


@pytest.mark.parametrize(
    ("op", "a", "b", "dtype", "code"),
    [
        ("Div", [7, 8], [2, 0], np.int32, "fold-division-by-zero"),
        ("Div", [7, 8], [0, 1], np.int64, "fold-division-by-zero"),
        ("Mod", [7, 8], [3, 0], np.int64, "fold-division-by-zero"),
        ("Div", [-(2**31), 5], [-1, 1], np.int32, "fold-integer-overflow"),
        ("Div", [-(2**63), 5], [-1, 1], np.int64, "fold-integer-overflow"),
        ("Mod", [-(2**31), 5], [-1, 2], np.int32, "fold-integer-overflow"),
    ],
)
def test_integer_division_traps_are_refused(op, a, b, dtype, code):
    """onnxruntime dies of SIGFPE evaluating these; the guard checks operands first.  (The
    original model itself would die running them, so parity is not run.)"""
    m = _division(op, a, b, dtype)
    out, report = graphopt.optimize(m, level=1, check=False)
    assert ops(out)[op] == 1
    assert code in codes(report, "fold-constants")


def test_safe_integer_division_still_folds():
    m = _division("Div", [7, -8], [2, 3], np.int32)
    out, report = run(m, level=1)
    assert "Div" not in ops(out) and report.parity.ok


def test_divisor_computed_in_the_same_round_is_checked_before_evaluation():
    """The divisor -1 is a Neg of a constant: only known once that folds; checked then."""
    nodes = [
        helper.make_node("Neg", ["one"], ["minus_one"]),
        helper.make_node("Div", ["a", "minus_one"], ["q"]),
        helper.make_node("Add", ["x", "q"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [2], TensorProto.INT64)],
        [vi("y", [2], TensorProto.INT64)],
        [const("a", [-(2**63), 5], np.int64), const("one", [1, 1], np.int64)],
    )
    out, report = graphopt.optimize(m, level=1, check=False)
    assert ops(out).get("Div") == 1 and "Neg" not in ops(out)
    assert "fold-integer-overflow" in codes(report, "fold-constants")


def test_integer_overflow_in_an_if_branch_that_never_runs():
    """Folding visits If bodies; a branch that is never taken must not crash the optimizer."""
    zero_div = helper.make_graph(
        [helper.make_node("Div", ["ta", "tz"], ["t_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("t_out", TensorProto.INT32, [2])],
        [const("ta", [-(2**31), 9], np.int32), const("tz", [-1, 1], np.int32)],
    )
    safe = helper.make_graph(
        [helper.make_node("Identity", ["ea"], ["e_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.INT32, [2])],
        [const("ea", [1, 2], np.int32)],
    )
    nodes = [
        helper.make_node("If", ["cond"], ["r"], then_branch=zero_div, else_branch=safe),
        helper.make_node("Add", ["x", "r"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("cond", [], TensorProto.BOOL), vi("x", [2], TensorProto.INT32)],
        [vi("y", [2], TensorProto.INT32)],
    )
    out, report = run(m, level=1, inputs={"cond": np.array(False), "x": np.ones(2, np.int32)})
    assert report.parity.ok
    assert "fold-integer-overflow" in codes(report, "fold-constants")


def test_tile_chain_is_bounded_by_the_model_budget():
    """Six Tile x2 in a row: each step only doubles (under the per-node rule), together 64x."""
    base = np.ones(16384, np.float32)  # 64 KiB
    nodes = [helper.make_node("Tile", [f"t{i}", "reps"], [f"t{i + 1}"]) for i in range(6)] + [
        helper.make_node("Add", ["x", "t6"], ["y"])
    ]
    m = model(
        nodes,
        [vi("x", [16384 * 64])],
        [vi("y", [16384 * 64])],
        [const("t0", base), const("reps", [2], np.int64)],
    )
    out, report = run(m, level=1)
    assert "fold-size-budget" in codes(report, "fold-constants")
    assert ops(out).get("Tile", 0) > 0
    assert _init_bytes(out) <= _init_bytes(m) + MIB // 64
    assert report.parity.ok


def test_concat_of_one_constant_with_itself_counts_it_once():
    """A 1 MiB constant concatenated 16 times is 16 MiB out of 1 MiB in, not out of 16."""
    big = np.ones(MIB // 4, np.float32)
    nodes = [
        helper.make_node("Concat", ["w"] * 16, ["c"], axis=0),
        helper.make_node("Add", ["x", "c"], ["y"]),
    ]
    m = model(nodes, [vi("x", [16 * MIB // 4])], [vi("y", [16 * MIB // 4])], [const("w", big)])
    out, report = run(m, level=1)
    assert ops(out).get("Concat") == 1
    assert "fold-size-limit" in codes(report, "fold-constants")
    assert _init_bytes(out) <= _init_bytes(m)


@pytest.fixture
def evaluated(monkeypatch):
    """Records the op types folding hands to onnxruntime (nothing is evaluated for real when
    the guard is missing: the test fails instead of allocating gigabytes)."""
    seen: list[str] = []
    real = fold_constants.evaluate

    def spy(ir, nodes, known, wanted):
        seen.extend(n.op for n in nodes)
        if any(n.op in ("ConstantOfShape", "Expand", "Tile", "Range") for n in nodes):
            raise AssertionError(f"evaluated {[n.op for n in nodes]}")
        return real(ir, nodes, known, wanted)

    monkeypatch.setattr(fold_constants, "evaluate", spy)
    return seen


@pytest.mark.parametrize(
    ("node", "inits"),
    [
        (
            helper.make_node(
                "ConstantOfShape",
                ["shape"],
                ["big"],
                value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5]),
            ),
            [const("shape", [1 << 19, 1 << 10], np.int64)],  # 2 GiB of float32
        ),
        (
            helper.make_node("Expand", ["one", "shape"], ["big"]),
            [const("one", [[0.5]]), const("shape", [1 << 19, 1 << 10], np.int64)],
        ),
        (
            helper.make_node("Tile", ["one", "shape"], ["big"]),
            [const("one", [[0.5]]), const("shape", [1 << 19, 1 << 10], np.int64)],
        ),
        (
            helper.make_node("Range", ["start", "limit", "delta"], ["big"]),
            [
                const("start", 0.0),
                const("limit", float(1 << 29)),
                const("delta", 1.0),
            ],
        ),
    ],
    ids=["ConstantOfShape", "Expand", "Tile", "Range"],
)
def test_generators_are_sized_before_evaluation(node, inits, evaluated):
    nodes = [node, helper.make_node("ReduceMax", ["big"], ["y"], keepdims=0)]
    m = model(nodes, [], [vi("y", [])], inits)
    out, report = graphopt.optimize(m, level=1, check=False)
    assert node.op_type in ops(out)
    assert "fold-size-limit" in codes(report, "fold-constants")
    assert node.op_type not in evaluated


def test_low_bit_constants_do_not_reach_the_evaluator():
    """int4 and fp8 constants (no numpy type without ml_dtypes) are left as they are."""
    w4 = helper.make_tensor("w4", TensorProto.INT4, [2, 2], [1, -2, 3, -4])
    w8 = helper.make_tensor("w8", TensorProto.FLOAT8E4M3FN, [2, 2], [0.5, 1.0, -2.0, 4.0])
    nodes = [
        helper.make_node("Cast", ["w4"], ["c4"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["w8"], ["c8"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["c4", "c8"], ["s"]),
        helper.make_node("Mul", ["x", "s"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [2, 2])],
        [vi("y", [2, 2])],
        [w4, w8],
        opset=21,
        ir_version=10,
    )
    out, report = run(m, level=1)
    assert report.parity.ok
    types = {t.name: t.data_type for t in out.graph.initializer}
    assert types.get("w4") == TensorProto.INT4 and types.get("w8") == TensorProto.FLOAT8E4M3FN


@pytest.mark.parametrize("big_model", [False, True], ids=["small-model", "4-MiB-model"])
def test_growth_budget_scales_with_the_model(big_model):
    """A 24 KiB net growth (a Tile x4 of 8 KiB) is over the 16 KiB budget of a small model, and
    within 1 % of a model with 4 MiB of weights, where it folds."""
    nodes = [
        helper.make_node("Tile", ["t0", "reps"], ["t1"]),
        helper.make_node("Add", ["x", "t1"], ["y"]),
    ]
    inits = [const("t0", np.ones(2048, np.float32)), const("reps", [4], np.int64)]
    inputs, outputs = [vi("x", [8192])], [vi("y", [8192])]
    if big_model:
        nodes.append(helper.make_node("MatMul", ["z", "W"], ["w"]))
        inits.append(const("W", np.ones((1024, 1024), np.float32)))
        inputs.append(vi("z", [1, 1024]))
        outputs.append(vi("w", [1, 1024]))
    out, report = run(model(nodes, inputs, outputs, inits), level=1)
    assert report.parity.ok
    assert ("Tile" in ops(out)) is not big_model
    assert ("fold-size-budget" in codes(report, "fold-constants")) is not big_model


def test_a_chain_deferred_for_its_operands_folds_in_one_run_of_the_pass():
    """ConstantOfShape's shape is a Div computed in the same round (a generator's shape and a
    divisor are deferred until known): the pass's next round folds them, in the same run."""
    nodes = [
        helper.make_node("Neg", ["two"], ["minus_two"]),
        helper.make_node("Div", ["dims", "minus_two"], ["half"]),
        helper.make_node("Neg", ["half"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("Add", ["x", "zeros"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [4, 6])],
        [vi("y", [4, 6])],
        [const("dims", [8, 12], np.int64), const("two", [2, 2], np.int64)],
    )
    out, report = run(m, pipeline="fold-constants")
    assert ops(out) == {"Add": 1}, ops(out)
    assert [p["name"] for p in report.passes] == ["fold-constants"] and report.parity.ok


def test_a_later_round_does_not_evaluate_what_it_cannot_size(monkeypatch):
    """A later round runs without a new inference: a node whose outputs' size is unknown is
    inferred alone from its constant inputs, so that a table too large to keep is refused
    before onnxruntime computes it (the [N, N] broadcast of a ConstantOfShape whose shape was
    itself computed in a round)."""
    n = 1024  # [n, n] float32: 4 MiB, past the default limit
    evaluated = []
    real = fold_constants.evaluate

    def spy(ir, nodes, known, wanted):
        evaluated.extend(node.op for node in nodes)
        return real(ir, nodes, known, wanted)

    monkeypatch.setattr(fold_constants, "evaluate", spy)
    nodes = [
        helper.make_node("Neg", ["minus_shape"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["row"]),
        helper.make_node("Add", ["row", "col"], ["table"]),
        helper.make_node("Add", ["x", "table"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [n, n])],
        [vi("y", [n, n])],
        [const("minus_shape", [-1, -n], np.int64), const("col", np.ones((n, 1), np.float32))],
    )
    out, report = run(m, pipeline="fold-constants")
    assert "ConstantOfShape" not in ops(out) and ops(out)["Add"] == 2
    assert evaluated.count("Add") == 0, evaluated
    assert "fold-size-limit" in codes(report, "fold-constants")


def _swin_v2_cpb(rng, heads: int = 3, window: int = 8):
    """Swin v2's continuous position bias, as exported: a constant coordinate table
    [1, 2w-1, 2w-1, 2] through a 2 → 512 → heads MLP (the hidden layer 0.44 MiB at w = 8),
    16·sigmoid, a Gather by the constant relative-position index, Reshape/Transpose to
    [1, heads, w², w²], added to the attention scores."""
    side, n = 2 * window - 1, window * window
    coords = np.stack(np.meshgrid(np.linspace(-1, 1, side), np.linspace(-1, 1, side)), -1)
    pos = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = (pos[:, :, None] - pos[:, None, :]).transpose(1, 2, 0) + window - 1
    index = (rel[..., 0] * side + rel[..., 1]).reshape(-1)
    nodes = [
        helper.make_node("MatMul", ["coords", "w1"], ["hid"], name="cpb/fc1"),
        helper.make_node("Add", ["hid", "b1"], ["hidb"], name="cpb/fc1_bias"),
        helper.make_node("Relu", ["hidb"], ["act"], name="cpb/relu"),
        helper.make_node("MatMul", ["act", "w2"], ["table"], name="cpb/fc2"),
        helper.make_node("Sigmoid", ["table"], ["sig"], name="cpb/sigmoid"),
        helper.make_node("Mul", ["sig", "sixteen"], ["table16"], name="cpb/scale"),
        helper.make_node("Reshape", ["table16", "flat_shape"], ["flat"], name="cpb/flat"),
        helper.make_node("Gather", ["flat", "index"], ["picked"], name="cpb/gather", axis=0),
        helper.make_node("Reshape", ["picked", "bias_shape"], ["bias_hw"], name="cpb/view"),
        helper.make_node("Transpose", ["bias_hw"], ["bias_t"], name="cpb/permute", perm=[2, 0, 1]),
        helper.make_node("Unsqueeze", ["bias_t", "axes0"], ["bias"], name="cpb/unsqueeze"),
        helper.make_node("Add", ["scores", "bias"], ["biased"], name="attn/add_bias"),
        helper.make_node("Softmax", ["biased"], ["probs"], name="attn/softmax", axis=-1),
    ]
    inits = [
        const("coords", coords[None] * 8),
        const("w1", rng.standard_normal((2, 512)) * 0.5),
        const("b1", rng.standard_normal(512) * 0.1),
        const("w2", rng.standard_normal((512, heads)) * 0.05),
        const("sixteen", 16.0),
        const("flat_shape", [-1, heads], np.int64),
        const("index", index, np.int64),
        const("bias_shape", [n, n, heads], np.int64),
        const("axes0", [0], np.int64),
    ]
    return model(nodes, [vi("scores", [1, heads, n, n])], [vi("probs", [1, heads, n, n])], inits)


def test_a_constant_cone_is_judged_by_what_it_leaves(rng):
    """The CPB cone's hidden layer (0.44 MiB) is far past a small model's 16 KiB budget, its
    result (a 48 KiB bias table) replaces about as many bytes of weights and index: it folds
    whole, into one constant added to the scores."""
    m = _swin_v2_cpb(rng)
    hidden = 15 * 15 * 512 * 4
    assert hidden > MIB // 64 * 16
    out, report = run(m, level=1)
    assert report.parity.ok
    assert ops(out) == {"Add": 1, "Softmax": 1}, ops(out)
    assert "fold-size-budget" not in codes(report, "fold-constants")
    assert _init_bytes(out) <= _init_bytes(m) + MIB // 64


def test_the_cone_folds_at_o2_too(rng):
    out, report = run(_swin_v2_cpb(rng), level=2)
    assert report.parity.ok and "MatMul" not in ops(out) and "Gather" not in ops(out)


def test_a_cone_whose_result_is_big_is_still_refused():
    """A 256 B row tiled to a 256 KiB table (under the per-node limit) and scaled, then added
    to an activation: the cone leaves the whole table, past the 16 KiB budget; refused at the
    Tile, the Mul reading it stays too."""
    nodes = [
        helper.make_node("Tile", ["row", "reps"], ["table"], name="blowup/tile"),
        helper.make_node("Mul", ["table", "two"], ["scaled"], name="blowup/scale"),
        helper.make_node("Add", ["x", "scaled"], ["y"], name="use"),
    ]
    m = model(
        nodes,
        [vi("x", [1024, 64])],
        [vi("y", [1024, 64])],
        [const("row", np.arange(64)[None]), const("reps", [1024, 1], np.int64), const("two", 2.0)],
    )
    out, report = run(m, level=1)
    assert report.parity.ok
    assert ops(out) == {"Tile": 1, "Mul": 1, "Add": 1}, ops(out)
    budget = [r for r in report.remarks if r.code == "fold-size-budget"]
    assert [r.nodes[0] for r in budget] == ["blowup/tile"]
    assert budget[0].args["cone_nodes"] == 2
    assert budget[0].args["cone_growth_bytes"] > 256 * 1024 - 1024
    assert _init_bytes(out) <= _init_bytes(m) + MIB // 64


def test_a_blow_up_reduced_inside_its_cone_folds():
    """The same 256 KiB table summed back to one row inside the cone leaves 256 B: it folds."""
    nodes = [
        helper.make_node("Tile", ["row", "reps"], ["table"], name="blowup/tile"),
        helper.make_node("ReduceSum", ["table", "axes0"], ["sum"], name="reduce", keepdims=0),
        helper.make_node("Add", ["x", "sum"], ["y"], name="use"),
    ]
    m = model(
        nodes,
        [vi("x", [64])],
        [vi("y", [64])],
        [
            const("row", np.arange(64)[None]),
            const("reps", [1024, 1], np.int64),
            const("axes0", [0], np.int64),
        ],
    )
    out, report = run(m, level=1)
    assert report.parity.ok and ops(out) == {"Add": 1}, ops(out)
    assert "fold-size-budget" not in codes(report, "fold-constants")


def test_an_output_that_grows_says_so_with_what_it_measured():
    """Growth the user allowed (a larger --fold-size-limit) is an analysis remark with the sizes;
    a model that does not grow gets none."""
    base = np.ones(4096, np.float32)  # 16 KiB
    nodes = [
        helper.make_node("Tile", ["t0", "reps"], ["t1"]),
        helper.make_node("Add", ["x", "t1"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [4096 * 8])],
        [vi("y", [4096 * 8])],
        [const("t0", base), const("reps", [8], np.int64)],
    )
    out, report = run(m, level=1, options={"fold_size_limit": 64 * MIB})
    (grew,) = [r for r in report.remarks if r.code == "output-grew"]
    assert (
        grew.args["after_bytes"] > grew.args["before_bytes"] and "x the original's" in grew.message
    )
    _, report = run(m, level=1)
    assert not [r for r in report.remarks if r.code == "output-grew"]

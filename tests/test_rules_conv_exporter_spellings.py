"""Exporter spellings that used to block Conv fusions: dynamo's CastLike/Expand bias, fp16
Conv+BN decided by measured error, weights built at run time by ConstantOfShape/Expand/Tile."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from conftest import assert_optimized, codes, const, model, ops, run, vi


def _bn_inits(rng, c, dtype=np.float32, names=("g", "b", "m", "v")):
    g, b, m, v = names
    return [
        const(g, rng.random(c) + 0.5, dtype),
        const(b, rng.standard_normal(c) * 0.1, dtype),
        const(m, rng.standard_normal(c) * 0.1, dtype),
        const(v, rng.random(c) + 0.5, dtype),
    ]


# ------------------------------------------------------------------------ CastLike / Expand
def test_castlike_with_static_dtype_folds():
    """CastLike(const, x) where x's dtype is known is a Cast: it folds to an fp16 constant."""
    nodes = [
        helper.make_node("CastLike", ["c", "x"], ["cl"]),
        helper.make_node("Add", ["x", "cl"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", ["batch", 4], TensorProto.FLOAT16)],
        [vi("y", None, TensorProto.FLOAT16)],
        [const("c", [0.5, 1.5, -2.0, 3.25])],
        opset=18,
    )
    out, report = assert_optimized(m)
    assert ops(out) == {"Add": 1}
    assert codes(report, "castlike-to-cast", "passed") == ["fired"]
    folded = [t for t in out.graph.initializer if t.data_type == TensorProto.FLOAT16]
    assert len(folded) == 1


def test_castlike_of_computed_value_becomes_cast():
    nodes = [
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("CastLike", ["r", "x"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("a", [3]), vi("x", [2], TensorProto.FLOAT16)],
        [vi("y", None, TensorProto.FLOAT16)],
        opset=18,
    )
    out, _ = assert_optimized(m)
    assert ops(out) == {"Relu": 1, "Cast": 1}
    cast = [n for n in out.graph.node if n.op_type == "Cast"][0]
    assert helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT16


def dynamo_conv_bn(rng, c_in=4, c_out=8):
    """torch.onnx dynamo's spelling of a bias-free Conv + BN: B = Expand(CastLike(0, x),
    Shape(W)[0:1])."""
    nodes = [
        helper.make_node("CastLike", ["zero", "x"], ["zero_x"]),
        helper.make_node("Shape", ["W"], ["w_shape"]),
        helper.make_node("Slice", ["w_shape", "s0", "s1"], ["c_out"]),
        helper.make_node("Expand", ["zero_x", "c_out"], ["B"]),
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]),
    ]
    inits = [
        const("zero", 0.0),
        const("s0", [0], np.int64),
        const("s1", [1], np.int64),
        const("W", rng.standard_normal((c_out, c_in, 3, 3))),
        *_bn_inits(rng, c_out),
    ]
    return model(nodes, [vi("x", [1, c_in, 8, 8])], [vi("y", None)], inits, opset=18)


def test_dynamo_expand_castlike_bias_folds_and_conv_bn_fuses(rng):
    out, report = assert_optimized(dynamo_conv_bn(rng))
    assert ops(out) == {"Conv": 1}
    assert codes(report, "fuse-conv-bn", "passed") == ["fired"]
    assert not codes(report, "fuse-conv-bn")


# ------------------------------------------------------------------- fp16 Conv+BN, measured
def fp16_conv_bn(rng, *, gamma=None, var=None, beta=None, mean=None, x_shape=(1, 4, 8, 8)):
    c_in, c_out = x_shape[1], 8
    inits = [
        const("W", rng.standard_normal((c_out, c_in, 3, 3)), np.float16),
        const("B", rng.standard_normal(c_out) * 0.1, np.float16),
        const("g", rng.random(c_out) + 0.5 if gamma is None else gamma, np.float16),
        const("b", rng.standard_normal(c_out) * 0.1 if beta is None else beta, np.float16),
        const("m", rng.standard_normal(c_out) * 0.1 if mean is None else mean, np.float16),
        const("v", rng.random(c_out) + 0.5 if var is None else var, np.float16),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn"),
    ]
    elem = TensorProto.FLOAT16
    return model(nodes, [vi("x", list(x_shape), elem)], [vi("y", None, elem)], inits)


def _numpy_error(m, got, x):
    w = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer}
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    h, wd = x.shape[2], x.shape[3]
    patches = np.stack(
        [xp[:, :, i : i + h, j : j + wd] for i in range(3) for j in range(3)], axis=2
    )  # N, C, 9, H, W
    if "W" in w and "g" in w:
        weights, bias = w["W"], w["B"]
        s = w["g"] / np.sqrt(w["v"] + 1e-5)
        y = np.einsum("nckhw,ock->nohw", patches, weights.reshape(8, -1, 9))
        y = (y + bias[None, :, None, None] - w["m"][None, :, None, None]) * s[
            None, :, None, None
        ] + w["b"][None, :, None, None]
    else:
        raise AssertionError("reference is computed from the original model only")
    return float(np.max(np.abs(got - y)) / np.max(np.abs(y)))


def test_fp16_conv_bn_folds_at_O2_when_no_worse(rng):
    """Scales of about 2 (gamma 2, var 1, mean 0, beta 0) re-round nothing: the folded layer's
    measured error is the unfused graph's, so it folds at -O2, and its output is no further
    from the float64 reference."""
    c = 8
    m = fp16_conv_bn(rng, gamma=np.full(c, 2.0), var=np.ones(c), beta=np.zeros(c), mean=np.zeros(c))
    out, report = assert_optimized(m)
    assert ops(out) == {"Conv": 1}
    assert codes(report, "fuse-conv-bn", "passed") == ["fired"]
    x = rng.standard_normal((1, 4, 8, 8)).astype(np.float16)
    folded_err = _numpy_error(m, _run(out, x), x)
    unfused_err = _numpy_error(m, _run(m, x), x)
    assert folded_err <= unfused_err * 1.05, (folded_err, unfused_err)


def test_fp16_conv_bn_with_real_statistics_is_refused_with_the_numbers(rng):
    """Non-trivial statistics re-round every weight: each channel's output then errs the same
    way on every input (systematic), which the unfused graph does not: refused at -O2 for a
    runtime that does not fold Conv+BN itself (onnxruntime does: test_rules_conv_fp16_refold)."""
    m = fp16_conv_bn(rng)
    out, report = run(m, target="tensorrt")
    assert ops(out)["BatchNormalization"] == 1
    assert codes(report, "fuse-conv-bn") == ["precision-refold"]
    args = [r for r in report.remarks if r.rule == "fuse-conv-bn"][0].args
    assert args["folded_bias"] > 1.05 * args["unfused_bias"]
    assert {"folded_max", "unfused_max", "folded_mean", "unfused_mean"} <= set(args)


def _run(m, x):
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0].astype(np.float64)


def test_fp16_conv_bn_refused_when_fold_is_less_accurate(rng):
    """One channel's scale (1e-5) makes its folded weights fp16 subnormals (up to 0.5 % error each)
    while the unfused graph keeps that channel in the normal range: refused with the numbers."""
    gamma = np.full(8, 1.0)
    gamma[3] = 1e-5 * np.sqrt(1e4)
    var = np.full(8, 1.0)
    var[3] = 1e4
    m = fp16_conv_bn(rng, gamma=gamma, var=var, beta=np.zeros(8), mean=np.zeros(8))
    out, report = run(m)
    assert ops(out)["BatchNormalization"] == 1
    assert codes(report, "fuse-conv-bn") == ["precision-refold"]
    remark = [r for r in report.remarks if r.rule == "fuse-conv-bn"][0]
    assert remark.args["folded_max"] > 2 * remark.args["unfused_max"]
    assert "worst error" in remark.message and "vs" in remark.message
    out3, _ = run(m, level=3, check=False)
    assert ops(out3) == {"Conv": 1}  # -O3 still folds (numerics-changing level)


def test_fp16_conv_bn_overflowing_fold_is_refused_with_numbers(rng):
    m = fp16_conv_bn(rng, var=np.full(8, 1e-7), gamma=np.full(8, 1000.0))
    out, report = run(m, check=False)
    assert ops(out)["BatchNormalization"] == 1
    assert codes(report, "fuse-conv-bn") == ["precision-overflow"]
    remark = [r for r in report.remarks if r.rule == "fuse-conv-bn"][0]
    assert remark.args["worst"] > 65504


def test_fp16_conv_add_folds_at_O2(rng):
    """Bias + constant exact in fp16: the fold re-rounds nothing and is kept at -O2."""
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "k"], ["y"]),
    ]
    elem = TensorProto.FLOAT16
    m = model(
        nodes,
        [vi("x", [1, 4, 8, 8], elem)],
        [vi("y", None, elem)],
        [
            const("W", rng.standard_normal((8, 4, 3, 3)), np.float16),
            const("B", rng.integers(-8, 8, 8) / 4, np.float16),
            const("k", rng.integers(-8, 8, (8, 1, 1)) / 4, np.float16),
        ],
    )
    out, _ = assert_optimized(m)
    assert ops(out) == {"Conv": 1}


# --------------------------------------------------------------- weights built at run time
def _runtime_weight(name, value, gen):
    """``value`` built at run time: gen(shape) (ConstantOfShape / Expand / Tile of ones) · 0.5
    · 2 + (value − 1)."""
    shape = const(f"{name}_shape", value.shape, np.int64)
    delta = const(f"{name}_delta", value - 1.0)
    half = const(f"{name}_half", 0.5)
    two = const(f"{name}_two", 2.0)
    unit = const(f"{name}_unit", np.ones([1] * value.ndim))
    if gen == "ConstantOfShape":
        one = helper.make_tensor(f"{name}_one", TensorProto.FLOAT, [1], [1.0])
        base = helper.make_node("ConstantOfShape", [shape.name], [f"{name}_base"], value=one)
    else:
        base = helper.make_node(gen, [unit.name, shape.name], [f"{name}_base"])
    nodes = [
        base,
        helper.make_node("Mul", [f"{name}_base", half.name], [f"{name}_h"]),
        helper.make_node("Mul", [f"{name}_h", two.name], [f"{name}_1"]),
        helper.make_node("Add", [f"{name}_1", delta.name], [name]),
    ]
    return nodes, [shape, delta, half, two, unit]


def zoo_conv_bn(rng, gen="ConstantOfShape"):
    c_in, c_out = 4, 8
    nodes, inits = [], []
    values = {
        "W": rng.standard_normal((c_out, c_in, 3, 3)),
        "g": rng.random(c_out) + 0.5,
        "b": rng.standard_normal(c_out),
        "m": rng.standard_normal(c_out),
        "v": rng.random(c_out) + 0.5,
    }
    for k, (name, v) in enumerate(values.items()):
        n, i = _runtime_weight(name, v.astype(np.float32), gen if k == 0 else "ConstantOfShape")
        nodes += n
        inits += i
    nodes += [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]),
    ]
    return model(nodes, [vi("x", [1, c_in, 8, 8])], [vi("y", None)], inits)


#: smaller than the 1152-byte weight, so the weight's fold is over the per-node limit
SMALL_LIMIT = {"fold_size_limit": 1024}


def test_runtime_built_weights_fold_then_fuse(rng):
    for gen in ("ConstantOfShape", "Expand", "Tile"):
        out, report = assert_optimized(zoo_conv_bn(rng, gen), options=SMALL_LIMIT)
        assert ops(out) == {"Conv": 1}, gen
        assert not codes(report, "fold-constants"), gen
        assert codes(report, "fuse-conv-bn", "passed") == ["fired"]


def test_runtime_built_tensor_not_feeding_a_weight_keeps_the_limit(rng):
    """The same 1152-byte ConstantOfShape added to an activation is not a weight: refused."""
    nodes, inits = _runtime_weight(
        "t", rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "ConstantOfShape"
    )
    nodes.append(helper.make_node("Add", ["x", "t"], ["y"]))
    m = model(nodes, [vi("x", [8, 4, 3, 3])], [vi("y", None)], inits)
    out, report = run(m, options=SMALL_LIMIT)
    assert "ConstantOfShape" in ops(out)
    assert "fold-size-limit" in codes(report, "fold-constants")


def test_runtime_built_weight_larger_than_largest_initializer_is_refused(rng):
    """A weight built from scalars only: the model's largest initializer (8 bytes of shape) does
    not raise the per-node limit, so the 1152-byte ConstantOfShape stays."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [0.1])
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["W"], value=one),
        helper.make_node("Conv", ["x", "W"], ["y"]),
    ]
    m = model(
        nodes, [vi("x", [1, 4, 8, 8])], [vi("y", None)], [const("shape", [8, 4, 3, 3], np.int64)]
    )
    out, report = run(m, options=SMALL_LIMIT)
    assert "ConstantOfShape" in ops(out)
    assert codes(report, "fold-constants") == ["fold-size-limit"]

"""Conv fusions: Conv+BN, ConvTranspose+BN, Conv+Add, Conv+Mul, Pad+Conv."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, codes, const, model, ops, run, vi


def conv_bn(
    rng,
    *,
    dtype=np.float32,
    var=None,
    bn_as_inputs=False,
    group=1,
    training=False,
    epsilon=1e-5,
    w_scale=1.0,
):
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    c_in, c_out = 4, 8
    var = rng.random(c_out) + 0.1 if var is None else var
    bn = [
        const("g", rng.random(c_out) + 0.5, dtype),
        const("b", rng.standard_normal(c_out), dtype),
        const("m", rng.standard_normal(c_out), dtype),
        const("v", var, dtype),
    ]
    inits = [
        const("W", w_scale * rng.standard_normal((c_out, c_in // group, 3, 3)), dtype),
        const("B", rng.standard_normal(c_out), dtype),
    ]
    inputs = [vi("x", [1, c_in, 8, 8], elem)]
    if bn_as_inputs:
        inputs += [vi(t.name, [c_out], elem) for t in bn]
    attrs = {"training_mode": 1} if training else {"epsilon": epsilon}
    outs = ["y", "rm", "rv"] if training else ["y"]
    nodes = [
        helper.make_node(
            "Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], group=group, name="conv"
        ),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], outs, name="bn", **attrs),
    ]
    return model(nodes, inputs, [vi("y", None, elem)], inits + bn, opset=15 if training else 17)


def test_conv_bn_fuses(rng):
    out, report = assert_optimized(conv_bn(rng))
    assert ops(out) == {"Conv": 1}
    assert codes(report, "fuse-conv-bn", "passed") == ["fired"]


def test_conv_bn_grouped(rng):
    out, _ = assert_optimized(conv_bn(rng, group=2))
    assert ops(out) == {"Conv": 1}


def test_conv_bn_params_as_graph_inputs_is_missed(rng):
    """keep_initializers_as_inputs: BN params are overridable inputs, so not constants."""
    out, report = run(conv_bn(rng, bn_as_inputs=True))
    assert ops(out) == {"Conv": 1, "BatchNormalization": 1}
    assert codes(report, "fuse-conv-bn") == ["non-constant-param"]
    msg = [r.message for r in report.remarks if r.rule == "fuse-conv-bn"][0]
    assert "keep_initializers_as_inputs" in msg
    assert report.parity.ok


def test_conv_bn_training_mode_is_missed(rng):
    out, report = run(conv_bn(rng, training=True), check=False)
    assert codes(report, "fuse-conv-bn") == ["training-mode"]


def test_conv_bn_fp16_overflow_is_refused(rng):
    """A tiny running_var makes folded fp16 weights exceed 65504: refused, with the numbers."""
    m = conv_bn(rng, dtype=np.float16, var=np.full(8, 1e-7), epsilon=1e-9, w_scale=30.0)
    out, report = run(m, check=False)
    assert ops(out)["BatchNormalization"] == 1
    assert codes(report, "fuse-conv-bn") == ["precision-overflow"]
    remark = [r for r in report.remarks if r.rule == "fuse-conv-bn"][0]
    assert remark.args["worst"] > 65504


def test_conv_bn_fp32_same_model_fuses(rng):
    m = conv_bn(rng, dtype=np.float32, var=np.full(8, 1e-7), epsilon=1e-9, w_scale=30.0)
    out, report = run(m)
    assert ops(out) == {"Conv": 1}
    assert report.parity.ok


def test_convtranspose_bn(rng):
    c_in, c_out, group = 4, 6, 2
    inits = [
        const("W", rng.standard_normal((c_in, c_out // group, 3, 3))),
        const("g", rng.random(c_out) + 0.5),
        const("b", rng.standard_normal(c_out)),
        const("m", rng.standard_normal(c_out)),
        const("v", rng.random(c_out) + 0.1),
    ]
    nodes = [
        helper.make_node("ConvTranspose", ["x", "W"], ["c"], group=group, strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]),
    ]
    out, _ = assert_optimized(model(nodes, [vi("x", [1, c_in, 5, 5])], [vi("y", None)], inits))
    assert ops(out) == {"ConvTranspose": 1}


def conv_then(op, shape, rng):
    inits = [const("W", rng.standard_normal((8, 3, 3, 3))), const("c", rng.standard_normal(shape))]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["y0"], name="conv"),
        helper.make_node(op, ["y0", "c"], ["y"], name="elt"),
    ]
    return model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", None)], inits)


@pytest.mark.parametrize("op", ["Add", "Mul"])
@pytest.mark.parametrize("shape", [[8, 1, 1], [1, 8, 1, 1], [1], [1, 1, 1, 1]])
def test_conv_elementwise_per_channel_fuses(op, shape, rng):
    out, report = assert_optimized(conv_then(op, shape, rng))
    assert ops(out) == {"Conv": 1}


@pytest.mark.parametrize("op", ["Add", "Mul"])
@pytest.mark.parametrize("shape", [[4], [1, 1, 1, 4], [8, 4, 4], [2, 8, 1, 1]])
def test_conv_elementwise_not_per_channel_is_refused(op, shape, rng):
    """Width/height/batch broadcasts are not per-channel: folding them would change outputs."""
    out, report = run(conv_then(op, shape, rng))
    assert ops(out) == {"Conv": 1, op: 1}
    assert codes(report, f"fuse-conv-{op.lower()}") == ["not-per-channel"]
    assert report.parity.ok


def pad_conv(rng, pads, mode="constant", value=None):
    inits = [const("W", rng.standard_normal((4, 3, 3, 3))), const("p", pads, np.int64)]
    pad_inputs = ["x", "p"]
    if value is not None:
        inits.append(const("val", value))
        pad_inputs.append("val")
    nodes = [
        helper.make_node("Pad", pad_inputs, ["xp"], mode=mode, name="pad"),
        helper.make_node("Conv", ["xp", "W"], ["y"], pads=[1, 0, 1, 0], name="conv"),
    ]
    return model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", None)], inits)


def test_pad_conv_fuses(rng):
    out, _ = assert_optimized(pad_conv(rng, [0, 0, 1, 2, 0, 0, 3, 1]))
    assert ops(out) == {"Conv": 1}
    conv = out.graph.node[0]
    assert list(
        helper.get_attribute_value(conv.attribute[[a.name for a in conv.attribute].index("pads")])
    ) == [2, 2, 4, 1]


@pytest.mark.parametrize(
    "kwargs,code",
    [
        ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "mode": "reflect"}, "pad-mode"),
        ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "value": 1.0}, "nonzero-pad-value"),
        ({"pads": [1, 0, 1, 1, 0, 0, 1, 1]}, "pads-non-spatial"),
    ],
)
def test_pad_conv_guards(kwargs, code, rng):
    out, report = run(pad_conv(rng, **kwargs))
    assert codes(report, "fuse-pad-conv") == [code]
    assert ops(out)["Pad"] == 1
    assert report.parity.ok


def test_calibration_range_refuses_fp16_fusion_that_could_overflow(rng):
    """Weights and bias fit fp16, but with the measured input range the fused accumulator
    (‖W'‖₁·max|x|) can exceed 65504: refused with precision-range and the numbers."""
    m = conv_bn(rng, dtype=np.float16, var=np.full(8, 1e-3), w_scale=20.0)
    x = {"x": (rng.standard_normal((1, 4, 8, 8)) * 40).astype(np.float16)}
    out, report = run(m, inputs=x, check=False, level=3)
    assert codes(report, "fuse-conv-bn") == ["precision-range"]
    remark = [r for r in report.remarks if r.rule == "fuse-conv-bn"][0]
    assert remark.args["worst"] > 65504 and remark.args["input_range"] > 0
    # Without calibration inputs nothing is assumed: at -O3 the fusion fires.
    out2, report2 = run(m, check=False, level=3)
    assert codes(report2, "fuse-conv-bn", "passed") == ["fired"]


def test_fp16_refold_is_decided_by_measured_error(rng):
    """Folding BN into fp16 weights re-rounds them: at -O2 the measured systematic error of the
    folded layer is worse than the unfused graph's here, so it is refused with the numbers
    (on a runtime that does not fold Conv+BN itself, unlike onnxruntime); -O3 folds."""
    m = conv_bn(rng, dtype=np.float16)
    out, report = run(m, target="tensorrt")
    assert codes(report, "fuse-conv-bn") == ["precision-refold"] and report.parity.ok
    remark = [r for r in report.remarks if r.rule == "fuse-conv-bn"][0]
    assert remark.args["folded_bias"] > remark.args["unfused_bias"]
    out3, report3 = run(m, level=3)
    assert ops(out3) == {"Conv": 1} and report3.parity.ok


# ---------------------------------------------------------- Conv [+ Z] + activation → FusedConv
def conv_act(rng, act="Relu", *, residual=None, dtype=np.float32, act_attrs=None, clip=None):
    """Conv → [Add(Z)] → activation; ``residual`` is Z's shape (None: no Add)."""
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inputs = [vi("x", ["n", 4, 8, 8], elem)]
    inits = [const("W", rng.standard_normal((8, 4, 3, 3)) * 0.3, dtype)]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv")]
    y = "c"
    if residual is not None:
        inputs.append(vi("z", residual, elem))
        nodes.append(helper.make_node("Add", ["z", "c"], ["a"], name="add"))
        y = "a"
    act_ins = [y]
    if clip is not None:
        inits += [const("lo", clip[0], dtype), const("hi", clip[1], dtype)]
        act_ins += ["lo", "hi"]
    nodes.append(helper.make_node(act, act_ins, ["y"], name="act", **(act_attrs or {})))
    return model(nodes, inputs, [vi("y", None, elem)], inits)


def fused_attr(out, name):
    node = next(n for n in out.graph.node if n.op_type == "FusedConv")
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


@pytest.mark.parametrize(
    "act, attrs, clip, params",
    [
        ("Relu", None, None, None),
        ("Sigmoid", None, None, None),
        ("LeakyRelu", {"alpha": 0.2}, None, [0.2]),
        ("HardSigmoid", None, None, [0.2, 0.5]),
        ("Clip", None, (0.0, 6.0), [0.0, 6.0]),
    ],
)
def test_conv_activation_becomes_fused_conv(act, attrs, clip, params, rng):
    out, report = assert_optimized(conv_act(rng, act, act_attrs=attrs, clip=clip))
    assert ops(out) == {"FusedConv": 1}
    assert fused_attr(out, "activation") == act.encode()
    got = fused_attr(out, "activation_params")
    assert (got is None and params is None) or got == pytest.approx(params)


def test_residual_add_becomes_z(rng):
    """ResNet's conv3 + identity → Relu: one FusedConv with the identity as Z (cuda)."""
    m = conv_act(rng, residual=["n", 8, 8, 8])
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    z = rng.standard_normal((2, 8, 8, 8)).astype(np.float32)
    out, _ = assert_optimized(m, target="cuda", inputs={"x": x, "z": z})
    assert ops(out) == {"FusedConv": 1}
    node = out.graph.node[0]
    assert list(node.input) == ["x", "W", "", "z"]


def test_residual_add_stays_for_onnxruntime_on_cpu(rng):
    """On cpu onnxruntime's NCHWc layout takes Conv + Add + Relu, not a FusedConv with Z."""
    out, report = run(conv_act(rng, residual=["n", 8, 8, 8]))
    assert codes(report, "fuse-conv-relu") == ["slower-on-target"]
    assert ops(out) == {"Conv": 1, "Add": 1, "Relu": 1} and report.parity.ok


def test_broadcast_residual_is_missed(rng):
    out, report = run(conv_act(rng, residual=[1, 8, 1, 1]))
    assert codes(report, "fuse-conv-relu") == ["shape-mismatch"]
    assert ops(out) == {"Conv": 1, "Add": 1, "Relu": 1} and report.parity.ok


def test_cuda_runs_only_relu_in_fused_conv(rng):
    out, report = run(conv_act(rng, "Sigmoid"), target="cuda", check=False)
    assert codes(report, "fuse-conv-sigmoid") == ["unsupported-activation"]
    out, _ = run(conv_act(rng, "Relu"), target="cuda", check=False)
    assert ops(out) == {"FusedConv": 1}


def test_fp16_on_cpu_fuses_inside_the_casts_its_conv_had(rng):
    """onnxruntime's cpu FusedConv is float only, like its Conv: a float16 Conv already runs
    inside casts to float (MobileNetV3-Large fp16: 0.87x the latency with Relu and HardSigmoid
    fused that way)."""
    out, report = run(conv_act(rng, dtype=np.float16))
    assert ops(out) == {"FusedConv": 1} and report.parity.ok
    assert not codes(report, "decompose-ms-fused-conv")  # it runs: nothing to decompose


def test_fp16_needs_a_fused_conv_kernel_where_nothing_casts_and_tensorrt_is_silent(
    rng, cpu_without_fp16_casts
):
    out, report = run(conv_act(rng, dtype=np.float16), target=cpu_without_fp16_casts, check=False)
    assert codes(report, "fuse-conv-relu") == ["no-kernel"]
    out, report = run(conv_act(rng), target="tensorrt", check=False)
    assert ops(out) == {"Conv": 1, "Relu": 1} and not codes(report, "fuse-conv-relu")


def test_conv_output_read_elsewhere_is_missed(rng):
    """EfficientNet's SiLU: the Conv output feeds the Sigmoid and the Mul."""
    m = conv_act(rng, "Sigmoid")
    m.graph.node.append(helper.make_node("Mul", ["c", "y"], ["silu"], name="mul"))
    m.graph.output[0].name = "silu"
    out, report = run(m)
    assert codes(report, "fuse-conv-sigmoid") == ["shared-intermediate"]
    assert report.parity.ok

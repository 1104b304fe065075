"""LayerNorm / RMSNorm fusion from their decomposed spellings, scale/bias folding, SkipLayerNorm."""

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import EXAMPLES, assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram
from graphopt.opt.rewrite.target import TARGETS
from graphopt.targets.profiles import CPU, CUDA

D = 8


def hist(m):
    return op_histogram(m.graph.node)


def attr(m, op, name):
    node = next(n for n in m.graph.node if n.op_type == op)
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def reduce_mean(inp, out, axes, opset, keepdims=None, prefix=""):
    """ReduceMean with axes as an attribute (opset < 18) or an input (opset ≥ 18)."""
    kw = {} if keepdims is None else {"keepdims": keepdims}
    if opset >= 18:
        name = f"{prefix}{out}_axes"
        return [helper.make_node("ReduceMean", [inp, name], [out], **kw)], [
            const(name, axes, np.int64)
        ]
    return [helper.make_node("ReduceMean", [inp], [out], axes=axes, **kw)], []


def layer_norm_nodes(
    x,
    y,
    *,
    opset=17,
    square="pow",
    div="div",
    axes=(-1,),
    eps=1e-5,
    gamma=None,
    beta=None,
    keepdims=None,
    dup_sub=False,
    prefix="",
    dtype=np.float32,
):
    """The decomposed LayerNorm: mean, Sub, Pow|Mul, mean, Add eps, Sqrt, Div|Reciprocal·Mul."""
    p = prefix
    nodes, inits = [], []
    n, i = reduce_mean(x, f"{p}mu", list(axes), opset, keepdims, p)
    nodes += n
    inits += i
    nodes.append(helper.make_node("Sub", [x, f"{p}mu"], [f"{p}d"]))
    d2 = f"{p}d"
    if dup_sub:
        nodes.append(helper.make_node("Sub", [x, f"{p}mu"], [f"{p}d_b"]))
        d2 = f"{p}d_b"
    if square == "pow":
        inits.append(const(f"{p}two", 2.0 if square == "pow" else 3.0, dtype))
        nodes.append(helper.make_node("Pow", [d2, f"{p}two"], [f"{p}sq"]))
    elif square == "cube":
        inits.append(const(f"{p}two", 3.0, dtype))
        nodes.append(helper.make_node("Pow", [d2, f"{p}two"], [f"{p}sq"]))
    else:
        nodes.append(helper.make_node("Mul", [d2, d2], [f"{p}sq"]))
    n, i = reduce_mean(f"{p}sq", f"{p}var", list(axes), opset, keepdims, p + "v")
    nodes += n
    inits += i
    if isinstance(eps, str):
        eps_name = eps
    else:
        eps_name = f"{p}eps"
        inits.append(const(eps_name, eps, dtype))
    nodes.append(helper.make_node("Add", [f"{p}var", eps_name], [f"{p}ve"]))
    if div == "pow":
        inits.append(const(f"{p}mhalf", -0.5, dtype))
        nodes.append(helper.make_node("Pow", [f"{p}ve", f"{p}mhalf"], [f"{p}r"]))
        nodes.append(helper.make_node("Mul", [f"{p}d", f"{p}r"], [f"{p}n"]))
    else:
        nodes.append(helper.make_node("Sqrt", [f"{p}ve"], [f"{p}sd"]))
        if div == "div":
            nodes.append(helper.make_node("Div", [f"{p}d", f"{p}sd"], [f"{p}n"]))
        else:
            nodes.append(helper.make_node("Reciprocal", [f"{p}sd"], [f"{p}r"]))
            nodes.append(helper.make_node("Mul", [f"{p}r", f"{p}d"], [f"{p}n"]))
    last = f"{p}n"
    if gamma is not None:
        g = gamma if isinstance(gamma, str) else f"{p}gamma"
        if not isinstance(gamma, str):
            inits.append(const(g, gamma, dtype))
        nodes.append(helper.make_node("Mul", [g, last], [f"{p}ng"]))
        last = f"{p}ng"
    if beta is not None:
        inits.append(const(f"{p}beta", beta, dtype))
        nodes.append(helper.make_node("Add", [last, f"{p}beta"], [y]))
    else:
        nodes.append(helper.make_node("Identity", [last], [y]))
    for node in nodes:
        node.name = f"{p}{node.op_type}_{node.output[0]}"
    return nodes, inits


def ln_model(*, opset=17, dtype=np.float32, shape=(2, 3, D), extra_inputs=(), **kw):
    rng = np.random.default_rng(0)
    kw.setdefault("gamma", rng.random(D) + 0.5)
    kw.setdefault("beta", rng.standard_normal(D))
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    nodes, inits = layer_norm_nodes("x", "y", opset=opset, dtype=dtype, **kw)
    inputs = [vi("x", list(shape), elem)] + [vi(n, s, elem) for n, s in extra_inputs]
    return model(nodes, inputs, [vi("y", None, elem)], inits, opset=opset)


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("div", ["div", "reciprocal", "pow"])
def test_layer_norm_spellings_fuse(opset, square, div):
    out, report = assert_optimized(ln_model(opset=opset, square=square, div=div, eps=1e-6))
    assert hist(out) == {"LayerNormalization": 1}
    assert attr(out, "LayerNormalization", "epsilon") == pytest.approx(1e-6)
    assert attr(out, "LayerNormalization", "axis") == -1
    assert len(out.graph.node[0].input) == 3  # gamma and beta folded in


def test_layer_norm_duplicated_sub_and_positive_axis():
    out, _ = assert_optimized(ln_model(dup_sub=True, axes=(2,)))
    assert hist(out) == {"LayerNormalization": 1}


def test_layer_norm_without_affine():
    out, _ = assert_optimized(ln_model(gamma=None, beta=None))
    assert hist(out) == {"LayerNormalization": 1}
    assert len(out.graph.node[0].input) == 2


def test_layer_norm_axes_not_last_is_missed():
    out, report = run(ln_model(axes=(1,)))
    assert codes(report, "fuse-layer-norm") == ["axes-not-last"]
    assert "LayerNormalization" not in hist(out)
    assert report.parity.ok


def test_layer_norm_keepdims_0_is_missed():
    """keepdims=0 changes what the Sub broadcasts against: not a LayerNorm (shape [D,D])."""
    out, report = run(ln_model(keepdims=0, shape=(D, D), gamma=None, beta=None))
    assert codes(report, "fuse-layer-norm") == ["keepdims"]


def test_layer_norm_pow_3_is_a_constant_mismatch():
    out, report = run(ln_model(square="cube"))
    assert codes(report, "fuse-layer-norm") == ["constant-mismatch"]


def test_layer_norm_eps_from_graph_input_is_missed():
    out, report = run(ln_model(eps="eps_in", extra_inputs=[("eps_in", [])]))
    assert codes(report, "fuse-layer-norm") == ["non-constant-param"]
    assert report.parity.ok


def test_layer_norm_per_channel_eps_is_missed():
    out, report = run(ln_model(eps=np.linspace(1e-5, 1e-3, D, dtype=np.float32)))
    assert codes(report, "fuse-layer-norm") == ["non-scalar-param"]
    assert "LayerNormalization" not in hist(out) and report.parity.ok


def test_layer_norm_gamma_from_graph_input_is_missed_by_the_fold():
    """The normalization fuses; the runtime gamma stays a Mul (with the reason)."""
    out, report = run(ln_model(gamma="g_in", beta=None, extra_inputs=[("g_in", [D])]))
    assert hist(out) == {"LayerNormalization": 1, "Mul": 1}
    assert codes(report, "fold-norm-scale") == ["non-constant-param"]
    assert report.parity.ok


def test_layer_norm_scale_not_along_last_axis_is_missed():
    out, report = run(ln_model(gamma=np.arange(1, 4, dtype=np.float32).reshape(3, 1), beta=None))
    assert codes(report, "fold-norm-scale") == ["not-last-axis"]
    assert report.parity.ok


def test_layer_norm_unknown_width_is_missed():
    out, report = run(ln_model(shape=("b", "s", "d"), gamma=None, beta=None))
    assert codes(report, "fuse-layer-norm") == ["unknown-shape"]


def test_layer_norm_opset_16_is_missed():
    out, report = run(ln_model(opset=16))
    assert codes(report, "fuse-layer-norm") == ["opset-too-old"]


def test_layer_norm_fp16_fuses_where_fp32_accumulation_is_declared():
    assert CPU.accumulates_fp32("LayerNormalization")
    out, report = run(ln_model(dtype=np.float16), check=False)
    assert hist(out) == {"LayerNormalization": 1}


def test_layer_norm_fp16_without_fp32_accumulation_is_missed(monkeypatch):
    tgt = dataclasses.replace(CPU, name="cpu-no-acc", fp32_accumulation={})
    monkeypatch.setitem(TARGETS, tgt.name, tgt)
    out, report = run(ln_model(dtype=np.float16), target=tgt.name, check=False)
    assert codes(report, "fuse-layer-norm") == ["precision-accumulation"]


def test_layer_norm_shared_intermediate_is_missed():
    m = ln_model()
    m.graph.output.append(vi("var", [2, 3, 1]))
    out, report = run(m)
    assert codes(report, "fuse-layer-norm") == ["shared-intermediate"]
    assert report.parity.ok


# ------------------------------------------------------------------------- RMSNorm
def rms_model(*, opset=23, div="div", square="pow", gamma=True, axes=(-1,)):
    rng = np.random.default_rng(0)
    nodes, inits = [], [const("eps", 1e-6)]
    if square == "pow":
        inits.append(const("two", 2.0))
        nodes.append(helper.make_node("Pow", ["x", "two"], ["sq"]))
    else:
        nodes.append(helper.make_node("Mul", ["x", "x"], ["sq"]))
    n, i = reduce_mean("sq", "ms", list(axes), opset)
    nodes += n + [helper.make_node("Add", ["ms", "eps"], ["mse"])]
    inits += i
    if div == "div":
        nodes += [
            helper.make_node("Sqrt", ["mse"], ["rms"]),
            helper.make_node("Div", ["x", "rms"], ["n"]),
        ]
    elif div == "one-over":
        inits.append(const("one", 1.0))
        nodes += [
            helper.make_node("Sqrt", ["mse"], ["rms"]),
            helper.make_node("Div", ["one", "rms"], ["r"]),
            helper.make_node("Mul", ["x", "r"], ["n"]),
        ]
    else:
        inits.append(const("mhalf", -0.5))
        nodes += [
            helper.make_node("Pow", ["mse", "mhalf"], ["r"]),
            helper.make_node("Mul", ["r", "x"], ["n"]),
        ]
    if gamma:
        inits.append(const("w", rng.random(D) + 0.5))
        nodes.append(helper.make_node("Mul", ["n", "w"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["n"], ["y"]))
    return model(
        nodes,
        [vi("x", [2, 3, D])],
        [vi("y", None)],
        inits,
        opset=opset,
        ir_version=10 if opset >= 23 else 8,
    )


@pytest.mark.parametrize("div", ["div", "one-over", "rsqrt"])
@pytest.mark.parametrize("square", ["pow", "mul"])
def test_rms_norm_fuses_at_opset_23(div, square):
    out, report = assert_optimized(rms_model(div=div, square=square))
    assert hist(out) == {"RMSNormalization": 1}
    assert attr(out, "RMSNormalization", "epsilon") == pytest.approx(1e-6)


def test_rms_norm_before_opset_23_says_how_to_upgrade():
    """onnxruntime registers SimplifiedLayerNormalization only in the ONNX domain (invalid ONNX),
    so before opset 23 there is no kernel; the remark names the --opset that has one."""
    out, report = run(rms_model(opset=18))
    assert codes(report, "fuse-rms-norm") == ["opset-too-old"]
    (r,) = [r for r in report.remarks if r.rule == "fuse-rms-norm"]
    assert r.args["needs"] == 23 and "--opset 23" in r.message
    assert report.parity.ok


def test_rms_norm_fuses_after_an_opset_upgrade():
    m = rms_model(opset=18)
    out, report = assert_optimized(m, opset=23)
    assert hist(out) == {"RMSNormalization": 1}
    assert next(i.version for i in out.opset_import if i.domain == "") == 23
    assert next(i.version for i in m.opset_import if i.domain == "") == 18  # input untouched
    assert [r.code for r in report.remarks if r.rule == "upgrade-opset"] == ["opset-upgraded"]


def test_rms_norm_axes_not_last_is_missed():
    out, report = run(rms_model(axes=(1,)))
    assert codes(report, "fuse-rms-norm") == ["axes-not-last"]


# -------------------------------------------------------------------- SkipLayerNorm
def skip_ln(*, residual_used=True, a_shape=(2, 5, D), s_shape=(2, 5, D), gamma_input=False):
    rng = np.random.default_rng(0)
    inits = [const("beta", rng.standard_normal(D))]
    inputs = [vi("a", list(a_shape)), vi("s", list(s_shape))]
    if gamma_input:
        inputs.append(vi("gamma", [D]))
    else:
        inits.append(const("gamma", rng.random(D) + 0.5))
    nodes = [
        helper.make_node("Add", ["a", "s"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], epsilon=1e-12),
    ]
    outputs = [vi("y", None)]
    if residual_used:
        nodes.append(helper.make_node("Add", ["sum", "y"], ["z"]))
        outputs.append(vi("z", None))
    return model(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("residual_used", [False, True])
def test_skip_layer_norm_on_cuda(residual_used):
    out, report = assert_optimized(skip_ln(residual_used=residual_used), target="cuda")
    expected = {"com.microsoft.SkipLayerNormalization": 1}
    if residual_used:
        expected["Add"] = 1
        node = next(n for n in out.graph.node if n.op_type == "SkipLayerNormalization")
        assert node.output[1] == node.output[2] == "" and node.output[3]
    assert hist(out) == expected


def test_skip_layer_norm_refused_on_cpu_with_the_measurement():
    out, report = run(skip_ln())
    assert hist(out) == {"Add": 2, "LayerNormalization": 1}
    assert codes(report, "fuse-skip-layer-norm") == ["slower-on-target"]
    remark = next(r for r in report.remarks if r.rule == "fuse-skip-layer-norm")
    assert remark.args["measured"] == CPU.measured_slower["SkipLayerNormalization"]
    assert "ms" in remark.message and "slower" in remark.message
    assert "SkipLayerNormalization" not in CUDA.measured_slower


def test_skip_layer_norm_broadcast_input_is_missed():
    out, report = run(skip_ln(a_shape=(1, 5, D)), target="cuda")
    assert codes(report, "fuse-skip-layer-norm") == ["shape-mismatch"]
    assert report.parity.ok


def test_skip_layer_norm_non_constant_gamma_is_missed():
    out, report = run(skip_ln(gamma_input=True), target="cuda")
    assert codes(report, "fuse-skip-layer-norm") == ["non-constant-param"]


# ------------------------------------------------------------------- real models
def decompose_layer_norms(m: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite every LayerNormalization as exporters before opset 17 spelled it."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    del out.graph.node[:]
    inits = {t.name: t for t in m.graph.initializer}
    for k, node in enumerate(m.graph.node):
        if node.op_type != "LayerNormalization":
            out.graph.node.append(node)
            continue
        eps = next(
            (helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"), 1e-5
        )
        nodes, new_inits = layer_norm_nodes(
            node.input[0],
            node.output[0],
            eps=eps,
            gamma=numpy_helper.to_array(inits[node.input[1]]),
            beta=numpy_helper.to_array(inits[node.input[2]]),
            prefix=f"ln{k}_",
            square="pow" if k % 2 else "mul",
            div="div" if k % 3 else "pow",
        )
        out.graph.node.extend(nodes)
        out.graph.initializer.extend(new_inits)
    return out


def test_bert_tiny_layer_norms_decomposed_fuse_back():
    """bert_tiny's 5 LayerNorms (embeddings + 2 per layer), decomposed, all fuse back."""
    m = decompose_layer_norms(onnx.load(str(EXAMPLES / "bert_tiny.onnx")))
    assert "LayerNormalization" not in hist(m)
    out, report = run(m)
    assert hist(out)["LayerNormalization"] == 5
    fired = codes(report, "fuse-layer-norm", "passed") + codes(
        report, "fuse-layer-norm-rcp", "passed"
    )
    assert len(fired) == 5
    assert report.parity.ran and report.parity.ok


def test_bert_tiny_skip_layer_norm_counts():
    """cuda: the 4 residual LayerNorms become SkipLayerNorm; the embeddings' sum of three
    gathers cannot be proven same-shape; cpu refuses all 4 as slower."""
    out, report = run(str(EXAMPLES / "bert_tiny.onnx"), target="cuda")
    h = hist(out)
    assert h["com.microsoft.SkipLayerNormalization"] == 4 and h["LayerNormalization"] == 1
    assert report.parity.ok
    _, report = run(str(EXAMPLES / "bert_tiny.onnx"), target="cpu", check=False)
    assert codes(report, "fuse-skip-layer-norm").count("slower-on-target") == 4

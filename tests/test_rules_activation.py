"""GELU (erf, tanh), bias + GELU, QuickGelu/SiLU: every exporter spelling, each guard's code."""

import dataclasses
import math

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import EXAMPLES, assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram
from graphopt.opt.rewrite.target import TARGETS
from graphopt.targets.profiles import CPU, live_cpu_kernels

SQRT2 = math.sqrt(2.0)
D = 8


def hist(m):
    return op_histogram(m.graph.node)


def attr(m, op, name):
    node = next(n for n in m.graph.node if n.op_type == op)
    value = next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)
    return value.decode() if isinstance(value, bytes) else value


def erf_gelu(
    form="div",
    half="end",
    swap=False,
    *,
    div=SQRT2,
    half_value=0.5,
    bias=False,
    dtype=np.float32,
    opset=17,
    half_shape=(),
):
    """x·0.5·(1+erf(x/√2)) as exporters write it: ``half`` is where the 0.5 multiply sits."""
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    rng = np.random.default_rng(0)
    inits = [const("one", 1.0, dtype), const("half", np.full(half_shape, half_value), dtype)]
    nodes = []
    x = "x"
    if bias:
        inits += [
            const("W", rng.standard_normal((D, D)), dtype),
            const("b", rng.standard_normal(D), dtype),
        ]
        nodes += [
            helper.make_node("MatMul", ["x", "W"], ["mm"]),
            helper.make_node("Add", ["mm", "b"], ["xb"]),
        ]
        x = "xb"
    if form == "div":
        inits.append(const("c", div, dtype))
        nodes.append(helper.make_node("Div", [x, "c"], ["s"]))
    else:
        inits.append(const("c", 1.0 / div, dtype))
        nodes.append(helper.make_node("Mul", ["c", x] if swap else [x, "c"], ["s"]))
    nodes += [
        helper.make_node("Erf", ["s"], ["e"]),
        helper.make_node("Add", ["one", "e"] if swap else ["e", "one"], ["p"]),
    ]
    pair = (lambda a, b: [b, a]) if swap else (lambda a, b: [a, b])
    if half == "end":  # (x·(1+erf))·0.5
        nodes += [
            helper.make_node("Mul", pair(x, "p"), ["xp"]),
            helper.make_node("Mul", pair("xp", "half"), ["y"]),
        ]
    elif half == "x":  # (x·0.5)·(1+erf)
        nodes += [
            helper.make_node("Mul", pair(x, "half"), ["xh"]),
            helper.make_node("Mul", pair("xh", "p"), ["y"]),
        ]
    else:  # x·((1+erf)·0.5)
        nodes += [
            helper.make_node("Mul", pair("p", "half"), ["ph"]),
            helper.make_node("Mul", pair(x, "ph"), ["y"]),
        ]
    return model(nodes, [vi("x", [2, "s", D], elem)], [vi("y", None, elem)], inits, opset=opset)


def tanh_gelu(cube="pow", half="x", *, cubic=0.044715, bias=False, swap=False):
    rng = np.random.default_rng(0)
    inits = [
        const("one", 1.0),
        const("half", 0.5),
        const("k", math.sqrt(2 / math.pi)),
        const("a", cubic),
        const("three", 3.0),
    ]
    nodes = []
    x = "x"
    if bias:
        inits += [const("W", rng.standard_normal((D, D))), const("b", rng.standard_normal(D))]
        nodes += [
            helper.make_node("MatMul", ["x", "W"], ["mm"]),
            helper.make_node("Add", ["b", "mm"], ["xb"]),
        ]
        x = "xb"
    if cube == "pow":
        nodes.append(helper.make_node("Pow", [x, "three"], ["x3"]))
    else:
        nodes += [
            helper.make_node("Mul", [x, x], ["x2"]),
            helper.make_node("Mul", ["x2", x] if swap else [x, "x2"], ["x3"]),
        ]
    nodes += [
        helper.make_node("Mul", ["a", "x3"] if swap else ["x3", "a"], ["ax3"]),
        helper.make_node("Add", ["ax3", x] if swap else [x, "ax3"], ["inner"]),
        helper.make_node("Mul", ["inner", "k"], ["targ"]),
        helper.make_node("Tanh", ["targ"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["p"]),
    ]
    if half == "x":  # GPT-2: (x·0.5)·(1+tanh)
        nodes += [
            helper.make_node("Mul", [x, "half"], ["xh"]),
            helper.make_node("Mul", ["xh", "p"], ["y"]),
        ]
    else:  # TF: (x·(1+tanh))·0.5
        nodes += [
            helper.make_node("Mul", [x, "p"], ["xp"]),
            helper.make_node("Mul", ["xp", "half"], ["y"]),
        ]
    return model(nodes, [vi("x", [2, "s", D])], [vi("y", None)], inits)


@pytest.mark.parametrize("form", ["div", "mul"])
@pytest.mark.parametrize("half", ["end", "x", "inner"])
@pytest.mark.parametrize("swap", [False, True])
def test_erf_gelu_spellings_fuse(form, half, swap):
    out, report = assert_optimized(erf_gelu(form, half, swap))
    assert hist(out) == {"com.microsoft.Gelu": 1}
    assert codes(report, "fuse-gelu-erf", "passed") == ["fired"]


def test_bias_gelu():
    out, report = assert_optimized(erf_gelu(bias=True))
    assert hist(out) == {"MatMul": 1, "com.microsoft.BiasGelu": 1}
    assert codes(report, "fuse-bias-gelu", "passed") == ["fired"]


def test_erf_gelu_constant_mismatch_reports_the_value():
    out, report = run(erf_gelu(div=1.5))
    assert hist(out)["Erf"] == 1
    assert codes(report, "fuse-gelu-erf") == ["constant-mismatch"]
    remark = next(r for r in report.remarks if r.rule == "fuse-gelu-erf")
    assert remark.args["seen"] == pytest.approx(1.5) and "1.5" in remark.message
    assert report.parity.ok


def test_erf_gelu_within_tolerance_fuses():
    """1e-4 relative: an exporter's rounded √2 (1.4142) is accepted."""
    out, _ = run(erf_gelu(div=1.4142))
    assert hist(out) == {"com.microsoft.Gelu": 1}


def test_erf_gelu_non_scalar_half_is_missed():
    out, report = run(erf_gelu(half_shape=(D,)))
    assert codes(report, "fuse-gelu-erf") == ["non-scalar-param"]
    assert "Erf" in hist(out)


def test_erf_gelu_shared_intermediate_is_missed():
    m = erf_gelu()
    m.graph.output.append(vi("e", [2, 3, D]))
    out, report = run(m)
    assert codes(report, "fuse-gelu-erf") == ["shared-intermediate"]
    assert report.parity.ok


def test_gelu_fp16_on_cpu_runs_inside_the_casts_the_erf_had():
    """onnxruntime's cpu Gelu is float only, like its Erf: a float16 Erf already runs inside
    casts to float, so the fused Gelu takes its place there."""
    out, report = assert_optimized(erf_gelu(dtype=np.float16))
    assert hist(out) == {"com.microsoft.Gelu": 1}


def test_gelu_fp16_needs_a_float16_kernel_where_nothing_casts(cpu_without_fp16_casts):
    out, report = run(erf_gelu(dtype=np.float16), target=cpu_without_fp16_casts, check=False)
    assert codes(report, "fuse-gelu-erf") == ["no-kernel"]
    msg = next(r.message for r in report.remarks if r.rule == "fuse-gelu-erf")
    assert "tensor(float16)" in msg


@pytest.fixture
def standard_only(monkeypatch):
    """A cpu-like target without contrib (com.microsoft) kernels."""
    tgt = dataclasses.replace(
        CPU,
        name="cpu-standard-ops",
        load_kernels=lambda: {k: v for k, v in live_cpu_kernels().items() if k[1] == ""},
    )
    monkeypatch.setitem(TARGETS, tgt.name, tgt)
    return tgt.name


def test_gelu_lowers_to_standard_op_at_opset_20(standard_only):
    out, _ = assert_optimized(erf_gelu(opset=20), target=standard_only)
    assert hist(out) == {"Gelu": 1}
    assert attr(out, "Gelu", "approximate") == "none"


def test_gelu_without_contrib_before_opset_20_is_missed(standard_only):
    """The target's only GELU kernel is the opset-20 op: the remark says to upgrade."""
    out, report = run(erf_gelu(opset=17), target=standard_only)
    assert codes(report, "fuse-gelu-erf") == ["opset-too-old"]
    assert "Erf" in hist(out)
    out, report = run(erf_gelu(opset=17), target=standard_only, opset=20)
    assert hist(out) == {"Gelu": 1} and report.parity.ok


def test_tanh_gelu_standard_lowering(standard_only):
    m = tanh_gelu()
    m.opset_import[0].version = 20
    out, _ = assert_optimized(m, target=standard_only)
    assert hist(out) == {"Gelu": 1}
    assert attr(out, "Gelu", "approximate") == "tanh"


@pytest.mark.parametrize("cube", ["pow", "mul"])
@pytest.mark.parametrize("half", ["x", "end"])
@pytest.mark.parametrize("swap", [False, True])
def test_tanh_gelu_spellings_fuse(cube, half, swap):
    out, report = assert_optimized(tanh_gelu(cube, half, swap=swap))
    assert hist(out) == {"com.microsoft.FastGelu": 1}


def test_tanh_gelu_with_bias():
    out, report = assert_optimized(tanh_gelu(bias=True))
    assert hist(out) == {"MatMul": 1, "com.microsoft.FastGelu": 1}
    node = next(n for n in out.graph.node if n.op_type == "FastGelu")
    assert len(node.input) == 2
    assert codes(report, "fuse-bias-fastgelu", "passed") == ["fired"]


def test_tanh_gelu_constant_mismatch():
    out, report = run(tanh_gelu(cubic=0.05))
    assert codes(report, "fuse-gelu-tanh") == ["constant-mismatch"]
    assert next(r for r in report.remarks if r.rule == "fuse-gelu-tanh").args["seen"] == (
        pytest.approx(0.05)
    )


def test_bias_gelu_non_vector_bias_is_missed():
    """A [3, D] bias varies along the sequence axis: Gelu fuses, the bias stays an Add."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Add", ["x", "b"], ["xb"]),
        helper.make_node("Gelu", ["xb"], ["y"], domain="com.microsoft"),
    ]
    g = helper.make_graph(
        nodes,
        "t",
        [vi("x", [2, 3, D])],
        [vi("y", [2, 3, D])],
        [const("b", rng.standard_normal((3, D)))],
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    m.ir_version = 8
    out, report = run(m)
    assert codes(report, "fuse-bias-gelu") == ["bias-shape"]
    assert hist(out) == {"Add": 1, "com.microsoft.Gelu": 1}
    assert report.parity.ok


def quick_gelu(alpha=1.702, swap=False):
    inits = [] if alpha is None else [const("alpha", alpha)]
    nodes = []
    arg = "x"
    if alpha is not None:
        nodes.append(helper.make_node("Mul", ["alpha", "x"] if swap else ["x", "alpha"], ["ax"]))
        arg = "ax"
    nodes += [
        helper.make_node("Sigmoid", [arg], ["s"]),
        helper.make_node("Mul", ["s", "x"] if swap else ["x", "s"], ["y"]),
    ]
    return model(nodes, [vi("x", [2, 3, D])], [vi("y", None)], inits)


@pytest.mark.parametrize("swap", [False, True])
def test_quick_gelu(swap):
    out, _ = assert_optimized(quick_gelu(swap=swap))
    assert hist(out) == {"com.microsoft.QuickGelu": 1}
    assert attr(out, "QuickGelu", "alpha") == pytest.approx(1.702)


def test_quick_gelu_fp16_on_cpu_runs_inside_the_casts_the_sigmoid_had():
    nodes = [
        helper.make_node("Mul", ["x", "alpha"], ["ax"]),
        helper.make_node("Sigmoid", ["ax"], ["s"]),
        helper.make_node("Mul", ["x", "s"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [2, 3, D], TensorProto.FLOAT16)],
        [vi("y", None, TensorProto.FLOAT16)],
        [const("alpha", 1.702, np.float16)],
    )
    out, _ = assert_optimized(m)
    assert hist(out) == {"com.microsoft.QuickGelu": 1}


def test_silu_is_quick_gelu_alpha_1():
    out, _ = assert_optimized(quick_gelu(alpha=None))
    assert hist(out) == {"com.microsoft.QuickGelu": 1}
    assert attr(out, "QuickGelu", "alpha") == 1.0


def test_quick_gelu_non_scalar_alpha_is_missed():
    out, report = run(quick_gelu(alpha=np.linspace(1, 2, D)))
    assert codes(report, "fuse-quick-gelu") == ["non-scalar-param"]
    assert report.parity.ok


def test_bert_tiny_gelu_count_and_parity():
    out, report = run(str(EXAMPLES / "bert_tiny.onnx"))
    h = hist(out)
    assert h["com.microsoft.BiasGelu"] == 2 and "Erf" not in h  # one per layer, 2 layers
    assert codes(report, "fuse-gelu-erf", "passed") == ["fired"] * 2
    assert report.parity.ran and report.parity.ok


# ----------------------------------------------------------------- HardSwish, Mish
def hard_swish(form, opset=14):
    """The spellings of x·clip(x/6 + ½, 0, 1): Paddle's HardSigmoid gate, PyTorch's Clip ones."""
    inits = [const("three", 3.0), const("zero", 0.0), const("six", 6.0), const("sixth", 1 / 6)]
    clip = [
        helper.make_node("Add", ["x", "three"], ["x3"]),
        helper.make_node("Clip", ["x3", "zero", "six"], ["c"]),
    ]
    nodes = {
        "hardsigmoid": [
            helper.make_node("HardSigmoid", ["x"], ["g"], alpha=1 / 6, beta=0.5),
            helper.make_node("Mul", ["x", "g"], ["y"]),
        ],
        "clip-div": clip
        + [
            helper.make_node("Mul", ["x", "c"], ["p"]),
            helper.make_node("Div", ["p", "six"], ["y"]),
        ],
        "clip-mul": clip
        + [
            helper.make_node("Mul", ["c", "x"], ["p"]),
            helper.make_node("Mul", ["p", "sixth"], ["y"]),
        ],
        "gate-div": clip
        + [
            helper.make_node("Div", ["c", "six"], ["g"]),
            helper.make_node("Mul", ["g", "x"], ["y"]),
        ],
    }[form]
    return model(nodes, [vi("x", ["n", D])], [vi("y", ["n", D])], inits, opset=opset)


@pytest.mark.parametrize("form", ["hardsigmoid", "clip-div", "clip-mul", "gate-div"])
def test_hard_swish_spellings_fuse(form):
    """On cuda, whose kernel table has HardSwish (parity runs the result on onnxruntime's cpu,
    which expands the op's function body)."""
    x = np.linspace(-5, 5, 4 * D, dtype=np.float32).reshape(4, D)  # both clip edges
    out, _ = assert_optimized(hard_swish(form), inputs={"x": x}, target="cuda")
    assert hist(out) == {"HardSwish": 1}


def test_hard_swish_on_cpu_has_no_kernel():
    """onnxruntime's cpu provider has no HardSwish kernel: it would run the op's function body,
    HardSigmoid + Mul, which is what Paddle wrote."""
    out, report = run(hard_swish("hardsigmoid"))
    assert codes(report, "fuse-hard-swish") == ["no-kernel"]


def test_hard_swish_before_opset_14_names_the_upgrade():
    out, report = run(hard_swish("hardsigmoid", opset=11), target="cuda")
    assert codes(report, "fuse-hard-swish") == ["opset-too-old"]
    assert hist(out) == {"HardSigmoid": 1, "Mul": 1}
    out, report = run(hard_swish("hardsigmoid", opset=11), target="cuda", opset=14)
    assert hist(out) == {"HardSwish": 1} and report.parity.ok


def test_hard_sigmoid_gate_with_other_constants_is_left_alone():
    m = hard_swish("hardsigmoid")
    m.graph.node[0].attribute[0].f = 0.2  # plain HardSigmoid(α=0.2): a squeeze-excite gate
    out, report = run(m, target="cuda")
    assert "HardSwish" not in hist(out) and not codes(report, "fuse-hard-swish")


@pytest.mark.parametrize("softplus", ["op", "log-exp"])
def test_mish_fuses(softplus):
    inits = [const("one", 1.0)]
    sp = (
        [helper.make_node("Softplus", ["x"], ["s"])]
        if softplus == "op"
        else [
            helper.make_node("Exp", ["x"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["e1"]),
            helper.make_node("Log", ["e1"], ["s"]),
        ]
    )
    nodes = sp + [
        helper.make_node("Tanh", ["s"], ["t"]),
        helper.make_node("Mul", ["x", "t"], ["y"]),
    ]
    m = model(nodes, [vi("x", ["n", D])], [vi("y", ["n", D])], inits, 18)
    out, _ = assert_optimized(m, target="tensorrt")  # the target whose table has Mish
    assert hist(out) == {"Mish": 1}
    out, report = run(m)
    assert codes(report, "fuse-mish") == ["no-kernel"]  # onnxruntime cpu: none

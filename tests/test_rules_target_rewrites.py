"""Target rewrites (rules/target_rewrites.py): positive cases with parity and idempotence, one
negative case per guard code, and the data-driven choice (prefers / lacks), never a target name."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphopt
from conftest import EXAMPLES, assert_optimized, codes, const, model, ops, run, vi
from graphopt.opt.rewrite import target as target_mod
from graphopt.opt.rewrite.target import get_target, register_target
from graphopt.rules.target_rewrites import _Sym, resolve_reshape, tanh_gelu_error
from graphopt.targets.profiles import live_cpu_kernels

MS = "com.microsoft"


# ----------------------------------------------------------------------- test targets
@pytest.fixture
def make_target():
    """Register a variant of the cpu profile for one test (kernels removed, other prefers)."""
    made = []

    def make(name, *, drop=(), prefers=None, approximations=frozenset()):
        base = get_target("cpu")

        def kernels():
            return {k: v for k, v in live_cpu_kernels().items() if k[0] not in drop}

        t = dataclasses.replace(
            base,
            name=name,
            load_kernels=kernels,
            prefers=dict(base.prefers if prefers is None else prefers),
            approximations=frozenset(approximations),
        )
        register_target(t)
        made.append(name)
        return name

    yield make
    for name in made:
        target_mod.TARGETS.pop(name, None)
        target_mod._CACHE.pop(name, None)


# ------------------------------------------------------------------------ PixelShuffle
def pixel_shuffle(
    mode="CRD",
    *,
    n=1,
    c=4,
    h=5,
    w=6,
    r=2,
    s1=None,
    s2=None,
    perm=None,
    batch=None,
    opset=17,
    share=False,
):
    first = (n, c, r, r, h, w) if mode == "CRD" else (n, r, r, c, h, w)
    perm = perm or ((0, 1, 4, 2, 5, 3) if mode == "CRD" else (0, 3, 4, 1, 5, 2))
    s1 = first if s1 is None else s1
    s2 = (n, c, h * r, w * r) if s2 is None else s2
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["f"], name="conv"),
        helper.make_node("Reshape", ["f", "s1"], ["a"], name="ps/reshape"),
        helper.make_node("Transpose", ["a"], ["t"], perm=list(perm), name="ps/transpose"),
        helper.make_node("Reshape", ["t", "s2"], ["y"], name="ps/reshape_1"),
    ]
    outputs = [vi("y", None)]
    if share:
        nodes.append(helper.make_node("Relu", ["t"], ["z"], name="other"))
        outputs.append(vi("z", None))
    rng = np.random.default_rng(0)
    inits = [
        const("W", rng.standard_normal((c * r * r, 3, 1, 1))),
        const("s1", s1, np.int64),
        const("s2", s2, np.int64),
    ]
    x_shape = [batch if batch else n, 3, h, w]
    return model(nodes, [vi("x", x_shape)], outputs, inits, opset=opset)


@pytest.mark.parametrize("mode", ["CRD", "DCR"])
@pytest.mark.parametrize("target", ["npu", "cpu", "tensorrt"])
def test_pixel_shuffle_becomes_depth_to_space(mode, target):
    m = pixel_shuffle(mode)
    out, report = assert_optimized(m, target=target)
    assert ops(out) == {"Conv": 1, "DepthToSpace": 1}
    d2s = next(n for n in out.graph.node if n.op_type == "DepthToSpace")
    attrs = {a.name: helper.get_attribute_value(a) for a in d2s.attribute}
    assert attrs == {"blocksize": 2, "mode": mode.encode()}
    assert codes(report, "pixel-shuffle-to-depth-to-space", "passed") == ["fired"]
    assert report.legal


@pytest.mark.parametrize("mode", ["CRD", "DCR"])
@pytest.mark.parametrize("first_dim", [-1, 0])
def test_pixel_shuffle_with_dynamic_batch(mode, first_dim):
    """The exporter writes -1 (or 0, copy) for the batch: resolved symbolically."""
    r, c, h, w = 3, 2, 4, 5
    s1 = (first_dim, c, r, r, h, w) if mode == "CRD" else (first_dim, r, r, c, h, w)
    m = pixel_shuffle(mode, c=c, h=h, w=w, r=r, s1=s1, s2=(first_dim, c, h * r, w * r), batch="N")
    out, _ = assert_optimized(m, target="cpu", shapes={"x": [2, 3, h, w]})
    assert ops(out) == {"Conv": 1, "DepthToSpace": 1}


def test_pixel_shuffle_perm_mismatch():
    m = pixel_shuffle("CRD", perm=(0, 1, 4, 2, 3, 5), s2=(1, 4, 5 * 2, 2 * 6))
    out, report = run(m, target="npu")
    assert "DepthToSpace" not in ops(out)
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["perm-mismatch"]


def test_pixel_shuffle_first_reshape_must_split_channels_only():
    """(N, C, r, r, W, H): H and W swapped by the first Reshape is not a pixel shuffle."""
    m = pixel_shuffle("CRD", c=4, r=2, s1=(1, 4, 2, 2, 6, 5))
    out, report = run(m, target="npu")
    assert "DepthToSpace" not in ops(out)
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["shape-mismatch"]


def test_pixel_shuffle_wrong_final_shape():
    m = pixel_shuffle("CRD", s2=(1, 4, 12, 10))  # (H·r, W·r) swapped to the wrong sizes
    out, report = run(m, target="npu")
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["shape-mismatch"]


def test_pixel_shuffle_literal_batch_needs_static_batch():
    """A literal 1 where the input's batch is symbolic is not provably the same dim."""
    out, report = run(pixel_shuffle("CRD", batch="N"), target="cpu", shapes={"x": [1, 3, 5, 6]})
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["shape-mismatch"]
    out, report = run(pixel_shuffle("CRD"), target="cpu")
    assert "DepthToSpace" in ops(out)


def test_pixel_shuffle_non_square_block():
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["f"], name="conv"),
        helper.make_node("Reshape", ["f", "s1"], ["a"], name="ps/reshape"),
        helper.make_node("Transpose", ["a"], ["t"], perm=[0, 1, 4, 2, 5, 3], name="ps/t"),
        helper.make_node("Reshape", ["t", "s2"], ["y"], name="ps/reshape_1"),
    ]
    inits = [
        const("W", rng.standard_normal((12, 3, 1, 1))),
        const("s1", (1, 2, 2, 3, 5, 6), np.int64),
        const("s2", (1, 2, 10, 18), np.int64),
    ]
    m = model(nodes, [vi("x", [1, 3, 5, 6])], [vi("y", None)], inits)
    out, report = run(m, target="npu")
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["non-square-block"]
    assert report.parity.ok


def test_pixel_shuffle_non_constant_shape():
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["a"], name="r1"),
        helper.make_node("Transpose", ["a"], ["t"], perm=[0, 1, 4, 2, 5, 3], name="t"),
        helper.make_node("Reshape", ["t", "s2"], ["y"], name="r2"),
    ]
    m = model(
        nodes,
        [vi("x", [1, 8, 3, 3]), vi("s1", [6], TensorProto.INT64)],
        [vi("y", None)],
        [const("s2", (1, 2, 6, 6), np.int64)],
    )
    _, report = run(m, target="npu", check=False)
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["non-constant-shape"]


def test_pixel_shuffle_unknown_shape():
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["a"], name="r1"),
        helper.make_node("Transpose", ["a"], ["t"], perm=[0, 1, 4, 2, 5, 3], name="t"),
        helper.make_node("Reshape", ["t", "s2"], ["y"], name="r2"),
    ]
    inits = [const("s1", (1, 2, 2, 2, 3, 3), np.int64), const("s2", (1, 2, 6, 6), np.int64)]
    m = model(nodes, [vi("x", [1, "C", "H", "W"])], [vi("y", None)], inits)
    _, report = run(m, target="cpu", shapes={"x": [1, 8, 3, 3]})
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["unknown-shape"]


def test_pixel_shuffle_shared_intermediate():
    out, report = run(pixel_shuffle("CRD", share=True), target="npu")
    assert "DepthToSpace" not in ops(out)
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["shared-intermediate"]


def test_pixel_shuffle_crd_needs_opset_11():
    out, report = run(pixel_shuffle("CRD", opset=10), target="cpu")
    assert "DepthToSpace" not in ops(out)
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["opset-too-old"]


def test_pixel_shuffle_no_kernel(make_target):
    name = make_target("t-prefers-d2s-lacks-it", drop=("DepthToSpace",))
    # The reverse rule also applies there (no kernel); a Transpose-less variant keeps it quiet.
    out, report = run(
        pixel_shuffle("CRD"),
        target=name,
        pipeline="simplify-shapes,pixel-shuffle-to-depth-to-space",
    )
    assert codes(report, "pixel-shuffle-to-depth-to-space") == ["no-kernel"]


def test_pixel_shuffle_silent_when_target_prefers_reshape(make_target):
    name = make_target("t-prefers-reshape", prefers={"pixel-shuffle": "reshape"})
    out, report = run(pixel_shuffle("CRD"), target=name)
    assert "DepthToSpace" not in ops(out)
    assert not [r for r in report.remarks if r.rule == "pixel-shuffle-to-depth-to-space"]


def test_resolve_reshape():
    n = _Sym("N")
    assert resolve_reshape([n, 8, 3, 3], [-1, 2, 2, 2, 3, 3], False) == [n, 2, 2, 2, 3, 3]
    assert resolve_reshape([n, 8, 3, 3], [0, 2, 2, 2, 3, 3], False) == [n, 2, 2, 2, 3, 3]
    assert resolve_reshape([n, 8, 3, 3], [0, 2, 2, 2, 3, 3], True) == [0, 2, 2, 2, 3, 3]
    assert resolve_reshape([2, 8, 3, 3], [2, -1], False) == [2, 72]
    assert resolve_reshape([n, 8, 3, 3], [1, -1], False) is None  # N·72: not exact
    assert resolve_reshape([2, 8, 3, 3], [-1, -1], False) is None


# ----------------------------------------------------------------- DepthToSpace reverse
def d2s_model(mode="DCR", *, c_out=3, r=2, h=4, w=5, x_shape=None):
    x_shape = x_shape or [1, c_out * r * r, h, w]
    nodes = [helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=r, mode=mode, name="d2s")]
    return model(nodes, [vi("x", x_shape)], [vi("y", None)])


@pytest.mark.parametrize("mode", ["CRD", "DCR"])
def test_depth_to_space_lowered_for_target_without_it(mode, make_target):
    name = make_target("t-no-d2s", drop=("DepthToSpace",))
    out, report = assert_optimized(d2s_model(mode), target=name)
    assert ops(out) == {"Reshape": 2, "Transpose": 1}
    assert codes(report, "depth-to-space-to-reshape", "passed") == ["fired"]
    assert report.legal


def test_depth_to_space_lowered_when_target_prefers_reshape(make_target):
    name = make_target("t-pref-reshape", prefers={"pixel-shuffle": "reshape"})
    out, _ = assert_optimized(d2s_model("CRD", r=3), target=name)
    assert ops(out) == {"Reshape": 2, "Transpose": 1}


def test_depth_to_space_kept_on_targets_that_have_it():
    for target in ("cpu", "cuda", "tensorrt", "npu"):
        out, report = run(d2s_model(), target=target)
        assert ops(out) == {"DepthToSpace": 1}, target
        assert not [r for r in report.remarks if r.rule == "depth-to-space-to-reshape"]


def test_depth_to_space_reverse_unknown_shape(make_target):
    name = make_target("t-no-d2s-2", drop=("DepthToSpace",))
    m = d2s_model(x_shape=[1, 12, "H", "W"])
    _, report = run(m, target=name, shapes={"x": [1, 12, 4, 5]})
    assert codes(report, "depth-to-space-to-reshape") == ["unknown-shape"]


def test_depth_to_space_reverse_no_kernel(make_target):
    name = make_target("t-no-d2s-no-transpose", drop=("DepthToSpace", "Transpose"))
    _, report = run(d2s_model(), target=name, check=False)
    assert codes(report, "depth-to-space-to-reshape") == ["no-kernel"]


def test_esrgan_example_on_npu_and_cpu():
    m = onnx.load(EXAMPLES / "esrgan_tiny.onnx")
    for target in ("npu", "cpu"):
        out, report = run(m, target=target, shapes={"input": [1, 3, 32, 32]})
        assert ops(out).get("DepthToSpace") == 1 and "Transpose" not in ops(out), target
        assert report.parity.ok and report.legal, target
    # npu pins the input to the parity shape: every tensor of the bundle is static
    dims = [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 32, 32] or target == "cpu"


# ---------------------------------------------------------------------------- GELU
def erf_gelu(*, divisor=None, opset=17, dtype=np.float32):
    divisor = np.sqrt(2.0) if divisor is None else divisor
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    nodes = [
        helper.make_node("Div", ["x", "sq"], ["d"], name="g/div"),
        helper.make_node("Erf", ["d"], ["e"], name="g/erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="g/add"),
        helper.make_node("Mul", ["x", "a"], ["m"], name="g/mul"),
        helper.make_node("Mul", ["m", "half"], ["y"], name="g/mul_1"),
    ]
    inits = [const("sq", divisor, dtype), const("one", 1.0, dtype), const("half", 0.5, dtype)]
    return model(nodes, [vi("x", [2, 64], elem)], [vi("y", None, elem)], inits, opset=opset)


def test_gelu_erf_refused_below_o3_on_a_target_without_erf():
    out, report = run(erf_gelu(), target="npu", level=2)
    assert ops(out).get("Erf") == 1
    assert codes(report, "gelu-erf-to-tanh") == ["numerics-changing"]
    failure = [r for r in report.remarks if r.kind == "failure" and r.args.get("op") == "Erf"]
    assert failure and failure[0].nodes == ("g/erf",)
    assert "gelu-erf-to-tanh" in failure[0].message and "-O3" in failure[0].message
    assert not report.legal


def test_gelu_erf_to_tanh_at_o3_reports_measured_error():
    out, report = assert_optimized(erf_gelu(), target="npu", level=3)
    assert "Erf" not in ops(out)
    assert ops(out) == {"Mul": 6, "Add": 2, "Tanh": 1}
    assert report.legal and report.parity.ok
    err = [r for r in report.remarks if r.code == "approximation-error"]
    assert len(err) == 1
    assert 1e-4 < err[0].args["max_abs_error"] < 1e-3  # the tanh form's known error (~4.7e-4)
    assert err[0].args["samples"] == 65536 and "seed 0" in err[0].args["inputs"]


def test_gelu_erf_to_tanh_allowed_below_o3_when_target_accepts_it(make_target):
    name = make_target("t-no-erf-approx", drop=("Erf", "Gelu"), approximations={"gelu-erf-to-tanh"})
    # the approximation misses the -O2 tolerance: parity would have the safety net revert it
    out, report = run(erf_gelu(), target=name, level=2, pipeline="gelu-erf-to-tanh", check=False)
    assert "Erf" not in ops(out) and "Tanh" in ops(out)


def test_gelu_erf_kept_where_erf_runs():
    for target in ("tensorrt",):
        out, report = run(erf_gelu(), target=target, level=3)
        assert ops(out).get("Erf") == 1
        assert not [r for r in report.remarks if r.rule == "gelu-erf-to-tanh"]


def test_gelu_erf_constant_mismatch():
    _, report = run(erf_gelu(divisor=1.5), target="npu", level=3)
    assert codes(report, "gelu-erf-to-tanh") == ["constant-mismatch"]


def test_gelu_erf_to_tanh_no_kernel(make_target):
    name = make_target("t-no-erf-no-tanh", drop=("Erf", "Tanh", "Gelu"))
    _, report = run(erf_gelu(), target=name, level=3, check=False, pipeline="gelu-erf-to-tanh")
    assert codes(report, "gelu-erf-to-tanh") == ["no-kernel"]


def test_tanh_gelu_error_is_measured_in_the_dtype():
    e32 = tanh_gelu_error("float32")
    e16 = tanh_gelu_error("float16")
    assert 3e-4 < e32["max_abs_error"] < 6e-4
    assert e16["erf_form_max_abs_error"] > e32["erf_form_max_abs_error"]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_decompose_gelu_op_on_target_without_it(approximate):
    nodes = [helper.make_node("Gelu", ["x"], ["y"], approximate=approximate, name="gelu")]
    m = model(nodes, [vi("x", [2, 16])], [vi("y", None)], opset=20)
    out, report = assert_optimized(m, target="npu", level=2)
    assert "Gelu" not in ops(out)
    if approximate == "tanh":  # exact decomposition: legal on the npu
        assert report.legal and ops(out) == {"Mul": 6, "Add": 2, "Tanh": 1}
    else:  # erf form: Erf is illegal on the npu at -O2
        assert ops(out).get("Erf") == 1 and not report.legal


# ------------------------------------------------------------ com.microsoft lowering
def ms_model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "ms", inputs, outputs, list(inits))
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    )
    m.ir_version = 8
    return m


def _node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, domain=MS, name=op.lower(), **attrs)


def contrib_cases(rng):
    f = lambda *s: rng.standard_normal(s)  # noqa: E731
    x = vi("x", [2, 3, 8])
    yield "Gelu", ms_model([_node("Gelu", ["x"], ["y"])], [x], [vi("y", [2, 3, 8])])
    yield (
        "BiasGelu",
        ms_model(
            [_node("BiasGelu", ["x", "b"], ["y"])], [x], [vi("y", [2, 3, 8])], [const("b", f(8))]
        ),
    )
    yield (
        "FastGelu",
        ms_model(
            [_node("FastGelu", ["x", "b"], ["y"])], [x], [vi("y", [2, 3, 8])], [const("b", f(8))]
        ),
    )
    yield "FastGelu-nobias", ms_model([_node("FastGelu", ["x"], ["y"])], [x], [vi("y", [2, 3, 8])])
    yield (
        "QuickGelu",
        ms_model([_node("QuickGelu", ["x"], ["y"], alpha=1.5)], [x], [vi("y", [2, 3, 8])]),
    )
    yield (
        "FusedMatMul",
        ms_model(
            [_node("FusedMatMul", ["x", "w"], ["y"], alpha=0.5, transB=1)],
            [x],
            [vi("y", [2, 3, 5])],
            [const("w", f(5, 8))],
        ),
    )
    yield (
        "FusedMatMul-transA",
        ms_model(
            [_node("FusedMatMul", ["x", "w"], ["y"], transA=1)],
            [x],
            [vi("y", [2, 8, 5])],
            [const("w", f(3, 5))],
        ),
    )
    yield (
        "TransposeMatMul",
        ms_model(
            [_node("TransposeMatMul", ["x", "w"], ["y"], transB=1)],
            [x],
            [vi("y", [2, 3, 5])],
            [const("w", f(5, 8))],
        ),
    )
    img = vi("img", [1, 4, 6, 6])
    yield (
        "FusedConv",
        ms_model(
            [_node("FusedConv", ["img", "W", "B"], ["y"], activation="Relu", pads=[1, 1, 1, 1])],
            [img],
            [vi("y", [1, 5, 6, 6])],
            [const("W", f(5, 4, 3, 3)), const("B", f(5))],
        ),
    )
    yield (
        "FusedConv-clip",
        ms_model(
            [
                _node(
                    "FusedConv",
                    ["img", "W"],
                    ["y"],
                    activation="Clip",
                    activation_params=[0.0, 6.0],
                )
            ],
            [img],
            [vi("y", [1, 5, 4, 4])],
            [const("W", f(5, 4, 3, 3))],
        ),
    )
    yield (
        "FusedGemm",
        ms_model(
            [
                _node(
                    "FusedGemm",
                    ["a", "w", "c"],
                    ["y"],
                    transB=1,
                    alpha=0.7,
                    activation="LeakyRelu",
                    activation_alpha=0.2,
                )
            ],
            [vi("a", [4, 8])],
            [vi("y", [4, 5])],
            [const("w", f(5, 8)), const("c", f(5))],
        ),
    )
    yield (
        "SkipLayerNormalization",
        ms_model(
            [
                _node(
                    "SkipLayerNormalization",
                    ["x", "s", "g", "be", "bi"],
                    ["y", "", "", "sum"],
                    epsilon=1e-5,
                )
            ],
            [x, vi("s", [2, 3, 8])],
            [vi("y", [2, 3, 8]), vi("sum", [2, 3, 8])],
            [const("g", f(8)), const("be", f(8)), const("bi", f(8))],
        ),
    )


CASES = [name for name, _ in contrib_cases(np.random.default_rng(0))]


@pytest.mark.parametrize("case", CASES)
def test_contrib_ops_lowered_to_standard_ops_for_tensorrt(case):
    m = dict(contrib_cases(np.random.default_rng(0)))[case]
    out, report = run(m, target="tensorrt")
    assert not [n for n in out.graph.node if n.domain == MS], ops(out)
    assert report.parity.ran and report.parity.ok, report.parity
    assert report.legal, [r.message for r in report.remarks if r.kind == "failure"]
    again, second = run(out, target="tensorrt")
    assert ops(again) == ops(out)
    assert [o.name for o in out.graph.output] == [o.name for o in m.graph.output]


@pytest.mark.parametrize("case", ["Gelu", "FusedConv", "SkipLayerNormalization"])
def test_contrib_ops_kept_where_the_target_runs_them(case):
    m = dict(contrib_cases(np.random.default_rng(0)))[case]
    out, report = run(m, target="cpu")
    assert [n.op_type for n in out.graph.node if n.domain == MS]
    assert report.legal


def test_fused_gemm_lowered_on_cuda_which_lacks_it():
    m = dict(contrib_cases(np.random.default_rng(0)))["FusedGemm"]
    out, report = run(m, target="cuda")
    assert ops(out) == {"Gemm": 1, "LeakyRelu": 1}


def test_bias_add_lowered():
    """onnxruntime's CPU provider has no BiasAdd: parity cannot run it; check by numpy."""
    rng = np.random.default_rng(0)
    x = vi("x", [2, 3, 8])
    m = ms_model(
        [_node("BiasAdd", ["x", "b", "s"], ["y"])],
        [x, vi("s", [2, 3, 8])],
        [vi("y", [2, 3, 8])],
        [const("b", rng.standard_normal(8))],
    )
    out, report = run(m, target="tensorrt", check=False)
    assert ops(out) == {"Add": 2}
    import onnxruntime as ort

    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    xv, sv = rng.standard_normal((2, 3, 8), "f"), rng.standard_normal((2, 3, 8), "f")
    b = onnx.numpy_helper.to_array(m.graph.initializer[0])
    np.testing.assert_allclose(sess.run(None, {"x": xv, "s": sv})[0], xv + b + sv, rtol=1e-6)


def test_fused_matmul_trans_batch_is_refused():
    m = ms_model(
        [_node("FusedMatMul", ["x", "w"], ["y"], transBatchA=1)],
        [vi("x", [2, 3, 8])],
        [vi("y", [3, 2, 5])],
        [const("w", np.ones((3, 5)))],
    )
    out, report = run(m, target="tensorrt", check=False)
    assert codes(report, "decompose-ms-fused-matmul") == ["unsupported-attribute"]
    assert not report.legal  # the contrib op stays and tensorrt cannot run it


def test_fused_matmul_unknown_rank():
    m = ms_model(
        [_node("FusedMatMul", ["x", "w"], ["y"], transA=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [vi("y", [8, 5])],
        [const("w", np.ones((3, 5)))],
    )
    _, report = graphopt.optimize(m, target="tensorrt", check=False)
    assert codes(report, "decompose-ms-fused-matmul") == ["unknown-rank"]


def test_fused_conv_unsupported_activation():
    m = ms_model(
        [_node("FusedConv", ["img", "W"], ["y"], activation="Softsign")],
        [vi("img", [1, 4, 6, 6])],
        [vi("y", [1, 5, 4, 4])],
        [const("W", np.ones((5, 4, 3, 3)))],
    )
    _, report = run(m, target="tensorrt", check=False)
    assert codes(report, "decompose-ms-fused-conv") == ["unsupported-activation"]


def test_skip_layernorm_extra_outputs_and_old_opset():
    rng = np.random.default_rng(0)
    inits = [const("g", rng.standard_normal(8)), const("be", rng.standard_normal(8))]
    ins = [vi("x", [2, 3, 8]), vi("s", [2, 3, 8])]
    m = ms_model(
        [_node("SkipLayerNormalization", ["x", "s", "g", "be"], ["y", "mean"])],
        ins,
        [vi("y", [2, 3, 8]), vi("mean", [2, 3, 1])],
        inits,
    )
    _, report = run(m, target="tensorrt", check=False)
    assert codes(report, "decompose-ms-skip-layernorm") == ["extra-outputs"]
    m = ms_model(
        [_node("SkipLayerNormalization", ["x", "s", "g", "be"], ["y"])],
        ins,
        [vi("y", [2, 3, 8])],
        inits,
        opset=16,
    )
    _, report = run(m, target="tensorrt", check=False)
    assert codes(report, "decompose-ms-skip-layernorm") == ["opset-too-old"]


def test_decomposition_needs_the_replacement_ops(make_target):
    name = make_target("t-no-sigmoid", drop=("QuickGelu", "Sigmoid"))
    m = dict(contrib_cases(np.random.default_rng(0)))["QuickGelu"]
    _, report = run(m, target=name, check=False)
    assert codes(report, "decompose-ms-quick-gelu") == ["no-kernel"]


def test_decomposition_needs_a_float_input():
    m = ms_model(
        [_node("Gelu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.INT32, [4])],
        [vi("y", [4], TensorProto.INT32)],
    )
    _, report = run(m, target="tensorrt", check=False)
    assert codes(report, "decompose-ms-gelu") == ["unknown-dtype"]


# ------------------------------------------------------------------------ Clip / Relu6
def min_max(outer="Min", lo=0.0, hi=6.0, *, vector=False, opset=17):
    inner = "Max" if outer == "Min" else "Min"
    c_in, c_out = (lo, hi) if outer == "Min" else (hi, lo)
    shape = (4,) if vector else ()
    nodes = [
        helper.make_node(inner, ["x", "a"], ["t"], name="inner"),
        helper.make_node(outer, ["t", "b"], ["y"], name="outer"),
    ]
    inits = [const("a", np.full(shape, c_in)), const("b", np.full(shape, c_out))]
    return model(nodes, [vi("x", [2, 4])], [vi("y", None)], inits, opset=opset)


@pytest.mark.parametrize("outer", ["Min", "Max"])
@pytest.mark.parametrize("opset", [10, 17])
def test_relu6_as_min_max_becomes_clip(outer, opset):
    # (the npu's table starts at opset 11: the opset-10 case runs on cpu, which also prefers Clip)
    target = "npu" if opset >= 11 else "cpu"
    out, report = assert_optimized(min_max(outer, opset=opset), target=target)
    assert ops(out) == {"Clip": 1}
    rule = "min-max-to-clip" if outer == "Min" else "max-min-to-clip"
    assert codes(report, rule, "passed") == ["fired"]


def test_min_max_bound_order():
    out, report = run(min_max("Min", lo=6.0, hi=0.0), target="npu")
    assert ops(out) == {"Max": 1, "Min": 1}
    assert codes(report, "min-max-to-clip") == ["bound-order"]


def test_min_max_non_scalar_bound():
    _, report = run(min_max("Min", vector=True), target="npu")
    assert codes(report, "min-max-to-clip") == ["non-scalar-bound"]


def test_min_max_no_clip_kernel(make_target):
    name = make_target("t-no-clip-pref-clip", drop=("Clip",))
    _, report = run(min_max("Min"), target=name, pipeline="min-max-to-clip")
    assert codes(report, "min-max-to-clip") == ["no-kernel"]


def clip(lo=0.0, hi=None, opset=17):
    ins, inits = ["x"], []
    if opset >= 11:
        ins.append("lo" if lo is not None else "")
        if lo is not None:
            inits.append(const("lo", lo))
        if hi is not None:
            ins.append("hi")
            inits.append(const("hi", hi))
        node = helper.make_node("Clip", ins, ["y"], name="clip")
    else:
        attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
        node = helper.make_node("Clip", ["x"], ["y"], name="clip", **attrs)
    return model([node], [vi("x", [2, 4])], [vi("y", None)], inits, opset=opset)


@pytest.mark.parametrize("opset", [10, 17])
def test_clip_at_zero_becomes_relu_where_preferred(opset):
    out, report = assert_optimized(clip(0.0, None, opset), target="cpu")
    assert ops(out) == {"Relu": 1}
    assert codes(report, "clip-to-relu", "passed") == ["fired"]
    out, _ = run(clip(0.0, None, opset), target="npu")  # npu does not prefer it: Clip stays
    assert ops(out) == {"Clip": 1}


def test_clip_with_upper_bound_is_not_relu():
    out, report = run(clip(0.0, 6.0), target="cpu")
    assert ops(out) == {"Clip": 1}
    assert not [r for r in report.remarks if r.rule == "clip-to-relu"]


@pytest.mark.parametrize("opset", [10, 17])
@pytest.mark.parametrize("bounds", [(0.0, 6.0), (None, 2.0), (-1.0, None)])
def test_clip_as_max_min_on_target_without_clip(bounds, opset, make_target):
    name = make_target(f"t-no-clip-{opset}", drop=("Clip",), prefers={})
    out, report = assert_optimized(clip(*bounds, opset=opset), target=name)
    want = {"Max": 1} if bounds[1] is None else {"Min": 1}
    if bounds[0] is not None and bounds[1] is not None:
        want = {"Max": 1, "Min": 1}
    assert ops(out) == want
    assert report.legal


def test_clip_as_max_min_no_kernel(make_target):
    name = make_target("t-no-clip-no-max", drop=("Clip", "Max"), prefers={})
    _, report = run(clip(0.0, 6.0), target=name, check=False)
    assert codes(report, "clip-to-min-max") == ["no-kernel"]


def test_gelu_erf_non_scalar_constant():
    m = erf_gelu()
    half = next(t for t in m.graph.initializer if t.name == "half")
    half.CopyFrom(onnx.numpy_helper.from_array(np.full((64,), 0.5, np.float32), "half"))
    _, report = run(m, target="npu", level=3)
    assert codes(report, "gelu-erf-to-tanh") == ["non-scalar-param"]


def test_min_max_bound_dtype_mismatch():
    """A bound of another dtype (an invalid model onnxruntime rejects): refused, not rewritten."""
    nodes = [
        helper.make_node("Max", ["x", "a"], ["t"], name="inner"),
        helper.make_node("Min", ["t", "b"], ["y"], name="outer"),
    ]
    g = helper.make_graph(
        nodes,
        "mm",
        [vi("x", [2, 4])],
        [vi("y", [2, 4])],
        [const("a", 0.0, np.float16), const("b", 6.0)],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    _, report = graphopt.optimize(m, target="npu", check=False)
    assert codes(report, "min-max-to-clip") == ["dtype-mismatch"]


def test_clip_at_zero_is_relu_not_max_where_both_lowerings_apply(make_target):
    """clip-to-relu and clip-to-min-max both root at Clip: the rules' priority, not their names
    or import order, picks one Relu over a Max."""
    name = make_target("t-no-clip-prefers-relu", drop=("Clip",), prefers={"clip-min-zero": "Relu"})
    out, report = assert_optimized(clip(0.0, None), target=name)
    assert ops(out) == {"Relu": 1}
    assert codes(report, "clip-to-relu", "passed") == ["fired"]

"""Kernel code generation (targets/codegen): expression grammar, C/CUDA source, the custom-op
library in onnxruntime (parity, shape errors, ABI indexes), injection safety."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.targets.codegen import cpu, cuda
from graphopt.targets.codegen.expr import Expr, ExprError, evaluate, format_number, parse
from graphopt.targets.codegen.library import cpu_library, cuda_library
from graphopt.targets.codegen.ort_abi import API_INDEX, HEADER, ORT_API_VERSION
from graphopt.targets.codegen.spec import DOMAIN, KernelSpec
from graphopt.targets.codegen.toolchain import find_compiler

HAVE_CC = find_compiler("cc") is not None
HAVE_NVCC = find_compiler("nvcc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no gcc")


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    """Builds go to a per-session cache (each distinct source is built once)."""
    old = os.environ.get("GRAPHOPT_KERNEL_CACHE")
    os.environ["GRAPHOPT_KERNEL_CACHE"] = str(tmp_path_factory.getbasetemp() / "kernel-cache")
    yield
    if old is None:
        os.environ.pop("GRAPHOPT_KERNEL_CACHE", None)
    else:
        os.environ["GRAPHOPT_KERNEL_CACHE"] = old


# ------------------------------------------------------------------------ grammar
@pytest.mark.parametrize(
    "text",
    [
        "mul(x0,sigmoid(add(mul(x0,p0),p1)))",
        "div(mul(x0,clip(add(x0,3),0,6)),6)",
        "add(mul(x0,p0),x1)",
        "mul(mul(x0,0.5),add(erf(mul(x0,0.70710677)),1))",
        "hardsigmoid(leakyrelu(x0,0.01),0.2,0.5)",
        "pow(sub(-1.5e-8,x0),3)",
    ],
)
def test_parse_roundtrip(text):
    e = parse(text)
    assert e.text() == text
    assert parse(e.text()) == e


@pytest.mark.parametrize(
    "text",
    [
        'mul(x0,1);system("rm -rf /")',
        "x0*/",
        "mul(x0,x0)) /* */",
        "mul(x0,\n1)",
        "mul(x0,foo)",
        "mul(x0)",
        "add(x0,1,2)",
        "system(x0)",
        "mul(x1,2)",  # inputs must be dense from x0
        "mul(x0,p1)",  # params too
        "mul(x0,inf)",
        "mul(x0,1e99)",
        "pow(x0,2.5)",
        "add(1,2)",
        "mul(x0,1)\u00a0",
        "neg(" * 200 + "x0" + ")" * 200,
        "x01",
    ],
)
def test_parse_rejects(text):
    with pytest.raises(ExprError):
        parse(text)


def test_format_number_is_shortest_float32():
    assert format_number(0.1) == "0.1"
    assert float(format_number(1 / 3)) == pytest.approx(1 / 3, rel=1e-7)
    assert np.float32(format_number(0.70710678)) == np.float32(0.70710678)
    assert format_number(1e-30) == "1e-30"


def test_kernel_identity_depends_on_everything():
    e = parse("mul(x0,sigmoid(x0))")
    a = KernelSpec(e, "float32", 0)
    assert a.op_type == KernelSpec(parse("mul(x0,sigmoid(x0))"), "float32", 0).op_type
    assert a.op_type != KernelSpec(e, "float16", 0).op_type
    assert a.op_type != KernelSpec(parse("mul(x0,sigmoid(add(x0,p0)))"), "float32", -1).op_type
    with pytest.raises(ExprError, match="does not match"):
        KernelSpec.from_attrs("Elementwise_0000000000000000", a.attrs())


def test_evaluate_matches_numpy():
    x = np.linspace(-4, 4, 101)
    got = evaluate(parse("mul(x0,sigmoid(x0))"), [x], [])
    assert np.allclose(got, x / (1 + np.exp(-x)))


# -------------------------------------------------------------------------- source
def test_c_source_shape():
    specs = [
        KernelSpec(parse("mul(x0,sigmoid(add(mul(x0,p0),p1)))"), "float32", -3),
        KernelSpec(parse("add(mul(x0,p0),x1)"), "float32", -1),
    ]
    src = cpu.generate(specs)
    assert "#pragma omp parallel" in src.text and "restrict" in src.text
    assert "expf(" not in src.text and "erff(" not in src.text  # own math by default
    assert '#include "graphopt_ort_abi.h"' in src.text
    for s in specs:
        line = src.text.splitlines()[src.loop_lines[s.op_type] - 1]
        assert line.strip().startswith("for (int64_t i = 0; i < n; ++i)")
    # x0 read once although the expression uses it twice (common subexpressions)
    assert src.text.count("(float)x0[i]") == 2  # once per kernel


def test_abi_header_is_ours():
    assert ORT_API_VERSION == 16
    assert "onnxruntime_c_api.h" not in HEADER
    for name, index in API_INDEX.items():
        assert f"#define GO_API_{name} {index}" in HEADER


def test_cuda_source_shape():
    src = cuda.generate([KernelSpec(parse("mul(x0,sigmoid(add(mul(x0,p0),p1)))"), "float32", -3)])
    assert src.text.count("__global__") == 2  # fp32 and fp16
    assert "__launch_bounds__(256)" in src.text and "gridDim.x" in src.text
    assert "KernelContext_GetGPUComputeStream" in src.text
    assert '"CUDAExecutionProvider"' in src.text


def test_ptxas_report_parsing():
    log = (
        "ptxas info    : Compiling entry function 'go_k0_f32' for 'sm_90'\n"
        "ptxas info    : Function properties for go_k0_f32\n"
        "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 0 barriers, 400 bytes cmem[0]\n"
    )
    assert cuda.ptxas_resources(log) == {
        "go_k0_f32": {
            "sm_90": {"registers": 40, "spill_stores": 8, "spill_loads": 4, "stack_bytes": 0}
        }
    }


# ---------------------------------------------------------------- onnxruntime runs
CASES = [
    ("mul(x0,sigmoid(add(mul(x0,p0),p1)))", -3, [2, 8, 5, 7], "float32"),
    ("mul(x0,sigmoid(add(mul(x0,p0),p1)))", -1, [3, 4, 24], "float32"),
    ("div(mul(x0,clip(add(x0,3),0,6)),6)", 0, [3, 20001], "float32"),
    ("add(mul(x0,p0),x1)", -1, [4, 32], "float32"),
    ("mul(mul(x0,0.5),add(erf(mul(x0,0.70710677)),1))", 0, [40000], "float32"),
    ("add(tanh(x0),add(softplus(x0),elu(x0,1.5)))", 0, [999], "float32"),
    ("mul(log(abs(x0)),sqrt(abs(x0)))", 0, [999], "float32"),
    ("mul(x0,sigmoid(x0))", 0, [7, 9], "float16"),
]


def _model(spec: KernelSpec, shape, params):
    et = TensorProto.FLOAT16 if spec.dtype == "float16" else TensorProto.FLOAT
    node = helper.make_node(
        spec.op_type,
        [f"x{i}" for i in range(spec.inputs)] + [f"p{j}" for j in range(spec.params)],
        ["y"],
        domain=DOMAIN,
        **spec.attrs(),
    )
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(f"x{i}", et, shape) for i in range(spec.inputs)],
        [helper.make_tensor_value_info("y", et, None)],
        [numpy_helper.from_array(p.reshape(-1), f"p{j}") for j, p in enumerate(params)],
    )
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    )


@pytest.fixture(scope="module")
def selftest_library():
    specs = [KernelSpec(parse(e), dt, a) for e, a, _, dt in CASES]
    return specs, cpu_library(specs, selftest=True)


@needs_cc
def test_float32_loops_vectorized(selftest_library):
    specs, lib = selftest_library
    assert all(lib.vectorized[s.op_type] for s in specs if s.dtype == "float32"), lib.vectorized


@needs_cc
@pytest.mark.parametrize("case", range(len(CASES)))
def test_library_runs_in_onnxruntime(selftest_library, case):
    """The library (built with GO_ABI_SELFTEST: every compute also calls
    KernelContext_GetInputCount and KernelContext_GetGPUComputeStream, checking the pinned
    indexes against this onnxruntime) computes the expression."""
    specs, lib = selftest_library
    spec = specs[case]
    _, axis, shape, dtype = CASES[case]
    rng = np.random.default_rng(case)
    npdt = np.dtype(dtype)
    xs = [(rng.standard_normal(shape) * 3).astype(npdt) for _ in range(spec.inputs)]
    pshape = ([shape[axis]] + [1] * (-axis - 1)) if axis else []
    ps = [rng.standard_normal(pshape).astype(npdt) for _ in range(spec.params)]
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib.path))
    sess = ort.InferenceSession(
        _model(spec, shape, ps).SerializeToString(), so, ["CPUExecutionProvider"]
    )
    y = sess.run(None, {f"x{i}": x for i, x in enumerate(xs)})[0]
    ref = evaluate(spec.expr, xs, ps, np.float64)
    assert y.dtype == npdt and y.shape == tuple(shape)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(y), fin)
    tol = 2e-2 if dtype == "float16" else 1e-5
    assert np.max(np.abs(y[fin] - ref[fin]) / np.maximum(1, np.abs(ref[fin]))) < tol


@needs_cc
def test_kernel_reports_shape_errors(selftest_library):
    specs, lib = selftest_library
    spec = specs[0]  # per-channel along axis -3
    params = [np.ones(3, np.float32), np.ones(3, np.float32)]  # 3 values, 8 channels
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib.path))
    sess = ort.InferenceSession(
        _model(spec, [2, 8, 5, 7], params).SerializeToString(), so, ["CPUExecutionProvider"]
    )
    with pytest.raises(Exception, match="one value per channel"):
        sess.run(None, {"x0": np.ones([2, 8, 5, 7], np.float32)})


@pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc")
def test_cuda_library_builds_with_resources():
    lib = cuda_library([KernelSpec(parse("mul(x0,sigmoid(add(mul(x0,p0),p1)))"), "float32", -3)])
    assert lib.path.exists()
    assert len(lib.resources) == 2
    for per_arch in lib.resources.values():
        assert set(per_arch) == {"sm_80", "sm_90"}
        for r in per_arch.values():
            assert r["spill_stores"] == 0 and 0 < r["registers"] <= cuda.MAX_REGISTERS


def test_expr_nodes_are_values():
    assert Expr.x(0) == Expr.x(0)
    assert len(parse("mul(add(x0,1),add(x0,1))").walk()) == 4  # x0, 1, add, mul

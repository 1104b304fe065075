"""MatMul+Add → Gemm: only rank 2, broadcastable bias, a Gemm kernel, and fp32 accumulation."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, codes, const, model, ops, run, vi


def mm_add(rng, a_shape, bias_shape, dtype=np.float32, bias_first=False):
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    k = a_shape[-1]
    inits = [
        const("B", rng.standard_normal((k, 5)), dtype),
        const("C", rng.standard_normal(bias_shape), dtype),
    ]
    add_inputs = ["C", "y0"] if bias_first else ["y0", "C"]
    nodes = [
        helper.make_node("MatMul", ["a", "B"], ["y0"], name="mm"),
        helper.make_node("Add", add_inputs, ["y"], name="add"),
    ]
    return model(nodes, [vi("a", a_shape, elem)], [vi("y", None, elem)], inits)


@pytest.mark.parametrize("bias_shape", [[5], [1, 5], [3, 5], [3, 1], []])
@pytest.mark.parametrize("bias_first", [False, True])
def test_rank2_fuses(bias_shape, bias_first, rng):
    out, report = assert_optimized(mm_add(rng, [3, 4], bias_shape, bias_first=bias_first))
    assert ops(out) == {"Gemm": 1}


def test_rank3_is_missed_with_reason(rng):
    out, report = run(mm_add(rng, [2, 3, 4], [5]))
    assert ops(out) == {"MatMul": 1, "Add": 1}
    assert codes(report, "matmul-add-to-gemm") == ["rank-not-2"]


def test_fp16_on_cpu_has_no_gemm_kernel(rng):
    out, report = run(mm_add(rng, [3, 4], [5], dtype=np.float16))
    assert codes(report, "matmul-add-to-gemm") == ["no-kernel"]
    assert report.parity.ok


def test_fp16_guard_uses_target_accumulation(rng):
    from graphopt.targets.profiles import CUDA

    if not CUDA.has_kernel("Gemm", "", 17, "tensor(float16)"):
        pytest.skip("pinned CUDA table lacks fp16 Gemm")
    out, report = run(mm_add(rng, [3, 4], [5], dtype=np.float16), target="cuda", check=False)
    assert ops(out) == {"Gemm": 1}  # CUDA declares fp32 accumulation for Gemm

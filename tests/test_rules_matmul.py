"""MatMul+Add → Gemm: only rank 2, broadcastable bias, a Gemm kernel, and fp32 accumulation."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_rules_attention import attention

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


def test_rank3_with_dynamic_dims_is_missed_with_reason(rng):
    out, report = run(mm_add(rng, [2, "seq", 4], [5]))
    assert ops(out) == {"MatMul": 1, "Add": 1}
    assert codes(report, "matmul-add-to-gemm") == ["rank-not-2"]
    (r,) = [r for r in report.remarks if r.rule == "matmul-add-to-gemm"]
    assert "every dim of the input but the first must be static" in r.message


def test_rank3_with_static_tail_becomes_a_flat_gemm_on_cpu(rng):
    """cpu prefers Reshape → Gemm(bias) → Reshape (targets/profiles.py, prefers linear-bias)."""
    m = mm_add(rng, ["batch", 3, 4], [5])
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    out, report = assert_optimized(m, inputs={"a": x})
    assert ops(out) == {"Reshape": 2, "Gemm": 1}
    out, report = run(m, target="cuda", check=False)  # cuda keeps MatMul + Add
    assert ops(out) == {"MatMul": 1, "Add": 1}


def mlp(rng):
    """Linear → GELU → Linear on [B, 3, 4] (static tail)."""
    inits = [
        const("W1", rng.standard_normal((4, 8))),
        const("b1", rng.standard_normal(8)),
        const("W2", rng.standard_normal((8, 4))),
        const("b2", rng.standard_normal(4)),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h"]),
        helper.make_node("Gelu", ["h"], ["g"]),
        helper.make_node("MatMul", ["g", "W2"], ["o0"]),
        helper.make_node("Add", ["o0", "b2"], ["y"]),
    ]
    return model(nodes, [vi("x", ["batch", 3, 4])], [vi("y", None)], inits, opset=20)


def test_mlp_runs_flat_between_its_two_reshapes(rng):
    """The activation between two flat Gemms runs on the flat tensor (reshape-through-unary);
    the bias stays in the Gemm, so no BiasGelu."""
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    out, report = assert_optimized(mlp(rng), inputs={"x": x})
    assert ops(out) == {"Reshape": 2, "Gemm": 2, "Gelu": 1}
    assert codes(report, "reshape-through-unary", "passed") == ["fired"]


def attention_of(keys, layout, mask=None):
    m = attention(mask=mask, layout=layout)
    for i in m.graph.input:  # x [B, S, D], and the mask's keys [B, 1, 1, S]
        dims = i.type.tensor_type.shape.dim
        dims[1 if len(dims) == 3 else 3].dim_value = keys
    del m.graph.value_info[:]
    return m


@pytest.mark.parametrize("layout", ["bsd", "packed"])
def test_attention_projections_keep_their_bias_for_the_kernel(layout):
    """fuse-attention is waited for: the MultiHeadAttention kernel takes the q/k/v bias."""
    out, report = run(attention_of(128, layout))
    assert ops(out)["MultiHeadAttention"] == 1 and "Gemm" not in ops(out)
    assert report.parity.ok
    # the misses recorded while waiting are moot: the kernel took the bias Adds
    assert codes(report, "matmul-add-to-gemm") == []


@pytest.mark.parametrize("layout", ["bsd", "packed"])
def test_projections_of_an_attention_left_unfused_become_flat_gemms(layout):
    """Swin-T's 49-key windows with their bias stay unfused on cpu (slower-on-target); their
    projections then take the bias inside the GEMM like any other linear layer."""
    out, report = assert_optimized(attention_of(49, layout, mask="padding"))
    assert codes(report, "fuse-attention") == ["slower-on-target"]
    assert ops(out)["Gemm"] == (3 if layout == "bsd" else 1)
    assert ops(out)["Add"] == 1  # the mask's; the projections' biases are in the GEMMs
    # Kᵀ and the scale, also waiting for that verdict, fold into FusedMatMul
    assert ops(out)["FusedMatMul"] == 1 and "Div" not in ops(out)


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


# ------------------------------------------------ Reshape → Gemm → Reshape back → MatMul + Add
def conv1d(rng, *, trans_b=False, shared_weight=False, swap_target=False, dtype=np.float32):
    """GPT-2's Conv1D: x [B,S,K] flattened to [-1,K], Gemm, then [B,S,N] rebuilt from Shape(x)."""
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    k, n = 4, 6
    w = rng.standard_normal((n, k) if trans_b else (k, n))
    inits = [
        const("W", w, dtype),
        const("C", rng.standard_normal(n), dtype),
        const("flat", [-1, k], np.int64),
        const("i0", 0, np.int64),
        const("i1", 1, np.int64),
        const("ax", [0], np.int64),
        const("nn", [n], np.int64),
    ]
    first, second = ("d1", "d0") if swap_target else ("d0", "d1")
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["g0"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["g1"], axis=0),
        helper.make_node("Unsqueeze", ["g0", "ax"], ["d0"]),
        helper.make_node("Unsqueeze", ["g1", "ax"], ["d1"]),
        helper.make_node("Concat", [first, second, "nn"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("Gemm", ["x2", "W", "C"], ["y2"], transB=int(trans_b)),
        helper.make_node("Reshape", ["y2", "target"], ["y"]),
    ]
    outputs = [vi("y", None, elem)]
    if shared_weight:
        nodes.append(helper.make_node("Identity", ["W"], ["w_out"]))
        outputs.append(vi("w_out", None, elem))
    return model(nodes, [vi("x", ["b", "s", k], elem)], outputs, inits)


@pytest.mark.parametrize("trans_b", [False, True])
def test_flattened_gemm_becomes_matmul(trans_b, rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    out, report = assert_optimized(conv1d(rng, trans_b=trans_b), inputs={"x": x})
    assert ops(out) == {"MatMul": 1, "Add": 1}
    assert codes(report, "flattened-gemm-to-matmul", "passed") == ["fired"]


@pytest.mark.parametrize(
    "kwargs, code",
    [
        ({"swap_target": True}, "reshape-not-identity"),
        ({"trans_b": True, "shared_weight": True}, "shared-weight"),
        ({"dtype": np.float16}, "precision-accumulation"),
    ],
)
def test_flattened_gemm_guards(kwargs, code, rng):
    out, report = run(conv1d(rng, **kwargs), check=False)
    assert code in codes(report, "flattened-gemm-to-matmul")
    assert ops(out)["Gemm"] == 1


# ----------------------------------------------------- layer scale folded into the linear layer
def layer_scale(rng, *, permute=False, scale_shape=None, bias=True, shared_weight=False):
    """ConvNeXt's MLP tail: x [B,H,W,K] · W (+ b), optionally permuted back to NCHW, times γ."""
    k, n = 4, 6
    inits = [const("W", rng.standard_normal((k, n))), const("b", rng.standard_normal(n))]
    shape = scale_shape or ([n, 1, 1] if permute else [n])
    inits.append(const("gamma", rng.uniform(0.1, 2.0, shape)))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y0"], name="mm")]
    y = "y0"
    if bias:
        nodes.append(helper.make_node("Add", ["b", "y0"], ["y1"], name="bias"))
        y = "y1"
    if permute:
        nodes.append(helper.make_node("Transpose", [y], ["yt"], perm=[0, 3, 1, 2], name="nchw"))
        y = "yt"
    nodes.append(helper.make_node("Mul", ["gamma", y], ["out"], name="scale"))
    outputs = [vi("out", None)]
    if shared_weight:
        nodes.append(helper.make_node("MatMul", ["x", "W"], ["other"], name="mm2"))
        outputs.append(vi("other", None))
    return model(nodes, [vi("x", ["batch", 3, 5, k])], outputs, inits)


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_scale_folds_into_the_weights(permute, bias, rng):
    out, report = assert_optimized(layer_scale(rng, permute=permute, bias=bias))
    assert "Mul" not in ops(out)
    assert codes(report, "fold-linear-scale", kind="passed") == ["fired"]


@pytest.mark.parametrize(
    "kwargs,code",
    [
        ({"permute": True, "scale_shape": [1, 1, 5]}, "not-per-channel"),  # along width
        ({"scale_shape": [5, 6]}, "not-per-channel"),  # varies along another axis
        ({"shared_weight": True}, "shared-weight"),
    ],
)
def test_layer_scale_guards(kwargs, code, rng):
    out, report = run(layer_scale(rng, **kwargs))
    assert codes(report, "fold-linear-scale") == [code]
    assert "Mul" in ops(out) and report.parity.ok


# ------------------------------------------------------------------------------ FusedMatMul
def transposed_product(rng, *, side="B", scale=None, softmax=False):
    """a [2, 3, 4] · Transpose(b [2, 5, 4]) (or the transposed left side), optionally scaled."""
    inits = [const("c", 0.125)]
    if side == "B":
        nodes = [
            helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["a", "bt"], ["p"]),
        ]
        ins = [vi("a", [2, 3, 4]), vi("b", [2, 5, 4])]
    else:
        nodes = [
            helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["at", "b"], ["p"]),
        ]
        ins = [vi("a", [2, 4, 3]), vi("b", [2, 4, 5])]
    y = "p"
    if scale:
        nodes.append(helper.make_node(scale, ["p", "c"], ["s"]))
        y = "s"
    if softmax:  # an attention score nobody fuses (no heads): the rules wait, then take it
        nodes.append(helper.make_node("Softmax", [y], ["sm"], axis=-1))
        y = "sm"
    nodes[-1].output[0] = "y"
    return model(nodes, ins, [vi("y", None)], inits)


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("scale", [None, "Mul", "Div"])
def test_transpose_and_scale_fold_into_fused_matmul(side, scale, rng):
    out, report = assert_optimized(transposed_product(rng, side=side, scale=scale))
    assert ops(out) == {"FusedMatMul": 1}
    node = out.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs[f"trans{side}"] == 1
    want = {None: 1.0, "Mul": 0.125, "Div": 8.0}[scale]
    assert attrs["alpha"] == pytest.approx(want)


def test_fused_matmul_only_where_the_target_has_it(rng):
    out, report = run(transposed_product(rng), target="tensorrt")
    assert "FusedMatMul" not in ops(out)
    assert codes(report, "fuse-matmul-transpose") == ["no-kernel"]


def test_scores_of_an_attention_without_a_head_merge_fold(rng):
    """Q·Kᵀ feeding a Softmax whose P·V is not followed by a head-merging Transpose (YOLO11's
    attention) is no pattern fuse-attention roots at: the folds take it."""
    out, report = run(transposed_product(rng, scale="Mul", softmax=True))
    assert ops(out) == {"FusedMatMul": 1, "Softmax": 1}


def test_fp16_folds_into_fused_matmul_where_the_matmul_ran_inside_casts(rng):
    """onnxruntime's cpu FusedMatMul is float only, like its MatMul: the float16 product
    already ran inside casts to float, and the fused one takes its place there."""
    m = transposed_product(rng, scale="Mul")
    for v in [*m.graph.input, *m.graph.output]:
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    (c,) = m.graph.initializer
    c.CopyFrom(const("c", 0.125, np.float16))
    out, report = assert_optimized(m)
    assert ops(out) == {"FusedMatMul": 1}

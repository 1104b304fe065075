"""Quantized models keep their quantization: QDQ, QOperator, dynamic, MatMulNBits, blocked
int4 and fp8.  Weights stay integer (no DequantizeLinear is folded), onnxruntime's own QDQ
fusions still fire at ORT_ENABLE_ALL, float fusions stop at Q/DQ, and only provably redundant
DQ→Q pairs go."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from conftest import codes, const, model, ops, run, vi

RNG = np.random.default_rng(0)
QUANT_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")


def _w(*shape: int, scale: float = 0.2) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _cnn() -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]]:
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
        n("Relu", ["c1"], ["r1"]),
        n("Conv", ["r1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1]),
        n("Relu", ["c2"], ["r2"]),
        n("GlobalAveragePool", ["r2"], ["p"]),
        n("Flatten", ["p"], ["f"]),
        n("MatMul", ["f", "Wf"], ["mm"]),
        n("Add", ["mm", "Bf"], ["y"]),
    ]
    inits = {"W1": _w(8, 3, 3, 3), "B1": _w(8), "W2": _w(16, 8, 3, 3), "B2": _w(16)}
    inits |= {"Wf": _w(16, 10), "Bf": _w(10)}
    m = model(
        nodes,
        [vi("x", [1, 3, 16, 16])],
        [vi("y", [1, 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return m, {"x": (1, 3, 16, 16)}


def _block(d: int = 32) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]]:
    """LayerNorm, 4-head self-attention, residual, GELU MLP, residual."""
    n = helper.make_node
    h = 4
    nodes = [
        n("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1),
        n("MatMul", ["ln", "Wq"], ["q"]),
        n("MatMul", ["ln", "Wk"], ["k"]),
        n("MatMul", ["ln", "Wv"], ["v"]),
        n("Reshape", ["q", "heads"], ["q4"]),
        n("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
        n("Reshape", ["k", "heads"], ["k4"]),
        n("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        n("Reshape", ["v", "heads"], ["v4"]),
        n("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3]),
        n("MatMul", ["qt", "kt"], ["s"]),
        n("Mul", ["s", "sc"], ["ss"]),
        n("Softmax", ["ss"], ["p"], axis=-1),
        n("MatMul", ["p", "vt"], ["o"]),
        n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ot", "merged"], ["o3"]),
        n("MatMul", ["o3", "Wo"], ["a"]),
        n("Add", ["a", "bo"], ["a2"]),
        n("Add", ["a2", "x"], ["r"]),
        n("MatMul", ["r", "W1"], ["f1"]),
        n("Add", ["f1", "b1"], ["f1b"]),
        n("Div", ["f1b", "sqrt2"], ["d"]),
        n("Erf", ["d"], ["e"]),
        n("Add", ["e", "one"], ["e1"]),
        n("Mul", ["f1b", "e1"], ["m"]),
        n("Mul", ["m", "half"], ["gl"]),
        n("MatMul", ["gl", "W2"], ["f2"]),
        n("Add", ["f2", "b2"], ["f2b"]),
        n("Add", ["f2b", "r"], ["y"]),
    ]
    inits = {k: _w(d, d) for k in ("Wq", "Wk", "Wv", "Wo")}
    inits |= {"bo": _w(d), "W1": _w(d, 4 * d), "b1": _w(4 * d), "W2": _w(4 * d, d), "b2": _w(d)}
    inits |= {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)}
    inits |= {"heads": np.array([1, 8, h, d // h], np.int64), "merged": np.array([1, 8, d])}
    inits |= {"sc": np.float32(1 / np.sqrt(d // h)), "sqrt2": np.float32(np.sqrt(2))}
    inits |= {"one": np.float32(1), "half": np.float32(0.5)}
    m = model(
        nodes,
        [vi("x", [1, 8, d])],
        [vi("y", [1, 8, d])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return m, {"x": (1, 8, d)}


class _Random(CalibrationDataReader):
    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        rng = np.random.default_rng(1)
        self.batches = iter(
            [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}] * 4
        )

    def get_next(self):
        return next(self.batches, None)


def _quantize(kind: str, arch: str, tmp: Path) -> onnx.ModelProto:
    m, shapes = {"cnn": _cnn, "block": _block}[arch]()
    src, dst = tmp / f"{arch}.onnx", tmp / f"{arch}.{kind}.onnx"
    onnx.save(m, src)
    if kind == "dynamic":
        quantize_dynamic(src, dst)
    elif kind == "nbits":
        pytest.importorskip("onnx_ir")  # onnxruntime's n-bit quantizer is written on onnx-ir
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        q = MatMulNBitsQuantizer(m, block_size=16, is_symmetric=True)
        q.process()
        q.model.save_model_to_file(str(dst))
    else:
        fmt = QuantFormat.QDQ if kind == "qdq" else QuantFormat.QOperator
        quantize_static(
            src,
            dst,
            _Random(shapes),
            quant_format=fmt,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    return onnx.load(dst)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantized")
    cache: dict[tuple[str, str], onnx.ModelProto] = {}

    def get(kind: str, arch: str) -> onnx.ModelProto:
        if (kind, arch) not in cache:
            cache[(kind, arch)] = _quantize(kind, arch, tmp)
        return cache[(kind, arch)]

    return get


def _weight_bytes(m: onnx.ModelProto, dtype: int | None = None) -> int:
    return sum(t.ByteSize() for t in m.graph.initializer if dtype in (None, t.data_type))


def _ort_ops(m: onnx.ModelProto, tmp: Path) -> Counter:
    """Op histogram of the model as onnxruntime runs it at ORT_ENABLE_ALL on cpu."""
    path = tmp / "ort_optimized.onnx"
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(path)
    so.log_severity_level = 3
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(path).graph.node)


def _exact(report) -> bool:
    return report.parity.ok and all(o.max_abs == 0 for o in report.parity.outputs)


@pytest.mark.parametrize("arch", ["cnn", "block"])
@pytest.mark.parametrize("level", [1, 2])
def test_qdq_weights_stay_quantized(quantized, arch, level, tmp_path):
    """Static per-channel int8 QDQ: no weight is dequantized into a float initializer, the
    output is no bigger, and onnxruntime still builds its integer kernels from it."""
    m = quantized("qdq", arch)
    out, report = run(m, level=level)
    assert report.parity.ok and (level > 1 or _exact(report))
    assert {op: ops(out).get(op, 0) for op in QUANT_OPS} == {
        op: ops(m).get(op, 0) for op in QUANT_OPS
    }
    assert _weight_bytes(out) <= _weight_bytes(m)
    assert _weight_bytes(out, TensorProto.FLOAT) <= _weight_bytes(m, TensorProto.FLOAT)
    before, after = _ort_ops(m, tmp_path), _ort_ops(out, tmp_path)
    integer_kernel = "QLinearConv" if arch == "cnn" else "QLinearMatMul"
    assert after[integer_kernel] == before[integer_kernel] > 0
    assert after == before


@pytest.mark.parametrize("kind", ["qoperator", "dynamic", "nbits"])
@pytest.mark.parametrize("arch", ["cnn", "block"])
def test_integer_operator_models_are_kept(quantized, kind, arch, tmp_path):
    if kind == "nbits" and arch == "cnn":
        pytest.skip("MatMulNBits quantizes MatMuls of 2-D weights with K >= block size only")
    m = quantized(kind, arch)
    out, report = run(m, level=2)
    assert report.parity.ok
    quant = {op for op in ops(m) if "Integer" in op or op.startswith("QLinear") or op in QUANT_OPS}
    quant |= {"MatMulNBits"} & set(ops(m))
    assert quant and all(ops(out).get(op) == ops(m)[op] for op in quant)
    assert _weight_bytes(out) <= _weight_bytes(m)
    before, after = _ort_ops(m, tmp_path), _ort_ops(out, tmp_path)
    fused = [op for op in before if op in ("MatMulNBits", "QLinearConv", "QLinearMatMul")]
    fused += [op for op in before if "IntegerToFloat" in op or op == "DynamicQuantizeMatMul"]
    assert fused and all(after[op] == before[op] for op in fused)


def _dq_matmul(w: onnx.TensorProto, scale: np.ndarray, **attrs) -> onnx.ModelProto:
    k, n = w.dims
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], **attrs),
        helper.make_node("MatMul", ["x", "wf"], ["y"]),
    ]
    return model(nodes, [vi("x", [2, k])], [vi("y", [2, n])], [w, const("s", scale)], 21, 10)


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("k,n", [(32, 16), (128, 128)])  # the large one is typed for inference
def test_blocked_int4_and_fp8_weights_stay(level, k, n):
    int4 = helper.make_tensor("w", TensorProto.INT4, [k, n], RNG.integers(-8, 8, k * n).tolist())
    blocked = _dq_matmul(int4, RNG.random((k // 16, n)) * 0.1 + 0.01, axis=0, block_size=16)
    fp8 = helper.make_tensor(
        "w", TensorProto.FLOAT8E4M3FN, [k, n], RNG.standard_normal(k * n).tolist()
    )
    for m, dtype in ((blocked, TensorProto.INT4), (fp8_m := _dq_matmul(fp8, 0.05), None)):
        out, report = run(m, level=level)
        assert _exact(report)
        assert ops(out)["DequantizeLinear"] == 1
        w = {t.name: t for t in out.graph.initializer}["w"]
        assert w.data_type == (dtype or TensorProto.FLOAT8E4M3FN)
        assert _weight_bytes(out) <= _weight_bytes(m)
    assert fp8_m is not None


def test_quantize_of_a_float_constant_folds_to_integers():
    """Q(float weight) → int8 initializer (exact); the DQ after it stays."""
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "s", "z"], ["wq"], axis=1),
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wf"], axis=1),
        helper.make_node("MatMul", ["x", "wf"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", [2, 8])],
        [vi("y", [2, 4])],
        [const("w", _w(8, 4)), const("s", [0.01, 0.02, 0.01, 0.03]), const("z", [0] * 4, np.int8)],
    )
    out, report = run(m, level=1)
    assert _exact(report)
    assert ops(out) == {"DequantizeLinear": 1, "MatMul": 1}
    dq_input = out.graph.node[0].input[0]
    w = {t.name: t for t in out.graph.initializer}[dq_input]
    assert w.data_type == TensorProto.INT8


def test_tensorrt_keeps_every_int8_weight_dequantize(quantized):
    m = quantized("qdq", "cnn")
    out, report = run(m, level=2, target="tensorrt")
    assert report.parity.ok

    def weight_dqs(g: onnx.ModelProto) -> int:
        ints = {t.name for t in g.graph.initializer if t.data_type == TensorProto.INT8}
        return sum(
            1 for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in ints
        )

    assert weight_dqs(out) == weight_dqs(m) > 0


# ------------------------------------------------------------------ redundant pairs
def _pair(dq_scale, q_scale, *, zq=None, fp16: bool = False, tail: bool = True) -> onnx.ModelProto:
    """x(float) → Q → DQ → Q' [→ DQ'] with the given scales."""
    ft = np.float16 if fp16 else np.float32
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s1", "z"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s1", "z"], ["d1"]),
        helper.make_node("QuantizeLinear", ["d1", "s2", "z2"], ["q2"]),
    ]
    if tail:
        nodes.append(helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["y"]))
    z2 = zq if zq is not None else 0
    inits = [const("s1", dq_scale, ft), const("z", 0, np.int8), const("s2", q_scale, ft)]
    inits.append(const("z2", z2, np.int8))
    out_elem = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    x_elem = out_elem
    return model(
        nodes,
        [vi("x", [4, 8], x_elem)],
        [vi("y" if tail else "q2", [4, 8], out_elem if tail else TensorProto.INT8)],
        inits,
        opset=19,
        ir_version=9,
    )


def test_dq_then_q_with_identical_parameters_goes():
    m = _pair(0.05, 0.05)
    out, report = run(m, level=1, inputs={"x": RNG.standard_normal((4, 8)).astype(np.float32) * 9})
    assert _exact(report)
    assert ops(out) == {"QuantizeLinear": 1, "DequantizeLinear": 1}
    assert "fired" in codes(report, "remove-dq-q", "passed")


def test_q_dq_q_collapses_to_the_first_q_at_a_graph_output():
    m = _pair(0.05, 0.05, tail=False)
    out, report = run(m, level=1)
    assert _exact(report)
    assert ops(out) == {"QuantizeLinear": 1}
    assert [o.name for o in out.graph.output] == ["q2"]


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"dq_scale": 0.05, "q_scale": 0.07}, "different-quantization"),
        ({"dq_scale": 0.05, "q_scale": 0.05, "zq": 3}, "different-quantization"),
        ({"dq_scale": 0.05, "q_scale": 0.05, "fp16": True}, "inexact-scale"),
    ],
)
def test_pairs_that_change_values_stay(kw, code):
    m = _pair(**kw)
    elem = np.float16 if kw.get("fp16") else np.float32
    out, report = run(m, level=1, inputs={"x": (RNG.standard_normal((4, 8)) * 9).astype(elem)})
    assert _exact(report)
    assert ops(out) == {"QuantizeLinear": 2, "DequantizeLinear": 2}
    assert code in codes(report, "remove-dq-q")


def test_fake_quantization_is_not_removed():
    """Q → DQ on activations changes values (that is its point): it stays."""
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        helper.make_node("Relu", ["d"], ["y"]),
    ]
    m = model(nodes, [vi("x", [4])], [vi("y", [4])], [const("s", 0.1), const("z", 0, np.uint8)])
    out, report = run(m, level=2)
    assert _exact(report)
    assert ops(out) == {"QuantizeLinear": 1, "DequantizeLinear": 1, "Relu": 1}


# ------------------------------------------------------------------ float fusions at the boundary
def _qdq_conv(tail: list, extra: list, out_shape=(1, 4, 6, 6)) -> onnx.ModelProto:
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xf"]),
        helper.make_node("DequantizeLinear", ["wq", "ws"], ["wf"], axis=0),
        helper.make_node("Conv", ["xf", "wf"], ["c"]),
        *tail,
    ]
    inits = [
        const("xs", 0.05),
        const("xz", 128, np.uint8),
        const("wq", RNG.integers(-100, 100, (4, 3, 3, 3)), np.int8),
        const("ws", [0.01, 0.02, 0.015, 0.03]),
        *extra,
    ]
    return model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", list(out_shape))], inits)


def test_conv_activation_does_not_absorb_a_quantized_conv():
    m = _qdq_conv([helper.make_node("Relu", ["c"], ["y"])], [])
    out, report = run(m, level=2)
    assert report.parity.ok
    assert "FusedConv" not in ops(out) and ops(out)["DequantizeLinear"] == 2
    assert "quantized-boundary" in codes(report, "fuse-conv-relu")


def test_conv_bn_refuses_a_dequantized_weight():
    c = 4
    bn = helper.make_node("BatchNormalization", ["c", "g", "b", "mu", "var"], ["y"])
    extra = [const("g", _w(c) + 1), const("b", _w(c)), const("mu", _w(c))]
    extra.append(const("var", np.abs(_w(c)) + 0.5))
    m = _qdq_conv([bn], extra)
    out, report = run(m, level=2)
    assert report.parity.ok
    assert ops(out)["BatchNormalization"] == 1 and ops(out)["DequantizeLinear"] == 2
    assert "quantized-boundary" in codes(report, "fuse-conv-bn")


def test_matmul_add_keeps_a_dequantized_weight_for_the_runtime():
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "ws"], ["wf"], axis=1),
        helper.make_node("MatMul", ["x", "wf"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["y"]),
    ]
    inits = [
        const("wq", RNG.integers(-100, 100, (8, 4)), np.int8),
        const("ws", [0.01, 0.02, 0.015, 0.03]),
        const("b", _w(4)),
    ]
    m = model(nodes, [vi("x", [2, 8])], [vi("y", [2, 4])], inits)
    out, report = run(m, level=2)
    assert _exact(report)
    assert ops(out) == {"DequantizeLinear": 1, "MatMul": 1, "Add": 1}
    assert "quantized-boundary" in codes(report, "matmul-add-to-gemm")


def test_int32_bias_dequantize_becomes_float_on_tensorrt_only():
    """TensorRT takes no int32 DequantizeLinear (onnxruntime's static quantizer writes one per
    bias): there it becomes the float bias, bit for bit; int8 weights keep their DQ."""
    w = helper.make_tensor("w", TensorProto.INT8, [4, 3, 3, 3], RNG.integers(-127, 128, 108))
    b = helper.make_tensor("b", TensorProto.INT32, [4], RNG.integers(-5000, 5000, 4))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xf"]),
        helper.make_node("DequantizeLinear", ["w", "ws"], ["wf"], axis=0),
        helper.make_node("DequantizeLinear", ["b", "bs"], ["bf"], axis=0),
        helper.make_node("Conv", ["xf", "wf", "bf"], ["y"]),
    ]
    inits = [
        w,
        b,
        const("xs", 0.02),
        const("xz", 0, np.int8),
        const("ws", RNG.random(4) * 0.01 + 0.001),
        const("bs", RNG.random(4) * 0.0002 + 0.00001),
    ]
    m = model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", None)], inits)
    out, report = run(m, target="tensorrt", level=1)
    assert _exact(report)
    assert ops(out)["DequantizeLinear"] == 2
    types = {t.name: t.data_type for t in out.graph.initializer}
    assert TensorProto.INT32 not in types.values() and types["w"] == TensorProto.INT8
    out, _ = run(m, target="cpu", level=1)
    assert ops(out)["DequantizeLinear"] == 3

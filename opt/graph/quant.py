"""Quantized models: recognizing Q/DQ, QOperator, weight-only, blocked int4 and fp8 graphs.

Shared by passes and rules.  What graphopt does with quantized graphs follows from one fact: the
runtime, not graphopt, turns ``DequantizeLinear → op → QuantizeLinear`` node units into integer
kernels (onnxruntime's QLinearConv, QLinearMatMul, MatMulNBits; TensorRT's explicit
quantization).  So:

* a ``DequantizeLinear`` is never folded (its float result would be stored 4-8x bigger and the
  runtime would re-quantize it with its own, coarser scales), and nothing computed from its
  output is folded either -- that would be folding it in disguise;
* ``QuantizeLinear`` of a float constant folds to an integer constant (exact: round half to even
  and saturation are what the runtime computes); the ``DequantizeLinear`` after it stays;
* rules never match a Q/DQ (or QOperator) node unless they are written for it, never fold a DQ
  output as a constant, and leave the weighted op of a node unit (Conv, MatMul, Gemm reading a
  DQ output) as it is: each refusal is a missed remark with code ``quantized-boundary``;
* only provably redundant pairs go (:func:`same_quantization`): ``DQ → Q`` with identical
  parameters is the identity, and ``Q → DQ → Q`` is the first ``Q``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx

from .domains import DEFAULT, MS, in_domains
from .ir import Constant, Node, Tensor, walk_nodes

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
#: ops that (de)quantize: a rule matching one of them must be written for it
QDQ_OPS = frozenset({QUANTIZE, DEQUANTIZE, "DynamicQuantizeLinear"})
#: integer-kernel ops (ONNX and com.microsoft) of QOperator and dynamic quantization
QOPERATOR_OPS = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "ConvInteger",
        "MatMulInteger",
        "QLinearAdd",
        "QLinearMul",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearAveragePool",
        "QLinearGlobalAveragePool",
        "QLinearConcat",
        "QLinearSoftmax",
        "QLinearWhere",
        "QGemm",
        "QAttention",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
    }
)
#: weight-only quantized contrib ops
WEIGHT_ONLY_OPS = frozenset({"MatMulNBits", "GatherBlockQuantized"})
#: ops whose DQ-fed inputs make a node unit the runtime turns into an integer kernel
WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})

_LOW_BIT = {
    onnx.TensorProto.INT4: "int4",
    onnx.TensorProto.UINT4: "uint4",
    onnx.TensorProto.FLOAT8E4M3FN: "float8e4m3fn",
    onnx.TensorProto.FLOAT8E4M3FNUZ: "float8e4m3fnuz",
    onnx.TensorProto.FLOAT8E5M2: "float8e5m2",
    onnx.TensorProto.FLOAT8E5M2FNUZ: "float8e5m2fnuz",
}
for _name in ("FLOAT4E2M1", "INT2", "UINT2", "FLOAT8E8M0"):  # newer onnx releases
    if hasattr(onnx.TensorProto, _name):
        _LOW_BIT[getattr(onnx.TensorProto, _name)] = _name.lower()
#: names of sub-byte and fp8 element types, as numpy (ml_dtypes) spells them
LOW_BIT_NAMES = frozenset(_LOW_BIT.values())


def is_qdq(node: Node) -> bool:
    return node.op in QDQ_OPS and in_domains(node.domain, DEFAULT, MS)


def is_quantized_op(node: Node) -> bool:
    """A Q/DQ, QOperator or weight-only quantized node."""
    return is_qdq(node) or node.op in QOPERATOR_OPS or node.op in WEIGHT_ONLY_OPS


def dequantized_by(tensor: Tensor | None) -> Node | None:
    """The DequantizeLinear that produces ``tensor``, or None."""
    if tensor is None or not tensor.inputs:
        return None
    node = tensor.inputs[0]
    return node if node.op == DEQUANTIZE and is_qdq(node) else None


def element_type_name(tensor: Tensor) -> str | None:
    """numpy-style name of a tensor's element type, or None when unknown.  graphsurgeon keeps
    types numpy cannot spell (fp8 without ml_dtypes) as their onnx enum value."""
    dt = tensor.dtype
    if dt is None:
        return None
    if isinstance(dt, (int, np.integer)) and not isinstance(dt, bool):
        if int(dt) in _LOW_BIT:
            return _LOW_BIT[int(dt)]
        try:
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(dt))).name
        except (KeyError, TypeError, ValueError):
            return None
    try:
        return np.dtype(dt).name
    except TypeError:
        return None


def is_low_bit(tensor: Tensor) -> bool:
    """int4/uint4/int2/fp8/fp4 tensors: numpy has no native type for them."""
    return element_type_name(tensor) in LOW_BIT_NAMES


def _param_bits(tensor: Tensor | None) -> tuple | None:
    """(dtype, shape, bytes) of a constant scale or zero point; () when absent; None when not
    known at optimization time."""
    if tensor is None or (not isinstance(tensor, Constant) and tensor.name == ""):
        return ()
    if not isinstance(tensor, Constant):
        return None
    v = np.asarray(tensor.values)
    return (element_type_name(tensor), tuple(v.shape), v.tobytes())


def quantized_type(node: Node) -> str | None:
    """Element type of the integer (or fp8) side of a Q or DQ."""
    ins = node.inputs
    if node.op == DEQUANTIZE:
        return element_type_name(ins[0]) if ins else None
    if len(ins) > 2 and ins[2] is not None and ins[2].name:
        return element_type_name(ins[2])
    out_dt = node.attrs.get("output_dtype", 0)
    if out_dt:
        return (
            _LOW_BIT.get(int(out_dt))
            or np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(out_dt))).name
        )
    return "uint8"


def quant_params(node: Node) -> tuple | None:
    """Everything that defines a Q or DQ's mapping: quantized type, scale and zero-point bits,
    axis, block size, saturate.  None when scale or zero point is not a constant."""
    if node.op not in (QUANTIZE, DEQUANTIZE):
        return None
    ins = list(node.inputs) + [None] * (3 - len(node.inputs))
    scale, zp = _param_bits(ins[1]), _param_bits(ins[2])
    if scale is None or zp is None:
        return None
    per_axis = bool(scale and len(scale[1]) > 0 and int(np.prod(scale[1])) > 1)
    axis = int(node.attrs.get("axis", 1)) if per_axis else None
    if axis is not None and ins[0] is not None and ins[0].shape is not None and axis < 0:
        axis += len(ins[0].shape)
    return (
        quantized_type(node),
        scale,
        zp,
        axis,
        int(node.attrs.get("block_size", 0)),
        int(node.attrs.get("saturate", 1)),
    )


def same_quantization(a: Node, b: Node) -> bool:
    """Whether a Q and a DQ (or two of either) use provably the same mapping."""
    pa, pb = quant_params(a), quant_params(b)
    return pa is not None and pa == pb


def boundary_violation(nodes: Iterable[Node]) -> str | None:
    """Why a rewrite of these matched nodes would cross a quantization boundary, or None.

    A matched Q/DQ/QOperator node would be moved, absorbed or dropped; a matched Conv, MatMul or
    Gemm reading a DequantizeLinear output is the core of a node unit the runtime lowers to an
    integer kernel, which a fused replacement (FusedConv, Gemm, FusedMatMul) would hide from it.
    """
    for node in nodes:
        if is_quantized_op(node):
            return f"{node.op} '{node.name}' is part of the quantization and stays where it is"
        if node.op in WEIGHTED_OPS:
            for t in node.inputs:
                dq = dequantized_by(t)
                if dq is not None:
                    return (
                        f"{node.op} '{node.name}' reads '{t.name}' from DequantizeLinear "
                        f"'{dq.name}': the runtime lowers this node unit to an integer kernel"
                    )
    return None


def quantization_formats(graph) -> dict[str, int]:
    """What kinds of quantization a graph uses (subgraphs included), with node counts:
    ``qdq``, ``qoperator``, ``dynamic``, ``weight-only``, ``blocked``, ``low-bit`` (int4/fp8
    tensors on a Q/DQ)."""
    found: dict[str, int] = {}

    def add(kind: str) -> None:
        found[kind] = found.get(kind, 0) + 1

    for node in walk_nodes(graph):
        if node.op in (QUANTIZE, DEQUANTIZE):
            add("qdq")
            if int(node.attrs.get("block_size", 0)):
                add("blocked")
            if quantized_type(node) in LOW_BIT_NAMES:
                add("low-bit")
        elif node.op == "DynamicQuantizeLinear" or node.op in (
            "DynamicQuantizeMatMul",
            "MatMulIntegerToFloat",
        ):
            add("dynamic")
        elif node.op in QOPERATOR_OPS:
            add("qoperator")
        elif node.op in WEIGHT_ONLY_OPS:
            add("weight-only")
    return found

"""Quantization cleanups (level 1): only pairs that provably compute nothing go.

* ``remove-dq-q``: ``QuantizeLinear(DequantizeLinear(x))`` with identical parameters (quantized
  type, scale and zero-point bits, axis, block size, saturate) is ``x``; that also collapses
  ``Q → DQ → Q`` to its first Q, and drops the middle DQ→Q of ``Q → DQ → Q → DQ``.  The DQ stays
  when something else reads it.

Exactness: the DQ computes ``(x − zp)·s`` in float32 and the Q ``round(y / s) + zp``; for
integers of at most 16 bits (and fp8) ``(k·s)/s`` lies within one float32 ulp of ``k``, so the
rounding returns ``k``.  A float16/bfloat16 scale rounds ``k·s`` too coarsely for that, so such
pairs stay.  Q→DQ ("fake quantization") and pairs whose parameters differ change values and are
left alone.  Every other rule refuses to move, absorb or drop a Q or DQ (``opt/quant``).

* ``dequantize-int32-bias`` (a target rewrite): an int32 bias DequantizeLinear becomes its float
  value where the target has no int32 DequantizeLinear kernel (tensorrt), bit for bit.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.ir import Constant, constant_value
from graphopt.opt.graph.quant import element_type_name, quant_params
from graphopt.opt.rewrite.engine import (
    Op,
    Rule,
    applies_only_if,
    opt,
    require,
    require_forwardable,
)
from graphopt.opt.rewrite.manager import register_rule

#: scale types for which DQ→Q round-trips every quantized value exactly
EXACT_SCALE_TYPES = ("float32", "float64")


@register_rule
class RemoveDequantizeQuantize(Rule):
    name = "remove-dq-q"
    root = "QuantizeLinear"
    level = 1
    exclusive = False  # a DQ read elsewhere stays; the Q goes
    quantization_aware = True
    summary = "DequantizeLinear → QuantizeLinear with identical parameters → nothing"
    pattern = Op(
        "QuantizeLinear",
        Op("DequantizeLinear", "x", "s_dq", opt("z_dq"), name="dq"),
        "s_q",
        opt("z_q"),
    )

    def check(self, m, cx):
        dq_params, q_params = quant_params(m.dq), quant_params(m.root)
        require(
            dq_params is not None and q_params is not None,
            "non-constant-param",
            "scale or zero point of the DQ→Q pair is computed at run time",
        )
        require(
            dq_params == q_params,
            "different-quantization",
            f"DequantizeLinear '{m.dq.name}' and QuantizeLinear '{m.root.name}' differ in "
            "type, scale, zero point, axis, block size or saturate; removing them would "
            "change values",
        )
        scale_type = element_type_name(m.s_dq)
        require(
            scale_type in EXACT_SCALE_TYPES,
            "inexact-scale",
            f"the pair's scale is {scale_type}: the DQ's product is rounded too coarsely for the "
            "Q to give back every value",
            scale_dtype=scale_type,
        )
        require_forwardable(cx.ir, m.root.outputs[0], m.x)

    def rewrite(self, m, b):
        return [m.x]


@register_rule
class DequantizeInt32Bias(Rule):
    """``DequantizeLinear(int32 constant)`` → its float value, on a target that has no int32
    DequantizeLinear kernel (TensorRT's parser takes only activation types into a DQ: the int32
    bias DQs onnxruntime's static quantizer writes make a QDQ model unloadable there).  The value
    is computed as the kernel does, ``float32(x − zp) · scale``, so the result is bit-identical;
    int8/int4/fp8 weights keep their DequantizeLinear."""

    name = "dequantize-int32-bias"
    root = "DequantizeLinear"
    level = 1
    exclusive = False
    quantization_aware = True
    summary = "int32 bias DequantizeLinear → float constant, where the target has no such kernel"
    pattern = Op("DequantizeLinear", "x", "s", opt("z"))

    def structure(self, m, cx):
        applies_only_if(element_type_name(m.x) == "int32" and isinstance(m.x, Constant))
        applies_only_if(
            not cx.target.has_kernel("DequantizeLinear", "", cx.ir.opset, "tensor(int32)")
            and cx.target.has_kernel("DequantizeLinear", "", cx.ir.opset)
        )

    def check(self, m, cx):
        scale = constant_value(m.s)
        zp = constant_value(m.z) if m.z is not None else np.zeros((), np.int32)
        require(
            scale is not None and zp is not None,
            "non-constant-param",
            "the bias DequantizeLinear's scale or zero point is computed at run time",
        )
        require(
            scale.dtype == np.float32,
            "dtype-mismatch",
            f"the scale is {scale.dtype}; only float32 scales are folded",
        )
        x = constant_value(m.x).astype(np.int64)
        if scale.size > 1:  # per-axis: scale and zero point run along `axis`
            axis = int(m.root.attrs.get("axis", 1)) % max(x.ndim, 1)
            shape = [1] * x.ndim
            shape[axis] = scale.size
            scale, zp = scale.reshape(shape), np.asarray(zp).reshape(shape if zp.size > 1 else ())
        m.stash(value=((x - zp.astype(np.int64)).astype(np.float32) * scale).astype(np.float32))

    def rewrite(self, m, b):
        return [b.const(m.value, "bias")]

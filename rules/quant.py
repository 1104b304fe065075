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
"""

from __future__ import annotations

from graphopt.opt.manager import register_rule
from graphopt.opt.quant import element_type_name, quant_params
from graphopt.opt.rewrite import Op, Rule, opt, require, require_forwardable

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

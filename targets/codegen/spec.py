"""What one generated kernel is: expression, element type, channel axis (and its op type).

A :class:`KernelSpec` is all a code generator needs and all a fused node carries (attributes
``expr``, ``dtype``, ``channel_axis``; op type ``Elementwise_<id>`` in domain ``graphopt.fused``).
Inputs of the fused node: the runtime inputs ``x0..`` (all of the output's shape), then the
constant parameters ``p0..`` (one value per channel along ``channel_axis``; 0 = none).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import onnx

from graphopt.opt.errors import GraphoptError
from graphopt.opt.graph.domains import GENERATED
from graphopt.opt.graph.ir import all_graphs

from .expr import Expr, ExprError, kernel_id, op_type, parse

DOMAIN = GENERATED
DTYPES = ("float32", "float16")
ELEM = {"float32": 1, "float16": 10}


@dataclass(frozen=True)
class KernelSpec:
    expr: Expr
    dtype: str = "float32"
    channel_axis: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ExprError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.channel_axis > 0 or self.channel_axis < -8:
            raise ExprError("channel_axis must be 0 (none) or a negative axis >= -8")
        if self.expr.params() and not self.channel_axis:
            raise ExprError("per-channel parameters need a channel_axis")

    @cached_property
    def id(self) -> str:
        return kernel_id(self.expr, self.dtype, self.channel_axis)

    @cached_property
    def op_type(self) -> str:
        return op_type(self.expr, self.dtype, self.channel_axis)

    @property
    def inputs(self) -> int:
        return self.expr.inputs()

    @property
    def params(self) -> int:
        return self.expr.params()

    def attrs(self) -> dict:
        return {"expr": self.expr.text(), "dtype": self.dtype, "channel_axis": self.channel_axis}

    @classmethod
    def from_attrs(cls, op: str, attrs: dict) -> KernelSpec:
        """Rebuild from a node's attributes; the op type must match (else ExprError)."""
        try:
            spec = cls(parse(str(attrs["expr"])), str(attrs["dtype"]), int(attrs["channel_axis"]))
        except KeyError as e:
            raise ExprError(f"fused node lacks attribute {e}") from None
        if spec.op_type != op:
            raise ExprError(f"op type {op!r} does not match its expression ({spec.op_type})")
        return spec


def _attr(a: onnx.AttributeProto):
    v = onnx.helper.get_attribute_value(a)
    return v.decode() if isinstance(v, bytes) else v


def specs_of(model: onnx.ModelProto) -> list[KernelSpec]:
    """The distinct kernels the model's ``graphopt.fused`` nodes need (sorted by op type)."""
    out: dict[str, KernelSpec] = {}
    for g in all_graphs(model.graph):
        for n in g.node:
            if n.domain != DOMAIN:
                continue
            try:
                spec = KernelSpec.from_attrs(n.op_type, {a.name: _attr(a) for a in n.attribute})
            except (ExprError, TypeError, ValueError) as e:
                raise GraphoptError(
                    f"node '{n.name or n.output[0]}' of domain {DOMAIN} is no kernel graphopt "
                    f"can build: {e}"
                ) from None
            out[spec.op_type] = spec
    return [out[k] for k in sorted(out)]

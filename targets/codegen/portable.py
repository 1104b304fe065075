"""The portable body of a generated kernel: a model-local ONNX function per fused op type.

A ``graphopt.fused`` node is a call of a model-local function (IR 8+) whose body is the chain it
replaced, in standard ONNX ops at the model's opset.  A bare onnxruntime session (any language,
any machine, no library) inlines the function and runs those ops; a session that registered the
bundle's kernel library runs the generated kernel instead (onnxruntime prefers a kernel an
execution provider claims over inlining the function).  So ``model.onnx`` never needs the
library: the kernels are the machine tier.

:func:`function_for` builds the body from the node's expression (:mod:`.expr`): runtime inputs
``x0..``, per-channel parameters ``p0..`` reshaped to broadcast along ``channel_axis``, float
literals as constants of the kernel's element type.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .expr import Expr
from .spec import DOMAIN, KernelSpec

#: the IR version that introduced model-local functions
FUNCTION_IR_VERSION = 8

_UNARY = {
    "relu": "Relu",
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
    "exp": "Exp",
    "log": "Log",
    "erf": "Erf",
    "abs": "Abs",
    "neg": "Neg",
    "sqrt": "Sqrt",
    "recip": "Reciprocal",
    "softplus": "Softplus",
    "hardswish": "HardSwish",
}
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min"}


class _Body:
    """Nodes of one function body, named t0, t1, ... (a function's names are its own)."""

    def __init__(self, spec: KernelSpec, opset: int) -> None:
        self.spec, self.opset = spec, opset
        self.dtype = np.dtype(spec.dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.names: dict[Expr, str] = {}

    def fresh(self) -> str:
        return f"t{len(self.nodes)}"

    def emit(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.fresh()
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def constant(self, value, dtype=None) -> str:
        array = np.asarray(value, dtype=dtype or self.dtype)
        return self.emit("Constant", [], value=numpy_helper.from_array(array))

    def param(self, index: int) -> str:
        """``p<index>`` (flattened per-channel values) shaped to broadcast along the axis."""
        trailing = -self.spec.channel_axis - 1
        if trailing == 0:
            return f"p{index}"
        shape = self.constant([-1] + [1] * trailing, np.int64)
        return self.emit("Reshape", [f"p{index}", shape])

    def value(self, e: Expr) -> str:
        if e in self.names:
            return self.names[e]
        if e.op == "x":
            name = f"x{e.index}"
        elif e.op == "p":
            name = self.param(e.index)
        elif e.op == "const":
            name = self.constant(e.value)
        else:
            name = self.call(e, [self.value(a) for a in e.args])
        self.names[e] = name
        return name

    def call(self, e: Expr, args: list[str]) -> str:
        if e.op == "hardswish" and self.opset < 14:  # HardSwish is opset 14
            gate = self.emit("HardSigmoid", args, alpha=1.0 / 6.0, beta=0.5)
            return self.emit("Mul", [args[0], gate])
        if e.op in _UNARY:
            return self.emit(_UNARY[e.op], args)
        if e.op in _BINARY:
            return self.emit(_BINARY[e.op], args)
        if e.op == "leakyrelu":
            return self.emit("LeakyRelu", args, alpha=e.lits[0])
        if e.op == "elu":
            return self.emit("Elu", args, alpha=e.lits[0])
        if e.op == "hardsigmoid":
            return self.emit("HardSigmoid", args, alpha=e.lits[0], beta=e.lits[1])
        if e.op == "pow":
            return self.emit("Pow", [args[0], self.constant(e.lits[0])])
        if e.op == "clip":
            lo, hi = e.lits
            if self.opset < 11:
                return self.emit("Clip", args, min=lo, max=hi)
            return self.emit("Clip", [args[0], self.constant(lo), self.constant(hi)])
        raise ValueError(f"no ONNX op for expression function {e.op!r}")


def function_for(spec: KernelSpec, opset: int) -> onnx.FunctionProto:
    """The model-local function ``graphopt.fused.<op type>`` computing ``spec`` with standard
    ops of default-domain ``opset``."""
    body = _Body(spec, opset)
    result = body.value(spec.expr)
    if result.startswith(("x", "p")):  # the body's output must be a node's
        result = body.emit("Identity", [result])
    body.nodes[-1].output[0] = "y"
    inputs = [f"x{i}" for i in range(spec.inputs)] + [f"p{i}" for i in range(spec.params)]
    return helper.make_function(
        DOMAIN,
        spec.op_type,
        inputs,
        ["y"],
        body.nodes,
        [helper.make_opsetid("", opset)],
        attributes=sorted(spec.attrs()),
        doc_string=f"portable body of the generated kernel {spec.expr.text()} ({spec.dtype})",
    )

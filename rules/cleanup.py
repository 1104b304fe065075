"""Exact cleanups (level 1): identities, inference-mode Dropout, operations that do nothing.

Each rule forwards its input in place of its output, so it only fires when the output is
provably the same tensor: same dtype, same static shape (broadcasting could otherwise grow it).
``CastLike(x, like)`` whose ``like`` has a statically known dtype becomes ``Cast(x, to=...)``
(the same conversion, so exact), which constant folding then evaluates when ``x`` is a constant
(torch.onnx dynamo exports spell Conv biases ``Expand(CastLike(0, x), Shape(W)[0:1])``).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import rank
from graphopt.opt.graph.ir import constant_value, dtype_of, static_shape
from graphopt.opt.rewrite.engine import (
    Const,
    Match,
    Op,
    Rule,
    applies_only_if,
    opt,
    require,
    require_forwardable,
)
from graphopt.opt.rewrite.manager import register_rule

from .activation import no_match


class Forward(Rule):
    """Base: replace the root's single output by ``m.src`` after the subclass's guards.  A no-op
    goes before any other rule rewrites it (a chain collapse would keep it in another form)."""

    level = 1
    priority = 1

    def forward_check(self, m: Match, cx) -> None:
        raise NotImplementedError

    def check(self, m: Match, cx) -> None:
        self.forward_check(m, cx)
        require_forwardable(cx.ir, m.root.outputs[0], m.src)

    def rewrite(self, m: Match, b):
        return [m.src] + [None] * (len(m.root.outputs) - 1)


@register_rule
class EliminateIdentity(Forward):
    name = "eliminate-identity"
    root = "Identity"
    summary = "remove Identity"
    pattern = Op("Identity", "src")

    def forward_check(self, m, cx):
        pass


@register_rule
class EliminateDropout(Forward):
    name = "eliminate-dropout"
    root = "Dropout"
    summary = "remove Dropout in inference mode"
    pattern = Op("Dropout", "src", opt("ratio"), opt("training_mode"))

    def forward_check(self, m, cx):
        if m.training_mode is not None:
            mode = constant_value(m.training_mode)
            require(
                mode is not None and not bool(mode),
                "training-mode",
                "Dropout's training_mode is not a constant false",
            )
        require(
            len(m.root.outputs) < 2 or not m.root.outputs[1].outputs,
            "mask-used",
            "Dropout's mask output is read by another node",
        )
        require(
            len(m.root.outputs) < 2 or not cx.ir.is_graph_output(m.root.outputs[1]),
            "mask-used",
            "Dropout's mask output is a graph output",
        )


def _same_tensor_shape(a, b) -> bool:
    sa, sb = static_shape(a), static_shape(b)
    return sa is not None and sa == sb


class NeutralBinary(Forward):
    """x op c → x when c is the operation's neutral element and the shape cannot grow."""

    def forward_check(self, m, cx):
        out = m.root.outputs[0]
        applies_only_if(dtype_of(m.src) is not None and dtype_of(m.src) == dtype_of(out))
        applies_only_if(_same_tensor_shape(m.src, out) or _scalarish(m.c, m.src))


def _scalarish(c, x) -> bool:
    """A constant of all-1 dims whose rank does not exceed x's (known) rank cannot grow x."""
    v = constant_value(c)
    shape = x.shape
    return (
        v is not None
        and all(d == 1 for d in v.shape)
        and shape is not None
        and len(v.shape) <= len(shape)
    )


#: (rule, op, neutral element, commutative, summary)
NEUTRAL_BINARIES = (
    ("eliminate-add-zero", "Add", 0.0, True, "x + 0 → x"),
    ("eliminate-sub-zero", "Sub", 0.0, False, "x - 0 → x"),
    ("eliminate-mul-one", "Mul", 1.0, True, "x * 1 → x"),
    ("eliminate-div-one", "Div", 1.0, False, "x / 1 → x"),
)

for _name, _op, _neutral, _commutes, _summary in NEUTRAL_BINARIES:
    register_rule(
        type(
            "Eliminate" + _op + "Neutral",
            (NeutralBinary,),
            {
                "name": _name,
                "summary": _summary,
                "pattern": Op(_op, "src", Const("c", value=_neutral), commute=_commutes),
            },
        )
    )


class ConstantWhere(Forward):
    """``Where(c, a, b)`` with a constant condition that is all true (→ a) or all false
    (→ b), when the other operands cannot grow the chosen one (SEW-D's mask of an unpadded
    input, constant before and after its Softmax)."""

    def forward_check(self, m, cx):
        out = m.root.outputs[0]
        applies_only_if(dtype_of(m.src) is not None and dtype_of(m.src) == dtype_of(out))
        applies_only_if(_same_tensor_shape(m.src, out))


for _name, _value, _summary, _branches in (
    ("eliminate-where-true", 1.0, "Where(all true, a, b) → a", ("src", "other")),
    ("eliminate-where-false", 0.0, "Where(all false, a, b) → b", ("other", "src")),
):
    register_rule(
        type(
            "EliminateWhere" + ("True" if _value else "False"),
            (ConstantWhere,),
            {
                "name": _name,
                "root": "Where",
                "summary": _summary,
                "pattern": Op("Where", Const("cond", value=_value, kind="b"), *_branches),
            },
        )
    )


@register_rule
class EliminateNoopCast(Forward):
    name = "eliminate-noop-cast"
    root = "Cast"
    summary = "Cast to the dtype the tensor already has"
    pattern = Op("Cast", "src")

    def forward_check(self, m, cx):
        src = dtype_of(m.src)
        applies_only_if(src is not None and src == dtype_of(m.root.outputs[0]))


@register_rule
class CastLikeToCast(Rule):
    name = "castlike-to-cast"
    root = "CastLike"
    level = 1
    summary = "CastLike whose target tensor has a static dtype → Cast (foldable)"
    pattern = Op("CastLike", "src", "like")

    def check(self, m, cx):
        target = dtype_of(m.like)
        applies_only_if(target is not None and dtype_of(m.root.outputs[0]) in (None, target))
        try:
            to = helper.np_dtype_to_tensor_dtype(target)
        except (KeyError, TypeError, ValueError):
            applies_only_if(False)
        saturate = m.root.attrs.get("saturate")
        require(
            saturate is None or int(saturate) == 1 or cx.ir.opset >= 19,
            "opset-too-old",
            "CastLike sets saturate=0, which Cast accepts only from opset 19",
        )
        m.stash(to=int(to), saturate=saturate)

    def rewrite(self, m, b):
        attrs = {"to": m.to}
        if m.saturate is not None and _has_saturate(b):
            attrs["saturate"] = int(m.saturate)
        return [b.op("Cast", [m.src], attrs, like=m.root.outputs[0])]


def _has_saturate(b) -> bool:
    """Cast has the ``saturate`` attribute from opset 19 (CastLike from 19 too)."""
    return b.ir.opset >= 19


@register_rule
class EliminateNoopTranspose(Forward):
    name = "eliminate-noop-transpose"
    root = "Transpose"
    summary = "Transpose with the identity permutation"
    pattern = Op("Transpose", "src")

    def forward_check(self, m, cx):
        perm = m.root.attrs.get("perm")
        applies_only_if(perm is not None and list(perm) == sorted(perm))


@register_rule
class EliminateNoopReshape(Forward):
    name = "eliminate-noop-reshape"
    root = "Reshape"
    summary = "Reshape whose output shape equals its input's"
    pattern = Op("Reshape", "src", "shape")

    def forward_check(self, m, cx):
        applies_only_if(_same_tensor_shape(m.src, m.root.outputs[0]))


@register_rule
class EliminateNoopExpand(EliminateNoopReshape):
    name = "eliminate-noop-expand"
    root = "Expand"
    summary = "Expand whose output shape equals its input's"
    pattern = Op("Expand", "src", "shape")


@register_rule
class EliminateNoopPad(Forward):
    name = "eliminate-noop-pad"
    root = "Pad"
    summary = "Pad with all-zero pads"
    pattern = Op("Pad", "src", opt("pads"), opt("value"), opt("axes"))

    def forward_check(self, m, cx):
        pads = constant_value(m.pads) if m.pads is not None else m.root.attrs.get("pads")
        applies_only_if(pads is not None and not np.any(np.asarray(pads)))


@register_rule
class EliminateNoopSlice(Forward):
    name = "eliminate-noop-slice"
    root = "Slice"
    summary = "Slice that keeps every element (start 0, end past the static dim, step 1)"
    pattern = Op("Slice", "src", "starts", "ends", opt("axes"), opt("steps"))

    def forward_check(self, m, cx):
        shape = m.src.shape
        vals = [constant_value(t) if t is not None else None for t in (m.starts, m.ends)]
        applies_only_if(shape is not None and all(v is not None for v in vals))
        starts, ends = (np.asarray(v).reshape(-1) for v in vals)
        rank = len(shape)
        axes = constant_value(m.axes) if m.axes is not None else np.arange(len(starts))
        steps = constant_value(m.steps) if m.steps is not None else np.ones(len(starts))
        applies_only_if(axes is not None and steps is not None and len(axes) == len(starts))
        for a, st, en, step in zip(np.asarray(axes).reshape(-1), starts, ends, np.asarray(steps)):
            dim = shape[int(a) % rank] if -rank <= int(a) < rank else None
            applies_only_if(isinstance(dim, (int, np.integer)) and step == 1)
            applies_only_if((st == 0 or st <= -dim) and en >= dim)


@register_rule
class EliminateSingleConcat(Forward):
    name = "eliminate-single-concat"
    root = "Concat"
    summary = "Concat of a single input"
    pattern = Op("Concat", "src")

    def forward_check(self, m, cx):
        pass


@register_rule
class ConcatDropEmpty(Rule):
    """An input of no width along the Concat's axis adds nothing (GPT-NeoX-style partial
    rotary at 100 %: the pass-through slice is empty): the Concat of the others, exact."""

    name = "concat-drop-empty"
    level = 1
    priority = 1
    summary = "drop Concat inputs empty along its axis"
    pattern = Op("Concat")

    def match(self, node, cx):
        ins = list(node.inputs)
        r = rank(node.outputs[0])
        if r is None or len(ins) < 2 or any(rank(t) != r for t in ins):
            raise no_match()
        axis = int(node.attrs.get("axis", 0)) % r
        dims = current_dims()
        kept = [t for t in ins if dims.key(t, axis) != ("int", 0)]
        if len(kept) in (0, len(ins)) or dtype_of(kept[0]) != dtype_of(node.outputs[0]):
            raise no_match()
        m = Match(node, {"concat": node})
        m.stash(kept=kept)
        return m

    def rewrite(self, m: Match, b):
        node = m.root
        return [b.op("Concat", m.kept, dict(node.attrs), like=node.outputs[0], name=node.name)]


def _last_axis_only(node, r: int) -> bool:
    """Whether a ReduceMax names only the last of ``r`` axes and keeps it."""
    axes = constant_value(node.inputs[1]) if len(node.inputs) > 1 else node.attrs.get("axes")
    if axes is None or not node.attrs.get("keepdims", 1):
        return False
    axes = [int(a) % r for a in np.asarray(axes).reshape(-1)]
    return axes == [r - 1]


@register_rule
class SoftmaxOfShiftedRows(Rule):
    """``Softmax(z − ReduceMax(z))`` over the last axis → ``Softmax(z)``: the Softmax
    subtracts the row maximum itself, and ``max(z − m) = 0`` exactly, so each exponent is
    the same ``z − m`` bit for bit (MiMo-V2's attention, a stabilized softmax spelled out).
    The Sub and ReduceMax stay for any other reader."""

    name = "softmax-of-shifted-rows"
    level = 1
    exclusive = False  # the Sub may have other readers: the Softmax alone stops reading it
    summary = "Softmax(z − rowmax(z)) → Softmax(z) (the Softmax shifts by the row max itself)"
    pattern = Op(
        "Softmax", Op("Sub", "z", Op("ReduceMax", "z", opt("axes"), name="rowmax"), name="shift")
    )

    def check(self, m, cx):
        r = rank(m.root.outputs[0])
        applies_only_if(r is not None and r >= 1)
        axis = int(m.root.attrs.get("axis", -1)) % r
        applies_only_if(axis == r - 1 and _last_axis_only(m.rowmax, r))
        applies_only_if(dtype_of(m.z) == dtype_of(m.root.outputs[0]))

    def rewrite(self, m, b):
        return [b.op("Softmax", [m.z], dict(m.root.attrs), like=m.root.outputs[0])]


@register_rule
class RangeScalarInputs(Rule):
    """``Range`` takes scalars; onnxruntime also runs one-element vectors, which exporters leave
    behind an ``If`` (AffineGrid's expansion splits a shape vector).  Once a rewrite makes such a
    [1] shape visible, onnx.checker rejects the model, so the vector becomes the scalar it meant
    (the same value: exact)."""

    name = "range-scalar-inputs"
    level = 1
    summary = "one-element Range inputs as scalars"
    pattern = Op("Range", "start", "limit", "delta")

    def structure(self, m: Match, cx) -> None:
        applies_only_if(any(_one_element_vector(t) for t in m.root.inputs))

    def rewrite(self, m: Match, b):
        scalars = [_as_scalar(t, b) if _one_element_vector(t) else t for t in m.root.inputs]
        return [b.op("Range", scalars, like=m.root.outputs[0])]


def _one_element_vector(t) -> bool:
    value = constant_value(t)
    shape = value.shape if value is not None else static_shape(t)
    return shape is not None and tuple(shape) == (1,)


def _as_scalar(t, b):
    value = constant_value(t)
    if value is not None:
        return b.const(value.reshape(()), "scalar")
    return b.op("Reshape", [t, b.const(np.zeros((0,), np.int64), "scalar_shape")])

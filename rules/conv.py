"""Convolution fusions (level 2): fold BatchNormalization, per-channel Add and Mul, and Pad.

Algebra (computed in float64, then stored in the weight dtype behind a precision guard):

* Conv+BN:  s = gamma / sqrt(var + eps);  W' = W · s (per output channel);
            B' = (B − mean) · s + beta
* Conv+Mul: W' = W · c;  B' = B · c          (c broadcast per output channel only)
* Conv+Add: B' = B + c                        (c broadcast per output channel only)
* Pad+Conv: zero constant padding of spatial axes moves into Conv's ``pads``.

"Per output channel" is checked exactly: after right-aligning the constant with the Conv output
(rank r), every axis but axis 1 must have size 1 and axis 1 must be 1 or C_out.  A width- or
height-broadcast constant is refused ("not-per-channel"): folding it would change outputs.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.ir import Constant, constant_value, dtype_of
from graphopt.opt.manager import register_rule
from graphopt.opt.precision import (
    require_accumulation_in_range,
    require_refold_allowed,
    require_representable,
)
from graphopt.opt.rewrite import (
    Op,
    Rule,
    applies_only_if,
    opt,
    require,
    require_constant,
    value,
)


def _float_weights(m) -> np.dtype:
    dt = dtype_of(m.W)
    require(
        dt is not None and dt.kind == "f",
        "non-float-weights",
        f"weights of '{m.conv.name}' are {dt}, only float weights are folded",
    )
    return dt


class ConvScaleBase(Rule):
    """Shared by Conv and ConvTranspose: how to scale weights per output channel."""

    conv_op = "Conv"

    def out_channels(self, w: np.ndarray, group: int) -> int:
        return w.shape[0] if self.conv_op == "Conv" else w.shape[1] * group

    def store(self, m, cx, w_new: np.ndarray, b_new: np.ndarray, dt: np.dtype) -> None:
        """Precision guards on the folded float64 values, then stash them in the weight dtype."""
        stored_w = require_representable(w_new, dt, "Conv weights")
        stored_b = require_representable(b_new, dt, "Conv bias")
        out_axis = 0 if self.conv_op == "Conv" else 1
        require_accumulation_in_range(cx, m.X.name, w_new, b_new, dt, self.conv_op, out_axis)
        require_refold_allowed(cx, dt, "Conv weights", int(w_new.size))
        m.stash(w_new=stored_w, b_new=stored_b)

    def scale_weights(self, w: np.ndarray, s: np.ndarray, group: int) -> np.ndarray:
        if self.conv_op == "Conv":
            return w * s.reshape((-1,) + (1,) * (w.ndim - 1))
        # ConvTranspose: W is [C_in, C_out/group, k...]; output channel g*(C_out/g)+j.
        c_in, c_per = w.shape[0], w.shape[1]
        grouped = w.reshape((group, c_in // group, c_per) + w.shape[2:])
        scale = s.reshape((group, 1, c_per) + (1,) * (w.ndim - 2))
        return (grouped * scale).reshape(w.shape)


@register_rule
class FuseConvBatchNorm(ConvScaleBase):
    name = "fuse-conv-bn"
    root = "BatchNormalization"
    summary = "fold BatchNormalization into the preceding Conv's weights and bias"
    pattern = Op(
        "BatchNormalization",
        Op("Conv", "X", "W", opt("B"), name="conv", out="y"),
        "gamma",
        "beta",
        "mean",
        "var",
        name="bn",
    )

    def check(self, m, cx):
        require(
            len([t for t in m.bn.outputs if t.outputs or cx.ir.is_graph_output(t)]) <= 1
            and not m.bn.attrs.get("training_mode", 0),
            "training-mode",
            "BatchNormalization runs in training mode (its running statistics are outputs)",
        )
        require(
            m.bn.attrs.get("spatial", 1) == 1,
            "bn-not-spatial",
            "BatchNormalization with spatial=0 normalizes per element, not per channel",
        )
        require_constant(
            cx,
            cx.ir,
            ("conv weight W", m.W),
            ("conv bias B", m.B),
            ("BN scale", m.gamma),
            ("BN bias", m.beta),
            ("BN running_mean", m.mean),
            ("BN running_var", m.var),
        )
        dt = _float_weights(m)
        w = value(m.W).astype(np.float64)
        group = int(m.conv.attrs.get("group", 1))
        c_out = self.out_channels(w, group)
        params = [value(t).astype(np.float64).reshape(-1) for t in (m.gamma, m.beta, m.mean, m.var)]
        require(
            all(p.size == c_out for p in params),
            "channel-mismatch",
            f"BN has {params[0].size} channels, the Conv produces {c_out}",
        )
        gamma, beta, mean, var = params
        eps = float(m.bn.attrs.get("epsilon", 1e-5))
        s = gamma / np.sqrt(var + eps)
        b = value(m.B).astype(np.float64) if m.B is not None else np.zeros(c_out)
        self.store(m, cx, self.scale_weights(w, s, group), (b - mean) * s + beta, dt)

    def rewrite(self, m, b):
        w = b.const(m.w_new, "W")
        bias = b.const(m.b_new, "B")
        out = b.op(
            self.conv_op,
            [m.X, w, bias],
            dict(m.conv.attrs),
            like=m.root.outputs[0],
            name=f"{m.conv.name or self.conv_op}/bn",
        )
        return [out] + [None] * (len(m.root.outputs) - 1)


@register_rule
class FuseConvTransposeBatchNorm(FuseConvBatchNorm):
    name = "fuse-convtranspose-bn"
    conv_op = "ConvTranspose"
    summary = "fold BatchNormalization into the preceding ConvTranspose"
    pattern = Op(
        "BatchNormalization",
        Op("ConvTranspose", "X", "W", opt("B"), name="conv", out="y"),
        "gamma",
        "beta",
        "mean",
        "var",
        name="bn",
    )


def per_channel(c: np.ndarray, out_rank: int, c_out: int) -> np.ndarray | None:
    """The per-output-channel vector that ``c`` broadcasts as, or None if it is not one."""
    if c.ndim > out_rank:
        return None
    shape = (1,) * (out_rank - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1):
        return None
    if shape[1] not in (1, c_out):
        return None
    return np.broadcast_to(c.reshape(-1), (c_out,)) if c.size == 1 else c.reshape(-1)


class FuseConvElementwise(ConvScaleBase):
    """Conv followed by Add/Mul with a constant: fold the constant into weights/bias."""

    def structure(self, m, cx):
        # A computed operand (a residual branch) is another pattern, not a missed fusion; a graph
        # input is worth a remark (weights exported as inputs).
        applies_only_if(isinstance(m.c, Constant) or cx.ir.is_graph_input(m.c))

    def check(self, m, cx):
        require_constant(
            cx, cx.ir, ("conv weight W", m.W), ("conv bias B", m.B), (f"{self.root} operand", m.c)
        )
        dt = _float_weights(m)
        c = value(m.c)
        require(
            dtype_of(m.c) == dt,
            "dtype-mismatch",
            f"{self.root} operand is {c.dtype}, weights are {dt}",
        )
        w = value(m.W).astype(np.float64)
        c_out = self.out_channels(w, int(m.conv.attrs.get("group", 1)))
        vec = per_channel(c, w.ndim, c_out)
        require(
            vec is not None,
            "not-per-channel",
            f"{self.root} operand of shape {list(c.shape)} does not broadcast per output "
            f"channel of the {w.ndim}-D Conv output (C_out={c_out}); folding it would "
            "change the result",
        )
        b = value(m.B).astype(np.float64) if m.B is not None else np.zeros(c_out)
        w_new, b_new = self.fold(w, b, vec.astype(np.float64), int(m.conv.attrs.get("group", 1)))
        self.store(m, cx, w_new, b_new, dt)

    def fold(self, w, b, vec, group):
        raise NotImplementedError

    def rewrite(self, m, b):
        out = b.op(
            self.conv_op,
            [m.X, b.const(m.w_new, "W"), b.const(m.b_new, "B")],
            dict(m.conv.attrs),
            like=m.root.outputs[0],
            name=f"{m.conv.name or self.conv_op}/{self.root.lower()}",
        )
        return [out]


@register_rule
class FuseConvAdd(FuseConvElementwise):
    name = "fuse-conv-add"
    root = "Add"
    summary = "fold a per-channel constant Add into the Conv bias"
    pattern = Op("Add", Op("Conv", "X", "W", opt("B"), name="conv", out="y"), "c", commute=True)

    def fold(self, w, b, vec, group):
        return w, b + vec


@register_rule
class FuseConvMul(FuseConvElementwise):
    name = "fuse-conv-mul"
    root = "Mul"
    summary = "fold a per-channel constant Mul into the Conv weights and bias"
    pattern = Op("Mul", Op("Conv", "X", "W", opt("B"), name="conv", out="y"), "c", commute=True)

    def fold(self, w, b, vec, group):
        return self.scale_weights(w, vec, group), b * vec


@register_rule
class FusePadConv(Rule):
    name = "fuse-pad-conv"
    root = "Conv"
    summary = "move zero constant Pad of spatial axes into Conv pads"
    pattern = Op(
        "Conv",
        Op("Pad", "X", opt("pads"), opt("value"), opt("axes"), name="pad"),
        "W",
        opt("B"),
        name="conv",
    )

    def check(self, m, cx):
        mode = m.pad.attrs.get("mode", "constant")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        require(mode == "constant", "pad-mode", f"Pad mode is '{mode}', only constant is foldable")
        pads = constant_value(m.pads) if m.pads is not None else m.pad.attrs.get("pads")
        require(pads is not None, "non-constant-param", "Pad's pads are computed at run time")
        pads = np.asarray(pads, dtype=np.int64).reshape(-1)
        fill = constant_value(m.value) if m.value is not None else m.pad.attrs.get("value", 0.0)
        require(
            fill is not None and np.all(np.asarray(fill) == 0),
            "nonzero-pad-value",
            "Pad fills with a non-zero value; Conv pads with zeros",
        )
        w = constant_value(m.W) if m.W is not None else None
        rank = w.ndim if w is not None else (len(m.X.shape) if m.X.shape is not None else None)
        require(rank is not None, "unknown-rank", "the Conv's rank is unknown")
        if m.axes is not None:
            axes = constant_value(m.axes)
            require(axes is not None, "non-constant-param", "Pad's axes are computed at run time")
            full = np.zeros(2 * rank, dtype=np.int64)
            for k, a in enumerate(np.asarray(axes).reshape(-1)):
                a = int(a) % rank
                full[a], full[a + rank] = pads[k], pads[k + len(axes)]
            pads = full
        require(pads.size == 2 * rank, "pad-rank", "Pad's pads do not match the Conv's rank")
        require(np.all(pads >= 0), "negative-pads", "Pad crops (negative pads)")
        require(
            pads[0] == pads[1] == pads[rank] == pads[rank + 1] == 0,
            "pads-non-spatial",
            "Pad pads the batch or channel axis",
        )
        auto = m.conv.attrs.get("auto_pad", "NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else auto
        require(auto == "NOTSET", "auto-pad", f"Conv uses auto_pad={auto}")
        spatial = rank - 2
        old = list(m.conv.attrs.get("pads", [0] * (2 * spatial)))
        new = [old[i] + int(pads[2 + i]) for i in range(spatial)] + [
            old[spatial + i] + int(pads[rank + 2 + i]) for i in range(spatial)
        ]
        m.stash(new_pads=new)

    def rewrite(self, m, b):
        attrs = dict(m.conv.attrs)
        attrs["pads"] = m.new_pads
        inputs = [m.X, m.W] + ([m.B] if m.B is not None else [])
        return [b.op("Conv", inputs, attrs, like=m.root.outputs[0], name=f"{m.conv.name}/pad")]

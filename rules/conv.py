"""Convolution fusions (level 2): fold BatchNormalization, per-channel Add and Mul, and Pad into a
Conv, and Conv [+ Z] + activation into FusedConv.

Folds are computed in float64 and stored in the weight dtype only behind precision guards: into
fp16/bf16 weights only where the folded layer's measured error is no worse than the unfused
graph's (``opt/numerics/precision.require_refold_no_worse``), or, for Conv+BN on a target that
runs onnxruntime at level BASIC or above, than onnxruntime's own fold, which it does anyway.  The
algebra and the measurements behind this: docs/rules.md (Conv algebra), docs/benchmarks.md.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import same_dim
from graphopt.opt.graph.ir import Constant, constant_value, dtype_of
from graphopt.opt.numerics.float16_fold import (
    compensated_rows_started,
    fold_rows,
    largest_magnitude_bits,
    require_no_worse_than_runtime,
    runtime_bn_scale,
    runtime_folds,
    runtime_scaled,
)
from graphopt.opt.numerics.halfcast import float64
from graphopt.opt.numerics.precision import (
    flushes_too_many,
    refold_measured,
    refold_probe,
    representable_scaled_rows,
    require_accumulation_in_range,
    require_refold_no_worse,
    require_representable,
    rounds_within_tolerance,
)
from graphopt.opt.rewrite.engine import (
    Alt,
    NoMatch,
    Op,
    Rule,
    applies_only_if,
    opt,
    require,
    require_constant,
    value,
)
from graphopt.opt.rewrite.manager import register_rule
from graphopt.rules.activation import MS, float_type, inputs, scalar


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

    def store(self, m, cx, w, b, scale, shift, dt, stats=None, runtime=None) -> None:
        """Fold ``z = scale·Conv(x) + shift`` (per output channel) into the weights ``w`` (as
        stored) in float64, check it with the precision guards, then stash it in the weight
        dtype (float32 Conv weights: in one native pass where every guard passes, the same
        values).  ``runtime``: returns onnxruntime's per-channel scale and bias of its own fold of
        this pattern (``runtime_bn_scale``), when it has one."""
        if self._store_rows(m, cx, w, b, scale, shift, dt, stats, runtime):
            return
        group = int(m.conv.attrs.get("group", 1))
        b_new = b * scale + shift
        stored_w = w_new = None
        if self.conv_op == "Conv":
            stored_w = representable_scaled_rows(w.reshape(w.shape[0], -1), scale, dt)
        if stored_w is not None:
            stored_w = stored_w.reshape(w.shape)
        else:
            w64 = float64(w)
            w_new = self.scale_weights(w64, scale, group)
            stored_w = require_representable(w_new, dt, "Conv weights")
        # float16: the re-rounding runs on the rounding threads while this one checks the bias
        # and the range and measures the unfused layer (and onnxruntime's own fold, where it
        # would be the yardstick): the same checks, in the same order, on both cores
        rounded = self.compensated(w_new, stored_w, group) if np.dtype(dt) == np.float16 else None
        try:
            stored_b = require_representable(b_new, dt, "Conv bias")
            out_axis = 0 if self.conv_op == "Conv" else 1
            require_accumulation_in_range(cx, m.X.name, w_new, b_new, dt, self.conv_op, out_axis)
            probe, theirs = None, None
            if refold_measured(cx, dt):
                probe = refold_probe(self.rows(w64, group), b, scale, shift, dt, stats)
            if probe is not None and runtime is not None and runtime_folds(cx.target):
                their_scale, their_bias = runtime()
                their_rows = self.rows(float64(runtime_scaled(w, their_scale)), group)
                theirs = probe(their_rows, float64(their_bias))
        finally:
            if rounded is not None:
                stored_w = rounded()
        ours: dict[str, float] = {}

        def measure() -> dict[str, float]:
            if not ours:
                rows = self.rows(float64(stored_w), group)
                ours.update(probe(rows, float64(stored_b)))
            return ours

        _require_refold_kept(cx, dt, measure, theirs)
        m.stash(w_new=stored_w, b_new=stored_b)

    def _store_rows(self, m, cx, w, b, scale, shift, dt, stats, runtime) -> bool:
        """:meth:`store` of a measured float16 Conv fold, folded and measured in blocks of
        output channels (``fold_rows``); False, leaving it to the whole-layer path, where that
        path's precision guards would refuse before measuring (it then says why) or where
        calibration ranges bound the accumulation."""
        if not (self.conv_op == "Conv" and dt == np.float16 and refold_measured(cx, dt)):
            return False
        if cx.ranges or not (np.isfinite(scale).all() and np.isfinite(shift).all()):
            return False
        rows = w.reshape(w.shape[0], -1)
        if rows.size == 0:
            return False
        largest = largest_magnitude_bits(rows)
        if largest.max() >= 0x7C00:  # an infinity or a NaN
            return False
        peak = float((largest.view(np.float16).astype(np.float64) * np.abs(scale)).max())
        if not (0 < peak <= float(np.finfo(np.float16).max) and rounds_within_tolerance(peak, dt)):
            return False
        try:
            stored_b = require_representable(b * scale + shift, dt, "Conv bias")
        except NoMatch:
            return False
        their = runtime() if runtime is not None and runtime_folds(cx.target) else None
        fold = fold_rows(rows, scale, shift, b, stored_b, stats, their)
        if flushes_too_many(fold.flushed, fold.nonzero):
            return False
        _require_refold_kept(cx, dt, lambda: fold.ours, fold.theirs)
        m.stash(w_new=fold.weights.reshape(w.shape), b_new=stored_b)
        return True

    def compensated(self, exact: np.ndarray, stored: np.ndarray, group: int):
        """``stored`` (``exact`` rounded to nearest float16) with each output channel's row
        re-rounded by :func:`compensated_rows`, started on the rounding threads: returns what
        waits for it."""
        if self.conv_op == "Conv":  # a row is an output channel's slice: views, no index
            rows = (exact.shape[0], -1)
            done = compensated_rows_started(exact.reshape(rows), stored.reshape(rows))
            return lambda: done().reshape(exact.shape)
        index = self.rows(np.arange(exact.size).reshape(exact.shape), group)
        flat = stored.reshape(-1).copy()
        done = compensated_rows_started(exact.reshape(-1)[index], flat[index])

        def scattered() -> np.ndarray:
            flat[index] = done()
            return flat.reshape(exact.shape)

        return scattered

    def rows(self, w: np.ndarray, group: int) -> np.ndarray:
        """The weights as one row per output channel: the values that channel's sum reads."""
        if self.conv_op == "Conv":
            return w.reshape(w.shape[0], -1)
        c_in, c_per = w.shape[0], w.shape[1]
        grouped = w.reshape((group, c_in // group, c_per, -1))
        return np.moveaxis(grouped, 2, 1).reshape(group * c_per, -1)

    def scale_weights(self, w: np.ndarray, s: np.ndarray, group: int) -> np.ndarray:
        if self.conv_op == "Conv":
            return w * s.reshape((-1,) + (1,) * (w.ndim - 1))
        # ConvTranspose: W is [C_in, C_out/group, k...]; output channel g*(C_out/g)+j.
        c_in, c_per = w.shape[0], w.shape[1]
        grouped = w.reshape((group, c_in // group, c_per) + w.shape[2:])
        scale = s.reshape((group, 1, c_per) + (1,) * (w.ndim - 2))
        return (grouped * scale).reshape(w.shape)


def _require_refold_kept(cx, dt, measure, theirs) -> None:
    """A float16/bfloat16 refold is kept when no worse than the unfused graph
    (``require_refold_no_worse``) or, failing that, than onnxruntime's own fold (``theirs``,
    when it would make one)."""
    try:
        require_refold_no_worse(cx, dt, "Conv weights", measure)
    except NoMatch:
        if theirs is None:
            raise
        require_no_worse_than_runtime(dt, measure(), theirs)


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
        w = value(m.W)
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
        runtime = None
        if self.conv_op == "Conv" and dt == np.float16:
            params = (m.B, m.gamma, m.beta, m.mean, m.var)

            def runtime() -> tuple[np.ndarray, np.ndarray]:
                stored = [value(t) if t is not None else None for t in params]
                return runtime_bn_scale(*stored, eps)

        self.store(m, cx, w, b, s, beta - mean * s, dt, stats=(mean, var), runtime=runtime)

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
        w = value(m.W)
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
        scale, shift = self.affine(vec.astype(np.float64))
        self.store(m, cx, w, b, scale, shift, dt)

    def affine(self, vec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel (scale, shift) the op applies to the Conv output."""
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

    def affine(self, vec):
        return np.ones_like(vec), vec


@register_rule
class FuseConvMul(FuseConvElementwise):
    name = "fuse-conv-mul"
    root = "Mul"
    summary = "fold a per-channel constant Mul into the Conv weights and bias"
    pattern = Op("Mul", Op("Conv", "X", "W", opt("B"), name="conv", out="y"), "c", commute=True)

    def affine(self, vec):
        return vec, np.zeros_like(vec)


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


# ------------------------------------------------------ Conv [+ Z] + activation → FusedConv
class FuseConvActivation(Rule):
    """``act(Conv(X, W, B) [+ Z])`` → ``com.microsoft.FusedConv(X, W, B, Z; activation)``.

    Lowered only where the target has a FusedConv kernel for the dtype and accepts the
    activation (``Target.kernel_attributes``; onnxruntime CUDA runs only Relu).  ``Z`` (the
    residual of ResNet blocks) must have exactly the Conv output's shape: the kernel adds it
    element by element, without broadcasting.  Where the target measured the residual form
    slower (``measured_slower["FusedConv(Z)"]``: on cpu, onnxruntime's ALL-level NCHWc layout
    takes Conv + Add + activation itself but leaves a FusedConv with Z in NCHW between
    reorders), only Conv + activation fuses.
    """

    level = 2
    exclusive = True

    def structure(self, m, cx):
        applies_only_if(cx.target.has_kernel("FusedConv", MS))
        applies_only_if(m.get("z") is not m.conv.outputs[0])

    def check(self, m, cx):
        y = m.conv.outputs[0]
        tname = float_type(y)
        require(
            cx.target.runs_fused("FusedConv", MS, 1, tname, ("Conv", "", cx.ir.opset)),
            "no-kernel",
            f"target {cx.target.name} has no FusedConv kernel for {tname}",
            dtype=tname,
        )
        allowed = cx.target.kernel_attributes.get("FusedConv", {}).get("activation")
        require(
            allowed is None or self.root in allowed,
            "unsupported-activation",
            f"target {cx.target.name}'s FusedConv runs only {', '.join(allowed or ())}",
            activation=self.root,
        )
        z = m.get("z")
        if z is not None:
            require(
                dtype_of(z) == dtype_of(y),
                "dtype-mismatch",
                "the added tensor differs in dtype from the Conv output",
            )
            same = (
                z.shape is not None
                and y.shape is not None
                and len(z.shape) == len(y.shape)
                and all(same_dim(z, i, y, i) for i in range(len(y.shape)))
            )
            require(
                same,
                "shape-mismatch",
                f"'{z.name}' {z.shape} is not provably the Conv output's shape {y.shape}; "
                "FusedConv adds Z without broadcasting",
            )
            slower = cx.target.measured_slower.get("FusedConv(Z)")
            require(
                slower is None,
                "slower-on-target",
                f"the residual Add stays for onnxruntime on {cx.target.name}: {slower}",
                measured=slower,
            )
        m.stash(params=self.params(m))

    def params(self, m) -> list[float]:
        if self.root == "Clip":
            return _clip_params(m.root)
        return [float(m.root.attrs.get(a, d)) for a, d in ACTIVATION_PARAMS.get(self.root, ())]

    def rewrite(self, m, b):
        attrs = dict(m.conv.attrs)
        attrs["activation"] = self.root
        if m.params:
            attrs["activation_params"] = m.params
        z = m.get("z")
        fused_ins = [m.X, m.W, m.B] + ([z] if z is not None else [])
        while fused_ins[-1] is None:
            fused_ins.pop()
        out = b.op(
            "FusedConv",
            fused_ins,
            attrs,
            domain=MS,
            like=m.root.outputs[0],
            name=f"{m.conv.name}/{self.root}",
        )
        return [out]


#: activation → (attribute, default) of its FusedConv activation_params (Clip: its bounds)
ACTIVATION_PARAMS = {
    "LeakyRelu": (("alpha", 0.01),),
    "HardSigmoid": (("alpha", 0.2), ("beta", 0.5)),
}

#: (rule, activation, as the summary names it)
CONV_ACTIVATIONS = (
    ("fuse-conv-relu", "Relu", "Relu"),
    ("fuse-conv-sigmoid", "Sigmoid", "Sigmoid"),
    ("fuse-conv-tanh", "Tanh", "Tanh"),
    ("fuse-conv-leaky-relu", "LeakyRelu", "LeakyRelu"),
    ("fuse-conv-hard-sigmoid", "HardSigmoid", "HardSigmoid"),
    ("fuse-conv-clip", "Clip", "Clip (ReLU6)"),
)


def _conv_activation_pattern(act: str) -> Alt:
    """``act(Conv(X, W, B))`` or ``act(Conv(X, W, B) + Z)`` (Z on either side)."""

    def conv() -> Op:
        return Op("Conv", "X", "W", opt("B"), name="conv")

    return Alt(
        Op(act, conv(), extra_inputs=True),
        Op(act, Op("Add", conv(), "z", commute=True, name="add"), extra_inputs=True),
    )


for _rule, _act, _label in CONV_ACTIVATIONS:
    register_rule(
        type(
            "FuseConv" + _act,
            (FuseConvActivation,),
            {
                "name": _rule,
                "summary": f"Conv [+ Z] + {_label} → com.microsoft.FusedConv",
                "pattern": _conv_activation_pattern(_act),
            },
        )
    )


def _clip_params(clip) -> list[float]:
    """Clip's (min, max) as FusedConv's activation_params (attributes before opset 11)."""
    if len(clip.inputs) <= 1 and ("min" in clip.attrs or "max" in clip.attrs):
        bounds = [clip.attrs.get("min"), clip.attrs.get("max")]  # opset < 11
    else:
        ins = inputs(clip)[1:3] + [None, None]
        bounds = []
        for t in ins[:2]:
            if t is None:
                bounds.append(None)
                continue
            v = scalar(t)
            require(v is not None, "non-constant-param", "a Clip bound is not a constant")
            bounds.append(v)
    big = float(np.finfo(np.float32).max)
    lo = -big if bounds[0] is None else float(bounds[0])
    hi = big if bounds[1] is None else float(bounds[1])
    return [lo, hi]

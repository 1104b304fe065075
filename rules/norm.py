"""Normalization fusions (level 2): LayerNorm, RMSNorm, Add + LayerNorm → SkipLayerNormalization,
Add + RMSNorm → SkipSimplifiedLayerNormalization.

Three small rules compose into the whole LayerNorm fusion, so a partial form still fuses as far as
its guards allow and every refusal names the clause that failed:

* ``fuse-layer-norm`` (root: the division) — ``(x − mean(x)) / sqrt(mean((x − mean(x))²) + eps)``
  with ``Pow(d, 2)`` or ``d·d``, ``Div`` or ``Mul`` by ``Reciprocal``/``1/·``/``Pow(·, −0.5)``,
  duplicated ``Sub`` nodes accepted → ``LayerNormalization(x, ones, axis=−1, epsilon=eps)``.
* ``fold-norm-scale`` (root: ``Mul``) — ``Mul(LN(x, γ0, β0), c)`` → ``LN(x, γ0·c, β0·c)``, also for
  RMSNormalization and SkipSimplifiedLayerNormalization (its residual-sum output kept);
  ``fold-layer-norm-bias`` (root: ``Add``) — ``Add(LN(x, γ, β0), c)`` → ``LN(x, γ, β0 + c)``.
  ``c`` must be constant and vary along the last axis only.
* ``fuse-rms-norm`` — ``x / sqrt(mean(x²) + eps)`` (or ``x · rsqrt``) → ``RMSNormalization``
  (opset ≥ 23).  onnxruntime's ``SimplifiedLayerNormalization`` is registered only in the ONNX
  domain, where onnx.checker rejects it, so it is used only if a target lists it under
  com.microsoft; below opset 23 the norm stays decomposed with ``opset-too-old`` (``--opset 23``).
  Measured (examples/llm/first_norm_bench.py, onnxruntime 1.32 CPU): the decomposed norm is
  what onnxruntime's session-time fusion turns into that same SimplifiedLayerNormalization, so
  it runs as fast as the ONNX-domain op would (which onnx.checker rejects), while a
  com.microsoft SkipSimplifiedLayerNormalization with a zero skip built at run time, the only
  valid contrib spelling without a residual, is slower: the first norm of a decoder stays
  decomposed.
* ``fuse-skip-rms-norm`` (before ``fuse-rms-norm`` at the same root) — the same RMSNorm of a
  residual sum ``a + b`` of two run-time tensors of one 2-D/3-D shape (a decoder's
  ``h = h + attn; n = RMSNorm(h)``) → ``com.microsoft.SkipSimplifiedLayerNormalization(a, b, γ)``
  at any opset; the sum, when read elsewhere (the next residual), comes from its fourth output
  (``input_skip_bias_sum``), the statistics outputs are left out.  Both exporters' spellings
  (``Div(1, Sqrt)``·x, ``Reciprocal(Sqrt)``·x, ``x / Sqrt``), and the fp32 upcast Casts of an
  fp32 model, which the cleanups remove first.  The weight (Gemma's folded ``1 + w`` too) is
  then folded into γ by ``fold-norm-scale``.  An fp16/bf16 sum upcast to fp32 for the norm
  (transformers: ``Cast(h → float32)``, the norm, ``Cast`` back, the weight) fuses in the sum's
  dtype where the target accumulates in fp32, when the fp32 norm is read only by Casts back to
  that dtype (the same rounding point); a float32 weight applied before the Cast back (Gemma)
  is refused with ``precision-rounding``.
* ``fuse-skip-layer-norm`` (root: ``LayerNormalization``) — ``LN(a + b)`` →
  ``com.microsoft.SkipLayerNormalization(a, b, γ, β)``; the sum, when read elsewhere, comes from
  its fourth output.  Refused with ``slower-on-target`` where the target profile records it as
  measured slower (onnxruntime CPU: 5–6× slower than Add + LayerNormalization).

Guards (missed remarks): ``axes-not-last`` (the reductions are not over exactly the last axis),
``keepdims``, ``non-constant-param`` (eps/γ/β not constants), ``non-scalar-param`` (eps),
``constant-mismatch`` (the square is not a power 2), ``unknown-shape`` (the normalized width is
not static), ``opset-too-old`` (LayerNormalization is standard from opset 17),
``precision-accumulation`` (fp16/bf16 unless the target declares fp32 accumulation for the
kernel), ``no-kernel``, ``not-last-axis``, ``shape-mismatch``, ``slower-on-target``,
``shared-intermediate`` (a skip norm's residual sum is a graph output), ``precision-rounding``.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphopt.opt.graph.dims import same_dim
from graphopt.opt.graph.ir import Constant, Node, Tensor, Variable, constant_value, dtype_of
from graphopt.opt.numerics.precision import require_representable
from graphopt.opt.rewrite.engine import (
    Alt,
    Const,
    Match,
    Op,
    Pattern,
    Rule,
    Var,
    applies_only_if,
    opt,
    require,
    require_constant,
)
from graphopt.opt.rewrite.manager import register_rule

from .activation import (
    MS,
    float_type,
    inputs,
    last_dim,
    lowering,
    producer,
    require_near,
    scalar,
)


# ------------------------------------------------------------------------- matching
def _rank(t: Tensor) -> int | None:
    return len(t.shape) if t.shape is not None else None


def _reduce_axes(node: Node) -> tuple[list[int] | None, str | None]:
    """(axes, problem) of a ReduceMean: attribute before opset 18, input from 18."""
    ins = inputs(node)
    if len(ins) > 1 and ins[1] is not None:
        v = constant_value(ins[1])
        if v is None:
            return None, "non-constant"
        return [int(a) for a in np.asarray(v).reshape(-1)], None
    axes = node.attrs.get("axes")
    return (None, None) if axes is None else ([int(a) for a in axes], None)


def _variance(u: Pattern, u2: Pattern) -> Op:
    """``ReduceMean(u²) + eps`` (eps on either side), u² as ``Pow(u, c)`` or ``u·u2``."""
    square = Alt(Op("Pow", u, Const("c_pow"), name="square"), Op("Mul", u, u2, name="square"))
    mean = Op("ReduceMean", square, extra_inputs=True, name="var_mean")
    return Op("Add", mean, "eps", commute=True, name="add_eps")


def _std(var: Op) -> Op:
    return Op("Sqrt", var, name="sqrt")


def _normalized(root: str, num: Pattern, u: Pattern, u2: Pattern) -> Op:
    """``num / sqrt(var + eps)`` (Div root) or ``num · rsqrt(var + eps)`` (Mul root), rsqrt as
    ``Reciprocal(sqrt)``, ``1 / sqrt`` or ``Pow(·, −0.5)``."""
    var = _variance(u, u2)
    if root == "Div":
        return Op("Div", num, _std(var), name="norm")
    rsqrt = Alt(
        Op("Reciprocal", _std(var), name="rsqrt"),
        Op("Div", Const("one", value=1.0, scalar=True), _std(var), name="rsqrt"),
        Op("Pow", var, Const("c_rsqrt", value=-0.5, scalar=True, rel=2e-6), name="rsqrt"),
    )
    return Op("Mul", num, rsqrt, commute=True, name="norm")


def _layer_norm(root: str) -> Op:
    """``(x − mean(x))`` normalized; the squared difference may be a duplicated ``Sub`` node
    (old PyTorch exports)."""
    mean = Op("ReduceMean", "x", extra_inputs=True, name="mean", out="mu")
    num = Op("Sub", "x", mean, name="sub", out="num")
    u = Alt(Var("num"), Op("Sub", "x", "mu", name="sub2"))
    u2 = Alt(Var("num"), Op("Sub", "x", "mu", name="sub3"))
    return _normalized(root, num, u, u2)


def _centered(t: Tensor) -> dict | None:
    """``Sub(x, ReduceMean(x))``."""
    sub = producer(t, "Sub")
    if sub is None:
        return None
    x, mu = inputs(sub)
    mean = producer(mu, "ReduceMean")
    if mean is None or inputs(mean)[0] is not x:
        return None
    return {"sub": sub, "x": x, "mean": mean}


def _check_last_axis(node: Node, x: Tensor, what: str) -> None:
    axes, problem = _reduce_axes(node)
    require(problem is None, "non-constant-param", f"the axes of {what} are computed at run time")
    require(
        node.attrs.get("keepdims", 1) == 1,
        "keepdims",
        f"{what} drops the reduced axis (keepdims=0), so it does not broadcast back over it",
    )
    rank = _rank(x)
    ok = (
        axes is not None
        and len(axes) == 1
        and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))
    )
    require(
        ok,
        "axes-not-last",
        f"{what} reduces over axes {axes if axes is not None else 'all'} of a rank-"
        f"{rank if rank is not None else '?'} tensor; only the last axis is fused",
        axes=axes,
    )


def _check_eps(cx, eps: Tensor) -> float:
    require_constant(cx, cx.ir, ("epsilon", eps))
    value = scalar(eps)
    require(value is not None, "non-scalar-param", f"epsilon '{eps.name}' is not a scalar")
    return value


def _check_square(m: Match) -> None:
    if "c_pow" in m.bindings:
        require_near(m.c_pow, 2.0, "the variance's Pow exponent", rel=0.0)


def _check_precision(cx, x: Tensor, kernel: str) -> str:
    tname = float_type(x)
    dt = dtype_of(x)
    if dt.name in ("float16", "bfloat16"):
        require(
            cx.target.accumulates_fp32(kernel),
            "precision-accumulation",
            f"{kernel} in {dt.name}: target {cx.target.name} does not declare fp32 "
            f"accumulation for {kernel}, so the fused mean/variance may lose accuracy",
            dtype=dt.name,
        )
    return tname


# ---------------------------------------------------------------------------- rules
@register_rule
class FuseLayerNorm(Rule):
    name = "fuse-layer-norm"
    root = "Div"
    summary = "(x−mean)/sqrt(var+eps) → LayerNormalization"
    pattern = _layer_norm("Div")

    def check(self, m, cx):
        _check_last_axis(m.mean, m.x, "the mean's ReduceMean")
        _check_last_axis(m.var_mean, m.x, "the variance's ReduceMean")
        _check_square(m)
        eps = _check_eps(cx, m.eps)
        width = last_dim(m.x)
        require(
            width is not None,
            "unknown-shape",
            f"the last dim of '{m.x.name}' is not static; LayerNormalization needs its scale",
        )
        require(
            cx.ir.opset >= 17,
            "opset-too-old",
            f"LayerNormalization is a standard op from opset 17; the model is opset {cx.ir.opset} "
            "(`--opset 17` upgrades it first)",
        )
        tname = _check_precision(cx, m.x, "LayerNormalization")
        lowering(cx, [("LayerNormalization", "", 17, {})], tname, "LayerNormalization")
        m.stash(eps_value=eps, width=width)

    def rewrite(self, m, b):
        ones = b.const(np.ones(m.width, dtype=dtype_of(m.x)), "scale")
        out = b.op(
            "LayerNormalization",
            [m.x, ones],
            {"axis": -1, "epsilon": float(m.eps_value)},
            like=m.root.outputs[0],
            name=f"{m.root.name}/LayerNormalization",
        )
        return [out]


@register_rule
class FuseLayerNormReciprocal(FuseLayerNorm):
    name = "fuse-layer-norm-rcp"
    pattern = _layer_norm("Mul")
    summary = "(x−mean)·rsqrt(var+eps) → LayerNormalization"


@register_rule
class FuseRmsNorm(Rule):
    name = "fuse-rms-norm"
    root = "Div"
    summary = "x/sqrt(mean(x²)+eps) → RMSNormalization"
    pattern = _normalized("Div", Var("x"), Var("x"), Var("x"))

    def structure(self, m, cx):
        applies_only_if(_centered(m.x) is None)  # that is a LayerNorm

    def check(self, m, cx):
        _check_last_axis(m.var_mean, m.x, "the ReduceMean of x²")
        _check_square(m)
        eps = _check_eps(cx, m.eps)
        width = last_dim(m.x)
        require(
            width is not None,
            "unknown-shape",
            f"the last dim of '{m.x.name}' is not static; the fused op needs its scale",
        )
        tname = _check_precision(cx, m.x, "RMSNormalization")
        op, domain, _ = lowering(
            cx,
            [("RMSNormalization", "", 23, {}), ("SimplifiedLayerNormalization", MS, None, {})],
            tname,
            "RMSNorm",
        )
        m.stash(eps_value=eps, width=width, op=op, op_domain=domain)

    def rewrite(self, m, b):
        ones = b.const(np.ones(m.width, dtype=dtype_of(m.x)), "scale")
        return [
            b.op(
                m.op,
                [m.x, ones],
                {"axis": -1, "epsilon": float(m.eps_value)},
                domain=m.op_domain,
                like=m.root.outputs[0],
                name=f"{m.root.name}/{m.op}",
            )
        ]


@register_rule
class FuseRmsNormReciprocal(FuseRmsNorm):
    name = "fuse-rms-norm-rcp"
    pattern = _normalized("Mul", Var("x"), Var("x"), Var("x"))
    summary = "x·rsqrt(mean(x²)+eps) → RMSNormalization"


def _residual_add(x: Tensor) -> Node | None:
    """The ``Add`` of two run-time tensors that computes ``x`` (a residual sum), else None."""
    add = producer(x, "Add")
    if add is None:
        return None
    ins = inputs(add)
    if len(ins) != 2 or any(i is None or isinstance(i, Constant) for i in ins):
        return None
    return add


@register_rule
class FuseSkipRmsNorm(Rule):
    name = "fuse-skip-rms-norm"
    root = "Div"
    priority = 1  # before fuse-rms-norm at the same root: it takes the residual Add too
    summary = "Add + x/sqrt(mean(x²)+eps) → com.microsoft.SkipSimplifiedLayerNormalization"
    pattern = _normalized("Div", Var("x"), Var("x"), Var("x"))

    def structure(self, m, cx):
        applies_only_if(_centered(m.x) is None)  # that is a LayerNorm
        add, upcast = _residual_add(m.x), None
        if add is None:  # an fp16/bf16 sum upcast to fp32 for the norm (transformers' RMSNorm)
            upcast = producer(m.x, "Cast")
            src = inputs(upcast)[0] if upcast is not None else None
            narrow = src is not None and str(dtype_of(src)) in ("float16", "bfloat16")
            if narrow and str(dtype_of(m.x)) == "float32":
                add = _residual_add(src)
        applies_only_if(add is not None)
        # a tuple: the Add (and the Cast) are not part of the match (they may stay)
        m.stash(residual=(add, upcast))

    def check(self, m, cx):
        add, upcast = m.residual
        a, skip = inputs(add)
        sum_t = add.outputs[0]
        _check_last_axis(m.var_mean, m.x, "the ReduceMean of x²")
        _check_square(m)
        eps = _check_eps(cx, m.eps)
        require(
            not cx.ir.is_graph_output(sum_t) and not cx.ir.is_graph_output(m.x),
            "shared-intermediate",
            f"the residual sum '{sum_t.name}' is a graph output",
        )
        if upcast is not None:
            out = m.root.outputs[0]
            back = [c for c in out.outputs if c.op == "Cast" and c.attrs.get("to") == _onnx_type(a)]
            require(
                back and len(back) == len(out.outputs) and not cx.ir.is_graph_output(out),
                "precision-rounding",
                f"the float32 norm of '{sum_t.name}' is read before its Cast back to "
                f"{dtype_of(a)}; the fused norm rounds to {dtype_of(a)} first",
            )
        width = last_dim(m.x)
        rank = _rank(a)
        require(
            rank in (2, 3)
            and _rank(skip) == rank
            and width is not None
            and last_dim(a) == width
            and last_dim(skip) == width
            and all(same_dim(a, i, skip, i) for i in range(rank - 1)),
            "shape-mismatch",
            f"SkipSimplifiedLayerNormalization adds two 2-D or 3-D tensors of one shape; cannot "
            f"prove that of '{a.name}' (rank {rank}) and '{skip.name}' (rank {_rank(skip)}), "
            f"last dims {last_dim(a)} and {last_dim(skip)}",
        )
        tname = _check_precision(cx, a, "SkipSimplifiedLayerNormalization")
        lowering(
            cx,
            [("SkipSimplifiedLayerNormalization", MS, None, {})],
            tname,
            "SkipSimplifiedLayerNormalization",
        )
        slower = cx.target.measured_slower.get("SkipSimplifiedLayerNormalization")
        require(
            slower is None,
            "slower-on-target",
            f"SkipSimplifiedLayerNormalization is slower than Add + RMSNorm on target "
            f"{cx.target.name}: {slower}",
            measured=slower,
        )
        m.stash(eps_value=eps, width=width, a=a, skip=skip, sum_t=sum_t, upcast=upcast)

    def rewrite(self, m, b):
        sum_t = m.sum_t
        inside = {id(n) for n in m.nodes()} | ({id(m.upcast)} if m.upcast is not None else set())
        others = [c for c in sum_t.outputs if id(c) not in inside]
        gamma = b.const(np.ones(m.width, dtype=dtype_of(m.a)), "gamma")
        b.op(
            "SkipSimplifiedLayerNormalization",
            [m.a, m.skip, gamma],
            {"epsilon": float(m.eps_value)},
            domain=MS,
            outputs=4 if others else 1,
            like=m.root.outputs[0] if m.upcast is None else sum_t,
            name=f"{m.root.name}/SkipSimplifiedLayerNormalization",
        )
        node = b.created[-1]
        if others:
            _route_sum(b, node, sum_t)
        normed = node.outputs[0]
        if m.upcast is None:
            return [normed]
        # back to float32 for the readers' Cast to the input dtype (fuse-casts drops both)
        return [b.op("Cast", [normed], {"to": onnx.TensorProto.FLOAT}, like=m.root.outputs[0])]


@register_rule
class FuseSkipRmsNormReciprocal(FuseSkipRmsNorm):
    name = "fuse-skip-rms-norm-rcp"
    root = "Mul"
    pattern = _normalized("Mul", Var("x"), Var("x"), Var("x"))
    summary = "Add + x·rsqrt(mean(x²)+eps) → com.microsoft.SkipSimplifiedLayerNormalization"


def _onnx_type(t: Tensor) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype_of(t)))


def _route_sum(b, node: Node, sum_t: Tensor) -> None:
    """``node`` (a skip norm with four outputs) gives the residual sum ``sum_t`` to its
    readers from its fourth output; the statistics outputs are left out."""
    node.outputs[1] = Variable.empty()
    node.outputs[2] = Variable.empty()
    summed = node.outputs[3]
    summed.dtype, summed.shape = sum_t.dtype, sum_t.shape
    b.ir.replace_all_uses(sum_t, summed)


def _is_skip_norm(node: Node) -> bool:
    return node.op == "SkipSimplifiedLayerNormalization"


def _norm_params(node: Node) -> tuple[list[Tensor], Tensor, Tensor | None]:
    """(the normalized inputs, the scale, the bias added after the scale) of a norm node; the
    skip norm's bias is added before normalizing, so it is not one."""
    ins = inputs(node)
    if _is_skip_norm(node):
        return ins[:2], ins[2], None
    return ins[:1], ins[1], ins[2] if len(ins) > 2 else None


def _last_axis_vector(c: np.ndarray, x_rank: int | None, width: int) -> np.ndarray | None:
    """``c`` as a per-last-axis vector of ``width`` if it broadcasts along the last axis only."""
    if c.ndim == 0:
        return np.full(width, c.reshape(()))
    if any(d != 1 for d in c.shape[:-1]) or c.shape[-1] not in (1, width):
        return None
    if x_rank is None and c.ndim > 1:
        return None
    if x_rank is not None and c.ndim > x_rank:
        return None
    return np.broadcast_to(c.reshape(-1), (width,))


class _FoldIntoNorm(Rule):
    """``Mul``/``Add`` of a constant after a normalization: fold it into scale/bias."""

    exclusive = True

    def structure(self, m, cx):
        applies_only_if(isinstance(m.c, Constant) or cx.ir.is_graph_input(m.c))

    def check(self, m, cx):
        lead, scale, bias = _norm_params(m.ln)
        require_constant(
            cx,
            cx.ir,
            (f"the {self.root}'s operand", m.c),
            ("the norm's scale", scale),
            ("the norm's bias", bias),
        )
        extra_outputs = [
            t
            for i, t in enumerate(m.ln.outputs)
            if i > 0
            and not (i == 3 and _is_skip_norm(m.ln))  # the skip norm's residual sum
            and (t.outputs or cx.ir.is_graph_output(t))
        ]
        applies_only_if(not extra_outputs)
        rank = len(m.x.shape) if m.x.shape is not None else None
        axis = int(m.ln.attrs.get("axis", -1))
        require(
            axis == -1 or (rank is not None and axis == rank - 1),
            "not-last-axis",
            f"'{m.ln.name}' normalizes from axis {axis}; only last-axis norms are folded into",
        )
        g = constant_value(scale).astype(np.float64).reshape(-1)
        width = g.size
        vec = _last_axis_vector(constant_value(m.c).astype(np.float64), rank, width)
        require(
            vec is not None,
            "not-last-axis",
            f"{self.root} operand of shape {list(constant_value(m.c).shape)} does not vary "
            f"along the last axis (width {width}) only",
        )
        beta = (
            constant_value(bias).astype(np.float64).reshape(-1)
            if bias is not None
            else np.zeros(width)
        )
        dt = dtype_of(scale)
        require(
            dtype_of(m.c) == dt,
            "dtype-mismatch",
            f"{self.root} operand is {dtype_of(m.c)}, the norm's scale is {dt}",
        )
        g_new, b_new = self.fold(g, beta, vec)
        m.stash(
            g_new=require_representable(g_new, dt, "norm scale"),
            b_new=None if b_new is None else require_representable(b_new, dt, "norm bias"),
        )

    def fold(self, g, beta, vec):
        raise NotImplementedError

    def rewrite(self, m, b):
        lead, _, bias = _norm_params(m.ln)
        ins = [*lead, b.const(m.g_new, "scale")]
        if m.b_new is not None and (np.any(m.b_new != 0) or bias is not None):
            ins.append(b.const(m.b_new, "bias"))
        summed = _is_skip_norm(m.ln) and len(m.ln.outputs) > 3 and bool(m.ln.outputs[3].outputs)
        out = b.op(
            m.ln.op,
            ins,
            dict(m.ln.attrs),
            domain=m.ln.domain or "",
            outputs=4 if summed else 1,
            like=m.root.outputs[0],
            name=f"{m.ln.name}/{self.root.lower()}",
        )
        if not summed:
            return [out]
        _route_sum(b, b.created[-1], m.ln.outputs[3])
        return [out[0]]


@register_rule
class FoldNormScale(_FoldIntoNorm):
    name = "fold-norm-scale"
    pattern = Op(
        "Mul",
        Alt(
            Op(("LayerNormalization", "RMSNormalization"), "x", extra_inputs=True, name="ln"),
            Op("SimplifiedLayerNormalization", "x", extra_inputs=True, domain=MS, name="ln"),
            Op(
                "SkipSimplifiedLayerNormalization",
                "x",
                "skip",
                "gamma",
                domain=MS,
                name="ln",
            ),
        ),
        "c",
        commute=True,
        name="op_node",
    )
    # the skip norm's residual sum (its fourth output) may feed the next block
    exclusive = False
    summary = (
        "Mul(constant) after LayerNormalization/RMSNormalization/SkipSimplifiedLayerNormalization"
        " → scale (and bias)"
    )

    def structure(self, m, cx):
        super().structure(m, cx)
        normalized = m.ln.outputs[0]
        applies_only_if(
            len(normalized.outputs) == 1 and not cx.ir.is_graph_output(normalized)
        )  # the norm's output feeds this Mul only

    def fold(self, g, beta, vec):
        return g * vec, beta * vec if np.any(beta) else None


@register_rule
class FoldLayerNormBias(_FoldIntoNorm):
    name = "fold-layer-norm-bias"
    pattern = Op(
        "Add",
        Op("LayerNormalization", "x", extra_inputs=True, name="ln"),
        "c",
        commute=True,
        name="op_node",
    )
    summary = "Add(constant) after LayerNormalization → its bias"

    def fold(self, g, beta, vec):
        return g, beta + vec


@register_rule
class FuseSkipLayerNorm(Rule):
    name = "fuse-skip-layer-norm"
    root = "LayerNormalization"
    exclusive = False  # the residual sum may feed the next block: SkipLayerNorm outputs it
    summary = "Add + LayerNormalization → com.microsoft.SkipLayerNormalization"
    pattern = Op(
        "LayerNormalization", Op("Add", "a", "skip", name="add"), "gamma", opt("beta"), name="ln"
    )

    def structure(self, m, cx):
        applies_only_if(not isinstance(m.a, Constant) and not isinstance(m.skip, Constant))

    def check(self, m, cx):
        sum_t = m.add.outputs[0]
        require(
            not cx.ir.is_graph_output(sum_t)
            and not any(t.outputs or cx.ir.is_graph_output(t) for t in m.ln.outputs[1:]),
            "shared-intermediate",
            f"'{sum_t.name}' is a graph output or the LayerNormalization's statistics are used",
        )
        require_constant(cx, cx.ir, ("gamma", m.gamma), ("beta", m.beta))
        rank = _rank(m.a)
        axis = int(m.ln.attrs.get("axis", -1))
        require(
            rank == 3 and _rank(m.skip) == 3 and axis in (-1, 2),
            "shape-mismatch",
            f"SkipLayerNormalization takes 3-D input and skip normalized over the last axis; "
            f"got ranks {rank}, {_rank(m.skip)} and axis {axis}",
        )
        width = last_dim(m.a)
        require(
            width is not None
            and width == last_dim(m.skip)
            and constant_value(m.gamma).size == width
            and (m.beta is None or constant_value(m.beta).size == width),
            "shape-mismatch",
            f"hidden sizes differ or are unknown: input {last_dim(m.a)}, skip "
            f"{last_dim(m.skip)}, gamma {constant_value(m.gamma).size}",
        )
        same = all(same_dim(m.a, i, m.skip, i) for i in (0, 1))
        require(
            same,
            "shape-mismatch",
            f"cannot prove '{m.a.name}' and '{m.skip.name}' have the same batch and sequence "
            "dims (SkipLayerNormalization does not broadcast its input)",
        )
        tname = _check_precision(cx, m.a, "SkipLayerNormalization")
        lowering(cx, [("SkipLayerNormalization", MS, None, {})], tname, "SkipLayerNormalization")
        slower = cx.target.measured_slower.get("SkipLayerNormalization")
        require(
            slower is None,
            "slower-on-target",
            f"SkipLayerNormalization is slower than Add + LayerNormalization on target "
            f"{cx.target.name}: {slower}",
            measured=slower,
        )

    def rewrite(self, m, b):
        sum_t = m.add.outputs[0]
        others = [c for c in sum_t.outputs if c is not m.ln]
        gamma = b.const(constant_value(m.gamma).reshape(-1), "gamma")
        ins = [m.a, m.skip, gamma]
        if m.beta is not None:
            ins.append(b.const(constant_value(m.beta).reshape(-1), "beta"))
        outs = b.op(
            "SkipLayerNormalization",
            ins,
            {"epsilon": float(m.ln.attrs.get("epsilon", 1e-5))},
            domain=MS,
            outputs=4 if others else 1,
            like=m.root.outputs[0],
            name=f"{m.ln.name}/SkipLayerNormalization",
        )
        if not others:
            return [outs] + [None] * (len(m.root.outputs) - 1)
        node = b.created[-1]
        node.outputs[1] = Variable.empty()
        node.outputs[2] = Variable.empty()
        summed = outs[3]
        summed.dtype, summed.shape = sum_t.dtype, sum_t.shape
        b.ir.replace_all_uses(sum_t, summed)
        return [outs[0]] + [None] * (len(m.root.outputs) - 1)

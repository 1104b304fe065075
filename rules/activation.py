"""Activation fusions (level 2): GELU (erf, tanh), bias + GELU, QuickGelu / SiLU, HardSwish, Mish.

What exporters write, and what it becomes (lowered per target from its kernel table):

* erf GELU   ``x·0.5·(1 + erf(x/√2))`` — Div by √2 or Mul by 1/√2, the 0.5 multiply applied to
  x, to ``1+erf`` or to the product, operands in any order  → ``com.microsoft.Gelu``, else (opset
  ≥ 20) ``Gelu(approximate="none")``.
* tanh GELU  ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` with ``Pow(x, 3)`` or ``x·x·x`` →
  ``com.microsoft.FastGelu``, else (opset ≥ 20) ``Gelu(approximate="tanh")``.  An erf GELU is
  never turned into a tanh one (that changes numerics).
* bias       ``Gelu(y + b)`` / ``FastGelu(y + b)`` with a constant 1-D ``b`` over the last axis →
  ``com.microsoft.BiasGelu(y, b)`` / ``FastGelu(y, b)``.
* QuickGelu  ``x·σ(α·x)`` (α = 1.702 in CLIP-style models; α = 1 is SiLU) →
  ``com.microsoft.QuickGelu(alpha=α)``.  α is an attribute of the fused op, so any scalar α is
  exact: there is no constant to mismatch, only a scalar to require.
* HardSwish  ``x·HardSigmoid(x, α=⅙, β=½)`` (Paddle before opset 14) or ``x·Clip(x+3, 0, 6)/6``
  (older PyTorch exports) → ``HardSwish`` (opset ≥ 14) where the target has its kernel:
  onnxruntime's cuda provider does, its cpu provider does not (it would expand the op's
  function body back into HardSigmoid + Mul), so on cpu the miss says ``no-kernel``.
* Mish       ``x·tanh(softplus(x))``, softplus as an op or ``log(exp(x)+1)`` → ``Mish`` (opset ≥
  18), where the target has it (TensorRT; not onnxruntime).

Guards, each a missed remark with a stable code: ``constant-mismatch`` (a GELU constant is off by
more than 1e-4 relative — the value seen is in the remark), ``non-scalar-param``, ``no-kernel``
(neither the contrib op nor, at the model's opset, the standard op exists on the target for the
dtype), ``bias-shape`` (the bias is not a vector over the last axis), ``shared-intermediate``.

The small matching helpers here (``producer``, ``scalar``, ``require_near``) are shared by
``norm.py`` and ``attention.py``.
"""

from __future__ import annotations

import math

import numpy as np
import onnx.defs

from graphopt.opt.graph.domains import MS, is_default, same_domain
from graphopt.opt.graph.ir import (
    Constant,
    Node,
    Tensor,
    Variable,
    constant_value,
    dtype_of,
    type_string,
)
from graphopt.opt.rewrite.engine import (
    Alt,
    Const,
    Match,
    NoMatch,
    Op,
    Pattern,
    Rule,
    Var,
    applies_only_if,
    require,
)
from graphopt.opt.rewrite.manager import register_rule

#: relative tolerance for the constants of a pattern (√2, 0.5, 0.044715, ...)
REL_TOL = 1e-4


# ------------------------------------------------------------------------- helpers
def no_match() -> NoMatch:
    return NoMatch("structure", "pattern did not match", structural=True)


def producer(t: Tensor | None, op: str | tuple[str, ...], domain: str = "") -> Node | None:
    """The node of type ``op`` (in ``domain``) that computes ``t``, or None."""
    if not isinstance(t, Variable) or not t.inputs:
        return None
    node = t.inputs[0]
    ops = (op,) if isinstance(op, str) else op
    if node.op not in ops or not same_domain(node.domain, domain):
        return None
    return node


def inputs(node: Node) -> list[Tensor | None]:
    """Node inputs with absent optional inputs as None."""
    return [
        None if t is None or (isinstance(t, Variable) and t.name == "") else t for t in node.inputs
    ]


def scalar(t: Tensor | None) -> float | None:
    """The value of a constant holding exactly one element, else None."""
    v = constant_value(t)
    if v is None or v.size != 1 or v.dtype.kind not in "fiu":
        return None
    return float(v.reshape(()))


def is_scalar_const(t: Tensor | None) -> bool:
    return scalar(t) is not None


def near(value: float, expected: float, rel: float = REL_TOL) -> bool:
    return abs(value - expected) <= rel * abs(expected)


def require_near(t: Tensor, expected: float, what: str, rel: float = REL_TOL) -> float:
    """``t`` must be a scalar constant within ``rel`` of ``expected``: else constant-mismatch."""
    v = scalar(t)
    require(
        v is not None,
        "non-scalar-param",
        f"{what} '{t.name}' is not a one-element constant",
        tensor=t.name,
    )
    # an fp16 model stores √2 as 1.4140625 (1.1e-4 off): the expected value rounded to the
    # constant's own dtype is exact for that model
    dt = constant_value(t).dtype
    rounded = float(np.asarray(expected).astype(dt)) if dt.kind == "f" else expected
    require(
        near(v, expected, rel) or v == rounded,
        "constant-mismatch",
        f"{what} is {v!r}, expected {expected!r} (±{rel:g} relative)",
        seen=v,
        expected=expected,
    )
    return v


def split_const(node: Node) -> tuple[Tensor, Tensor] | None:
    """For a binary op with exactly one Constant operand: (other operand, constant)."""
    ins = inputs(node)
    if len(ins) != 2:
        return None
    a, b = ins
    if isinstance(b, Constant) and not isinstance(a, Constant):
        return a, b
    if isinstance(a, Constant) and not isinstance(b, Constant):
        return b, a
    return None


def float_type(t: Tensor) -> str:
    """onnxruntime's type string of a float tensor; NoMatch (unknown-dtype) otherwise."""
    dt = dtype_of(t)
    require(dt is not None, "unknown-dtype", f"the dtype of '{t.name}' is unknown")
    require(dt.kind == "f", "non-float", f"'{t.name}' is {dt}, not a float tensor")
    return type_string(dt)


def last_dim(t: Tensor) -> int | None:
    shape = t.shape
    if shape is None or not len(shape):
        return None
    d = shape[-1]
    return int(d) if isinstance(d, (int, np.integer)) and d >= 0 else None


def lowering(
    cx,
    choices: list[tuple[str, str, int | None, dict]],
    tname: str,
    what: str,
    instead_of: str | tuple[str, str] | None = None,
) -> tuple[str, str, dict]:
    """The first (op, domain, min_opset, attrs) the target has a kernel for at the model's opset.

    ``min_opset`` applies to default-domain ops only (the op must exist at the model's opset).
    ``instead_of``: the op (a default-domain name, or (op, domain)) whose compute the fused op
    takes over; where the runtime runs both inside casts to float (``Target.runs_fused``),
    that counts as a kernel.
    """
    opset = cx.ir.opset
    if isinstance(instead_of, str):
        instead_of = (instead_of, "")
    replaced = None
    if instead_of is not None:
        replaced = (instead_of[0], instead_of[1], opset if is_default(instead_of[1]) else 1)

    def runs(op: str, domain: str, at: int) -> bool:
        if replaced is None:
            return cx.target.has_kernel(op, domain, at, tname)
        return cx.target.runs_fused(op, domain, at, tname, replaced)

    for op, domain, min_opset, attrs in choices:
        if domain:
            if runs(op, domain, 1):
                return op, domain, attrs
        elif opset >= (min_opset or 1) and _onnx_defines(op, opset) and runs(op, "", opset):
            return op, domain, attrs
    names = ", ".join(
        f"{d + '.' if d else ''}{op}" + (f" (opset ≥ {v})" if not d and v else "")
        for op, d, v, _ in choices
    )
    latest = onnx.defs.onnx_opset_version()
    newer = [
        (op, o)
        for op, d, v, _ in choices
        if not d
        and _onnx_defines(op, latest)
        and (o := _kernel_opset(cx, op, max(opset + 1, v or 1), latest, tname))
    ]
    if newer:
        op, v = newer[0]
        raise NoMatch(
            "opset-too-old",
            f"{what} → {op} needs opset ≥ {v}, the model is at opset {opset} and target "
            f"{cx.target.name} has no other kernel for it in {tname} (tried {names}); "
            f"`--opset {v}` upgrades the model first",
            dtype=tname,
            opset=opset,
            needs=v,
        )
    raise NoMatch(
        "no-kernel",
        f"target {cx.target.name} has no kernel for {what} in {tname} at opset {opset} "
        f"or any later one up to {latest} (tried {names}), so `--opset` would not help",
        dtype=tname,
        opset=opset,
    )


def _onnx_defines(op: str, opset: int) -> bool:
    """Whether ONNX defines the default-domain ``op`` at ``opset``. onnxruntime also registers
    kernels in the default domain for ops of its own schemas (SimplifiedLayerNormalization,
    Affine, Crop, Scale, ...: targets/data, tests/test_kernel_tables.py); a model using one
    fails onnx.checker, so no lowering picks them."""
    try:
        onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


def _kernel_opset(cx, op: str, lo: int, hi: int, tname: str) -> int | None:
    """The first default-domain opset in [lo, hi] at which the target has a kernel for op."""
    return next((o for o in range(lo, hi + 1) if cx.target.has_kernel(op, "", o, tname)), None)


# ------------------------------------------------------------------- GELU patterns
def _gelu_tree(body: Pattern) -> Alt:
    """``x · half · (1 + body)`` as two Muls, in each association and operand order."""
    one_plus = Op("Add", body, Const("one"), commute=True, name="add_one")
    leaves = (Var("x"), Const("half"), one_plus)
    return Alt(
        *(
            Op(
                "Mul",
                Op(
                    "Mul",
                    *[leaf for j, leaf in enumerate(leaves) if j != i],
                    commute=True,
                    name="inner_mul",
                ),
                leaves[i],
                commute=True,
                name="root_mul",
            )
            for i in (1, 0, 2)
        )
    )


#: erf(x/√2) or erf(x·(1/√2))
ERF_BODY = Op(
    "Erf",
    Alt(
        Op("Div", "x", Const("c_scale"), name="scale"),
        Op("Mul", "x", Const("c_scale"), commute=True, name="scale"),
    ),
    name="erf",
)
#: x³ as Pow(x, 3) or x·x·x
CUBE = Alt(
    Op("Pow", "x", Const("c_pow"), name="cube"),
    Op("Mul", "x", Op("Mul", "x", "x", name="square"), commute=True, name="cube"),
)
#: tanh(√(2/π)·(x + 0.044715·x³))
TANH_BODY = Op(
    "Tanh",
    Op(
        "Mul",
        Op(
            "Add",
            "x",
            Op("Mul", CUBE, Const("c_cubic"), commute=True, name="cubic"),
            commute=True,
            name="inner_sum",
        ),
        Const("c_sqrt"),
        commute=True,
        name="tanh_in",
    ),
    name="tanh",
)


class _Activation(Rule):
    """Base of the activation fusions: the activation's input ``x`` is a computed tensor, not a
    constant (folding a constant is folding's job)."""

    def structure(self, m, cx):
        applies_only_if(not isinstance(m.x, Constant))


class _GeluBase(_Activation):
    approximate = "none"
    #: the op of the pattern whose compute the Gelu kernel takes over
    core_op = "Erf"

    def lowering_choices(self) -> list[tuple[str, str, int | None, dict]]:
        raise NotImplementedError

    def check_constants(self, m: Match) -> None:
        raise NotImplementedError

    def check(self, m, cx):
        require_near(m.half, 0.5, "the GELU half factor")
        require_near(m.one, 1.0, "the constant added to the GELU's erf/tanh")
        self.check_constants(m)
        tname = float_type(m.x)
        op, domain, attrs = lowering(
            cx, self.lowering_choices(), tname, f"GELU ({self.approximate})", self.core_op
        )
        m.stash(lowered=(op, domain, attrs))

    def rewrite(self, m, b):
        op, domain, attrs = m.lowered
        return [
            b.op(
                op, [m.x], attrs, domain=domain, like=m.root.outputs[0], name=f"{m.root.name}/{op}"
            )
        ]


@register_rule
class FuseGeluErf(_GeluBase):
    name = "fuse-gelu-erf"
    summary = "x·0.5·(1+erf(x/√2)) → Gelu"
    pattern = _gelu_tree(ERF_BODY)

    def lowering_choices(self):
        return [("Gelu", MS, None, {}), ("Gelu", "", 20, {"approximate": "none"})]

    def check_constants(self, m):
        if m.scale.op == "Div":
            require_near(m.c_scale, math.sqrt(2.0), "the erf argument's divisor")
        else:
            require_near(m.c_scale, math.sqrt(0.5), "the erf argument's factor")


@register_rule
class FuseGeluTanh(_GeluBase):
    name = "fuse-gelu-tanh"
    summary = "0.5·x·(1+tanh(√(2/π)·(x+0.044715·x³))) → FastGelu"
    approximate = "tanh"
    core_op = "Tanh"
    pattern = _gelu_tree(TANH_BODY)

    def lowering_choices(self):
        return [("FastGelu", MS, None, {}), ("Gelu", "", 20, {"approximate": "tanh"})]

    def check_constants(self, m):
        require_near(m.c_sqrt, math.sqrt(2.0 / math.pi), "the tanh argument's factor √(2/π)")
        require_near(m.c_cubic, 0.044715, "the cubic coefficient")
        if "c_pow" in m.bindings:
            require_near(m.c_pow, 3.0, "the Pow exponent")


@register_rule
class FuseQuickGelu(_Activation):
    name = "fuse-quick-gelu"
    root = "Mul"
    summary = "x·σ(α·x) → QuickGelu(alpha=α) (α=1: SiLU)"
    pattern = Alt(
        Op("Mul", "x", Op("Sigmoid", "x", name="sigmoid"), commute=True, name="mul"),
        Op(
            "Mul",
            "x",
            Op(
                "Sigmoid",
                Op("Mul", "x", Const("alpha"), commute=True, name="scale"),
                name="sigmoid",
            ),
            commute=True,
            name="mul",
        ),
    )

    def check(self, m, cx):
        alpha, factor = 1.0, m.get("alpha")
        if factor is not None:
            alpha = scalar(factor)
            require(
                alpha is not None,
                "non-scalar-param",
                f"the sigmoid's factor '{factor.name}' is not a one-element constant",
            )
        tname = float_type(m.x)
        lowering(cx, [("QuickGelu", MS, None, {})], tname, "QuickGelu", "Sigmoid")
        m.stash(alpha_value=float(alpha))

    def rewrite(self, m, b):
        return [
            b.op(
                "QuickGelu",
                [m.x],
                {"alpha": m.alpha_value},
                domain=MS,
                like=m.root.outputs[0],
                name=f"{m.root.name}/QuickGelu",
            )
        ]


def _near_const(name: str, value: float) -> Const:
    return Const(name, value=value, scalar=True, rel=REL_TOL)


#: clip(x + 3, 0, 6), the bounds as attributes or inputs (checked by ``_relu6_bounds``)
RELU6_OF_X_PLUS_3 = Op(
    "Clip",
    Op("Add", "x", _near_const("three", 3.0), commute=True, name="add"),
    extra_inputs=True,
    name="clip",
)
#: clip(x/6 + ½, 0, 1) as Paddle (HardSigmoid α=⅙, β=½) and PyTorch (Clip(x+3, 0, 6)/6) write it
HARD_GATES = (
    Op(
        "HardSigmoid",
        "x",
        attrs={"alpha": lambda a: near(a, 1 / 6), "beta": lambda b: near(b, 0.5)},
        name="gate",
    ),
    Op("Div", RELU6_OF_X_PLUS_3, _near_const("k", 6.0), name="gate"),
    Op("Mul", RELU6_OF_X_PLUS_3, _near_const("k", 1 / 6), commute=True, name="gate"),
)


def _relu6_bounds(clip: Node) -> bool:
    """Whether ``clip`` clips to [0, 6] (bounds as attributes or constant inputs)."""
    ins = inputs(clip) + [None, None]
    lo = clip.attrs.get("min", scalar(ins[1]) if ins[1] is not None else None)
    hi = clip.attrs.get("max", scalar(ins[2]) if ins[2] is not None else None)
    return lo is not None and hi is not None and lo == 0.0 and near(hi, 6.0)


@register_rule
class FuseHardSwish(_Activation):
    """``x · clip(x/6 + ½, 0, 1)`` → ``HardSwish(x)`` (opset ≥ 14).

    Paddle writes it as ``x · HardSigmoid(x, α=⅙, β=½)`` before opset 14, PyTorch's older exports
    as ``x · Clip(x + 3, 0, 6) / 6`` (the division on either side of the product).  One kernel
    instead of two or four passes; onnxruntime fuses none of these spellings itself.  Before
    opset 14 the miss says ``--opset 14``.
    """

    name = "fuse-hard-swish"
    root = "Mul"
    summary = "x·HardSigmoid(x, ⅙, ½) or x·Clip(x+3, 0, 6)·⅙ → HardSwish"
    pattern = Alt(
        *(Op("Mul", "x", gate, commute=True, name="mul") for gate in HARD_GATES),
        Op(
            "Mul",
            Op("Mul", "x", RELU6_OF_X_PLUS_3, commute=True, name="mul"),
            _near_const("k", 1 / 6),
            commute=True,
            name="scale",
        ),
    )

    def structure(self, m, cx):
        applies_only_if(m.get("clip") is None or _relu6_bounds(m.clip))
        super().structure(m, cx)

    def check(self, m, cx):
        tname = float_type(m.x)
        lowering(cx, [("HardSwish", "", 14, {})], tname, "HardSwish")

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        return [b.op("HardSwish", [m.x], like=like, name=f"{m.root.name}/HardSwish")]


@register_rule
class FuseHardSwishDiv(FuseHardSwish):
    name = "fuse-hard-swish-div"
    summary = "x·Clip(x+3, 0, 6)/6 → HardSwish"
    pattern = Op(
        "Div",
        Op("Mul", "x", RELU6_OF_X_PLUS_3, commute=True, name="mul"),
        _near_const("k", 6.0),
        name="scale",
    )


@register_rule
class FuseMish(_Activation):
    """``x · tanh(softplus(x))`` → ``Mish(x)`` (opset ≥ 18); softplus as Softplus or as
    ``log(exp(x) + 1)``.  The fused kernel is the more robust one: ``exp`` overflows for large x
    in the spelled-out form (inf → tanh 1 → x, the same result in fp32, but not in fp16)."""

    name = "fuse-mish"
    root = "Mul"
    summary = "x·tanh(softplus(x)) → Mish"
    pattern = Op(
        "Mul",
        "x",
        Op(
            "Tanh",
            Alt(
                Op("Softplus", "x", name="softplus"),
                Op(
                    "Log",
                    Op(
                        "Add",
                        Op("Exp", "x", name="exp"),
                        Const("one", value=1.0, scalar=True),
                        commute=True,
                        name="add",
                    ),
                    name="log",
                ),
            ),
            name="tanh",
        ),
        commute=True,
        name="mul",
    )

    def check(self, m, cx):
        lowering(cx, [("Mish", "", 18, {})], float_type(m.x), "Mish")

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        return [b.op("Mish", [m.x], like=like, name=f"{m.root.name}/Mish")]


def bias_vector(c: Constant, width: int | None) -> np.ndarray | None:
    """A constant that adds one value per last-axis element as a 1-D vector, else None."""
    v = constant_value(c)
    if v is None or v.ndim == 0 or any(d != 1 for d in v.shape[:-1]):
        return None
    if width is not None and v.shape[-1] != width:
        return None
    return v.reshape(-1)


def _bias_gelu_pattern(op: str) -> Op:
    """``com.microsoft.<op>(y + b)`` with a constant ``b`` (either operand)."""
    return Op(op, Op("Add", "y", Const("bias"), commute=True, name="add"), domain=MS, name="gelu")


class _BiasGeluBase(Rule):
    """``Gelu(y + b)`` → ``BiasGelu(y, b)``; the bias is a constant vector over the last axis."""

    fused_op = "BiasGelu"

    def structure(self, m, cx):
        applies_only_if(not isinstance(m.y, Constant))

    def check(self, m, cx):
        width = last_dim(m.y) or last_dim(m.add.outputs[0])
        vec = bias_vector(m.bias, width)
        require(
            vec is not None and width is not None and len(m.y.shape or ()) >= 1,
            "bias-shape",
            f"bias '{m.bias.name}' of shape {list(constant_value(m.bias).shape)} is not a vector "
            f"over the last axis of '{m.y.name}' (last dim {width})",
        )
        require(
            dtype_of(m.bias) == dtype_of(m.y),
            "dtype-mismatch",
            f"bias is {dtype_of(m.bias)}, input is {dtype_of(m.y)}",
        )
        tname = float_type(m.y)
        gelu = (m.gelu.op, m.gelu.domain)
        lowering(cx, [(self.fused_op, MS, None, {})], tname, self.fused_op, gelu)
        m.stash(vec=vec)

    def rewrite(self, m, b):
        bias = b.const(m.vec, "bias")
        return [
            b.op(
                self.fused_op,
                [m.y, bias],
                dict(m.gelu.attrs),
                domain=MS,
                like=m.root.outputs[0],
                name=f"{m.add.name}/{self.fused_op}",
            )
        ]


@register_rule
class FuseBiasGelu(_BiasGeluBase):
    name = "fuse-bias-gelu"
    pattern = _bias_gelu_pattern("Gelu")
    summary = "Add(constant bias) + com.microsoft.Gelu → BiasGelu"


@register_rule
class FuseBiasFastGelu(_BiasGeluBase):
    name = "fuse-bias-fastgelu"
    pattern = _bias_gelu_pattern("FastGelu")
    fused_op = "FastGelu"
    summary = "Add(constant bias) + com.microsoft.FastGelu → FastGelu(x, bias)"


__all__ = [
    "MS",
    "REL_TOL",
    "applies_only_if",
    "bias_vector",
    "float_type",
    "inputs",
    "is_scalar_const",
    "last_dim",
    "lowering",
    "near",
    "no_match",
    "producer",
    "require_near",
    "scalar",
    "split_const",
]

"""Target rewrites: spell an operation the way the target runs it, driven by the target's data.

No rule here names a target.  Each reads the profile (:class:`graphopt.opt.rewrite.target.Target`):
its
kernel table (``has_kernel``: what the target *lacks*) and ``prefers`` (which spelling it wants),
so a new target gets the right rewrites by saying what it has and prefers.

* PixelShuffle.  ``pixel-shuffle-to-depth-to-space``: Reshape (N,C,r,r,H,W) → Transpose
  (0,1,4,2,5,3) → Reshape (N,C,H·r,W·r) becomes ``DepthToSpace(mode="CRD")``; the DCR spelling
  Reshape (N,r,r,C,H,W) → Transpose (0,3,4,1,5,2) → Reshape becomes ``DepthToSpace(mode="DCR")``
  — when ``prefers["pixel-shuffle"] == "DepthToSpace"``.  Both reshape targets are resolved
  exactly (0 = copy, -1 = inferred, a symbolic batch carried through) and must be the pixel
  shuffle of the input's static (C·r², H, W).  ``depth-to-space-to-reshape`` is the reverse, for
  a target without a DepthToSpace kernel (or preferring ``"reshape"``).
* GELU.  ``gelu-erf-to-tanh``: x·½·(1+erf(x/√2)) → ½x(1+tanh(√(2/π)(x+0.044715x³))) for a target
  without Erf (or ``prefers["gelu"] == "tanh"``).  It changes numerics, so it fires only at -O3
  or when the target lists the rule in ``approximations``; below that it is a missed remark
  ``numerics-changing``.  Either way the approximation's error is measured on random inputs in
  the tensor's dtype and reported (an ``approximation-error`` analysis remark: max abs error vs
  the float64 erf GELU, and the erf form's own rounding error in that dtype for comparison).
  ``decompose-gelu``: the ONNX Gelu op (opset 20) as elementary ops on a target without it.
* com.microsoft ops → standard ops on a target without the contrib kernel (tensorrt, npu, and
  cuda for FusedGemm): Gelu, BiasGelu, FastGelu, QuickGelu, FusedMatMul/TransposeMatMul,
  FusedConv, FusedGemm, BiasAdd, SkipLayerNormalization.  All are exact decompositions (FastGelu
  *is* the tanh formula).  Ops with no decomposition here (Attention, MultiHeadAttention,
  EmbedLayerNormalization, ...) stay, and legalize reports them.
* Clip / Relu6.  ``min-max-to-clip`` / ``max-min-to-clip``: Min(Max(x,a),b) and Max(Min(x,b),a)
  with scalar constants a ≤ b → Clip(x,a,b) (ReLU6 is a=0, b=6) when ``prefers["relu6"] ==
  "Clip"``; ``clip-to-relu``: Clip(x, 0) → Relu when ``prefers["clip-min-zero"] == "Relu"``;
  ``clip-to-min-max``: Clip → Max/Min on a target without a Clip kernel (or preferring
  ``"Min/Max"``).

Guard codes (missed remarks): ``non-constant-shape``, ``unknown-shape``, ``perm-mismatch``,
``shape-mismatch``, ``non-square-block``, ``opset-too-old``, ``no-kernel``, ``numerics-changing``,
``unknown-dtype``, ``constant-mismatch`` / ``non-scalar-param`` (GELU constants),
``unsupported-attribute``, ``unsupported-activation``, ``unknown-rank``, ``extra-outputs``,
``non-scalar-bound``, ``bound-order``, ``dtype-mismatch``, plus the driver's
``shared-intermediate``.  Whether a rule applies at all (the target's preference, a kernel it
already has) is silent.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from graphopt.opt.graph.domains import MS, is_default, same_domain
from graphopt.opt.graph.ir import Constant, Node, Tensor, constant_value, dtype_of, type_string
from graphopt.opt.rewrite.engine import Op, Rule, applies_only_if, opt, require
from graphopt.opt.rewrite.manager import register_rule
from graphopt.rules.activation import FuseGeluErf, float_type, inputs, require_near, scalar

CRD_PERM = (0, 1, 4, 2, 5, 3)
DCR_PERM = (0, 3, 4, 1, 5, 2)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------- helpers
def _attr(node: Node, name: str, default=None):
    v = node.attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else v


def _tname(t: Tensor | None) -> str | None:
    dt = dtype_of(t) if t is not None else None
    if dt is None:
        return None
    try:
        return type_string(dt)
    except (TypeError, ValueError, KeyError):
        return None


def _float_dtype(t: Tensor, what: str) -> np.dtype:
    dt = dtype_of(t)
    require(dt is not None, "unknown-dtype", f"the dtype of {what} '{t.name}' is unknown")
    require(dt.kind == "f", "unknown-dtype", f"{what} '{t.name}' is {dt}, not a float tensor")
    return dt


def _opset(cx, domain: str = "") -> int:
    if is_default(domain):
        return cx.ir.opset
    for imp in cx.ir.template.opset_import:
        if same_domain(imp.domain, domain):
            return int(imp.version)
    return 1


def require_kernels(cx, ops: list[str], tname: str | None, why: str) -> None:
    """The target must run every op of the replacement (at the model's opset, for the dtype)."""
    missing = [op for op in ops if not cx.target.has_kernel(op, "", cx.ir.opset, tname)]
    require(
        not missing,
        "no-kernel",
        f"{why} needs {', '.join(missing)}, which {cx.target.name} has no kernel for "
        f"(dtype {tname or 'unknown'}, opset {cx.ir.opset})",
        missing=missing,
    )


def _prefers(cx, key: str) -> str | None:
    return cx.target.prefers.get(key)


def _static_int(d) -> int | None:
    return int(d) if isinstance(d, (int, np.integer)) and d >= 0 else None


class _Sym:
    """A symbolic dim carried through a reshape (compared by identity)."""

    def __init__(self, label: str):
        self.label = label

    def __repr__(self) -> str:
        return self.label


def resolve_reshape(in_dims: list, target: list[int], allowzero: bool) -> list | None:
    """Output dims of ``Reshape(in_dims → target)`` under ONNX semantics.

    ``in_dims`` holds ints or :class:`_Sym` objects; the result too, or None when the output
    cannot be determined exactly (e.g. -1 standing for a product involving a symbol).
    """
    out: list = []
    infer_at = None
    for i, t in enumerate(target):
        if t == 0 and not allowzero:
            if i >= len(in_dims):
                return None
            out.append(in_dims[i])
        elif t == -1:
            if infer_at is not None:
                return None
            infer_at = i
            out.append(None)
        elif t < 0:
            return None
        else:
            out.append(int(t))
    if infer_at is None:
        return out
    in_syms = [d for d in in_dims if isinstance(d, _Sym)]
    out_syms = [d for d in out if isinstance(d, _Sym)]
    known_in = int(np.prod([d for d in in_dims if isinstance(d, int)], dtype=np.int64))
    known_out = int(np.prod([d for d in out if isinstance(d, int)], dtype=np.int64))
    left = [s for s in in_syms if not any(s is o for o in out_syms)]
    if len(left) + len(out_syms) != len(in_syms):
        return None  # an output symbol that is not an input symbol
    if known_out == 0 or known_in % known_out:
        return None
    factor = known_in // known_out
    if not left:
        out[infer_at] = factor
    elif len(left) == 1 and factor == 1:
        out[infer_at] = left[0]
    else:
        return None
    return out


def _same_dim(a, b) -> bool:
    return a is b if isinstance(a, _Sym) or isinstance(b, _Sym) else a == b


def _input_dims(t: Tensor) -> list | None:
    """The tensor's dims as ints and symbols (one _Sym per distinct symbolic dim)."""
    shape = t.shape
    if shape is None:
        return None
    syms: dict = {}
    out = []
    for i, d in enumerate(shape):
        v = _static_int(d)
        if v is not None:
            out.append(v)
        else:
            key = d if isinstance(d, str) and d else ("axis", i)
            out.append(syms.setdefault(key, _Sym(str(d) if d else f"d{i}")))
    return out


# ----------------------------------------------------------------- PixelShuffle
@register_rule
class PixelShuffleToDepthToSpace(Rule):
    name = "pixel-shuffle-to-depth-to-space"
    root = "Reshape"
    level = 2
    phase = "lower"
    summary = "Reshape→Transpose→Reshape pixel shuffle (CRD or DCR) → DepthToSpace"
    pattern = Op(
        "Reshape",
        Op("Transpose", Op("Reshape", "x", "s1", name="first"), name="transpose"),
        "s2",
        name="last",
    )

    def structure(self, m, cx):
        perm = m.transpose.attrs.get("perm")
        applies_only_if(perm is not None and len(perm) == 6)
        applies_only_if(_prefers(cx, "pixel-shuffle") == "DepthToSpace")

    def check(self, m, cx):
        perm = tuple(int(p) for p in m.transpose.attrs["perm"])
        require(
            perm in (CRD_PERM, DCR_PERM),
            "perm-mismatch",
            f"Transpose perm {list(perm)} is neither the CRD pixel shuffle {list(CRD_PERM)} nor "
            f"the DCR one {list(DCR_PERM)}",
            perm=list(perm),
        )
        mode = "CRD" if perm == CRD_PERM else "DCR"
        s1, s2 = constant_value(m.s1), constant_value(m.s2)
        require(
            s1 is not None and s2 is not None,
            "non-constant-shape",
            "a Reshape target is computed at run time, not a constant",
        )
        dims = _input_dims(m.x)
        require(
            dims is not None and len(dims) == 4 and all(isinstance(d, int) for d in dims[1:]),
            "unknown-shape",
            f"the input '{m.x.name}' needs a known rank-4 shape with static C, H, W; it is "
            f"{list(m.x.shape) if m.x.shape is not None else 'unknown'}",
        )
        n, c_in, h, w = dims
        six = resolve_reshape(
            dims, [int(v) for v in s1.reshape(-1)], bool(_attr(m.first, "allowzero", 0))
        )
        require(
            six is not None and len(six) == 6,
            "shape-mismatch",
            f"the first Reshape's target {s1.tolist()} does not resolve to a 6-D shape",
        )
        if mode == "CRD":
            n1, c, r1, r2, h1, w1 = six
        else:
            n1, r1, r2, c, h1, w1 = six
        require(
            all(isinstance(d, int) for d in (c, r1, r2, h1, w1)) and _same_dim(n1, n),
            "shape-mismatch",
            f"the first Reshape gives {six}, not "
            f"({'N,C,r,r,H,W' if mode == 'CRD' else 'N,r,r,C,H,W'})",
        )
        require(
            r1 == r2,
            "non-square-block",
            f"the block is {r1}x{r2}; DepthToSpace needs a square block",
            block=[r1, r2],
        )
        r = r1
        require(
            c * r * r == c_in and h1 == h and w1 == w and r > 0,
            "shape-mismatch",
            f"the first Reshape gives {six} from input {dims}: not a {mode} pixel shuffle "
            f"(expects C·r²={c_in}, H={h}, W={w})",
        )
        transposed = [six[p] for p in perm]  # (N, C, H, r, W, r)
        final = resolve_reshape(
            transposed, [int(v) for v in s2.reshape(-1)], bool(_attr(m.last, "allowzero", 0))
        )
        want = [n, c, h * r, w * r]
        require(
            final is not None
            and len(final) == 4
            and all(_same_dim(a, b) for a, b in zip(final, want)),
            "shape-mismatch",
            f"the last Reshape gives {final}, not (N, C, H·r, W·r) = {want}",
        )
        require(
            cx.ir.opset >= (11 if mode == "CRD" else 1),
            "opset-too-old",
            f"DepthToSpace mode CRD needs opset 11, the model has {cx.ir.opset}",
        )
        tname = _tname(m.x)
        require(
            cx.target.has_kernel("DepthToSpace", "", cx.ir.opset, tname),
            "no-kernel",
            f"{cx.target.name} has no DepthToSpace kernel for {tname} at opset {cx.ir.opset}",
        )
        m.stash(mode=mode, blocksize=r)

    def rewrite(self, m, b):
        out = b.op(
            "DepthToSpace",
            [m.x],
            {"blocksize": m.blocksize, "mode": m.mode},
            like=m.root.outputs[0],
            name=f"{m.first.name or 'pixel_shuffle'}/DepthToSpace",
        )
        return [out]


@register_rule
class DepthToSpaceToReshape(Rule):
    name = "depth-to-space-to-reshape"
    root = "DepthToSpace"
    level = 2
    phase = "lower"
    summary = "DepthToSpace → Reshape→Transpose→Reshape for a target without DepthToSpace"
    pattern = Op("DepthToSpace", "x", name="d2s")

    def structure(self, m, cx):
        tname = _tname(m.x)
        lacks = not cx.target.has_kernel("DepthToSpace", "", cx.ir.opset, tname)
        applies_only_if(lacks or _prefers(cx, "pixel-shuffle") == "reshape")

    def check(self, m, cx):
        dims = _input_dims(m.x)
        require(
            dims is not None and len(dims) == 4 and all(isinstance(d, int) for d in dims[1:]),
            "unknown-shape",
            f"the input '{m.x.name}' needs a known rank-4 shape with static C, H, W; it is "
            f"{list(m.x.shape) if m.x.shape is not None else 'unknown'}",
        )
        r = int(m.d2s.attrs.get("blocksize", 0))
        n, c_in, h, w = dims
        require(
            r > 0 and c_in % (r * r) == 0,
            "shape-mismatch",
            f"{c_in} channels do not split into blocks of {r}x{r}",
        )
        require_kernels(cx, ["Reshape", "Transpose"], _tname(m.x), "the Reshape/Transpose form")
        mode = _attr(m.d2s, "mode", "DCR")
        m.stash(n=n if isinstance(n, int) else 0, c=c_in // (r * r), h=h, w=w, r=r, mode=mode)

    def rewrite(self, m, b):
        n, c, h, w, r = m.n, m.c, m.h, m.w, m.r
        first = (n, c, r, r, h, w) if m.mode == "CRD" else (n, r, r, c, h, w)
        perm = CRD_PERM if m.mode == "CRD" else DCR_PERM
        a = b.op("Reshape", [m.x, b.const(np.array(first, np.int64), "shape6")])
        t = b.op("Transpose", [a], {"perm": list(perm)})
        out = b.op(
            "Reshape",
            [t, b.const(np.array((n, c, h * r, w * r), np.int64), "shape4")],
            like=m.root.outputs[0],
        )
        return [out]


# ------------------------------------------------------------------------- GELU
def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


@lru_cache(maxsize=8)
def tanh_gelu_error(dtype_name: str, samples: int = 1 << 16, seed: int = 0) -> dict:
    """Max error of the tanh GELU computed in ``dtype`` against the float64 erf GELU."""
    dt = np.dtype(dtype_name)
    x = (np.random.default_rng(seed).standard_normal(samples) * 3.0).astype(dt)
    xd = x.astype(np.float64)
    exact = 0.5 * xd * (1.0 + _erf(xd / math.sqrt(2.0)))
    half, one = dt.type(0.5), dt.type(1.0)
    k, c = dt.type(0.044715), dt.type(SQRT_2_OVER_PI)
    with np.errstate(over="ignore", invalid="ignore"):
        approx = (x * half) * (np.tanh((x + k * (x * x * x)) * c) + one)
        erf_form = (
            x * (one + _erf((x / dt.type(math.sqrt(2.0))).astype(np.float64)).astype(dt)) * half
        )
    err = np.abs(approx.astype(np.float64) - exact)
    base = np.abs(erf_form.astype(np.float64) - exact)
    return {
        "max_abs_error": float(np.nanmax(err)),
        "mean_abs_error": float(np.nanmean(err)),
        "erf_form_max_abs_error": float(np.nanmax(base)),
        "samples": samples,
        "inputs": f"normal(0, 3) in {dt.name}, seed {seed}",
        "reference": "float64 erf GELU",
    }


def _tanh_gelu(b, x: Tensor, dt: np.dtype, like: Tensor) -> Tensor:
    """½x(1 + tanh(√(2/π)(x + 0.044715x³))) from Mul, Add and Tanh (no Pow: not every target
    has it)."""
    cube = b.op("Mul", [b.op("Mul", [x, x]), x])
    inner = b.op("Add", [x, b.op("Mul", [cube, b.const(np.array(0.044715, dt), "k")])])
    t = b.op("Tanh", [b.op("Mul", [inner, b.const(np.array(SQRT_2_OVER_PI, dt), "c")])])
    half_x = b.op("Mul", [x, b.const(np.array(0.5, dt), "half")])
    return b.op("Mul", [half_x, b.op("Add", [t, b.const(np.array(1.0, dt), "one")])], like=like)


def _erf_gelu(b, x: Tensor, dt: np.dtype, like: Tensor) -> Tensor:
    """x·½·(1 + erf(x·(1/√2))) — the spelling the fuse-gelu-erf rule recognises."""
    e = b.op("Erf", [b.op("Mul", [x, b.const(np.array(math.sqrt(0.5), dt), "inv_sqrt2")])])
    plus = b.op("Add", [e, b.const(np.array(1.0, dt), "one")])
    return b.op("Mul", [b.op("Mul", [x, plus]), b.const(np.array(0.5, dt), "half")], like=like)


def require_numerics_allowed(rule: Rule, cx, what: str, err: dict) -> None:
    require(
        cx.level >= 3 or rule.name in cx.target.approximations,
        "numerics-changing",
        f"{what} changes results (max abs error {err['max_abs_error']:.2e} on "
        f"{err['inputs']}); allowed at -O3 (this run is -O{cx.level})",
        max_abs_error=err["max_abs_error"],
    )


@register_rule
class GeluErfToTanh(FuseGeluErf):
    name = "gelu-erf-to-tanh"
    level = 2  # enforced in check: -O3, or a target that accepts the approximation
    phase = "lower"
    changes_numerics = True
    summary = "erf GELU → tanh approximation on a target without Erf (numerics-changing: -O3)"

    def structure(self, m, cx):  # on fuse-gelu-erf's pattern: every spelling it knows
        super().structure(m, cx)
        tname = _tname(m.x)
        lacks = not cx.target.has_kernel("Erf", "", cx.ir.opset, tname)
        applies_only_if(lacks or _prefers(cx, "gelu") == "tanh")

    def check(self, m, cx):
        require_near(m.half, 0.5, "the GELU half factor")
        require_near(m.one, 1.0, "the constant added to the GELU's erf")
        self.check_constants(m)
        float_type(m.x)
        dt = _float_dtype(m.x, "the GELU input")
        err = tanh_gelu_error(dt.name)
        require_numerics_allowed(self, cx, "the tanh approximation of GELU", err)
        tname = _tname(m.x)
        gelu20 = cx.ir.opset >= 20 and cx.target.has_kernel("Gelu", "", cx.ir.opset, tname)
        if not gelu20:
            require_kernels(cx, ["Mul", "Add", "Tanh"], tname, "the tanh GELU")
        nodes = [n.name for n in m.nodes()]
        cx.remark(
            "analysis",
            "rules",
            self.name,
            "approximation-error",
            [m.root.name, *[n for n in nodes if n != m.root.name]],
            f"tanh GELU replaces erf GELU at '{m.root.name}': max abs error "
            f"{err['max_abs_error']:.2e} (the erf form's own {dt.name} rounding: "
            f"{err['erf_form_max_abs_error']:.2e}) on {err['samples']} samples of {err['inputs']}",
            dtype=dt.name,
            **err,
        )
        m.stash(dt=dt, gelu20=gelu20)

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        if m.gelu20:
            return [b.op("Gelu", [m.x], {"approximate": "tanh"}, like=like)]
        return [_tanh_gelu(b, m.x, m.dt, like)]


class _Decompose(Rule):
    """Base of decompositions of one op the target lacks into ops it has (exact): the pattern is
    the op (in the rule's ``domain``) with its first input bound to ``x``."""

    level = 2
    phase = "lower"
    exclusive = False
    #: ops of the replacement the target must have (Erf is left to gelu-erf-to-tanh)
    needs: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "root" in cls.__dict__:
            cls.pattern = Op(cls.root, opt("x"), extra_inputs=True, domain=cls.domain, name="node")

    def structure(self, m, cx):
        tname = _tname(m.x)
        opset = _opset(cx, self.domain)
        applies_only_if(not cx.target.has_kernel(self.root, self.domain, opset, tname))
        # a float16 node the runtime runs inside casts to float needs no decomposition
        applies_only_if(not cx.target.runs_via_float(self.root, self.domain, opset, tname))

    def check(self, m, cx):
        require(m.x is not None, "unknown-dtype", "the op has no input")
        dt = _float_dtype(m.x, f"{self.root}'s input")
        require_kernels(cx, list(self.needs), _tname(m.x), f"decomposing {self.root}")
        self.check_more(m, cx)
        m.stash(dt=dt)

    def check_more(self, m, cx) -> None:
        """Op-specific guards."""


@register_rule
class DecomposeGelu(_Decompose):
    name = "decompose-gelu"
    root = "Gelu"
    summary = "Gelu (opset 20) → erf or tanh formula, for a target without a Gelu kernel"
    needs = ("Mul", "Add")

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        if _attr(m.node, "approximate", "none") == "tanh":
            return [_tanh_gelu(b, m.x, m.dt, like)]
        return [_erf_gelu(b, m.x, m.dt, like)]


@register_rule
class DecomposeMsGelu(_Decompose):
    name = "decompose-ms-gelu"
    root = "Gelu"
    domain = MS
    summary = "com.microsoft.Gelu → x·½·(1+erf(x/√2)) for a target without it"
    needs = ("Mul", "Add")

    def rewrite(self, m, b):
        return [_erf_gelu(b, m.x, m.dt, m.root.outputs[0])]


@register_rule
class DecomposeMsBiasGelu(_Decompose):
    name = "decompose-ms-bias-gelu"
    root = "BiasGelu"
    domain = MS
    summary = "com.microsoft.BiasGelu(x, b) → erf GELU of x + b"
    needs = ("Mul", "Add")

    def rewrite(self, m, b):
        s = b.op("Add", inputs(m.node)[:2])
        return [_erf_gelu(b, s, m.dt, m.root.outputs[0])]


@register_rule
class DecomposeMsFastGelu(_Decompose):
    name = "decompose-ms-fast-gelu"
    root = "FastGelu"
    domain = MS
    summary = "com.microsoft.FastGelu(x[, bias]) → ½x(1+tanh(√(2/π)(x+0.044715x³)))"
    needs = ("Mul", "Add", "Tanh")

    def rewrite(self, m, b):
        ins = inputs(m.node)
        x = b.op("Add", ins[:2]) if len(ins) > 1 and ins[1] is not None else m.x
        return [_tanh_gelu(b, x, m.dt, m.root.outputs[0])]


@register_rule
class DecomposeMsQuickGelu(_Decompose):
    name = "decompose-ms-quick-gelu"
    root = "QuickGelu"
    domain = MS
    summary = "com.microsoft.QuickGelu(x, alpha) → x·Sigmoid(alpha·x)"
    needs = ("Mul", "Sigmoid")

    def rewrite(self, m, b):
        alpha = float(m.node.attrs.get("alpha", 1.702))
        ax = b.op("Mul", [m.x, b.const(np.array(alpha, m.dt), "alpha")])
        return [b.op("Mul", [m.x, b.op("Sigmoid", [ax])], like=m.root.outputs[0])]


def _swap_last_two(b, t: Tensor, rank: int) -> Tensor:
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return b.op("Transpose", [t], {"perm": perm})


@register_rule
class DecomposeMsFusedMatMul(_Decompose):
    name = "decompose-ms-fused-matmul"
    root = "FusedMatMul"
    domain = MS
    summary = "com.microsoft.FusedMatMul → [Transpose] MatMul [Mul alpha]"
    needs = ("MatMul",)

    def check_more(self, m, cx):
        a = m.node.attrs
        require(
            not a.get("transBatchA", 0) and not a.get("transBatchB", 0),
            "unsupported-attribute",
            "transBatchA/transBatchB move the batch axes; not decomposed",
        )
        ins = inputs(m.node)
        ranks = []
        for flag, t in (("transA", ins[0]), ("transB", ins[1])):
            if a.get(flag, 0):
                require(
                    t.shape is not None and len(t.shape) >= 2,
                    "unknown-rank",
                    f"{flag}=1 needs the rank of '{t.name}', which is unknown",
                )
                ranks.append(len(t.shape))
            else:
                ranks.append(None)
        needs = ["Transpose"] if any(ranks) else []
        if float(a.get("alpha", 1.0)) != 1.0:
            needs.append("Mul")
        require_kernels(cx, needs, _tname(m.x), "decomposing FusedMatMul")
        m.stash(ranks=ranks)

    def rewrite(self, m, b):
        ins = inputs(m.node)[:2]
        ops = [_swap_last_two(b, t, r) if r else t for t, r in zip(ins, m.ranks)]
        alpha = float(m.node.attrs.get("alpha", 1.0))
        like = m.root.outputs[0]
        if alpha == 1.0:
            return [b.op("MatMul", ops, like=like)]
        mm = b.op("MatMul", ops)
        return [b.op("Mul", [mm, b.const(np.array(alpha, m.dt), "alpha")], like=like)]


@register_rule
class DecomposeMsTransposeMatMul(DecomposeMsFusedMatMul):
    name = "decompose-ms-transpose-matmul"
    root = "TransposeMatMul"
    summary = "com.microsoft.TransposeMatMul → [Transpose] MatMul [Mul alpha]"


#: FusedConv / FusedGemm activation → (op, attrs from params)
def _activation(b, name: str, x: Tensor, params: list[float], dt, like) -> Tensor:
    if name in ("Relu", "Tanh", "Sigmoid"):
        return b.op(name, [x], like=like)
    if name == "LeakyRelu":
        return b.op("LeakyRelu", [x], {"alpha": params[0] if params else 0.01}, like=like)
    if name == "HardSigmoid":
        alpha, beta = (params + [0.2, 0.5][len(params) :])[:2]
        return b.op("HardSigmoid", [x], {"alpha": alpha, "beta": beta}, like=like)
    if name == "Clip":
        lo, hi = params[:2]
        return b.op(
            "Clip",
            [x, b.const(np.array(lo, dt), "min"), b.const(np.array(hi, dt), "max")],
            like=like,
        )
    raise AssertionError(name)


ACTIVATIONS = ("Relu", "Tanh", "Sigmoid", "LeakyRelu", "HardSigmoid", "Clip")


class _FusedWithActivation(_Decompose):
    base_op = "Conv"

    def activation(self, m) -> tuple[str, list[float]]:
        raise NotImplementedError

    def check_more(self, m, cx):
        act, params = self.activation(m)
        require(
            not act or act in ACTIVATIONS,
            "unsupported-activation",
            f"activation '{act}' has no standard-op decomposition here",
            activation=act,
        )
        require(
            act != "Clip" or len(params) >= 2,
            "unsupported-attribute",
            "a Clip activation needs two activation parameters (min, max)",
        )
        extra = ["Add"] if len(inputs(m.node)) > 3 and inputs(m.node)[3] is not None else []
        require_kernels(
            cx,
            [self.base_op, *extra, *([act] if act else [])],
            _tname(m.x),
            f"decomposing {self.root}",
        )
        m.stash(act=act, params=params)


@register_rule
class DecomposeMsFusedConv(_FusedWithActivation):
    name = "decompose-ms-fused-conv"
    root = "FusedConv"
    domain = MS
    summary = "com.microsoft.FusedConv → Conv [+ Z] + activation"

    def activation(self, m):
        return (
            _attr(m.node, "activation", "") or "",
            [float(p) for p in m.node.attrs.get("activation_params", [])],
        )

    def rewrite(self, m, b):
        ins = inputs(m.node)
        attrs = {
            k: v for k, v in m.node.attrs.items() if k not in ("activation", "activation_params")
        }
        like = m.root.outputs[0]
        has_z = len(ins) > 3 and ins[3] is not None
        conv_ins = ins[:2] + ([ins[2]] if len(ins) > 2 and ins[2] is not None else [])
        y = b.op("Conv", conv_ins, attrs, like=None if (m.act or has_z) else like)
        if has_z:
            y = b.op("Add", [y, ins[3]], like=None if m.act else like)
        return [_activation(b, m.act, y, m.params, m.dt, like) if m.act else y]


@register_rule
class DecomposeMsFusedGemm(_FusedWithActivation):
    name = "decompose-ms-fused-gemm"
    root = "FusedGemm"
    domain = MS
    base_op = "Gemm"
    summary = "com.microsoft.FusedGemm → Gemm + activation"

    def activation(self, m):
        a = m.node.attrs
        act = _attr(m.node, "activation", "") or ""
        params = [float(a[k]) for k in ("activation_alpha", "activation_beta") if k in a]
        if act == "LeakyRelu":
            params = [float(a.get("activation_alpha", 0.01))]
        return act, params

    def rewrite(self, m, b):
        ins = inputs(m.node)
        attrs = {
            k: v for k, v in m.node.attrs.items() if k in ("alpha", "beta", "transA", "transB")
        }
        like = m.root.outputs[0]
        y = b.op("Gemm", [t for t in ins[:3] if t is not None], attrs, like=None if m.act else like)
        return [_activation(b, m.act, y, m.params, m.dt, like) if m.act else y]


@register_rule
class DecomposeMsBiasAdd(_Decompose):
    name = "decompose-ms-bias-add"
    root = "BiasAdd"
    domain = MS
    summary = "com.microsoft.BiasAdd(X, bias, skip) → X + bias + skip"
    needs = ("Add",)

    def rewrite(self, m, b):
        x, bias, skip = inputs(m.node)[:3]
        return [b.op("Add", [b.op("Add", [x, bias]), skip], like=m.root.outputs[0])]


@register_rule
class DecomposeMsSkipLayerNorm(_Decompose):
    name = "decompose-ms-skip-layernorm"
    root = "SkipLayerNormalization"
    domain = MS
    summary = "com.microsoft.SkipLayerNormalization → Add (+ bias) + LayerNormalization"
    needs = ("Add",)

    def check_more(self, m, cx):
        outs = m.node.outputs
        used = [i for i, t in enumerate(outs) if t.name and (t.outputs or cx.ir.is_graph_output(t))]
        require(
            not any(i in (1, 2) for i in used),
            "extra-outputs",
            "the mean / inv_std_var outputs are used; LayerNormalization-17 gives them in a "
            "different shape",
        )
        require(
            cx.ir.opset >= 17,
            "opset-too-old",
            f"LayerNormalization needs opset 17, the model has {cx.ir.opset}",
        )
        require_kernels(
            cx, ["LayerNormalization"], _tname(m.x), "decomposing SkipLayerNormalization"
        )

    def rewrite(self, m, b):
        ins = inputs(m.node) + [None] * 5
        x, skip, gamma, beta, bias = ins[:5]
        s = b.op("Add", [x, skip])
        if bias is not None:
            s = b.op("Add", [s, bias])
        eps = float(m.node.attrs.get("epsilon", 1e-12))
        y = b.op(
            "LayerNormalization",
            [s, gamma] + ([beta] if beta is not None else []),
            {"axis": -1, "epsilon": eps},
            like=m.root.outputs[0],
        )
        result: list[Tensor | None] = [y]
        for i, _ in enumerate(m.node.outputs[1:], start=1):
            result.append(s if i == 3 else None)
        return result


# ------------------------------------------------------------------- Clip / Relu6
def _scalar_bound(t: Tensor, x: Tensor, what: str) -> float:
    v = constant_value(t)
    require(
        v is not None and v.size == 1,
        "non-scalar-bound",
        f"the {what} bound '{t.name}' is not a one-element constant",
    )
    require(
        dtype_of(t) == dtype_of(x),
        "dtype-mismatch",
        f"the {what} bound is {dtype_of(t)}, the input is {dtype_of(x)}",
    )
    return float(v.reshape(()))


class _MinMaxToClip(Rule):
    """Min(Max(x, lo), hi) (root Min) or Max(Min(x, hi), lo) (root Max) → Clip(x, lo, hi)."""

    level = 2
    phase = "lower"
    inner_op = "Max"

    def structure(self, m, cx):
        applies_only_if(_prefers(cx, "relu6") == "Clip")
        applies_only_if(isinstance(m.c_out, Constant) and isinstance(m.c_in, Constant))
        applies_only_if(not isinstance(m.x, Constant))

    def check(self, m, cx):
        a = _scalar_bound(m.c_in, m.x, "inner")
        c = _scalar_bound(m.c_out, m.x, "outer")
        lo, hi = (a, c) if self.inner_op == "Max" else (c, a)
        require(lo <= hi, "bound-order", f"lower bound {lo} exceeds upper bound {hi}")
        tname = _tname(m.x)
        require(
            cx.target.has_kernel("Clip", "", cx.ir.opset, tname),
            "no-kernel",
            f"{cx.target.name} has no Clip kernel for {tname} at opset {cx.ir.opset}",
        )
        m.stash(lo=lo, hi=hi, dt=dtype_of(m.x))

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        if b.ir.opset < 11:
            return [b.op("Clip", [m.x], {"min": m.lo, "max": m.hi}, like=like)]
        lo = b.const(np.array(m.lo, m.dt), "min")
        hi = b.const(np.array(m.hi, m.dt), "max")
        return [b.op("Clip", [m.x, lo, hi], like=like)]


@register_rule
class MinMaxToClip(_MinMaxToClip):
    name = "min-max-to-clip"
    root = "Min"
    summary = "Min(Max(x, a), b) with constants a ≤ b (ReLU6: 0, 6) → Clip(x, a, b)"
    pattern = Op(
        "Min",
        Op("Max", "x", "c_in", name="inner", commute=True),
        "c_out",
        name="outer",
        commute=True,
    )


@register_rule
class MaxMinToClip(_MinMaxToClip):
    name = "max-min-to-clip"
    root = "Max"
    inner_op = "Min"
    summary = "Max(Min(x, b), a) with constants a ≤ b → Clip(x, a, b)"
    pattern = Op(
        "Max",
        Op("Min", "x", "c_in", name="inner", commute=True),
        "c_out",
        name="outer",
        commute=True,
    )


def _clip_bounds(node: Node) -> tuple[Tensor | float | None, Tensor | float | None]:
    """Clip's (min, max): tensors (opset ≥ 11) or floats (attributes), None when absent."""
    ins = inputs(node) + [None, None]
    if "min" in node.attrs or "max" in node.attrs:
        return node.attrs.get("min"), node.attrs.get("max")
    return ins[1], ins[2]


def _bound_value(v) -> float | None:
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    s = scalar(v)
    return s


@register_rule
class ClipToRelu(Rule):
    name = "clip-to-relu"
    root = "Clip"
    level = 2
    phase = "lower"
    summary = "Clip(x, 0) with no upper bound → Relu"
    priority = 1  # one Relu rather than a Max, where clip-to-min-max applies too
    pattern = Op("Clip", "x", extra_inputs=True, name="clip")

    def structure(self, m, cx):
        applies_only_if(_prefers(cx, "clip-min-zero") == "Relu")
        lo, hi = _clip_bounds(m.clip)
        applies_only_if(_bound_value(lo) == 0.0)
        hv = _bound_value(hi)
        applies_only_if(
            hi is None
            or (hv is not None and math.isinf(hv) and hv > 0)
            or (isinstance(hi, float) and hi >= 3.0e38)
        )

    def check(self, m, cx):
        tname = _tname(m.x)
        require(
            cx.target.has_kernel("Relu", "", cx.ir.opset, tname),
            "no-kernel",
            f"{cx.target.name} has no Relu kernel for {tname}",
        )

    def rewrite(self, m, b):
        return [b.op("Relu", [m.x], like=m.root.outputs[0])]


@register_rule
class ClipToMinMax(Rule):
    name = "clip-to-min-max"
    root = "Clip"
    level = 2
    phase = "lower"
    summary = "Clip → Max/Min on a target without a Clip kernel"
    pattern = Op("Clip", "x", extra_inputs=True, name="clip")

    def structure(self, m, cx):
        tname = _tname(m.x)
        lacks = not cx.target.has_kernel("Clip", "", cx.ir.opset, tname)
        applies_only_if(lacks or _prefers(cx, "relu6") == "Min/Max")

    def check(self, m, cx):
        lo, hi = _clip_bounds(m.clip)
        dt = dtype_of(m.x)
        require(dt is not None, "unknown-dtype", f"the dtype of '{m.x.name}' is unknown")
        for bound in (lo, hi):
            if isinstance(bound, Tensor) and not isinstance(bound, Constant):
                require(
                    dtype_of(bound) in (None, dt),
                    "dtype-mismatch",
                    f"the bound '{bound.name}' is {dtype_of(bound)}, the input is {dt}",
                )
        needs = (["Max"] if lo is not None else []) + (["Min"] if hi is not None else [])
        require_kernels(cx, needs, _tname(m.x), "Clip as Max/Min")
        m.stash(lo=lo, hi=hi, dt=dt)

    def rewrite(self, m, b):
        y = m.x
        like = m.root.outputs[0]
        for op, bound in (("Max", m.lo), ("Min", m.hi)):
            if bound is None:
                continue
            t = bound if isinstance(bound, Tensor) else b.const(np.array(bound, m.dt), op.lower())
            last = op == "Min" or m.hi is None
            y = b.op(op, [y, t], like=like if last else None)
        if y is m.x:
            return [b.op("Identity", [m.x], like=like)]
        return [y]

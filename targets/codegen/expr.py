"""The expression a fused element-wise node carries: grammar, validation, evaluation, identity.

A ``graphopt.fused`` node holds its computation as a compact string attribute ``expr``::

    expr    := NAME "(" expr ("," expr)* ")" | leaf
    leaf    := "x" INDEX          runtime input i (same shape as the output)
             | "p" INDEX          constant input i, one value per channel along ``channel_axis``
             | NUMBER             a float32 literal (decimal, shortest round-trip form)

``mul(x0,sigmoid(add(mul(x0,p0),p1)))`` is x·σ(x·s+t) with per-channel s, t.  The string is
parsed by a small hand-written parser that accepts only the function names of :data:`FUNCS` with
their arities, ``x``/``p`` leaves with dense indices and plain decimal numbers; anything else is
a :class:`ExprError`.  Code generators work from the parsed tree, never from the text, and emit
identifiers they make up themselves: a model's names cannot reach generated source.

The tree is a :class:`Expr` (frozen, hashable): equal sub-trees are one value, so generators get
common-subexpression elimination for free (``x`` used twice is loaded once).

:func:`evaluate` computes the expression with numpy in any float dtype (float64 is the reference
of the numerics gate).  :func:`kernel_id` is the identity of a generated kernel: a hash of the
grammar version, element type, channel axis and canonical text; the node's op type is derived
from it, so a model whose attribute was edited no longer matches its kernel.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GRAMMAR_VERSION = 1
MAX_TEXT = 8192
MAX_NODES = 512
MAX_DEPTH = 96
MAX_INPUTS = 8
MAX_PARAMS = 16

#: function name -> (number of expression operands, number of literal operands after them)
FUNCS: dict[str, tuple[int, int]] = {
    # unary
    "relu": (1, 0),
    "sigmoid": (1, 0),
    "tanh": (1, 0),
    "exp": (1, 0),
    "log": (1, 0),
    "erf": (1, 0),
    "abs": (1, 0),
    "neg": (1, 0),
    "sqrt": (1, 0),
    "recip": (1, 0),
    "softplus": (1, 0),
    "hardswish": (1, 0),
    # unary with literal parameters
    "clip": (1, 2),  # clip(e, lo, hi)
    "leakyrelu": (1, 1),  # leakyrelu(e, alpha)
    "elu": (1, 1),  # elu(e, alpha)
    "hardsigmoid": (1, 2),  # hardsigmoid(e, alpha, beta)
    "pow": (1, 1),  # pow(e, k), k in POW_EXPONENTS
    # binary
    "add": (2, 0),
    "sub": (2, 0),
    "mul": (2, 0),
    "div": (2, 0),
    "max": (2, 0),
    "min": (2, 0),
}
#: exponents Pow may have (each has an exact or libm-free expansion)
POW_EXPONENTS = frozenset({-1.0, -0.5, 0.5, 1.0, 2.0, 3.0, 4.0})

_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_NAME = re.compile(r"[a-z][a-z0-9]*")
_LEAF = re.compile(r"([xp])(0|[1-9]\d?)")


class ExprError(ValueError):
    """The expression text is not in the grammar (or not a valid kernel)."""


@dataclass(frozen=True)
class Expr:
    """A node of the expression tree: ``op`` is a function name, ``"x"``, ``"p"`` or ``"const"``.

    ``args`` are sub-expressions, ``lits`` literal parameters (float32 values), ``index`` the
    input/param number of a leaf, ``value`` the number of a ``const``.
    """

    op: str
    args: tuple[Expr, ...] = ()
    lits: tuple[float, ...] = ()
    index: int = -1
    value: float = 0.0

    # ------------------------------------------------------------------ building
    @staticmethod
    def x(i: int) -> Expr:
        return Expr("x", index=i)

    @staticmethod
    def p(i: int) -> Expr:
        return Expr("p", index=i)

    @staticmethod
    def const(v: float) -> Expr:
        return Expr("const", value=f32(v))

    @staticmethod
    def call(name: str, *args: Expr, lits: Sequence[float] = ()) -> Expr:
        arity, nlits = FUNCS[name]
        if len(args) != arity or len(lits) != nlits:
            raise ExprError(f"{name} takes {arity} operand(s) and {nlits} literal(s)")
        return Expr(name, tuple(args), tuple(f32(v) for v in lits))

    # ------------------------------------------------------------------ reading
    def text(self) -> str:
        """The canonical text (what the node's ``expr`` attribute holds)."""
        if self.op == "x" or self.op == "p":
            return f"{self.op}{self.index}"
        if self.op == "const":
            return format_number(self.value)
        parts = [a.text() for a in self.args] + [format_number(v) for v in self.lits]
        return f"{self.op}({','.join(parts)})"

    def walk(self):
        """Post-order over distinct sub-expressions (each once)."""
        seen: set[Expr] = set()
        out: list[Expr] = []

        def visit(e: Expr) -> None:
            if e in seen:
                return
            for a in e.args:
                visit(a)
            seen.add(e)
            out.append(e)

        visit(self)
        return out

    def inputs(self) -> int:
        return 1 + max((e.index for e in self.walk() if e.op == "x"), default=-1)

    def params(self) -> int:
        return 1 + max((e.index for e in self.walk() if e.op == "p"), default=-1)

    def uses(self, name: str) -> bool:
        return any(e.op == name for e in self.walk())


def f32(v: float) -> float:
    """The float32 value nearest ``v``, as a Python float."""
    return float(np.float32(v))


def format_number(v: float) -> str:
    """Shortest decimal that reads back as the same float32 (no exponent for ordinary values)."""
    x = np.float32(v)
    if not np.isfinite(x):
        raise ExprError(f"literal {v!r} is not finite")
    if x == 0:
        return "0"
    if 1e-4 <= abs(float(x)) < 1e7:
        s = np.format_float_positional(x, unique=True, trim="-")
    else:
        s = np.format_float_scientific(x, unique=True, trim="-").replace("e+", "e")
        s = re.sub(r"e(-?)0+(\d)", r"e\1\2", s)
    return s


# ---------------------------------------------------------------------------- parsing
def parse(text: str) -> Expr:
    """Parse and validate expression text; raises :class:`ExprError` with the position."""
    if not isinstance(text, str):
        raise ExprError("expression must be a string")
    if len(text) > MAX_TEXT:
        raise ExprError(f"expression longer than {MAX_TEXT} characters")
    if not text.isascii():
        raise ExprError("expression must be ASCII")
    p = _Parser(text)
    e = p.expr(0)
    if p.pos != len(text):
        raise ExprError(f"unexpected {text[p.pos : p.pos + 8]!r} at {p.pos}")
    validate(e)
    return e


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.count = 0

    def _fail(self, what: str):
        raise ExprError(f"{what} at {self.pos}: {self.text[self.pos : self.pos + 12]!r}")

    def _number(self) -> float | None:
        m = _NUMBER.match(self.text, self.pos)
        if not m:
            return None
        self.pos = m.end()
        v = float(m.group(0))
        if not math.isfinite(v) or not np.isfinite(np.float32(v)):
            self._fail("number out of float32 range")
        return v

    def expr(self, depth: int) -> Expr:
        if depth > MAX_DEPTH:
            self._fail("expression nested too deeply")
        self.count += 1
        if self.count > MAX_NODES:
            self._fail("expression too large")
        m = _LEAF.match(self.text, self.pos)
        if m and not (m.end() < len(self.text) and self.text[m.end()].isalnum()):
            self.pos = m.end()
            return Expr(m.group(1), index=int(m.group(2)))
        v = self._number()
        if v is not None:
            return Expr.const(v)
        m = _NAME.match(self.text, self.pos)
        if not m or m.group(0) not in FUNCS:
            self._fail("unknown function or leaf")
        name = m.group(0)
        self.pos = m.end()
        if self.text[self.pos : self.pos + 1] != "(":
            self._fail("expected '('")
        self.pos += 1
        arity, nlits = FUNCS[name]
        args: list[Expr] = []
        lits: list[float] = []
        for k in range(arity + nlits):
            if k:
                if self.text[self.pos : self.pos + 1] != ",":
                    self._fail(f"{name} takes {arity + nlits} argument(s); expected ','")
                self.pos += 1
            if k < arity:
                args.append(self.expr(depth + 1))
            else:
                v = self._number()
                if v is None:
                    self._fail(f"{name}: literal parameter expected")
                lits.append(v)
        if self.text[self.pos : self.pos + 1] != ")":
            self._fail(f"{name} takes {arity + nlits} argument(s); expected ')'")
        self.pos += 1
        return Expr.call(name, *args, lits=lits)


def validate(e: Expr) -> None:
    """Semantic checks: dense leaf indices, at least one runtime input, literal rules."""
    xs = sorted({n.index for n in e.walk() if n.op == "x"})
    ps = sorted({n.index for n in e.walk() if n.op == "p"})
    if not xs:
        raise ExprError("expression reads no runtime input (x0)")
    if xs != list(range(len(xs))) or len(xs) > MAX_INPUTS:
        raise ExprError(f"runtime inputs must be x0..x{len(xs) - 1} (at most {MAX_INPUTS})")
    if ps != list(range(len(ps))) or len(ps) > MAX_PARAMS:
        raise ExprError(f"parameters must be p0..p{len(ps) - 1} (at most {MAX_PARAMS})")
    for n in e.walk():
        if n.op == "pow" and n.lits[0] not in POW_EXPONENTS:
            raise ExprError(f"pow exponent {n.lits[0]} not supported")
        if n.op == "clip" and not n.lits[0] <= n.lits[1]:
            raise ExprError("clip bounds out of order")
        if n.op in FUNCS and all(a.op == "const" for a in n.args):
            raise ExprError(f"{n.op} of constants only (fold it first)")


# --------------------------------------------------------------------------- identity
def kernel_id(expr: Expr, dtype: str, channel_axis: int) -> str:
    """Stable identity of the kernel for (expression, element type, channel axis)."""
    spec = f"graphopt.fused/{GRAMMAR_VERSION};{dtype};axis={channel_axis};{expr.text()}"
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def op_type(expr: Expr, dtype: str, channel_axis: int) -> str:
    """The op type of a fused node: ``Elementwise_<id>`` (one custom op per generated kernel)."""
    return f"Elementwise_{kernel_id(expr, dtype, channel_axis)}"


# --------------------------------------------------------------------------- evaluation
def evaluate(
    expr: Expr, xs: Sequence[np.ndarray], ps: Sequence[np.ndarray], dtype=np.float64
) -> np.ndarray:
    """The expression with numpy in ``dtype`` (params broadcast as given)."""
    dt = np.dtype(dtype)
    memo: dict[Expr, np.ndarray] = {}
    with np.errstate(all="ignore"):
        for n in expr.walk():
            memo[n] = _eval(n, [memo[a] for a in n.args], xs, ps, dt)
    return np.asarray(memo[expr], dtype=dt)


def _eval(n: Expr, a: list[np.ndarray], xs, ps, dt: np.dtype):
    c = dt.type
    if n.op == "x":
        return np.asarray(xs[n.index], dtype=dt)
    if n.op == "p":
        return np.asarray(ps[n.index], dtype=dt)
    if n.op == "const":
        return c(n.value)
    lit = [c(v) for v in n.lits]
    op = n.op
    if op == "relu":
        return np.maximum(a[0], c(0))
    if op == "sigmoid":
        return c(1) / (c(1) + np.exp(-a[0]))
    if op == "tanh":
        return np.tanh(a[0])
    if op == "exp":
        return np.exp(a[0])
    if op == "log":
        return np.log(a[0])
    if op == "erf":
        return _erf(a[0], dt)
    if op == "abs":
        return np.abs(a[0])
    if op == "neg":
        return -a[0]
    if op == "sqrt":
        return np.sqrt(a[0])
    if op == "recip":
        return c(1) / a[0]
    if op == "softplus":
        return np.logaddexp(c(0), a[0])
    if op == "hardswish":
        return a[0] * np.clip(a[0] / c(6) + c(0.5), c(0), c(1))
    if op == "clip":
        return np.clip(a[0], lit[0], lit[1])
    if op == "leakyrelu":
        return np.where(a[0] >= 0, a[0], lit[0] * a[0])
    if op == "elu":
        return np.where(a[0] >= 0, a[0], lit[0] * (np.exp(a[0]) - c(1)))
    if op == "hardsigmoid":
        return np.clip(lit[0] * a[0] + lit[1], c(0), c(1))
    if op == "pow":
        return np.power(a[0], lit[0])
    if op == "add":
        return a[0] + a[1]
    if op == "sub":
        return a[0] - a[1]
    if op == "mul":
        return a[0] * a[1]
    if op == "div":
        return a[0] / a[1]
    if op == "max":
        return np.maximum(a[0], a[1])
    if op == "min":
        return np.minimum(a[0], a[1])
    raise ExprError(f"no evaluator for {op}")


def _erf(v: np.ndarray, dt: np.dtype) -> np.ndarray:
    flat = np.asarray(v, dtype=np.float64).ravel()
    out = np.fromiter((math.erf(t) for t in flat), dtype=np.float64, count=flat.size)
    return out.reshape(np.shape(v)).astype(dt)

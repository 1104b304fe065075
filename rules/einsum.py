"""A two-operand Einsum that is a batched matrix product → Transpose · MatMul · Transpose.

``einsum("b h i d, b h j d -> b h i j", q, k)`` (Stable Diffusion's and many research
models' attention, written with einops) is ``MatMul(q, Transpose(k))``: the letters of the
equation sort into batch (in both operands and the output), m (first operand and output), n
(second operand and output) and k (both operands, summed over).  With one m, one n and one k
letter, each operand is transposed to [batch…, m, k] and [batch…, k, n] (no node where it
already is), multiplied, and the product transposed to the output's order.  The attention
rules then read those MatMuls; onnxruntime runs an Einsum by the same transposes and a GEMM.

Left alone: an ellipsis of different lengths in the two operands (one of the same length is
spelled out), a repeated letter (a trace or a diagonal), a letter summed over in one operand
only, an operand whose rank does not match its letters, more than one letter of a class (that
needs Reshapes), or a summed dim static and different in the two operands.

A projection by a constant weight with several letters on a side (XLNet's
``einsum("ibh,hnd->ibnd", x, Wq)`` straight into heads and ``einsum("ibnd,hnd->ibh", ctx,
Wo)`` out of them) is ``einsum-projection``: the weight transposed and flattened to a matrix,
the activation's summed dims flattened, one MatMul and a Reshape back to the output's dims:
the MatMul and head split the attention rules know.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import rank
from graphopt.opt.graph.ir import constant_value, dtype_of
from graphopt.opt.rewrite.engine import Match, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from .activation import inputs, no_match


def parse(equation: str, ranks: tuple = (None, None)) -> tuple[str, str, str] | None:
    """(a, b, out) letters of a two-operand explicit equation, else None.  An ellipsis
    standing for the same number of dims in both operands (``...qhd,...khd->...hqk``, LongT5's
    local blocks), known from their ``ranks``, is spelled out with letters of its own."""
    eq = equation.replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    operands = lhs.split(",")
    if len(operands) != 2:
        return None
    a, b = operands
    if "..." in eq:
        spelled = _without_ellipsis(a, b, out, ranks)
        if spelled is None:
            return None
        a, b, out = spelled
    letters = a + b + out
    if not letters.isalpha() or any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    return a, b, out


def _operands(node) -> tuple[tuple[str, str, str], tuple]:
    """((a, b, out) letters, (x, y) operands) of a two-operand Einsum, else no match."""
    ins = inputs(node)
    if len(ins) != 2 or any(t is None for t in ins):
        raise no_match()
    found = parse(str(node.attrs.get("equation", "")), (rank(ins[0]), rank(ins[1])))
    if found is None:
        raise no_match()
    return found, tuple(ins)


def _without_ellipsis(a: str, b: str, out: str, ranks: tuple) -> tuple[str, str, str] | None:
    """``a``, ``b`` and ``out`` with a leading ``...`` replaced by the same fresh letters, when
    it stands for as many dims in each operand; else None."""
    if any(t.count("...") != 1 or not t.startswith("...") for t in (a, b, out)):
        return None
    ra, rb = ranks
    if ra is None or rb is None:
        return None
    n = ra - (len(a) - 3)
    if n < 0 or n != rb - (len(b) - 3):
        return None
    used = set(a + b + out)
    fresh = "".join([c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used][:n])
    if len(fresh) != n:
        return None
    return tuple(fresh + t[3:] for t in (a, b, out))


def plan(a: str, b: str, out: str) -> tuple[list[int], list[int], list[int]] | None:
    """The permutations of a to [batch…, m, k], of b to [batch…, k, n], and of the product
    [batch…, m, n] to ``out``; None when the equation is not one batched matrix product."""
    batch = [c for c in out if c in a and c in b]
    m = [c for c in out if c in a and c not in b]
    n = [c for c in out if c in b and c not in a]
    k = [c for c in a if c in b and c not in out]
    if len(m) != 1 or len(n) != 1 or len(k) != 1 or set(out) - set(a + b):
        return None
    if set(a) != set(batch + m + k) or set(b) != set(batch + k + n):
        return None  # a letter of one operand summed over alone
    product = batch + m + n
    return (
        [a.index(c) for c in batch + m + k],
        [b.index(c) for c in batch + k + n],
        [product.index(c) for c in out],
    )


@register_rule
class EinsumToMatMul(Rule):
    name = "einsum-to-matmul"
    pattern = Op("Einsum", "x", "y")
    phase = "fuse"
    summary = "a batched matrix product spelled as Einsum → Transpose · MatMul · Transpose"

    def match(self, node, cx):
        (a, b, out), (x, y) = _operands(node)
        if rank(x) != len(a) or rank(y) != len(b) or dtype_of(x) != dtype_of(y):
            raise no_match()
        perms = plan(a, b, out)
        if perms is None:
            raise no_match()
        # the summed dim: not provably different (batch dims broadcast in MatMul as they
        # would have to agree for the Einsum)
        kc = [c for c in a if c in b and c not in out][0]
        dx, dy = _static(x, a.index(kc)), _static(y, b.index(kc))
        if dx is not None and dy is not None and dx != dy:
            raise no_match()
        m = Match(node, {"einsum": node})
        m.stash(perms=perms)
        return m

    def rewrite(self, m, b):
        node = m.root
        pa, pb, po = m.perms
        x, y = inputs(node)
        name = node.name or "Einsum"
        x = _transposed(b, x, pa, f"{name}/a")
        y = _transposed(b, y, pb, f"{name}/b")
        prod = b.op("MatMul", [x, y], name=f"{name}/matmul")
        prod.dtype = dtype_of(node.outputs[0])
        if po == sorted(po):
            prod.shape = node.outputs[0].shape
            return [prod]
        return [b.op("Transpose", [prod], {"perm": po}, like=node.outputs[0], name=f"{name}/out")]


def projection(x: str, w: str, out: str) -> tuple[list[int], int] | None:
    """(the permutation of the weight to [k…, n…], how many leading dims of the activation
    are kept) when ``x`` = m… k… and ``out`` = m… n…, with the k letters summed against the
    weight ``w`` = the k and n letters in any order; else None."""
    k = [c for c in x if c in w and c not in out]
    n = [c for c in out if c in w and c not in x]
    m = out[: len(out) - len(n)]
    if not m or not k or not n or x != m + "".join(k) or out != m + "".join(n):
        return None
    if set(w) != set(k + n):
        return None
    return [w.index(c) for c in k + n], len(m)


@register_rule
class EinsumProjection(Rule):
    name = "einsum-projection"
    pattern = Op("Einsum", "x", "w")
    phase = "fuse"
    summary = "a projection by a constant weight spelled as Einsum → MatMul and Reshapes"

    def match(self, node, cx):
        (a, wl, out), (x, w) = _operands(node)
        weight = constant_value(w)
        if weight is None or plan(a, wl, out) is not None:  # one MatMul already: einsum-to-matmul
            raise no_match()
        how = projection(a, wl, out)
        if how is None or rank(x) != len(a) or weight.ndim != len(wl):
            raise no_match()
        if weight.dtype != dtype_of(x):
            raise no_match()
        perm, kept = how
        k_dims = [weight.shape[i] for i in perm[: len(a) - kept]]
        for i, d in enumerate(k_dims):
            if _static(x, kept + i) not in (None, d):
                raise no_match()
        m = Match(node, {"einsum": node})
        m.stash(weight=weight, perm=perm, kept=kept, k=len(k_dims))
        return m

    def rewrite(self, m, b):
        node = m.root
        x = inputs(node)[0]
        name = node.name or "Einsum"
        w = np.transpose(m.weight, m.perm)
        k_dims, n_dims = list(w.shape[: m.k]), list(w.shape[m.k :])
        matrix = b.const(np.ascontiguousarray(w.reshape(int(np.prod(k_dims)), -1)), "weight")
        if m.k > 1:
            flat = b.const(np.array([0] * m.kept + [int(np.prod(k_dims))], np.int64), "flat")
            x = _reshaped(b, x, flat, f"{name}/flat")
        prod = b.op("MatMul", [x, matrix], name=f"{name}/matmul")
        prod.dtype = dtype_of(node.outputs[0])
        if len(n_dims) == 1:
            prod.shape = node.outputs[0].shape
            return [prod]
        dims = b.const(np.array([0] * m.kept + n_dims, np.int64), "split")
        return [b.op("Reshape", [prod, dims], like=node.outputs[0], name=f"{name}/split")]


def _reshaped(b, t, dims, name: str):
    out = b.op("Reshape", [t, dims], name=name)
    out.dtype = dtype_of(t)
    return out


def _static(t, axis: int) -> int | None:
    d = t.shape[axis] if t.shape is not None else None
    return d if isinstance(d, int) else None


def _transposed(b, t, perm: list[int], name: str):
    if perm == sorted(perm):
        return t
    out = b.op("Transpose", [t], {"perm": perm}, name=name)
    out.dtype = dtype_of(t)
    if t.shape is not None:
        out.shape = [t.shape[i] for i in perm]
    return out

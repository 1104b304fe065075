"""A two-operand Einsum that is a batched matrix product → Transpose · MatMul · Transpose.

``einsum("b h i d, b h j d -> b h i j", q, k)`` (Stable Diffusion's and many research
models' attention, written with einops) is ``MatMul(q, Transpose(k))``: the letters of the
equation sort into batch (in both operands and the output), m (first operand and output), n
(second operand and output) and k (both operands, summed over).  With one m, one n and one k
letter, each operand is transposed to [batch…, m, k] and [batch…, k, n] (no node where it
already is), multiplied, and the product transposed to the output's order.  The attention
rules then read those MatMuls; onnxruntime runs an Einsum by the same transposes and a GEMM.

Left alone: an ellipsis, a repeated letter (a trace or a diagonal), a letter summed over in
one operand only, an operand whose rank does not match its letters, more than one letter of a
class (that needs Reshapes), or a summed dim static and different in the two operands.
"""

from __future__ import annotations

from graphopt.opt.graph.dims import rank
from graphopt.opt.graph.ir import dtype_of
from graphopt.opt.rewrite.engine import Match, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from .activation import inputs, no_match


def parse(equation: str) -> tuple[str, str, str] | None:
    """(a, b, out) letters of a two-operand explicit equation without ellipsis, else None."""
    eq = equation.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.split("->")
    operands = lhs.split(",")
    if len(operands) != 2:
        return None
    a, b = operands
    letters = a + b + out
    if not letters.isalpha() or any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    return a, b, out


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
        found = parse(str(node.attrs.get("equation", "")))
        ins = inputs(node)
        if found is None or len(ins) != 2 or any(t is None for t in ins):
            raise no_match()
        (a, b, out), (x, y) = found, ins
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

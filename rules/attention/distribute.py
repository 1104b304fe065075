"""A score scale applied after a term was added, distributed over the sum.

BROS's bounding-box term (and BERT's ``relative_key`` scores in transformers before v5) add a
term to the raw product before scaling the sum::

    z = (Q·Kᵀ + term) / c            (or · c)

``distribute-score-scale`` writes it ``Q·Kᵀ / c + term / c``: the scaled scores and one more
additive term, which stage 1 reads as it reads any bias.  It fires only where the sum feeds a
Softmax (through masks and bias terms) and ``c`` is a constant scalar; also where the
attention will not fuse after all (then stage 1 says why, not that it cannot read the scores:
the cost is one more element-wise division).  The two spellings differ by the rounding of
one division per score, well inside parity's tolerance.

GPT-J (transformers before v5) scales after its causal mask::

    z = Where(causal, Q·Kᵀ, fill) / c

``scale-through-where`` writes it ``Where(causal, Q·Kᵀ / c, fill / c)`` (the fill a constant
scalar, divided here): each element is the same division of the same value, so it is exact.

XLNet masks by subtracting, ``z = scores − 1e30 · mask``; ``subtract-score-term`` writes it
``scores + Neg(1e30 · mask)``, a term stage 1 reads as any bias (exact: a − b is a + (−b)).
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.ir import Node, Tensor, dtype_of
from graphopt.opt.rewrite.engine import Match, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Alt, Op

from ..activation import inputs, no_match, producer, scalar
from .core import is_scores

#: ops between the scaled sum and the Softmax: more terms, a Where mask, a fold, a cast
_TO_SOFTMAX = ("Add", "Sub", "Where", "Reshape", "Cast")


def _feeds_softmax(t: Tensor, steps: int = 4) -> bool:
    """Whether ``t`` reaches a Softmax through at most ``steps`` of :data:`_TO_SOFTMAX`."""
    frontier = [t]
    for _ in range(steps + 1):
        nxt = []
        for x in frontier:
            for r in x.outputs:
                if r.op == "Softmax":
                    return True
                if r.op in _TO_SOFTMAX:
                    nxt += r.outputs
        frontier = nxt
    return False


def _scaled(node: Node) -> tuple[Tensor, Tensor]:
    """(what is scaled, the factor or divisor) of a Div, or of a Mul whichever side is the
    scalar."""
    ins = inputs(node)
    if node.op == "Div" or scalar(ins[1]) is not None:
        return ins[0], ins[1]
    return ins[1], ins[0]


def _scaled_sum(node: Node) -> tuple[Node, Tensor, Tensor, Tensor] | None:
    """(the Add, scores, term, c) when ``node`` is ``(scores + term) ÷|· c`` with ``c`` a
    constant scalar and exactly one side Q·Kᵀ; else None."""
    a, c = _scaled(node)
    add = producer(a, "Add")
    if add is None or scalar(c) is None or len(a.outputs) != 1:
        return None
    x, y = inputs(add)
    sides = [is_scores(x), is_scores(y)]
    if sides.count(True) != 1:
        return None
    return (add, x, y, c) if sides[0] else (add, y, x, c)


class _ScaledScores(Rule):
    """A Div or Mul by a scalar of something built from Q·Kᵀ that feeds a Softmax: ``find``
    gives (the node it replaces, the rewrite's parts) or None."""

    pattern = Alt(Op("Div", "scale"), Op("Mul", "scale"))
    phase = "attention"
    priority = 1  # before fuse-attention reads the scores
    exclusive = False  # the node it replaces has this one as its only reader

    def find(self, node: Node) -> tuple[Node, tuple] | None:
        raise NotImplementedError

    def match(self, node, cx):
        found = self.find(node)
        if found is None or not _feeds_softmax(node.outputs[0]):
            raise no_match()
        m = Match(node, {"scale": node, "inner": found[0]})
        m.stash(parts=found[1])
        return m


@register_rule
class DistributeScoreScale(_ScaledScores):
    name = "distribute-score-scale"
    summary = "(Q·Kᵀ + term) ÷ c → Q·Kᵀ ÷ c + term ÷ c (the term becomes a bias)"

    def find(self, node):
        found = _scaled_sum(node)
        return None if found is None else (found[0], found[1:])

    def rewrite(self, m, b):
        scores, term, c = m.parts
        op, out = m.root.op, m.root.outputs[0]
        parts = []
        for t, role in ((scores, "scores"), (term, "term")):
            p = b.op(op, [t, c], name=f"{m.root.name}/{role}")
            p.dtype, p.shape = dtype_of(out), t.shape
            parts.append(p)
        return [b.op("Add", parts, like=out, name=f"{m.root.name}/sum")]


def _scaled_where(node: Node) -> tuple[Node, int, Tensor, float] | None:
    """(the Where, which of its branches is Q·Kᵀ, c, the fill) when ``node`` is
    ``Where(cond, scores, fill) ÷|· c`` (either branch) with ``fill`` and ``c`` constant
    scalars; else None."""
    a, c = _scaled(node)
    where = producer(a, "Where")
    if where is None or scalar(c) is None or len(a.outputs) != 1:
        return None
    _, x, y = inputs(where)
    for side, scores, fill in ((1, x, y), (2, y, x)):
        if is_scores(scores) and scalar(fill) is not None:
            return where, side, c, scalar(fill)
    return None


@register_rule
class ScaleThroughWhere(_ScaledScores):
    name = "scale-through-where"
    summary = "Where(cond, Q·Kᵀ, fill) ÷ c → Where(cond, Q·Kᵀ ÷ c, fill ÷ c)"

    def find(self, node):
        found = _scaled_where(node)
        return None if found is None else (found[0], found[1:])

    def rewrite(self, m, b):
        side, c, fill = m.parts
        op, out = m.root.op, m.root.outputs[0]
        dt = dtype_of(out)
        ins = inputs(m.inner)
        scores = ins[side]
        scaled = b.op(op, [scores, c], name=f"{m.root.name}/scores")
        scaled.dtype, scaled.shape = dt, scores.shape
        k = np.asarray(scalar(c), dtype=dt)
        value = np.asarray(fill, dtype=dt) / k if op == "Div" else np.asarray(fill, dtype=dt) * k
        new_fill = b.const(np.asarray(value, dtype=dt), "scaled_fill")
        branches = [scaled, new_fill] if side == 1 else [new_fill, scaled]
        return [b.op("Where", [ins[0], *branches], like=out, name=f"{m.root.name}/masked")]


@register_rule
class SubtractScoreTerm(Rule):
    name = "subtract-score-term"
    pattern = Op("Sub", "sub")
    phase = "attention"
    priority = 1  # before fuse-attention reads the scores
    summary = "Q·Kᵀ − term → Q·Kᵀ + (−term) (the term becomes a bias)"

    def match(self, node, cx):
        scores, term = inputs(node)
        if not is_scores(scores) or is_scores(term) or not _feeds_softmax(node.outputs[0]):
            raise no_match()
        if dtype_of(scores) != dtype_of(term):
            raise no_match()
        return Match(node, {"sub": node})

    def rewrite(self, m, b):
        scores, term = inputs(m.root)
        neg = b.op("Neg", [term], name=f"{m.root.name}/negated")
        neg.dtype, neg.shape = dtype_of(term), term.shape
        return [b.op("Add", [scores, neg], like=m.root.outputs[0], name=f"{m.root.name}/sum")]

"""Attention over an extra axis of windows, made per head over heads × windows.

HF's Hiera (mask-unit attention) keeps a window axis W beside the heads A through the whole
attention::

    q5, k5, v5 = [B,A,W,S,H]   (unbound from one packed projection per window)
    ctx5 = MatMul(Softmax(MatMul(q5 · c, Transpose(k5, (0,1,2,4,3)))), v5)    [B,A,W,S,H]

Every (batch, head, window) attends on its own, so the same products over ``A·W`` heads are
exact: ``fold-window-heads`` reshapes q5, k5 and v5 to [B,A·W,S,H] (row-major: head-major,
window-minor), runs Q·Kᵀ, the Softmax and P·V per head, and gives the model its
[B,A,W,S,H] back through the heads' merge ``Transpose(0,2,1,3)`` that ``fuse-attention`` reads
an attention from (then a Reshape to [B,S,A,W,H] and a Transpose to [B,A,W,S,H]; the model's
own merge Transpose follows and the transposes compose).  It fires only with A, W and H static
(``num_heads`` = A·W) and a target with an attention kernel; additive terms of the 5-D
scores (ProphetNet's n-gram stream: relative positions and its causal mask) are broadcast over
heads and windows and folded as the scores are.  It asks fuse-attention's cost bound first
(a biased attention over few static keys stays as it is, refused here); where fuse-attention
then refuses, the per-head form stays (the same numbers).
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import rank
from graphopt.opt.graph.ir import Tensor, dtype_of
from graphopt.opt.rewrite.engine import Builder, Match, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from ..activation import inputs, no_match, producer
from .core import peel_terms, strip_scale
from .heads import transpose_of
from .unfold3d import _scaled, check_pays, require_attention_kernel, static_dim

#: the key's transpose in the window layout: its last two axes swapped
_KT5 = (0, 1, 2, 4, 3)


def _static(t: Tensor, axis: int) -> int | None:
    key = current_dims().key(t, axis)
    return key[1] if key[0] == "int" and key[1] > 0 else None


@register_rule
class FoldWindowHeads(Rule):
    name = "fold-window-heads"
    pattern = Op("MatMul", "probs", "v5")
    phase = "attention"
    priority = 1  # before fuse-attention reads the heads' merge it adds
    exclusive = False  # its own checks: the scores and probabilities are read here only
    summary = "attention over [B,A,W,S,H] (heads × windows: Hiera) → per head over A·W heads"

    def match(self, node, cx):
        p5, v5 = inputs(node)
        sm = producer(p5, "Softmax")
        if sm is None or rank(p5) != 5 or sm.attrs.get("axis", -1) not in (-1, 4):
            raise no_match()
        if len(p5.outputs) != 1 or cx.ir.is_graph_output(p5) or cx.ir.opset < 13:
            raise no_match()
        z = inputs(sm)[0]
        s, terms, adds = peel_terms(z)
        s, factors = strip_scale(s)
        qk = producer(s, "MatMul")
        if qk is None or len(s.outputs) != 1 or len(z.outputs) != 1:
            raise no_match()
        if any(len(a.outputs[0].outputs) != 1 for a in adds) or not all(
            _term_fits(t, rank(p5)) for t in terms
        ):
            raise no_match()
        q5, qf = strip_scale(inputs(qk)[0])
        kt5, kf = strip_scale(inputs(qk)[1])
        flip = transpose_of(kt5, _KT5)
        if flip is None or rank(q5) != 5 or rank(v5) != 5:
            raise no_match()
        k5 = inputs(flip)[0]
        dims = current_dims()
        for i in (0, 1, 2):  # one batch, heads and windows for q, k and v
            if not dims.key(q5, i) == dims.key(k5, i) == dims.key(v5, i):
                raise no_match()
        a, w, h, hv = _static(q5, 1), _static(q5, 2), _static(q5, 4), _static(v5, 4)
        if None in (a, w, h, hv) or _static(k5, 4) != h:
            raise no_match()
        require_attention_kernel(cx, q5, sm)  # (the keys' count is the values': P·V runs)
        check_pays(cx, sm, static_dim(k5, 3), k5)
        m = Match(node, {"pv": node, "softmax": sm, "qk": qk})
        m.stash(q5=q5, k5=k5, v5=v5, factors=(qf, kf, factors), heads=a * w, a=a, w=w, h=h, hv=hv)
        m.stash(terms=terms)
        return m

    def rewrite(self, m, b):
        qf, kf, factors = m.factors
        name = m.root.name
        q4 = _heads(b, m.q5, m.heads, m.h, f"{name}/q")
        q = _scaled(b, q4, qf, q4)  # the scaled query has the 4-D query's shape
        k4 = _heads(b, m.k5, m.heads, m.h, f"{name}/k")
        bq, n, sq, sk = k4.shape[0], m.heads, q.shape[2], k4.shape[2]
        kt = b.op("Transpose", [k4], {"perm": [0, 1, 3, 2]}, name=f"{name}/kt")
        kt.dtype = dtype_of(k4)
        kt = _scaled(b, _shaped(kt, [bq, n, m.h, sk]), kf, kt)
        s = b.op("MatMul", [q, kt], name=f"{name}/scores")
        s.dtype = dtype_of(q)
        s = _scaled(b, _shaped(s, [bq, n, sq, sk]), factors, s)
        for i, term in enumerate(m.terms):
            t4 = _folded_term(b, term, m.a, m.w, f"{name}/term{i}")
            s = _shaped(b.op("Add", [s, t4], name=f"{name}/biased{i}"), [bq, n, sq, sk])
            s.dtype = dtype_of(q)
        p = b.op("Softmax", [s], {"axis": -1}, name=f"{name}/probs")
        p.dtype = dtype_of(s)
        p = _shaped(p, [bq, n, sq, sk])
        ctx = b.op("MatMul", [p, _heads(b, m.v5, m.heads, m.hv, f"{name}/v")], name=f"{name}/ctx")
        ctx.dtype = dtype_of(q)
        ctx = _shaped(ctx, [bq, n, sq, m.hv])
        merged = b.op("Transpose", [ctx], {"perm": [0, 2, 1, 3]}, name=f"{name}/merge")
        merged.dtype = dtype_of(ctx)
        merged = _shaped(merged, [bq, sq, n, m.hv])
        target = b.const(np.array([0, 0, m.a, m.w, m.hv], dtype=np.int64), "windows")
        split = b.op("Reshape", [merged, target], name=f"{name}/windows")
        split.dtype = dtype_of(ctx)
        split = _shaped(split, [bq, sq, m.a, m.w, m.hv])
        back = b.op("Transpose", [split], {"perm": [0, 2, 3, 1, 4]}, like=m.root.outputs[0])
        return [back]


def _heads(b: Builder, t5: Tensor, heads: int, size: int, name: str) -> Tensor:
    """``t5`` [B,A,W,L,H] as [B,A·W,L,H] (H = ``size``)."""
    target = b.const(np.array([0, heads, -1, size], dtype=np.int64), "window_heads")
    out = b.op("Reshape", [t5, target], name=f"{name}_heads")
    out.dtype = dtype_of(t5)
    shape = t5.shape if t5.shape is not None and len(t5.shape) == 5 else [None] * 5
    out.shape = [shape[0], heads, shape[3], size]
    return out


def _term_fits(t: Tensor, r: int) -> bool:
    """Whether the additive term ``t`` of the [B,A,W,S,T] scores is at most 5-D (it then
    broadcasts against them as the scores' own axes)."""
    return rank(t) is not None and rank(t) <= r


def _folded_term(b: Builder, t: Tensor, a: int, w: int, name: str) -> Tensor:
    """A term of the [B,A,W,S,T] scores as a term of the [B,A·W,S,T] ones: broadcast over the
    heads and windows (``Expand`` to [1,A,W,1,1] keeps its other dims, 1 or full), then its
    two axes folded as the scores' are."""
    ones = b.const(np.array([1, a, w, 1, 1], dtype=np.int64), "term_heads_windows")
    full = b.op("Expand", [t, ones], name=f"{name}_expanded")
    full.dtype = dtype_of(t)
    lead = b.op("Shape", [full], {"start": 0, "end": 1}, name=f"{name}_batch")
    lead.dtype, lead.shape = np.dtype(np.int64), [1]
    tail = b.op("Shape", [full], {"start": 3}, name=f"{name}_rows_keys")
    tail.dtype, tail.shape = np.dtype(np.int64), [2]
    heads = b.const(np.array([a * w], dtype=np.int64), "term_heads")
    target = b.op("Concat", [lead, heads, tail], {"axis": 0}, name=f"{name}_target")
    target.dtype, target.shape = np.dtype(np.int64), [4]
    out = b.op("Reshape", [full, target], name=f"{name}_folded")
    out.dtype = dtype_of(t)
    out.shape = [None, a * w, None, None]
    return out


def _shaped(t: Tensor, shape: list) -> Tensor:
    """``t`` with its rank known (the dims the fold proves, None where it does not)."""
    t.shape = shape
    return t

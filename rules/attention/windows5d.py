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
(``num_heads`` = A·W), unbiased scores (a term of the 5-D scores would need its own fold),
and a target with an attention kernel; where fuse-attention then refuses, the per-head form
stays (the same numbers).
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
from .core import strip_scale
from .heads import transpose_of
from .unfold3d import _scaled, has_attention_kernel

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
        s, factors = strip_scale(inputs(sm)[0])
        qk = producer(s, "MatMul")
        if qk is None or len(s.outputs) != 1 or len(inputs(sm)[0].outputs) != 1:
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
        if dims.key(k5, 3) != dims.key(v5, 3) or not has_attention_kernel(cx, q5):
            raise no_match()
        m = Match(node, {"pv": node, "softmax": sm, "qk": qk})
        m.stash(q5=q5, k5=k5, v5=v5, factors=(qf, kf, factors), heads=a * w, a=a, w=w, h=h, hv=hv)
        return m

    def rewrite(self, m, b):
        qf, kf, factors = m.factors
        name = m.root.name
        q = _scaled(b, _heads(b, m.q5, m.heads, m.h, f"{name}/q"), qf, m.q5)
        k4 = _heads(b, m.k5, m.heads, m.h, f"{name}/k")
        bq, n, sq, sk = k4.shape[0], m.heads, q.shape[2], k4.shape[2]
        kt = b.op("Transpose", [k4], {"perm": [0, 1, 3, 2]}, name=f"{name}/kt")
        kt.dtype = dtype_of(k4)
        kt = _scaled(b, _shaped(kt, [bq, n, m.h, sk]), kf, kt)
        s = b.op("MatMul", [q, kt], name=f"{name}/scores")
        s.dtype = dtype_of(q)
        s = _scaled(b, _shaped(s, [bq, n, sq, sk]), factors, s)
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


def _shaped(t: Tensor, shape: list) -> Tensor:
    """``t`` with its rank known (the dims the fold proves, None where it does not)."""
    t.shape = shape
    return t

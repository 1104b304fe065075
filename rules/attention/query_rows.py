"""Multi-query attention with the query heads folded into the sequence, made per head.

GPT-BigCode (StarCoder, SantaCoder) as transformers before v5 writes its multi-query
attention without a head axis::

    q3 = Reshape(q [B,S,N·H], [B,S·N,H])                    the heads as rows
    s4 = Reshape(q3 · kᵀ [B,H,T] (· scale), [B,S,N,T])      (+ baddbmm's zeros · beta)
    P4 = Softmax(Where(mask [B,S,1,T], s4, fill) [+ terms])
    out = Reshape(Reshape(P4, [B,S·N,T]) · v [B,T,H], [B,S,N·H])

Row-major, row ``s·N + n`` of ``q3`` is head ``n`` of token ``s``, so each Reshape is exact.
``unfold-query-rows`` writes it per head: ``q`` split into [B,N,S,H], the one key and value
head [B,1,T,H] broadcast by the MatMuls (which fuse-attention takes as multi-query), the
scale steps replayed, each mask operand transposed from [B,S,·,T] to [B,·,S,T], and the merge
``Transpose(0,2,1,3)`` and Reshape.  It fires only where the target has an attention kernel.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import rank, shape_elements
from graphopt.opt.graph.ir import Node, Tensor, dtype_of
from graphopt.opt.rewrite.engine import Match, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from ..activation import inputs, no_match, producer, scalar
from .masks import check_where_fill, is_zero
from .unfold3d import require_attention_kernel

_PERM = [0, 2, 1, 3]  # [B,S,N,T] ↔ [B,N,S,T]


def _scale_steps(t: Tensor, limit: int = 5) -> tuple[Node, list[Node]] | None:
    """(the MatMul under ``t``, the Mul/Div-by-scalar nodes from its product to ``t``
    innermost first), Adds of a zero term skipped; None when another op is between them."""
    steps = []
    for _ in range(limit + 1):
        mm = producer(t, "MatMul")
        if mm is not None:
            return mm, steps[::-1]
        node = producer(t, ("Mul", "Div", "Add"))
        if node is None:
            return None
        a, b = inputs(node)
        if node.op == "Add":
            t = a if is_zero(b) else b if is_zero(a) else None
            if t is None:
                return None
        elif scalar(b) is not None:
            steps.append(node)
            t = a
        elif node.op == "Mul" and scalar(a) is not None:
            steps.append(node)
            t = b
        else:
            return None
    return None


def _mask_steps(z: Tensor, scores: Tensor, limit: int = 4) -> list[tuple[Node, int]] | None:
    """(node, the input that carries the scores) for each Add, Where or Cast from ``scores`` to
    ``z``, innermost first; None where another op is between them."""
    steps = []
    for _ in range(limit + 1):
        if z is scores:
            return steps[::-1]
        node = producer(z, ("Add", "Where", "Cast"))
        if node is None:
            return None
        ins = inputs(node)
        if node.op == "Cast":
            at = 0
        elif node.op == "Add":
            at = 0 if _reaches(ins[0], scores) else 1
        else:
            at = 1 if _reaches(ins[1], scores) else 2
            if scalar(ins[3 - at]) is None:
                return None
        steps.append((node, at))
        z = ins[at]
    return None


def _reaches(t: Tensor, scores: Tensor, depth: int = 5) -> bool:
    """Whether ``scores`` is ``t`` or under it through Adds, Wheres and Casts."""
    if t is scores:
        return True
    node = producer(t, ("Add", "Where", "Cast"))
    return (
        depth > 0 and node is not None and any(_reaches(i, scores, depth - 1) for i in inputs(node))
    )


@register_rule
class UnfoldQueryRows(Rule):
    name = "unfold-query-rows"
    pattern = Op("Reshape", "ctx3", "target")
    phase = "attention"
    priority = 1  # before fuse-attention
    exclusive = False  # its own checks: each step feeds the next only
    summary = "multi-query attention with the heads as query rows → its per-head form"

    def match(self, node, cx):
        dims = current_dims()
        pv = producer(inputs(node)[0], "MatMul")
        p3 = producer(inputs(pv)[0], "Reshape") if pv is not None else None
        sm = producer(inputs(p3)[0], "Softmax") if p3 is not None else None
        if sm is None or rank(sm.outputs[0]) != 4 or sm.attrs.get("axis", -1) not in (-1, 3):
            raise no_match()
        v3 = inputs(pv)[1]
        z = inputs(sm)[0]
        r4 = _scores_reshape(z)
        found = _scale_steps(inputs(r4)[0]) if r4 is not None else None
        if found is None:
            raise no_match()
        mm, scale = found
        q3, kt3 = inputs(mm)
        q3r = producer(q3, "Reshape")
        kt_tr = producer(kt3, "Transpose")
        if q3r is None or kt_tr is None or tuple(kt_tr.attrs.get("perm", ())) != (0, 2, 1):
            raise no_match()
        q, k3 = inputs(q3r)[0], inputs(kt_tr)[0]
        if any(rank(t) != 3 for t in (q, q3, k3, v3, p3.outputs[0], node.outputs[0])):
            raise no_match()
        width, head = dims.key(q, 2), dims.key(q3, 2)
        if width[0] != "int" or head[0] != "int" or head[1] <= 0 or width[1] % head[1]:
            raise no_match()
        heads = width[1] // head[1]
        if heads < 2 or dims.key(r4.outputs[0], 2) != ("int", heads):
            raise no_match()
        if not self._rows_of(dims, q, [q3r, r4, p3, node], width[1], head[1], heads):
            raise no_match()
        masks = _mask_steps(z, r4.outputs[0])
        if masks is None:
            raise no_match()
        for step, at in masks:
            if step.op == "Where":
                check_where_fill(inputs(step)[3 - at], sm.name)
            others = [t for i, t in enumerate(inputs(step)) if i != at and scalar(t) is None]
            if any(rank(t) != 4 for t in others):
                raise no_match()
        chain = [mm, *scale, r4, *(s for s, _ in masks), sm, p3, pv]
        for n in chain:
            out = n.outputs[0]
            readers = [c for c in out.outputs if c.op != "Shape"]
            if len(readers) != 1 or cx.ir.is_graph_output(out):
                raise no_match()
        require_attention_kernel(cx, q, sm)
        m = Match(node, {"root": node, "softmax": sm})
        m.stash(q=q, k3=k3, v3=v3, heads=heads, head=head[1], scale=scale, masks=masks)
        return m

    @staticmethod
    def _rows_of(dims, q: Tensor, reshapes: list[Node], width: int, head: int, heads: int):
        """Whether the four Reshapes keep the batch and give [B,S·N,H], [B,S,N,T], [B,S·N,T]
        and [B,S,N·H]: each target's batch element the batch (or 0), its last element the
        static width, or the keys' count (or -1)."""
        batch = {dims.key(q, 0), ("int", 0)}
        lasts = [{("int", head)}, None, None, {("int", width)}]
        for rs, last in zip(reshapes, lasts):
            elems = shape_elements(inputs(rs)[1], dims)
            y = rs.outputs[0]
            if elems is None or len(elems) != rank(y):
                return False
            if not ({elems[0], dims.key(y, 0)} & batch):
                return False
            if last is not None and not ({elems[-1], dims.key(y, rank(y) - 1)} & last):
                return False
        return True

    def rewrite(self, m, b):
        n, h, name = m.heads, m.head, m.root.name
        dt = dtype_of(m.q)
        split = b.const(np.array([0, 0, n, h], dtype=np.int64), "query_heads")
        qs = b.op("Reshape", [m.q, split], name=f"{name}/q_split")
        q4 = b.op("Transpose", [qs], {"perm": _PERM}, name=f"{name}/q_heads")
        axis = b.const(np.array([1], dtype=np.int64), "one_head")
        k4 = b.op("Unsqueeze", [m.k3, axis], name=f"{name}/k_head")
        kt4 = b.op("Transpose", [k4], {"perm": [0, 1, 3, 2]}, name=f"{name}/kt_head")
        v4 = b.op("Unsqueeze", [m.v3, axis], name=f"{name}/v_head")
        for t in (qs, q4, k4, kt4, v4):
            t.dtype = dt
        bq, sq = _dims(m.q, 2)
        (bk, tk, hk), (bv, tv, hv) = _dims(m.k3, 3), _dims(m.v3, 3)
        qs.shape, q4.shape = [bq, sq, n, h], [bq, n, sq, h]
        k4.shape, kt4.shape, v4.shape = [bk, 1, tk, hk], [bk, 1, hk, tk], [bv, 1, tv, hv]
        s = b.op("MatMul", [q4, kt4], name=f"{name}/scores")
        s.dtype, s.shape = dt, [bq, n, sq, tk]
        for step in m.scale:
            c = next(i for i in inputs(step) if scalar(i) is not None)
            ins = [s, c] if step.op == "Div" or inputs(step)[1] is c else [c, s]
            s = b.op(step.op, ins, name=f"{step.name}/heads")
            s.dtype = dt
        for step, at in m.masks:
            ins = list(inputs(step))
            for i, t in enumerate(ins):
                if i != at and scalar(t) is None:
                    ins[i] = b.op("Transpose", [t], {"perm": _PERM}, name=f"{step.name}/{i}")
                    cond = step.op == "Where" and i == 0  # a condition is bool
                    ins[i].dtype = np.dtype(bool) if cond else dtype_of(t)
                    ins[i].shape = [_dims(t, 4)[j] for j in _PERM]
            ins[at] = s
            s = b.op(step.op, ins, dict(step.attrs), name=f"{step.name}/heads")
            s.dtype = dtype_of(step.outputs[0])
        p = b.op("Softmax", [s], {"axis": -1}, name=f"{m.softmax.name}/heads")
        p.dtype = s.dtype
        ctx = b.op("MatMul", [p, v4], name=f"{name}/ctx")
        ctx.dtype, ctx.shape = dt, [bq, n, sq, hv]
        merged = b.op("Transpose", [ctx], {"perm": _PERM}, name=f"{name}/merge")
        merged.dtype, merged.shape = dt, [bq, sq, n, hv]
        target = b.const(np.array([0, 0, n * h], dtype=np.int64), "merge_heads")
        return [b.op("Reshape", [merged, target], like=m.root.outputs[0], name=f"{name}/out")]


def _dims(t: Tensor, count: int) -> list:
    """The first ``count`` dims of ``t``'s shape (None where unknown)."""
    shape = list(t.shape) if t.shape is not None else []
    return (shape + [None] * count)[:count]


def _scores_reshape(z: Tensor) -> Node | None:
    """The Reshape of 3-D scores to 4-D under the mask steps of ``z``."""
    for _ in range(5):
        rs = producer(z, "Reshape")
        if rs is not None:
            return rs if rank(inputs(rs)[0]) == 3 and rank(z) == 4 else None
        node = producer(z, ("Add", "Where", "Cast"))
        if node is None:
            return None
        nxt = [i for i in inputs(node) if rank(i) == 4 and scalar(i) is None]
        cands = [i for i in nxt if _under_reshape(i)]
        if not cands:
            return None
        z = cands[0]
    return None


def _under_reshape(t: Tensor, depth: int = 4) -> bool:
    if producer(t, "Reshape") is not None:
        return rank(inputs(producer(t, "Reshape"))[0]) == 3
    node = producer(t, ("Add", "Where", "Cast"))
    return (
        depth > 0 and node is not None and any(_under_reshape(i, depth - 1) for i in inputs(node))
    )

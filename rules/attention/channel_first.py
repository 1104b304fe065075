"""Attention over channel-first activations [B,C,S], made the batch-first spelling.

SqueezeBERT (and convolutional attention blocks in general) projects q, k and v with 1×1
convolutions, so each is [B,C,S] and its heads split as [B,N,H,S]::

    q4  = Transpose(Reshape(xq [B,C,S], [B,N,H,S]), (0,1,3,2))     [B,N,S,H]
    kᵀ4 = Reshape(xk [B,C,T], [B,N,H,T])                           [B,N,H,T], Kᵀ as it is
    v4  = Transpose(Reshape(xv [B,C,T], [B,N,H,T]), (0,1,3,2))     [B,N,T,H]
    out = Reshape(Transpose(MatMul(P, v4), (0,1,3,2)), [B,C,S])

``channel-first-attention`` reads each source through ``Transpose(x, (0,2,1))`` [B,S,C] and
splits it the batch-first way (``Transpose(Reshape(·, [0,0,N,H]), (0,2,1,3))``, (0,2,3,1) for
Kᵀ); P·V merges by (0,2,1,3) to [B,S,C] and goes back to [B,C,S] by (0,2,1).  Row-major, both
give element [b,n,s,j] = x[b, n·H + j, s]: exact.  It fires only where the target has an
attention kernel and fuse-attention's cost bound would not refuse it (asked first), so that
the transposes it adds are paid for by the fusion.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import rank, shape_elements
from graphopt.opt.graph.ir import Node, Tensor, dtype_of
from graphopt.opt.rewrite.engine import Builder, Match, Rule
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Op

from ..activation import inputs, no_match, producer
from .core import pinned
from .heads import PERM_BNHS, PERM_BNSH, transpose_of
from .unfold3d import check_pays, has_attention_kernel, qk_matmul, scaled_operand

_SWAP_LAST = (0, 1, 3, 2)


def _channel_split(t: Tensor | None) -> tuple[Node, int, int] | None:
    """(Reshape, N, H) when ``t`` = ``Reshape(x [B,C,S], [B,N,H,S])`` with N and H static,
    N·H = C, and B and S kept; else None."""
    rs = producer(t, "Reshape")
    x = inputs(rs)[0] if rs is not None else None
    if x is None or rank(x) != 3 or rank(t) != 4:
        return None
    dims = current_dims()
    elems = shape_elements(inputs(rs)[1], dims)
    c = dims.key(x, 1)
    heads = [dims.key(t, 1), dims.key(t, 2)]
    if elems is not None and len(elems) == 4:
        heads = [h if h[0] == "int" else e for h, e in zip(heads, elems[1:3])]
    if c[0] != "int" or any(h[0] != "int" or h[1] <= 0 for h in heads):
        return None
    n, h = heads[0][1], heads[1][1]
    if n * h != c[1]:
        return None
    if not pinned(rs, [{dims.key(x, 0)}, {heads[0]}, {heads[1]}, {dims.key(x, 2)}]):
        return None
    return rs, n, h


def _merges_channels(rs: Node, b, c, s) -> bool:
    """Whether the Reshape ``rs`` of [B,N,H,S] provably gives [B,C,S] (keys ``b``, ``c``,
    ``s``): its output's dims, or its target's elements, a 0 copying B and one -1 allowed."""
    if pinned(rs, [{b}, {c}, {s}]):
        return True
    elems = shape_elements(inputs(rs)[1], current_dims())
    if elems is None or len(elems) != 3 or sum(e == ("int", -1) for e in elems) > 1:
        return False
    copy = rs.attrs.get("allowzero", 0) == 0
    return (
        (elems[0] == b or (copy and elems[0] == ("int", 0)))
        and elems[1] in (c, ("int", -1))
        and elems[2] in (s, ("int", -1))
    )


def _batch_first(b: Builder, split: tuple[Node, int, int], perm: tuple[int, ...]) -> Tensor:
    """``Transpose(Reshape(Transpose(x, (0,2,1)), [0,0,N,H]), perm)`` for a channel split."""
    rs, n, h = split
    x = inputs(rs)[0]
    bsc = b.op("Transpose", [x], {"perm": [0, 2, 1]}, name=f"{rs.name}/bsc")
    bsc.dtype = dtype_of(x)
    if x.shape is not None:
        bsc.shape = [x.shape[0], x.shape[2], x.shape[1]]
    target = b.const(np.array([0, 0, n, h], dtype=np.int64), "heads", shared=True)
    bsnh = b.op("Reshape", [bsc, target], name=f"{rs.name}/bsnh")
    bsnh.dtype = dtype_of(x)
    if bsc.shape is not None:
        bsnh.shape = [bsc.shape[0], bsc.shape[1], n, h]
    out = b.op("Transpose", [bsnh], {"perm": list(perm)}, name=f"{rs.name}/heads")
    out.dtype = dtype_of(x)
    if bsnh.shape is not None:
        out.shape = [bsnh.shape[i] for i in perm]
    return out


@register_rule
class ChannelFirstAttention(Rule):
    name = "channel-first-attention"
    pattern = Op("Reshape", Op("Transpose", "merge"), "shape")
    phase = "attention"
    priority = 1  # before fuse-attention at the same Reshape
    exclusive = False  # its own checks: only the heads' reads change, to the same values
    summary = "attention over [B,C,S] heads (1×1 conv projections) → the batch-first spelling"

    def match(self, node, cx):
        tr = producer(inputs(node)[0], "Transpose")
        if (
            tr is None
            or tuple(tr.attrs.get("perm", ())) != _SWAP_LAST
            or rank(node.outputs[0]) != 3
        ):
            raise no_match()
        if [r for r in tr.outputs[0].outputs if r.op != "Shape"] != [node]:
            raise no_match()
        pv = producer(inputs(tr)[0], "MatMul")
        sm = producer(inputs(pv)[0], "Softmax") if pv is not None else None
        if sm is None or rank(sm.outputs[0]) != 4 or len(sm.outputs[0].outputs) != 1:
            raise no_match()
        qk = qk_matmul(inputs(sm)[0])
        if qk is None:
            raise no_match()
        q_reader, qi, q4 = scaled_operand(qk, 0)
        k_reader, ki, kt4 = scaled_operand(qk, 1)
        q_tr, v_tr = transpose_of(q4, _SWAP_LAST), transpose_of(inputs(pv)[1], _SWAP_LAST)
        if q_tr is None or v_tr is None:
            raise no_match()
        q, k, v = (_channel_split(t) for t in (inputs(q_tr)[0], kt4, inputs(v_tr)[0]))
        if q is None or k is None or v is None or len({q[1:], k[1:], v[1:]}) != 1:
            raise no_match()
        dims = current_dims()
        if not _merges_channels(node, dims.key(q4, 0), ("int", q[1] * q[2]), dims.key(q4, 2)):
            raise no_match()
        if not has_attention_kernel(cx, inputs(q[0])[0]):
            raise no_match()
        keys = dims.key(inputs(k[0])[0], 2)
        check_pays(cx, sm, keys[1] if keys[0] == "int" else None, inputs(k[0])[0])
        m = Match(node, {"root": node, "merge": tr, "softmax": sm})  # the Softmax: kept
        m.stash(reads=[(q_reader, qi, q, PERM_BNSH), (k_reader, ki, k, PERM_BNHS)], pv=pv, v=v)
        return m

    def rewrite(self, m, b):
        for reader, i, split, perm in m.reads:
            reader.inputs[i] = _batch_first(b, split, perm)
        m.pv.inputs[1] = _batch_first(b, m.v, PERM_BNSH)
        ctx = m.pv.outputs[0]
        bsnh = b.op("Transpose", [ctx], {"perm": list(PERM_BNSH)}, name=f"{m.root.name}/bsnh")
        bsnh.dtype = dtype_of(ctx)
        if ctx.shape is not None:
            bsnh.shape = [ctx.shape[i] for i in PERM_BNSH]
        n, h = m.v[1], m.v[2]
        target = b.const(np.array([0, 0, n * h], dtype=np.int64), "merged", shared=True)
        bsc = b.op("Reshape", [bsnh, target], name=f"{m.root.name}/bsc")
        bsc.dtype = dtype_of(ctx)
        out = m.root.outputs[0]
        if out.shape is not None:
            bsc.shape = [out.shape[0], out.shape[2], out.shape[1]]
        back = b.op("Transpose", [bsc], {"perm": [0, 2, 1]}, like=out, name=f"{m.root.name}/bcs")
        return [back]

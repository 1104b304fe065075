"""Scaled-dot-product attention → ``com.microsoft.MultiHeadAttention`` (level 2).

The pattern, as the PyTorch exporters write it for BERT, GPT-2 and their relatives (root: the
Reshape that merges the heads back)::

    q, k, v                      [B,S,D]  (D = N·H; separate MatMul+Add, or Split of a packed QKV)
    Reshape(·, [0,0,N,H] | [0,0,-1,H] | shape glue) → Transpose(0,2,1,3)        = Q, V  [B,N,S,H]
    K: the same Reshape, then Transpose(0,2,3,1) (or (0,2,1,3)∘(0,1,3,2))       = Kᵀ    [B,N,H,T]
    scores = MatMul(Q·c_q, Kᵀ·c_k) [÷ c | · c]                                   scale = c_q·c_k·c
    z = scores [+ mask] | Where(cond, scores, −big) [+ mask]
    P = Softmax(z, axis=−1) [→ Where(IsNaN(P), 0, P)]     (transformers ≥ 4.48 SDPA exports)
    out = Reshape(Transpose(MatMul(P, V) [→ Reshape to itself], (0,2,1,3)), [B,S,D])

becomes ``MultiHeadAttention(q, k, v, bias?, , attention_bias?; num_heads=N[, scale])``:

* ``num_heads`` and the head size come from the Reshape targets (constants after graphopt's shape
  folding, e.g. ``[0,0,-1,64]``; shape glue is resolved symbolically).  Not determinable or not
  consistent across q/k/v: ``dynamic-heads``.
* The scale is the product of every constant factor on the path; 1/√H needs no attribute, any
  other positive scalar becomes the ``scale`` attribute.  A non-scalar (per-head) factor or one
  ≤ 0 (0 means "default" to the kernel): ``scale-mismatch``; a computed one: ``non-constant-param``.
* The mask becomes ``attention_bias``, which the kernel requires as ``[B|1, N|1, S, T]``.  When its
  last two dims are not provably ``S`` and ``T`` it is expanded to ``[1,1,S,T]`` at run time (one
  Expand per distinct mask and sequence lengths, shared by all layers that can be proven to have
  the same ones).  A ``Where(cond, scores, v)`` mask becomes ``Where(cond, 0, v)`` added to the
  bias — exact only for ``v ≤ −1e30`` (then ``s + v == v`` in fp32).  Unknown rank, rank > 4, a
  non-float additive mask or a milder Where value: ``mask-shape``.
* Swin's shifted windows add a per-window mask through a regrouping of the scores,
  ``Reshape(Reshape(s + M, [b, nW, N, S, T]) + W, [B, N, S, T])`` with B = b·nW.  The kernel
  cannot broadcast over the windows, so the bias ``M + W`` ([1, nW, N|1, S, T]) is expanded over
  the b images at run time and flattened to [B, N, S, T].  The regroup must have static nW, S
  and T, and M and W must not vary per image: else ``mask-shape``.
* Bias Adds of q/k/v with constant vectors move into the ``bias`` input.
* SDPA exports guard fully masked rows (softmax of all −inf is NaN) with ``Where(IsNaN(P), 0, P)``;
  the kernel yields NaN there too, so the same guard is applied to the fused output, where it
  zeros the same rows (it would also zero a NaN that V alone carries; the original keeps that one).
* It is assumed, as every exporter guarantees, that the mask does not broadcast the scores to a
  larger shape; a model that did would get a run-time error from the kernel, not wrong numbers.
* ``slower-on-target`` where the key length is static and below the bound from which the
  target's kernel was measured to pay (onnxruntime CPU: 128 keys; Swin's 49-key windows ran
  slower fused);
* a target without MultiHeadAttention but with the ONNX ``Attention`` op (opset ≥ 23; TensorRT)
  gets that: 3-D q/k/v, ``q_num_heads``/``kv_num_heads``, the mask as ``attn_mask`` (made
  [.., S, T] as for the contrib op: onnxruntime's kernel does not broadcast the query axis),
  the q/k/v bias Adds kept in front (the op has no bias input);
* ``no-kernel`` where the target lacks both for the dtype (``opset-too-old`` with the
  ``--opset 23`` hint where only the ONNX op would do); ``shared-intermediate``
  when a tensor inside the pattern (other than through Shape) is read elsewhere;
  ``softmax-axis`` when the Softmax is not over the last (key) axis; ``unknown-shape`` when q, k
  or v is not known to be 3-D; ``reshape-not-identity`` when a Reshape between the two MatMuls
  cannot be proven to be a no-op.

The symbolic dimension reasoning (``dim_key``/``same_dim``) is also used by ``norm.py``.
"""

from __future__ import annotations

import math

import numpy as np

from graphopt.opt.ir import Constant, Node, Tensor, Variable, constant_value, dtype_of
from graphopt.opt.manager import register_rule
from graphopt.opt.rewrite import Match, NoMatch, Rule, require

from .activation import MS, float_type, inputs, lowering, no_match, producer, scalar, split_const

# ------------------------------------------------------------------ symbolic dims
Key = tuple

_UNARY = {
    "Cast",
    "Relu",
    "Erf",
    "Tanh",
    "Sigmoid",
    "Sqrt",
    "Neg",
    "Identity",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "Gelu",
    "BiasGelu",
    "FastGelu",
    "QuickGelu",
    "Dropout",
    "Abs",
    "Exp",
    "Log",
    "Reciprocal",
    "IsNaN",
    "Not",
    "Clip",
    "LeakyRelu",
    "HardSigmoid",
    "Softplus",
    "Mish",
    "HardSwish",
    "Elu",
    "Selu",
}
_BROADCAST = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "And",
    "Or",
    "Xor",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "Where",
    "Max",
    "Min",
    "Sum",
    "Mean",
}


def _rank(t: Tensor | None) -> int | None:
    return len(t.shape) if t is not None and t.shape is not None else None


class Dims:
    """What each dimension of a tensor provably equals, as a key: ``("int", n)``, a graph input's
    named dim ``("param", name)``, or ``("dim", tensor, axis)`` — the dim itself, when nothing
    better is known.  Two equal keys mean equal dims at run time; unequal keys mean "unknown"."""

    def __init__(self) -> None:
        self.memo: dict[tuple[int, int], Key] = {}

    def key(self, t: Tensor, axis: int) -> Key:
        rank = _rank(t)
        if axis < 0:
            if rank is None:
                return ("dim", t.name, axis)
            axis += rank
        mk = (id(t), axis)
        if mk not in self.memo:
            self.memo[mk] = ("dim", t.name, axis)  # cycle guard
            self.memo[mk] = self._key(t, axis, rank)
        return self.memo[mk]

    def _key(self, t: Tensor, axis: int, rank: int | None) -> Key:
        own = ("dim", t.name, axis)
        if t.shape is not None and axis < len(t.shape):
            d = t.shape[axis]
            if isinstance(d, (int, np.integer)) and d >= 0:
                return ("int", int(d))
            if isinstance(d, str) and d and not d.startswith("unk__"):
                # onnx shape inference names a dim after an input's only when it proved them
                # equal (a broadcast against an unknown dim yields a fresh ``unk__`` name)
                return ("param", d)
        if isinstance(t, Constant):
            return ("int", int(t.shape[axis])) if axis < len(t.shape) else own
        if not t.inputs:  # graph input
            d = t.shape[axis] if t.shape is not None and axis < len(t.shape) else None
            return ("param", d) if isinstance(d, str) and d else own
        node = t.inputs[0]
        ins = inputs(node)
        op, out_index = node.op, node.outputs.index(t)
        if op in _UNARY or (op == "SkipLayerNormalization" and out_index in (0, 3)):
            return self.key(ins[0], axis) if ins and ins[0] is not None else own
        if op in _BROADCAST:
            return self._broadcast(t, axis, rank, [(i, None) for i in ins if i is not None])
        if op == "Expand":
            elems = shape_elements(ins[1], self)
            if elems is None:
                return own
            return self._broadcast(t, axis, len(elems), [(ins[0], None), (None, elems)])
        if op == "MatMul":
            return self._matmul(t, axis, ins)
        if op == "Gemm":
            if axis == 0:
                return self.key(ins[0], 1 if node.attrs.get("transA", 0) else 0)
            return self.key(ins[1], 0 if node.attrs.get("transB", 0) else 1)
        if op == "Transpose":
            perm = node.attrs.get("perm")
            if perm is None:
                r = _rank(ins[0])
                return self.key(ins[0], r - 1 - axis) if r is not None else own
            return self.key(ins[0], int(perm[axis]))
        if op == "Reshape":
            elems = shape_elements(ins[1], self)
            if elems is None or axis >= len(elems):
                return own
            e = elems[axis]
            if e == ("int", 0) and not node.attrs.get("allowzero", 0):
                return self.key(ins[0], axis)
            return own if e == ("int", -1) else e
        if op == "Split":
            s = int(node.attrs.get("axis", 0))
            r = _rank(ins[0])
            if r is not None and s < 0:
                s += r
            return self.key(ins[0], axis) if axis != s else own
        if op == "Gather":
            g = int(node.attrs.get("axis", 0))
            r_idx = _rank(ins[1])
            if r_idx is None:
                return own
            if g < 0 and _rank(ins[0]) is not None:
                g += _rank(ins[0])
            if axis < g:
                return self.key(ins[0], axis)
            if axis < g + r_idx:
                return self.key(ins[1], axis - g)
            return self.key(ins[0], axis - r_idx + 1)
        if op == "MultiHeadAttention" and (node.domain or "") == MS and axis < 2:
            return self.key(ins[0], axis)
        return own

    def _broadcast(self, t, axis, rank, operands) -> Key:
        own = ("dim", t.name, axis)
        if rank is None:
            ranks = [_rank(o) if o is not None else len(e) for o, e in operands]
            if any(r is None for r in ranks):
                return own
            rank = max(ranks)
        found = set()
        for o, elems in operands:
            r = _rank(o) if o is not None else len(elems)
            if r is None:
                return own
            a = axis - (rank - r)
            if a < 0:
                continue
            k = self.key(o, a) if o is not None else elems[a]
            if k != ("int", 1):
                found.add(k)
        if not found:
            return ("int", 1)
        return found.pop() if len(found) == 1 else own

    def _matmul(self, t, axis, ins) -> Key:
        own = ("dim", t.name, axis)
        a, b = ins[0], ins[1]
        ra, rb = _rank(a), _rank(b)
        if ra is None or rb is None or ra < 2 or rb < 2:
            return own
        r = max(ra, rb)
        if axis == r - 1:
            return self.key(b, rb - 1)
        if axis == r - 2:
            return self.key(a, ra - 2)
        found = set()
        for o, ro in ((a, ra), (b, rb)):
            ax = axis - (r - ro)
            if ax >= 0:
                k = self.key(o, ax)
                if k != ("int", 1):
                    found.add(k)
        if not found:
            return ("int", 1)
        return found.pop() if len(found) == 1 else own


def shape_elements(t: Tensor | None, dims: Dims | None = None) -> list[Key] | None:
    """The elements of a small int64 shape tensor as dim keys (constants as ``("int", v)``)."""
    dims = dims or Dims()
    if t is None:
        return None
    v = constant_value(t)
    if v is not None:
        if v.dtype.kind not in "iu" or v.ndim > 1:
            return None
        return [("int", int(x)) for x in v.reshape(-1)]
    if not t.inputs:
        return None
    node = t.inputs[0]
    ins = inputs(node)
    if node.op == "Shape":
        r = _rank(ins[0])
        if r is None:
            return None
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        start = start + r if start < 0 else start
        end = r if end is None else (int(end) + r if int(end) < 0 else min(int(end), r))
        return [dims.key(ins[0], i) for i in range(max(start, 0), end)]
    if node.op == "Concat":
        out: list[Key] = []
        for i in ins:
            e = shape_elements(i, dims)
            if e is None:
                return None
            out += e
        return out
    if node.op in ("Cast", "Identity"):
        return shape_elements(ins[0], dims)
    if node.op in ("Unsqueeze", "Squeeze", "Reshape"):  # scalar <-> [1]
        e = shape_elements(ins[0], dims)
        return e if e is not None and len(e) == 1 else None
    if node.op == "Gather" and int(node.attrs.get("axis", 0)) == 0:
        e = shape_elements(ins[0], dims)
        idx = constant_value(ins[1])
        if e is None or idx is None:
            return None
        try:
            return [e[int(i)] for i in np.asarray(idx).reshape(-1)]
        except IndexError:
            return None
    if node.op == "Slice":
        e = shape_elements(ins[0], dims)
        consts = [constant_value(i) if i is not None else None for i in ins[1:]]
        if e is None or any(c is None for c in consts[:2]):
            return None
        axes = consts[2] if len(consts) > 2 and consts[2] is not None else [0]
        steps = consts[3] if len(consts) > 3 and consts[3] is not None else [1]
        if list(np.asarray(axes).reshape(-1)) not in ([0], [-1]):
            return None
        s, en, st = (int(np.asarray(c).reshape(-1)[0]) for c in (consts[0], consts[1], steps))
        return e[slice(s, min(en, len(e)) if en >= 0 else en, st)]
    return None


def same_dim(a: Tensor, i: int, b: Tensor, j: int) -> bool:
    """Whether dim ``i`` of ``a`` provably equals dim ``j`` of ``b`` at run time."""
    d = Dims()
    return d.key(a, i) == d.key(b, j)


# ------------------------------------------------------------------------ matching
_PERM_BNSH = [0, 2, 1, 3]
_PERM_BNHS = [0, 2, 3, 1]


def _transpose(t: Tensor | None, perm: list[int]) -> Node | None:
    node = producer(t, "Transpose")
    if node is None or list(node.attrs.get("perm", [])) != perm:
        return None
    return node


def _split_heads(t: Tensor | None, perm: list[int]) -> dict | None:
    """Reshape(x, [.., .., N, H]) → Transpose(perm): x and both nodes."""
    tr = _transpose(t, perm)
    chain = [tr] if tr is not None else []
    if tr is None and perm == _PERM_BNHS:  # K as (0,2,1,3) then (0,1,3,2)
        outer = _transpose(t, [0, 1, 3, 2])
        inner = _transpose(inputs(outer)[0], _PERM_BNSH) if outer is not None else None
        if inner is not None:
            tr, chain = inner, [outer, inner]
        else:
            chain = _k_through_3d(t)
            tr = chain[-1] if chain else None
    if tr is None:
        return _split_heads_sbd(t, perm) or _split_heads_packed(t, perm)
    rs = producer(inputs(tr)[0], "Reshape")
    if rs is None:
        return None
    return {"x": inputs(rs)[0], "reshape": rs, "transposes": chain, "layout": "bsd"}


_PERM_PACKED = [2, 0, 3, 1, 4]


def _untranspose_k(t: Tensor | None, perm: list[int]) -> tuple[Tensor | None, list[Node]]:
    """For Kᵀ (perm (0,2,3,1)): the K under its final (0,1,3,2) Transpose, and that node."""
    if perm != _PERM_BNHS:
        return t, []
    outer = _transpose(t, [0, 1, 3, 2])
    return (inputs(outer)[0], [outer]) if outer is not None else (None, [])


def _split_heads_packed(t: Tensor | None, perm: list[int]) -> dict | None:
    """One packed projection split three ways (timm ViT, Swin, DeiT: ``qkv.reshape(B, N, 3,
    heads, hd).permute(2, 0, 3, 1, 4)`` then ``unbind(0)``)::

        Gather(Transpose(Reshape(x, [B, S, 3, N, H]), (2,0,3,1,4)), i)   [→ (0,1,3,2) for K]
    """
    t, chain = _untranspose_k(t, perm)
    if t is None:
        return None
    gather = producer(t, "Gather")
    if gather is None or int(gather.attrs.get("axis", 0)) != 0:
        return None
    index = scalar(inputs(gather)[1])
    tr = _transpose(inputs(gather)[0], _PERM_PACKED)
    rs = producer(inputs(tr)[0], "Reshape") if tr is not None else None
    if rs is None or index not in (0.0, 1.0, 2.0) or constant_value(inputs(gather)[1]).ndim:
        return None
    return {
        "x": inputs(rs)[0],
        "reshape": rs,
        "transposes": chain + [gather, tr],
        "layout": "packed",
        "index": int(index),
    }


def _split_heads_sbd(t: Tensor | None, perm: list[int]) -> dict | None:
    """Sequence-first heads (torch.nn.MultiheadAttention): x is [S,B,D] and ::

    Reshape(Transpose(Reshape(x, [S, -1, H]), (1,0,2)), [B, N, S, H])   [→ (0,1,3,2) for K]
    """
    t, chain = _untranspose_k(t, perm)
    if t is None:
        return None
    merge = producer(t, "Reshape")
    tr = _transpose(inputs(merge)[0], [1, 0, 2]) if merge is not None else None
    rs = producer(inputs(tr)[0], "Reshape") if tr is not None else None
    if rs is None:
        return None
    return {
        "x": inputs(rs)[0],
        "reshape": rs,
        "transposes": chain + [merge, tr],
        "layout": "sbd",
        "merge": merge,
    }


def _k_through_3d(t: Tensor | None) -> list[Node]:
    """Kᵀ as the dynamo exporter writes it, heads folded into the batch for a 3-D transpose::

        Reshape(Transpose(Reshape(y, [-1, T, H]), (0,2,1)), [B, N, H, T]),  y = [B,N,T,H]

    The nodes (consumers first, ending with the Transpose that makes ``y``) when both Reshape
    targets provably have those elements, else []."""
    outer = producer(t, "Reshape")
    flip = _transpose(inputs(outer)[0], [0, 2, 1]) if outer is not None else None
    inner = producer(inputs(flip)[0], "Reshape") if flip is not None else None
    base = _transpose(inputs(inner)[0], _PERM_BNSH) if inner is not None else None
    if base is None:
        return []
    dims = Dims()
    y = base.outputs[0]
    k = [dims.key(y, i) for i in range(4)]
    ie = shape_elements(inputs(inner)[1], dims)
    oe = shape_elements(inputs(outer)[1], dims)
    if ie is None or oe is None or len(ie) != 3 or len(oe) != 4:
        return []
    if ie != [("int", -1), k[2], k[3]]:
        return []
    want = [k[0], k[1], k[3], k[2]]
    free = [i for i, e in enumerate(oe) if e == ("int", -1)]
    if len(free) > 1 or any(e != w for i, (e, w) in enumerate(zip(oe, want)) if i not in free):
        return []
    return [outer, flip, inner, base]


_SCALED = ("MatMul", "Transpose", "Reshape", "Gather")  # what a scale multiplies, never is


def _strip_scale(t: Tensor | None) -> tuple[Tensor | None, list[tuple[Tensor, bool]], list[Node]]:
    """``t`` = ``u · c`` or ``u / c`` (at most one): (u, [(factor, divides)], [node])."""
    node = producer(t, ("Mul", "Div"))
    if node is None:
        return t, [], []
    ins = inputs(node)
    if node.op == "Div":
        return ins[0], [(ins[1], True)], [node]
    for u, c in ((ins[0], ins[1]), (ins[1], ins[0])):
        if producer(u, _SCALED) is not None and producer(c, _SCALED[1:]) is None:
            return u, [(c, False)], [node]
    return t, [], []


def _match(root: Node) -> dict:
    b: dict = {"out_reshape": root}
    ctx_t = inputs(root)[0]
    tr_out = producer(ctx_t, "Transpose")
    if tr_out is None:
        raise no_match()
    b["out_transpose"] = tr_out
    ctx = inputs(tr_out)[0]
    mid = producer(ctx, "Reshape")
    if mid is not None:
        b["mid_reshape"] = mid
        ctx = inputs(mid)[0]
    pv = producer(ctx, "MatMul")
    if pv is None:
        raise no_match()
    b["pv"] = pv
    p, vt = inputs(pv)
    guard = producer(p, "Where")
    if guard is not None:
        g_cond, g_zero, g_p = inputs(guard)
        isnan = producer(g_cond, "IsNaN")
        if isnan is None or inputs(isnan)[0] is not g_p or scalar(g_zero) != 0.0:
            raise no_match()
        b.update(nan_where=guard, isnan=isnan)
        p = g_p
    sm = producer(p, "Softmax")
    if sm is None:
        raise no_match()
    b["softmax"] = sm
    # Softmax between two MatMuls: attention; an unknown spelling from here on is a missed remark
    out_perm = list(tr_out.attrs.get("perm", []))
    out_layout = {tuple(_PERM_BNSH): "bsd", (2, 0, 1, 3): "sbd"}.get(tuple(out_perm))
    if out_layout is None:
        raise _unknown(
            f"the heads are merged by Transpose{tuple(out_perm)}, not (0,2,1,3) or (2,0,1,3)",
            sm,
        )
    z = inputs(sm)[0]
    if _scores_folded(z):
        raise no_match()  # this rule already refused it; its verdict stays
    # shifted windows (Swin): Reshape(Reshape(z0, [b, nW, N, S, T]) + M5, [B, N, S, T])
    window = _window_regroup(z)
    if window is not None:
        b.update(win_merge=window["merge"], win_add=window["add"], win_split=window["split"])
        z = inputs(window["split"])[0]
    # mask: Add(s, M) | Where(c, s, v) | Add(Where(c, s, v), M) | none
    mask = where_mask = None
    add = producer(z, "Add")
    if add is not None:
        a0, a1 = inputs(add)
        for s_t, m_t in ((a0, a1), (a1, a0)):
            where = producer(s_t, "Where")
            if _is_scores(s_t) or (where is not None and _is_scores(inputs(where)[1])):
                b["mask_add"], mask, z = add, m_t, s_t
                break
    wh = producer(z, "Where")
    if wh is not None:
        w_cond, w_s, w_v = inputs(wh)
        if _is_scores(w_s):
            b["mask_where"], where_mask, z = wh, (w_cond, w_v), w_s
    scores, factors, scale_nodes = _strip_scale(z)
    mm = producer(scores, "MatMul")
    if mm is None:
        raise _unknown(
            f"the Softmax input '{z.name}' is not a scaled, masked MatMul of Q and Kᵀ", sm
        )
    b["qk"] = mm
    qs, ks = inputs(mm)
    q_t, q_f, q_nodes = _strip_scale(qs)
    k_t, k_f, k_nodes = _strip_scale(ks)
    q = _split_heads(q_t, _PERM_BNSH)
    k = _split_heads(k_t, _PERM_BNHS)
    v = _split_heads(vt, _PERM_BNSH)
    for name, part, t in (("Q", q, q_t), ("Kᵀ", k, k_t), ("V", v, vt)):
        if part is None:
            raise _unknown(
                f"{name} '{t.name}' is not split into heads by a Reshape and Transpose the rule "
                "knows (batch-first, sequence-first, packed, or the 3-D Kᵀ of dynamo exports)",
                sm,
            )
    packed = [part.get("layout") == "packed" for part in (q, k, v)]
    if any(packed) and not (
        all(packed)
        and q["x"] is k["x"] is v["x"]
        and [q["index"], k["index"], v["index"]] == [0, 1, 2]
    ):
        raise _unknown("Q, K and V are not the parts 0, 1, 2 of one packed projection", sm)
    for i, n in enumerate(scale_nodes + q_nodes + k_nodes):
        b[f"scale{i}"] = n
    # consumers before producers, so the driver can drop each once its readers are gone
    for r, part in (("q", q), ("k", k), ("v", v)):
        for i, n in enumerate(part["transposes"]):
            b[f"{r}_transpose{i}"] = n
    b.update(q_reshape=q["reshape"], k_reshape=k["reshape"], v_reshape=v["reshape"])
    return {
        "layout": {"q": q["layout"], "k": k["layout"], "v": v["layout"], "out": out_layout},
        "merges": {r: part.get("merge") for r, part in (("q", q), ("k", k), ("v", v))},
        "b": b,
        "q": q["x"],
        "k": k["x"],
        "v": v["x"],
        "mask": mask,
        "where_mask": where_mask,
        "window_mask": window["mask"] if window is not None else None,
        "factors": factors + q_f + k_f,
        "tensors": {"ctx": ctx, "scores": scores, "p": p, "qt": q_t, "vt": vt},
    }


def _window_regroup(z: Tensor) -> dict | None:
    """``z`` = Reshape(Add(Reshape(z0, 5-D), M5), 4-D) with ``z0`` scores (maybe masked)."""
    merge = producer(z, "Reshape")
    add = producer(inputs(merge)[0], "Add") if merge is not None else None
    if add is None:
        return None
    for s_t, m_t in (inputs(add), inputs(add)[::-1]):
        split = producer(s_t, "Reshape")
        if split is None or _rank(s_t) != 5 or _rank(z) != 4:
            continue
        z0 = inputs(split)[0]
        m_add, m_where = producer(z0, "Add"), producer(z0, "Where")
        if (
            _is_scores(z0)
            or (m_add is not None and any(_is_scores(t) for t in inputs(m_add)))
            or (m_where is not None and _is_scores(inputs(m_where)[1]))
        ):
            return {"merge": merge, "add": add, "split": split, "mask": m_t}
    return None


def _pins(target: list[Key], dims: list[Key]) -> bool:
    """Whether Reshape ``target`` keeps ``dims``: equal keys, or a static size where the dim is
    symbolic (softmax(P)·V then runs only when the dim has that size)."""
    return all(
        t == d or (t[0] == "int" and t[1] > 0 and d[0] != "int") for t, d in zip(target, dims)
    )


def _unknown(message: str, softmax: Node) -> NoMatch:
    """The miss of an attention whose spelling is not known; names its Softmax, so that rules
    waiting for this verdict (FusedMatMul folds) can find it."""
    return NoMatch("unrecognized-layout", message, softmax=softmax.name)


def _repeated_constant(t: Tensor | None) -> np.ndarray | None:
    """The constant value of ``t``, also seen through an Expand (which only repeats it)."""
    v = constant_value(t)
    if v is None and producer(t, "Expand") is not None:
        v = constant_value(inputs(producer(t, "Expand"))[0])
    return v


def _zero(t: Tensor | None, depth: int = 2) -> bool:
    """Whether ``t`` is zeros for sure: a constant (maybe expanded) of zeros, or a Where whose
    constant condition picks a branch of zeros everywhere."""
    v = _repeated_constant(t)
    if v is not None:
        return v.size > 0 and not np.any(v)
    where = producer(t, "Where")
    if where is None or depth == 0:
        return False
    cond, a, b = inputs(where)
    c = _repeated_constant(cond)
    if c is None or c.size == 0 or (c.any() and not c.all()):
        return False
    return _zero(a if c.all() else b, depth - 1)


def _scores_folded(t: Tensor) -> bool:
    """Whether the scores reaching a Softmax come from a com.microsoft.FusedMatMul: the folds of
    fuse-matmul-transpose and fold-matmul-scale, which wait for this rule to refuse."""
    for _ in range(7):
        node = t.inputs[0] if t.inputs else None
        if node is None:
            return False
        if node.op == "FusedMatMul" and (node.domain or "") == MS:
            return True
        if node.op not in ("Add", "Where", "Mul", "Div", "Reshape"):
            return False
        t = inputs(node)[1] if node.op == "Where" else inputs(node)[0]
    return False


def _is_scores(t: Tensor | None) -> bool:
    """Q·Kᵀ (possibly scaled): a MatMul whose right operand is a transposed tensor."""
    mm = producer(_strip_scale(t)[0], "MatMul")
    right = _strip_scale(inputs(mm)[1])[0] if mm is not None else None
    return producer(right, ("Transpose", "Reshape")) is not None


# ---------------------------------------------------------------------------- rule
def _heads(reshape: Node, x: Tensor, dims: Dims) -> tuple[int, int] | str:
    """(N, H) of ``Reshape(x [B,S,D], target)`` splitting D into heads, or why not."""
    target = inputs(reshape)[1]
    copy = () if reshape.attrs.get("allowzero", 0) else (("int", 0),)  # 0 copies the input dim
    elems = shape_elements(target, dims)
    if elems is None:
        return f"the reshape target '{target.name}' is computed at run time and not resolvable"
    if len(elems) != 4:
        return f"the reshape target has {len(elems)} elements, not 4"
    width = x.shape[-1] if x.shape is not None and len(x.shape) == 3 else None
    width = int(width) if isinstance(width, (int, np.integer)) else None
    n, h = elems[2], elems[3]
    ints = [e[1] if e[0] == "int" else None for e in (n, h)]
    if ints[0] is not None and ints[1] == -1 and width:
        ints[1] = width // ints[0] if ints[0] > 0 else None
    if ints[1] is not None and ints[0] == -1 and width:
        ints[0] = width // ints[1] if ints[1] > 0 else None
    if ints[0] is None or ints[1] is None or ints[0] <= 0 or ints[1] <= 0:
        return f"heads and head size {[n, h]} are not static"
    if width is not None and ints[0] * ints[1] != width:
        return f"{ints[0]}×{ints[1]} heads do not split the hidden size {width}"
    s_ok = elems[1] in (*copy, dims.key(x, 1), ("int", -1))
    b_ok = elems[0] in (*copy, dims.key(x, 0)) or _inferred_batch(elems, 2, copy, dims.key(x, 1))
    if not (b_ok and s_ok):
        return f"the reshape target {elems[:2]} does not keep the batch and sequence dims"
    return ints[0], ints[1]


def _inferred_batch(elems: list[Key], first_head: int, copy: tuple, seq: Key) -> bool:
    """Whether a -1 batch is forced to be the batch: the sequence dim is provably kept and the
    head dims are explicit positive numbers (dynamo writes [-1, S, N, H])."""
    return (
        elems[0] == ("int", -1)
        and elems[1] in (*copy, seq)
        and all(e[0] == "int" and e[1] > 0 for e in elems[first_head:])
    )


def _heads_packed(reshape: Node, x: Tensor, dims: Dims) -> tuple[int, int] | str:
    """(N, H) of ``Reshape(x [B,S,3·N·H], [B, S, 3, N, H])``, or why not."""
    elems = shape_elements(inputs(reshape)[1], dims)
    if elems is None or len(elems) != 5:
        return f"the packed reshape target {elems} is not [B, S, 3, N, H]"
    width = x.shape[-1] if x.shape is not None and len(x.shape) == 3 else None
    copy = () if reshape.attrs.get("allowzero", 0) else (("int", 0),)
    three, n, h = elems[2:]
    ints = [e[1] if e[0] == "int" else None for e in (three, n, h)]
    if isinstance(width, (int, np.integer)) and ints[0] == 3:  # one -1 among N, H
        if ints[1] == -1 and ints[2] is not None and ints[2] > 0:
            ints[1] = int(width) // (3 * ints[2])
        elif ints[2] == -1 and ints[1] is not None and ints[1] > 0:
            ints[2] = int(width) // (3 * ints[1])
    if ints[0] != 3 or ints[1] is None or ints[2] is None or min(ints[1:]) <= 0:
        return f"the packed reshape target {elems} does not split into 3 × N × H"
    if not isinstance(width, (int, np.integer)) or 3 * ints[1] * ints[2] != width:
        return f"3×{ints[1]}×{ints[2]} does not split the packed width {width}"
    b_ok = elems[0] in (*copy, dims.key(x, 0)) or _inferred_batch(elems, 2, copy, dims.key(x, 1))
    s_ok = elems[1] in (*copy, dims.key(x, 1), ("int", -1))
    if not (b_ok and s_ok) or elems[:2] == [("int", -1), ("int", -1)]:
        return f"the packed reshape target {elems[:2]} does not keep the batch and sequence dims"
    return ints[1], ints[2]


def _heads_sbd(split: Node, merge: Node, x: Tensor, dims: Dims) -> tuple[int, int] | str:
    """(N, H) of the sequence-first split ``Reshape(Transpose(Reshape(x [S,B,D], [S,-1,H]),
    (1,0,2)), [B,N,S,H])``, or why not."""
    ea = shape_elements(inputs(split)[1], dims)
    eb = shape_elements(inputs(merge)[1], dims)
    if ea is None or eb is None:
        return "a sequence-first reshape target is computed at run time and not resolvable"
    if len(ea) != 3 or len(eb) != 4:
        return f"the sequence-first reshape targets have {len(ea)} and {len(eb)} elements, not 3, 4"
    width = x.shape[-1] if x.shape is not None and len(x.shape) == 3 else None
    if not isinstance(width, (int, np.integer)):
        return f"the hidden size of '{x.name}' is not static"
    copy = () if split.attrs.get("allowzero", 0) else (("int", 0),)
    h, n = ea[2], eb[1]
    if h[0] != "int" or n[0] != "int" or h[1] <= 0 or n[1] <= 0 or eb[3] != h:
        return f"heads and head size {[n, h]} are not static and consistent"
    if n[1] * h[1] != width:
        return f"{n[1]}×{h[1]} heads do not split the hidden size {width}"
    seq, batch = dims.key(x, 0), dims.key(x, 1)
    if ea[0] not in (*copy, seq) or ea[1] != ("int", -1):
        return f"the reshape target {ea} does not keep the sequence dim and fold batch × heads"
    if eb[2] != seq or eb[0] not in (("int", -1), batch):
        return f"the reshape target {eb} does not unfold batch × heads"
    return n[1], h[1]


def _axis(m, r: str, which: str) -> int:
    """The batch or sequence axis of the [B,S,D] or [S,B,D] source of q, k or v."""
    return (which == "seq") ^ (m.layout[r] == "sbd")


@register_rule
class FuseMultiHeadAttention(Rule):
    name = "fuse-attention"
    root = "Reshape"
    exclusive = False  # checked here: Shape nodes may read inside the pattern
    summary = "scaled-dot-product attention → com.microsoft.MultiHeadAttention"

    def match(self, node, cx):
        found = _match(node)
        m = Match(node, found["b"])
        m.stash(**{k: v for k, v in found.items() if k != "b"})
        return m

    # --------------------------------------------------------------------- guards
    def check(self, m, cx):
        dims = Dims()
        q, k, v = m.q, m.k, m.v
        for t in (q, k, v):
            require(
                _rank(t) == 3,
                "unknown-shape",
                f"'{t.name}' has rank {_rank(t)}; MultiHeadAttention takes [B,S,D] inputs",
            )
        self._check_exclusive(m, cx)
        # before opset 13 a Softmax without axis flattens from axis 1: not a per-row softmax
        axis = m.softmax.attrs.get("axis", -1 if cx.ir.opset >= 13 else 1)
        require(
            axis in (-1, 3),
            "softmax-axis",
            f"the Softmax normalizes over axis {axis} (opset {cx.ir.opset}), not over the keys",
        )
        split = {"bsd": _heads, "packed": _heads_packed}
        heads = [
            split[m.layout[r]](m.bindings[f"{r}_reshape"], t, dims)
            if m.layout[r] in split
            else _heads_sbd(m.bindings[f"{r}_reshape"], m.merges[r], t, dims)
            for r, t in (("q", q), ("k", k), ("v", v))
        ]
        bad = [h for h in heads if isinstance(h, str)]
        require(not bad, "dynamic-heads", lambda: f"cannot determine num_heads: {bad[0]}")
        n, h = heads[0]
        require(
            heads[1] == (n, h) and heads[2][0] == n,
            "dynamic-heads",
            f"q, k and v split into different heads: {heads}",
        )
        scale = self._scale(m, cx, h)
        tname = float_type(q)
        require(
            all(dtype_of(t) == dtype_of(q) for t in (k, v)),
            "dtype-mismatch",
            "q, k and v differ in dtype",
        )
        require(
            self._mid_is_identity(m, dims),
            "reshape-not-identity",
            "the Reshape between the two attention MatMuls is not provably a no-op",
        )
        hidden = n * h if m.layout["v"] == "packed" else m.v.shape[-1]
        m.stash(hidden=hidden)
        out_direct = self._out_direct(m, dims)
        bias = self._mask(m, cx, dims)
        op, domain, _ = lowering(
            cx,
            [("MultiHeadAttention", MS, None, {}), ("Attention", "", 23, {})],
            tname,
            "attention",
        )
        if op == "MultiHeadAttention":
            self._check_pays(m, cx)
        qkv_bias = self._qkv_bias(m, cx) if op == "MultiHeadAttention" else None
        m.stash(
            op=op,
            num_heads=n,
            head_size=h,
            scale_value=scale,
            out_direct=out_direct,
            qkv_bias=qkv_bias,
            bias_plan=bias,
        )
        if qkv_bias is not None:  # the bias Adds the kernel takes belong to the fusion
            m.stash(**{f"bias_add_{i}": add for i, add in enumerate(qkv_bias[-1])})
            m.stash(absorbed=[add.name for add in qkv_bias[-1]])

    def _check_pays(self, m, cx) -> None:
        """Refuse a static key length below the one from which the target's kernel pays."""
        bound, why = cx.target.slower_below.get("MultiHeadAttention", (0, ""))
        keys = m.k.shape[_axis(m, "k", "seq")]
        require(
            not isinstance(keys, (int, np.integer)) or keys >= bound,
            "slower-on-target",
            lambda: (
                f"MultiHeadAttention over {keys} keys is slower than the unfused attention "
                f"on target {cx.target.name} below {bound} keys: {why}"
            ),
            keys=int(keys) if isinstance(keys, (int, np.integer)) else None,
            bound=bound,
            softmax=m.softmax.name,
        )

    def _check_exclusive(self, m, cx) -> None:
        inside = {id(n) for n in m.nodes()}
        for node in m.nodes():
            if node is m.root:
                continue
            for out in node.outputs:
                require(
                    not cx.ir.is_graph_output(out),
                    "shared-intermediate",
                    f"'{out.name}' inside the attention is a graph output",
                )
                outside = [c.name for c in out.outputs if id(c) not in inside and c.op != "Shape"]
                require(
                    not outside,
                    "shared-intermediate",
                    f"'{out.name}' inside the attention also feeds {', '.join(outside[:3])}",
                )

    def _scale(self, m, cx, head_size: int) -> float | None:
        for f, _ in m.factors:
            if not isinstance(f, Constant):
                raise NoMatch(
                    "non-constant-param",
                    f"the attention scale '{f.name}' is computed at run time, not a constant",
                    tensor=f.name,
                )
        total = 1.0
        for f, divides in m.factors:
            s = scalar(f)
            require(
                s is not None,
                "scale-mismatch",
                f"the attention scale '{f.name}' of shape {list(constant_value(f).shape)} is not "
                "one scalar (per-head scales cannot be a kernel attribute)",
            )
            require(s != 0, "scale-mismatch", "the attention scale factor is zero")
            total *= (1.0 / s) if divides else s
        require(
            total > 0,
            "scale-mismatch",
            f"the attention scale is {total:g}; the kernel reads a scale ≤ 0 as 'default'",
            seen=total,
        )
        default = 1.0 / math.sqrt(head_size)
        return None if abs(total - default) <= 1e-6 * default else total

    def _mid_is_identity(self, m, dims: Dims) -> bool:
        mid = m.bindings.get("mid_reshape")
        if mid is None:
            return True
        ctx = inputs(mid)[0]
        elems = shape_elements(inputs(mid)[1], dims)
        if elems is None or len(elems) != 4:
            return False
        want = [dims.key(ctx, i) for i in range(4)]
        t = m.tensors
        alts = [
            {dims.key(m.q, _axis(m, "q", "batch"))}
            | {dims.key(x, 0) for x in (t["qt"], t["scores"], t["p"], t["ctx"])},
            {dims.key(x, 1) for x in (t["qt"], t["scores"], t["p"], t["ctx"])},
            {dims.key(m.q, _axis(m, "q", "seq"))}
            | {dims.key(x, 2) for x in (t["qt"], t["scores"], t["p"], t["ctx"])},
            {dims.key(x, 3) for x in (t["qt"], t["vt"], t["ctx"])},
        ]
        minus_one = sum(e == ("int", -1) for e in elems)
        for i, e in enumerate(elems):
            if e == ("int", -1) and minus_one == 1:
                continue
            if e == ("int", 0) and not mid.attrs.get("allowzero", 0):
                continue
            if e != want[i] and e not in alts[i]:
                return False
        return True

    def _out_direct(self, m, dims: Dims) -> bool:
        """Whether the output Reshape provably yields [B,S,N·H]; else it is kept after MHA."""
        elems = shape_elements(inputs(m.root)[1], dims)
        if elems is None or len(elems) != 3 or m.layout["out"] == "sbd":
            # kept after the kernel: a 0 past axis 1 would copy a dim of [B|S,S|B,N,H] that the
            # kernel's [B|S,S|B,D] does not have
            target = constant_value(inputs(m.root)[1])
            require(
                target is None or 0 not in list(target)[2:] or m.root.attrs.get("allowzero", 0),
                "reshape-not-identity",
                f"the merging Reshape copies a head dim with 0 in {list(target)}",
            )
            return False
        if elems[2] == ("int", 0):
            raise no_match()
        copy = () if m.root.attrs.get("allowzero", 0) else (("int", 0),)
        b_ok = elems[0] in (*copy, dims.key(m.q, _axis(m, "q", "batch")))
        s_ok = elems[1] in (*copy, dims.key(m.q, _axis(m, "q", "seq")))
        width = m.hidden
        d_ok = elems[2] == ("int", -1) or (
            isinstance(width, (int, np.integer)) and elems[2] == ("int", int(width))
        )
        return b_ok and s_ok and d_ok

    def _mask(self, m, cx, dims: Dims) -> dict | None:
        """How to build attention_bias: {'mask', 'where', 'direct'} or None (no mask)."""
        if m.mask is None and m.where_mask is None and m.window_mask is None:
            return None
        if m.window_mask is None and m.where_mask is None and _zero(m.mask):
            return None  # a mask of zeros (dynamo's ViT: Where(all-true, 0, min)) masks nothing
        qdt = dtype_of(m.q)
        if m.where_mask is not None:
            cond, value = m.where_mask
            val = scalar(value)
            require(
                val is not None and val <= -1e30,
                "mask-shape",
                f"the Where mask fills {val if val is not None else value.name}; only −inf or "
                "≤ −1e30 (which absorbs the score exactly) can move into an additive bias",
            )
            require(
                dtype_of(cond) == np.dtype(bool) and _rank(cond) is not None and _rank(cond) <= 4,
                "mask-shape",
                f"the Where mask condition '{cond.name}' is not a bool tensor of rank ≤ 4",
            )
        if m.mask is not None:
            r = _rank(m.mask)
            require(
                r is not None and r <= 4,
                "mask-shape",
                f"the additive mask '{m.mask.name}' has rank {r}; attention_bias is 4-D",
            )
            require(
                dtype_of(m.mask) == qdt,
                "mask-shape",
                f"the additive mask is {dtype_of(m.mask)}, the scores are {qdt}",
            )
        if m.window_mask is not None:
            return {"direct": True, "window": self._window(m, dims, qdt)}
        direct = (
            m.where_mask is None
            and _rank(m.mask) == 4
            and dims.key(m.mask, 2) == dims.key(m.q, _axis(m, "q", "seq"))
            and dims.key(m.mask, 3) == dims.key(m.k, _axis(m, "k", "seq"))
        )
        return {"direct": direct}

    def _window(self, m, dims: Dims, qdt) -> list[int]:
        """[nW, N, S, T] of a shifted-window regroup whose mask can be tiled over the batch."""
        scores = m.tensors["scores"]
        want = [dims.key(scores, i) for i in (1, 2, 3)]
        split = shape_elements(inputs(m.bindings["win_split"])[1], dims)
        merge = shape_elements(inputs(m.bindings["win_merge"])[1], dims)
        static = split is not None and all(e[0] == "int" and e[1] > 0 for e in split[1:])
        require(
            static and len(split) == 5 and _pins(split[2:], want),
            "mask-shape",
            f"the window regroup {split} does not split the batch of scores {want} into a static "
            "number of windows",
        )
        require(
            merge is not None and len(merge) == 4 and _pins(merge[1:], want),
            "mask-shape",
            f"the window regroup is not merged back into the scores' layout ({merge})",
        )
        mask = m.window_mask
        require(
            _rank(mask) is not None
            and _rank(mask) <= 5
            and (_rank(mask) < 5 or mask.shape[0] == 1)
            and dtype_of(mask) == qdt,
            "mask-shape",
            f"the window mask '{mask.name}' is not a {qdt} tensor of rank ≤ 5 shared by every "
            "image",
        )
        for t in (m.mask, m.where_mask[0] if m.where_mask is not None else None):
            require(
                t is None or _rank(t) is not None and (_rank(t) < 4 or t.shape[0] == 1),
                "mask-shape",
                f"the mask '{t.name if t is not None else ''}' varies over the windows' batch",
            )
        return [e[1] for e in split[1:]]

    def _qkv_bias(self, m, cx) -> tuple | None:
        """(query, key, value, packed bias) when q/k/v are MatMul + constant-vector Adds; for
        a packed projection (source, None, None, bias) with the source the MatMul output."""
        if m.layout["q"] == "packed":
            add = producer(m.q, "Add")
            sc = split_const(add) if add is not None else None
            if sc is None or producer(sc[0], "MatMul") is None or len(m.q.outputs) != 1:
                return None
            vec = constant_value(sc[1])
            if vec.ndim != 1 or vec.size != 3 * m.hidden or vec.dtype != dtype_of(m.q):
                return None
            return sc[0], None, None, vec, (add,)
        parts = []
        for t in (m.q, m.k, m.v):
            add = producer(t, "Add")
            sc = split_const(add) if add is not None else None
            if sc is None or producer(sc[0], "MatMul") is None:
                return None
            vec = constant_value(sc[1])
            width = t.shape[-1] if t.shape is not None else None
            if vec.ndim != 1 or not isinstance(width, (int, np.integer)) or vec.size != width:
                return None
            if vec.dtype != dtype_of(t) or len(t.outputs) != 1 or cx.ir.is_graph_output(t):
                return None
            parts.append((sc[0], vec, add))
        return tuple(p[0] for p in parts) + (
            np.concatenate([p[1] for p in parts]),
            tuple(p[2] for p in parts),
        )

    # -------------------------------------------------------------------- rewrite
    def rewrite(self, m, b):
        opset = b.ir.opset
        q, k, v, bias = m.q, m.k, m.v, None
        if m.qkv_bias is not None:
            q, k, v, vec, _ = m.qkv_bias
            bias = b.const(vec, "qkv_bias")
        if m.layout["q"] == "packed":
            q, k, v = self._unpack(m, b, q)
        q, k, v = (
            b.op("Transpose", [t], {"perm": [1, 0, 2]}, name=f"{m.root.name}/{r}_batch_first")
            if m.layout[r] == "sbd"
            else t
            for r, t in (("q", q), ("k", k), ("v", v))
        )
        m.stash(mha_q=q, mha_k=k)
        attention_bias = None
        if m.bias_plan is not None:
            attention_bias = self._attention_bias(m, b, opset)
        if m.op == "Attention":  # ONNX opset 23: 3-D inputs, heads as attributes, no bias
            attrs = {"q_num_heads": int(m.num_heads), "kv_num_heads": int(m.num_heads)}
            ins = [q, k, v] + ([attention_bias] if attention_bias is not None else [])
        else:
            attrs = {"num_heads": int(m.num_heads)}
            ins = [q, k, v, bias, None, attention_bias]
            while ins and ins[-1] is None:
                ins.pop()
        if m.scale_value is not None:
            attrs["scale"] = float(m.scale_value)
        like = m.root.outputs[0] if m.out_direct else None
        out = b.op(
            m.op,
            ins,
            attrs,
            domain=MS if m.op == "MultiHeadAttention" else "",
            like=like,
            name=f"{m.root.name}/{m.op}",
        )
        out.dtype = m.root.outputs[0].dtype
        if m.q.shape is not None and len(m.q.shape) == 3:
            out.shape = [  # [B, S, D_v] from the sources' dims: D_v is static there
                m.q.shape[_axis(m, "q", "batch")],
                m.q.shape[_axis(m, "q", "seq")],
                m.hidden,
            ]
        if "nan_where" in m.bindings:
            isnan = b.op("IsNaN", [out], like=out, name=f"{m.root.name}/IsNaN")
            isnan.dtype = np.dtype(bool)
            zero = b.const(np.zeros((), dtype=dtype_of(m.q)), "zero")
            out = b.op("Where", [isnan, zero, out], like=out, name=f"{m.root.name}/nan_to_zero")
        if m.layout["out"] == "sbd":
            out = b.op("Transpose", [out], {"perm": [1, 0, 2]}, name=f"{m.root.name}/seq_first")
        if not m.out_direct:
            out = b.op(
                "Reshape",
                [out, inputs(m.root)[1]],
                dict(m.root.attrs),
                like=m.root.outputs[0],
                name=f"{m.root.name}/merge_heads",
            )
        return [out]

    def _unpack(self, m, b, packed: Tensor) -> list[Tensor]:
        """Split the [B, S, 3·D] projection into q, k, v of [B, S, D] each."""
        sizes = np.full(3, m.hidden, dtype=np.int64)
        ins, attrs = [packed], {"axis": 2}
        if b.ir.opset >= 13:
            ins.append(b.const(sizes, "qkv_sizes"))
        else:
            attrs["split"] = [int(x) for x in sizes]
        parts = b.op("Split", ins, attrs, outputs=3, name=f"{m.root.name}/unpack_qkv")
        for t in parts:
            t.dtype = dtype_of(m.q)
            if m.q.shape is not None and len(m.q.shape) == 3:
                t.shape = [m.q.shape[0], m.q.shape[1], m.hidden]
        return parts

    def _attention_bias(self, m, b, opset: int) -> Tensor:
        dt = dtype_of(m.q)
        parts = []
        if m.where_mask is not None:
            cond, value = m.where_mask
            zero = b.const(np.zeros((), dtype=dt), "zero")
            fill = b.const(np.asarray(scalar(value), dtype=dt), "mask_value")
            parts.append(b.op("Where", [cond, zero, fill], name=f"{m.root.name}/causal_bias"))
        if m.mask is not None:
            parts.append(m.mask)
        if m.window_mask is not None:
            parts.append(m.window_mask)
        bias = parts[0]
        for i, part in enumerate(parts[1:]):
            bias = b.op("Add", [bias, part], name=f"{m.root.name}/attention_bias{i or ''}")
            bias.dtype = dt  # known, so that a sum of constant masks folds right away
        if m.bias_plan.get("window"):
            return self._tile_windows(m, b, bias, opset)
        if m.bias_plan["direct"]:
            return bias
        cached = self._shared_expand(m, bias, b)
        if cached is not None:
            return cached
        lens = [
            self._seq_len(b, t, opset, f"{m.root.name}/{n}_len")
            for n, t in (("q", m.mha_q), ("k", m.mha_k))
        ]
        ones = b.const(np.ones(2, dtype=np.int64), "bias_prefix")
        shape = b.op("Concat", [ones, *lens], {"axis": 0}, name=f"{m.root.name}/bias_shape")
        return b.op("Expand", [bias, shape], name=f"{m.root.name}/attention_bias_expand")

    def _tile_windows(self, m, b, bias: Tensor, opset: int) -> Tensor:
        """The [1, nW, N|1, S, T] window bias repeated over the images: [B, N, S, T]."""
        n_win, heads, s, t = m.bias_plan["window"]
        batch = self._seq_len(b, m.mha_q, opset, f"{m.root.name}/windows", axis=0)
        images = b.op(
            "Div",
            [batch, b.const(np.array([n_win], dtype=np.int64), "num_windows")],
            name=f"{m.root.name}/images",
        )
        tail = b.const(np.array([n_win, heads, s, t], dtype=np.int64), "window_bias_dims")
        shape = b.op("Concat", [images, tail], {"axis": 0}, name=f"{m.root.name}/window_shape")
        tiled = b.op("Expand", [bias, shape], name=f"{m.root.name}/window_bias")
        flat = b.const(np.array([-1, heads, s, t], dtype=np.int64), "bias_shape")
        return b.op("Reshape", [tiled, flat], name=f"{m.root.name}/window_bias_flat")

    def _seq_len(self, b, t: Tensor, opset: int, name: str, axis: int = 1) -> Tensor:
        if opset >= 15:
            return b.op("Shape", [t], {"start": axis, "end": axis + 1}, name=name)
        shape = b.op("Shape", [t], name=name)
        return b.op(
            "Slice",
            [shape, b.const(np.array([axis]), "start"), b.const(np.array([axis + 1]), "end")],
            name=f"{name}/slice",
        )

    def _shared_expand(self, m, bias: Tensor, b) -> Tensor | None:
        """An Expand of the same mask to provably the same [1,1,S,T], made for another layer.

        Exporters often recompute the mask per layer (``Where(mask, 0, -inf)`` twelve times);
        a mask computed by an identical node from the same inputs counts as the same mask.
        """
        for node in b.ir.graph.nodes:
            if node.op != "Expand" or b.ir.provenance.get(node.name) != self.name:
                continue
            if not node.outputs or not _same_value(inputs(node)[0], bias):
                continue
            concat = producer(inputs(node)[1], "Concat")
            if concat is None or len(inputs(concat)) != 3:
                continue
            srcs = [_shape_source(t) for t in inputs(concat)[1:]]
            if any(s is None for s in srcs):
                continue
            if same_dim(srcs[0], 1, m.mha_q, 1) and same_dim(srcs[1], 1, m.mha_k, 1):
                return node.outputs[0]
        return None


def _same_value(a: Tensor, b: Tensor) -> bool:
    """``a`` is ``b``, or both come from identical nodes over the same inputs (one level)."""
    if a is b:
        return True
    pa = a.inputs[0] if isinstance(a, Variable) and a.inputs else None
    pb = b.inputs[0] if isinstance(b, Variable) and b.inputs else None
    if pa is None or pb is None or len(pa.outputs) != 1 or len(pb.outputs) != 1:
        return False
    if (pa.op, pa.domain or "", pa.attrs) != (pb.op, pb.domain or "", pb.attrs):
        return False
    ia, ib = inputs(pa), inputs(pb)
    if len(ia) != len(ib):
        return False
    for x, y in zip(ia, ib):
        if x is y:
            continue
        vx, vy = constant_value(x), constant_value(y)
        if vx is None or vy is None or vx.dtype != vy.dtype or not np.array_equal(vx, vy):
            return False
    return True


def _shape_source(t: Tensor) -> Tensor | None:
    node = producer(t, ("Shape", "Slice"))
    if node is not None and node.op == "Slice":
        node = producer(inputs(node)[0], "Shape")
    return inputs(node)[0] if node is not None else None


__all__ = ["Dims", "same_dim", "shape_elements"]

"""The ``fuse-attention`` rule: stage 1 (core), stage 2 (lift), stage 3 (lower) in one rewrite.

Its structure is read by :func:`lift` into a typed :class:`Attention`; its guards are the
contract of the kernel, each refusal a missed remark with the stage and the tensor in its
arguments (``stage``, ``tensor``) and the attention's Softmax (``softmax``), which the rules of
the later ``linear`` phase look up.
"""

from __future__ import annotations

import math

import numpy as np

from graphopt.opt.graph.dims import Dims, arith, rank, shape_elements
from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.ir import Constant, Node, Tensor, constant_value, dtype_of
from graphopt.opt.remarks import Remark
from graphopt.opt.rewrite.engine import Match, NoMatch, Rule, require
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.rewrite.patterns import Alt, Op

from ..activation import MS, float_type, inputs, lowering, no_match, producer, scalar, split_const
from .core import Core, match_core, unrecognized
from .gqa import OPTION, plan_gqa
from .heads import (
    PERM_BNHS,
    PERM_BNSH,
    HeadSplit,
    already_split,
    batch_keys,
    head_count,
    per_head_key,
    per_head_split,
    rotated_split,
    split_heads,
    transposed_key,
)
from .lifted import Attention, QkvBias
from .lower import lower
from .masks import ABSORBING_FILL, plan_bias

LIFT = "2 (lift)"
LOWER = "3 (lower)"


def lift(root: Node) -> Attention:
    """Stages 1 and 2 (structure): the core and the head splits of the attention at ``root``."""
    merge = None
    if root.op == "Reshape":
        merge, root = root, producer(inputs(root)[0], "Transpose")
        if root is None or _merged_readers(root) != [merge]:
            raise no_match()
    elif root.op == "MatMul":
        if not _context_per_head(root):
            raise no_match()
    elif [r.op for r in _merged_readers(root)] == ["Reshape"]:
        raise no_match()  # that Reshape is the root
    core = match_core(root)
    kperm = PERM_BNSH if core.fold is not None and core.fold.k_plain else PERM_BNHS
    splits = [
        _of_3d(split_heads(core.q, PERM_BNSH))
        or _of_3d(rotated_split(core.q))
        or per_head_split(core.q)
        or _query_per_head(core),
        _of_3d(split_heads(core.kt, kperm))
        or already_split(core.kt, kperm)
        or per_head_key(core.kt)
        or transposed_key(core.kt, core.q),
        _of_3d(split_heads(core.v, PERM_BNSH)) or already_split(core.v, PERM_BNSH),
    ]
    for name, split, t in zip(("Q", "Kᵀ", "V"), splits, (core.q, core.kt, core.v)):
        if split is None and isinstance(t, Constant):
            raise unrecognized(
                LIFT,
                f"{name} '{t.name}' is a constant {list(t.shape)}: it reads no graph input (a "
                "static export folded it), and the kernels take heads split from activations",
                core.softmax,
                t,
            )
        if split is None:
            raise unrecognized(
                LIFT,
                f"{name} '{t.name}' is not split into heads by a Reshape and Transpose the rule "
                "knows (batch-first, sequence-first, packed, or the 3-D Kᵀ of dynamo exports)",
                core.softmax,
                t,
            )
    q, k, v = splits
    if _per_head(k) != _per_head(v):
        k, v = _kept_per_head(k), _kept_per_head(v)
    if _per_head(k) != _per_head(v):  # the split one is given per head too
        if _per_head(k):
            v = already_split(core.v, PERM_BNSH) or v
        else:
            k = already_split(core.kt, PERM_BNHS) or k
    if _per_head(k) != _per_head(v):
        raise unrecognized(
            LIFT,
            "one of K and V is split into heads and the other is already [B,N,T,H]",
            core.softmax,
            v.x if v.layout == "bnsh" else k.x,
        )
    packed = [s.layout == "packed" for s in (q, k, v)]
    if any(packed) and not (
        all(packed) and q.x is k.x is v.x and [q.index, k.index, v.index] == [0, 1, 2]
    ):
        raise unrecognized(
            LIFT, "Q, K and V are not the parts 0, 1, 2 of one packed projection", core.softmax, q.x
        )
    return Attention(core, q, k, v, merge)


def _of_3d(split: HeadSplit | None) -> HeadSplit | None:
    """``split`` unless its source is known not to be [B,S,D] (a part of a fused projection's
    head groups, Falcon's [B,S,G,r,H] or CodeGen's [B,S,G,3L] split on its last axis: then
    walked as per-head)."""
    if split is not None and split.layout == "bsd" and rank(split.x) not in (None, 3):
        return None
    return split


def _per_head(split: HeadSplit) -> bool:
    """Whether the kernel is given ``split`` as [B,N,T,H] (a cache), not as [B,T,D]."""
    return split.layout == "bnsh" and not split.kept


def _kept_per_head(split: HeadSplit) -> HeadSplit:
    """A key or value [B,N,T,H] computed head by head from a split (rotary or a norm on the
    key of an encoder), or transposed into heads from anything else, as a per-head tensor the
    kernel takes back as [B,T,N·H], so that it pairs with the other one's [B,T,D] split (a
    cache, no Transpose's output, stays as it is); else ``split`` unchanged."""
    if split.layout != "bnsh" or split.kept:
        return split
    kept = per_head_split(split.x)
    cat = producer(split.x, "Concat")
    if kept is None and (
        producer(split.x, "Transpose") is not None
        or (cat is not None and cat.attrs.get("axis") in (-1, 3))
    ):
        # heads transposed from anything else (SAM2's packed projection of an image
        # [B,h,w,3D]), or two values joined per head (DiffLlama's contexts, one product)
        return HeadSplit(split.x, None, "bnsh", list(split.nodes), kept=True)
    if kept is None:
        return split
    kept.nodes = list(split.nodes)
    return kept


def _query_per_head(core: Core) -> HeadSplit | None:
    """A query [B,N,S,H] computed some other way goes to the kernel as it is, merged to
    [B,S,N·H]: with folded heads (Bloom's per-head interleaved q/k/v:
    ``Gather(Reshape(x, [B,S,N,3,H]), i, axis=3)``; its key and value then go per head too),
    a constant (learned queries of a pooling head, folded with a static batch), or any
    computed [B,N,S,H] with the key's batch and heads (Conditional DETR's per-head Concat of
    content and position parts): attention per (b, n) is the kernel's over N heads, whatever
    made them."""
    if rank(core.q) != 4:
        return None
    if core.fold is None and not _unbroadcast_constant(core.q, core.kt):
        dims = current_dims()
        computed = not isinstance(core.q, Constant) and rank(core.kt) == 4
        if not computed or any(dims.key(core.q, i) != dims.key(core.kt, i) for i in (0, 1)):
            return None
    return HeadSplit(core.q, None, "bnsh", [], kept=True)


def _unbroadcast_constant(q: Tensor, kt: Tensor) -> bool:
    """Whether ``q`` is a constant [B,N,S,H] whose batch and heads are those of Kᵀ (a query
    the MatMul broadcasts over them would not fit the kernel)."""
    if not isinstance(q, Constant) or rank(kt) != 4:
        return False
    dims = current_dims()
    return all(dims.key(kt, i) == ("int", int(q.shape[i])) for i in (0, 1))


def _keep_shared_heads(a: Attention, cx) -> Attention:
    """K and V split into heads that the model also reads as [B,N,T,H] (a decoder's first step
    returns them as ``present`` without a cache to concatenate to): the kernel takes those
    [B,N,T,H] tensors as they are, leaving their splits to the model; else the attention as
    lifted."""
    if a.k.layout != "bsd" or a.v.layout != "bsd":
        return a
    inside = {id(n) for n in a.nodes()}
    views = [_heads_view(s, inside, cx) for s in (a.k, a.v)]
    if None in views or not any(shared for _, shared in views):
        return a
    a.k, a.v = (
        HeadSplit(t.outputs[0], None, "bnsh", [n for n in s.nodes if n is not t])
        for (t, _), s in zip(views, (a.k, a.v))
    )
    return a


def _heads_view(s: HeadSplit, inside: set[int], cx) -> tuple[Node, bool] | None:
    """The Transpose making ``s``'s [B,N,T,H] heads from its Reshape, and whether the model
    reads that tensor outside the attention (a graph output, or another reader)."""
    best = None
    for node in s.reshape.outputs[0].outputs:
        if node.op != "Transpose" or tuple(node.attrs.get("perm", ())) != PERM_BNSH:
            continue
        out = node.outputs[0]
        shared = cx.ir.is_graph_output(out) or any(
            id(r) not in inside and r.op != "Shape" for r in out.outputs
        )
        if best is None or (shared and not best[1]):
            best = (node, shared)
    return best


def _context_per_head(pv: Node) -> bool:
    """Whether the P·V MatMul ``pv`` gives a 4-D context that is read per head before any
    merge: only cut along the head's last axis (DeepSeek-V4 rotates the rope part of each
    context head back before the heads merge); the attention then ends at ``pv``."""
    ctx = pv.outputs[0]
    readers = [r for r in ctx.outputs if r.op != "Shape"]
    if rank(ctx) != 4 or not readers:
        return False
    for r in readers:
        if r.op == "Split" and r.attrs.get("axis", 0) in (3, -1):
            continue
        if r.op == "Slice" and len(inputs(r)) > 3:
            axes = constant_value(inputs(r)[3])
            if axes is not None and [int(a) for a in np.reshape(axes, -1)] in ([3], [-1]):
                continue
        return False
    return True


def _merged_readers(transpose: Node) -> list[Node]:
    """The readers of the merged heads, other than Shape."""
    return [r for r in transpose.outputs[0].outputs if r.op != "Shape"]


def _refused(
    code: str, stage: str, message: str, a: Attention, tensor: Tensor | None, **args
) -> NoMatch:
    return NoMatch(
        code,
        f"stage {stage}: {message}",
        stage=stage,
        tensor=tensor.name if tensor is not None else None,
        softmax=a.core.softmax.name,
        **args,
    )


@register_rule
class FuseMultiHeadAttention(Rule):
    name = "fuse-attention"
    pattern = Alt(
        Op("Reshape", Op("Transpose", "ctx"), "shape"), Op("Transpose", "ctx"), Op("MatMul", "pv")
    )
    phase = "attention"
    exclusive = False  # checked here: Shape nodes may read inside the pattern
    summary = "scaled-dot-product attention → com.microsoft.MultiHeadAttention"

    def match(self, node, cx):
        a = _keep_shared_heads(lift(node), cx)
        nodes = _shared_splits_kept(a, cx)
        m = Match(node, {f"node{i}": n for i, n in enumerate(nodes)})
        m.stash(attention=a)
        return m

    # --------------------------------------------------------------------- guards
    def check(self, m, cx):
        a: Attention = m.attention
        dims = current_dims()
        for t in [s.x for s in (a.q, a.k, a.v) if s.layout not in ("bnsh", "bsnh", "bnht")]:
            if rank(t) != 3:
                raise _refused(
                    "unknown-shape",
                    LIFT,
                    f"'{t.name}' has rank {rank(t)}; MultiHeadAttention takes [B,S,D] inputs",
                    a,
                    t,
                )
        self._check_exclusive(m, a, cx)
        self._check_softmax(a, cx)
        self._check_heads(a, dims)
        a.scale = self._scale(a)
        require(
            all(dtype_of(t) == dtype_of(a.q.x) for t in (a.k.x, a.v.x)),
            "dtype-mismatch",
            "q, k and v differ in dtype",
            softmax=a.core.softmax.name,
        )
        if not _mid_is_identity(a, dims):
            raise _refused(
                "reshape-not-identity",
                LIFT,
                "the Reshape between the two attention MatMuls is not provably a no-op",
                a,
                a.core.mid_reshape.outputs[0],
            )
        if a.core.fold is not None:
            self._check_fold(a, dims)
        a.out_direct = _out_direct(a, dims)
        q_seq = dims.key(a.q.x, a.axis("q", "seq"))
        k_seq = dims.key(a.k.x, a.axis("k", "seq"))
        a.bias = plan_bias(a.core, q_seq, k_seq, dims)
        self._lowering(a, cx)
        _note_weak_fill(a, cx)
        if a.qkv_bias is not None:  # the bias Adds the kernel takes belong to the fusion
            m.stash(**{f"bias_add_{i}": add for i, add in enumerate(a.qkv_bias.adds)})
            m.stash(absorbed=[add.name for add in a.qkv_bias.adds])

    def _lowering(self, a: Attention, cx) -> None:
        """Stage 3: the kernel the target has, whether it pays, and the bias it takes."""
        sink = a.core.sink
        logits = sink.values if sink is not None else None
        if logits is not None and logits.size not in (1, a.num_heads):
            raise _refused(
                "mask-shape",
                LOWER,
                f"the sink column has {logits.size} logits for {a.num_heads} heads",
                a,
                sink.nodes[-1].outputs[0],
            )
        causal = cx.target.kernel_attributes.get("GroupQueryAttention", {}).get("causal")
        gqa_kernel = cx.target.has_kernel("GroupQueryAttention", MS, 1, float_type(a.q.x))
        constant_sink = sink is None or sink.column is None  # head_sink takes constants only
        if (causal is None or "0" in causal) and gqa_kernel and constant_sink:
            a.gqa = plan_gqa(
                a,
                current_dims(),
                cx.options.get(OPTION) == "generate",
                without_past=a.core.softcap is not None or a.core.sink is not None,
            )
            if a.gqa is not None:
                a.op = "GroupQueryAttention"
                _note_declared(a, cx)
                return
        if a.core.sink is not None:
            self._sink_lowering(a, cx, gqa_kernel, causal)
            return
        if a.core.softcap is not None:
            self._softcap_lowering(a, cx, gqa_kernel, causal)
            return
        choices = [("MultiHeadAttention", MS, None, {}), ("Attention", "", 23, {})]
        try:
            op, _, _ = lowering(cx, choices, float_type(a.q.x), "attention", "MatMul")
        except NoMatch as e:
            e.message = f"stage {LOWER}: {e.message}"
            e.args_.update(stage=LOWER, tensor=a.q.x.name, softmax=a.core.softmax.name)
            raise
        a.op = op
        if op == "MultiHeadAttention":
            self._check_pays(a, cx)
            # the kernel adds q's bias before the scores: a per-head scale of q cannot take it;
            # folded heads may keep their splits for other readers, which read the biased sums
            plain = a.head_scale is None and a.core.fold is None
            a.qkv_bias = _qkv_bias(a, cx) if plain else None

    def _sink_lowering(self, a: Attention, cx, gqa_kernel: bool, causal) -> None:
        """Attention sinks outside GroupQueryAttention: MultiHeadAttention over one more key, a
        zero key and value whose bias column is the sink logit (``q·0 = 0``, and the zero value
        adds nothing), exact; soft-capped scores too need GroupQueryAttention."""
        has_mha = cx.target.has_kernel("MultiHeadAttention", MS, 1, float_type(a.q.x))
        if has_mha and a.core.softcap is None:
            a.op = "MultiHeadAttention"
            self._check_pays(a, cx)
            return
        mha = (
            "MultiHeadAttention has no softcap"
            if has_mha
            else f"target {cx.target.name} has no MultiHeadAttention kernel"
        )
        if a.core.sink.column is not None:
            gqa = "GroupQueryAttention's head_sink is a constant per head"
        else:
            gqa = _gqa_why(cx, gqa_kernel, causal)
        raise _refused(
            "no-kernel",
            LOWER,
            "the scores get a sink logit (a column concatenated before the Softmax and sliced "
            f"off after it); {mha}, and {gqa}",
            a,
            a.core.sink.nodes[-1].outputs[0],
        )

    def _softcap_lowering(self, a: Attention, cx, gqa_kernel: bool, causal) -> None:
        """Soft-capped scores: the ONNX Attention op (opset ≥ 23: ``softcap`` before the mask,
        as the model caps them) where the target's kernel takes ``softcap``, else a miss naming
        what each kernel lacks. MultiHeadAttention has no softcap."""
        cap = a.core.softcap.cap
        t = cx.target.name
        has_onnx = cx.ir.opset >= 23 and cx.target.has_kernel(
            "Attention", "", cx.ir.opset, float_type(a.q.x)
        )
        softcaps = cx.target.kernel_attributes.get("Attention", {}).get("softcap")
        if has_onnx and softcaps is None:
            a.op = "Attention"
            return
        gqa = _gqa_why(cx, gqa_kernel, causal)
        if cx.ir.opset < 23:
            onnx_att = f"the ONNX Attention op needs opset ≥ 23 (the model has {cx.ir.opset})"
        elif has_onnx:
            onnx_att = (
                f"target {t}'s ONNX Attention takes no softcap "
                f"({cx.target.kernel_attributes_why.get('Attention', '')})"
            )
        else:
            onnx_att = f"target {t} has no ONNX Attention kernel at opset {cx.ir.opset}"
        upgrade = (
            cx.ir.opset < 23
            and softcaps is None
            and cx.target.has_kernel("Attention", "", 23, float_type(a.q.x))
        )
        raise _refused(
            "opset-too-old" if upgrade else "no-kernel",
            LOWER,
            f"the scores are soft-capped (tanh(s/{cap:g})·{cap:g}) before the mask; "
            f"MultiHeadAttention has no softcap, {gqa}, and {onnx_att}",
            a,
            a.core.softcap.nodes[0].outputs[0],
            softcap=cap,
        )

    def _check_fold(self, a: Attention, dims: Dims) -> None:
        """Folded batch and heads: the scores are unfolded to [B,N,S,T] with the query's heads
        at axis 1, and P·V [B·N,S,H] back to [B,N,S,H] (then merged by the root)."""
        z4 = a.core.fold.scores.outputs[0] if a.core.fold.scores is not None else a.core.scores
        if dims.key(z4, 1) != ("int", a.num_heads):
            raise _refused(
                "reshape-not-identity",
                LIFT,
                f"the folded scores are unfolded to {dims.key(z4, 1)} heads at axis 1, not the "
                f"{a.num_heads} heads of the query",
                a,
                z4,
            )
        c, mid = a.core, a.core.mid_reshape
        if c.fold.probs is None:  # P·V per head: the merge as in any attention
            return
        elems = shape_elements(inputs(mid)[1], dims) if mid is not None else None
        heads = ("int", a.num_heads)
        # the probabilities, and the row guard's zeroed copy of them (its condition is the
        # mask's, already broadcast into them: the same shape)
        probs = [c.probs] + ([c.row_guard.outputs[0]] if c.row_guard is not None else [])
        want = [  # P·V [B·N,S,H] is as many rows as the folded V: B is them over N
            {dims.key(a.q.x, a.axis("q", "batch")), dims.key(c.q, 0)}
            | {dims.key(p, 0) for p in probs}
            | {arith("Div", dims.key(c.ctx, 0), heads)},
            {("int", a.num_heads)},
            {dims.key(a.q.x, a.axis("q", "seq")), dims.key(c.q, 2)}
            | {dims.key(p, 2) for p in probs},
            {("int", a.v_head_size), dims.key(c.v, 3)},
        ]
        minus_one = sum(e == ("int", -1) for e in elems or [])
        ok = elems is not None and len(elems) == 4 and minus_one <= 1
        if ok and not all(e in w or e == ("int", -1) for e, w in zip(elems, want)):
            ok = False
        if not ok:
            raise _refused(
                "reshape-not-identity",
                LIFT,
                f"P·V over folded batch and heads is not provably unfolded to [B,N,S,H] ({elems})",
                a,
                a.core.ctx,
            )

    def _check_softmax(self, a: Attention, cx) -> None:
        # before opset 13 a Softmax without axis flattens from axis 1: not a per-row softmax
        axis = a.core.softmax.attrs.get("axis", -1 if cx.ir.opset >= 13 else 1)
        if axis not in (-1, 3):
            raise _refused(
                "softmax-axis",
                "1 (core)",
                f"the Softmax normalizes over axis {axis} (opset {cx.ir.opset}), not over the keys",
                a,
                a.core.probs,
            )

    def _check_heads(self, a: Attention, dims: Dims) -> None:
        batch = batch_keys(a.q.x, dims) if a.q.layout == "bsd" else None
        heads = [head_count(s, dims, batch if s is not a.q else None) for s in (a.q, a.k, a.v)]
        n_q = dims.key(a.q.x, 1) if a.q.layout == "bnsh" else None
        if (
            isinstance(heads[0], str)
            and not isinstance(heads[1], str)
            and n_q == ("int", heads[1][0])
        ):
            heads[0] = heads[1]  # a query per head with the key's heads has its head size (Q·Kᵀ)
        bad = [(h, s) for h, s in zip(heads, (a.q, a.k, a.v)) if isinstance(h, str)]
        if bad:
            raise _refused(
                "dynamic-heads",
                LIFT,
                f"cannot determine num_heads: {bad[0][0]}",
                a,
                bad[0][1].x,
            )
        (n, h), (nk, hk), (nv, hv) = heads
        if nk == nv == 1 < n and hk == h and a.k.layout == a.v.layout == "bnsh":
            a.kv_broadcast = True  # multi-query: one key/value head the MatMuls broadcast
        elif (nk, hk) != (n, h) or nv != n:
            raise _refused(
                "dynamic-heads", LIFT, f"q, k and v split into different heads: {heads}", a, a.k.x
            )
        a.num_heads, a.head_size, a.v_head_size = int(n), int(h), int(hv)

    def _check_pays(self, a: Attention, cx) -> None:
        """Refuse a static key length below the one from which the target's kernel pays, for
        an attention whose scores the kernel must add an ``attention_bias`` to (without one it
        was measured faster at every length: see the target's reason)."""
        bound, why = cx.target.slower_below.get("MultiHeadAttention", (0, ""))
        if a.bias is None and a.core.sink is None:
            return
        keys = a.k.x.shape[a.axis("k", "seq")]
        require(
            not isinstance(keys, (int, np.integer)) or keys >= bound,
            "slower-on-target",
            lambda: (
                f"stage {LOWER}: MultiHeadAttention over {keys} keys with an attention_bias is "
                f"slower than the unfused attention on target {cx.target.name} below {bound} "
                f"keys: {why}"
            ),
            keys=int(keys) if isinstance(keys, (int, np.integer)) else None,
            bound=bound,
            softmax=a.core.softmax.name,
            stage=LOWER,
            tensor=a.k.x.name,
        )

    def _check_exclusive(self, m, a: Attention, cx) -> None:
        """Intermediates of the fusion feed only it (Shape readers aside); the bias terms,
        masks and q/k/v sources are its inputs and may be shared (one mask for every layer)."""
        inside = {id(n) for n in m.nodes()}
        for node in m.nodes():
            if node is m.root:
                continue
            for out in node.outputs:
                if cx.ir.is_graph_output(out):
                    raise _refused(
                        "shared-intermediate",
                        LIFT,
                        f"'{out.name}' inside the attention is a graph output",
                        a,
                        out,
                    )
                outside = [c.name for c in out.outputs if id(c) not in inside and c.op != "Shape"]
                if outside:
                    raise _refused(
                        "shared-intermediate",
                        LIFT,
                        f"'{out.name}' inside the attention also feeds {', '.join(outside[:3])}",
                        a,
                        out,
                    )

    def _scale(self, a: Attention) -> float | None:
        for f in a.core.factors:
            if not isinstance(f.value, Constant):
                raise _refused(
                    "non-constant-param",
                    "1 (core)",
                    f"the attention scale '{f.value.name}' is computed at run time, not a constant",
                    a,
                    f.value,
                )
        total, per_head = 1.0, []
        for f in a.core.factors:
            s = scalar(f.value)
            heads = _head_factors(constant_value(f.value), a.num_heads) if s is None else None
            if heads is not None:
                per_head.append(1.0 / heads if f.divides else heads)
                continue
            if s is None or s == 0:
                shape = list(constant_value(f.value).shape)
                raise _refused(
                    "scale-mismatch",
                    "1 (core)",
                    f"the attention scale "
                    f"'{f.value.name}' of shape {shape} is not one non-zero scalar "
                    f"(nor one per head of {a.num_heads}, [N,1,1])",
                    a,
                    f.value,
                )
            total *= (1.0 / s) if f.divides else s
        if total <= 0:
            raise _refused(
                "scale-mismatch",
                "1 (core)",
                f"the attention scale is {total:g}; the kernel reads a scale ≤ 0 as 'default'",
                a,
                None,
                seen=total,
            )
        default = 1.0 / math.sqrt(a.head_size)
        if per_head:
            # cosine attention's learned logit scale: each head's factor multiplies its query
            a.head_scale = np.prod(per_head, axis=0)
            if not np.all(np.isfinite(a.head_scale)):
                raise _refused(
                    "scale-mismatch",
                    "1 (core)",
                    "the per-head attention scale is not finite",
                    a,
                    None,
                )
            return total  # the kernel's scale then holds the scalar factors alone
        return None if abs(total - default) <= 1e-6 * default else total

    # -------------------------------------------------------------------- rewrite
    def rewrite(self, m, b):
        return [lower(m.attention, b)]


def _gqa_why(cx, gqa_kernel: bool, causal) -> str:
    """Why an attention did not lower to GroupQueryAttention on the target."""
    t = cx.target.name
    if not gqa_kernel:
        return f"target {t} has no GroupQueryAttention kernel"
    if causal is not None and "0" not in causal:
        return (
            f"target {t} takes GroupQueryAttention only with causal=1 "
            f"({cx.target.kernel_attributes_why.get('GroupQueryAttention', '')})"
        )
    return (
        "GroupQueryAttention reads a decoder's own keys and values (a cache "
        "Concat(past, new) with a batch or new-token count provably 1 (or "
        f"{OPTION}=generate), or the new [B,S,Nkv·H] keys alone, split batch-first) "
        "with a head size that is a multiple of 8"
    )


def _head_factors(v: np.ndarray | None, heads: int) -> np.ndarray | None:
    """The [N] values of a constant factor that is one number per head ([N,1,1] or
    [1,N,1,1] against the [B,N,S,T] scores), else None."""
    if v is None or v.ndim > 4 or v.size != heads or heads <= 1:
        return None
    shape = (1,) * (4 - v.ndim) + tuple(v.shape)
    if shape != (1, heads, 1, 1):
        return None
    return v.reshape(heads).astype(np.float64)


def _note_weak_fill(a: Attention, cx) -> None:
    """An analysis remark when the Where mask's fill becomes a bias it does not absorb: rows
    with every key masked are not the model's (see ``check_where_fill``)."""
    if a.bias is None or a.bias.where is None or a.bias.where[1] <= ABSORBING_FILL:
        return
    fill = a.bias.where[1]
    cx.remarks.add(
        Remark(
            "analysis",
            "fuse-attention",
            "fuse-attention",
            "mask-fill-not-absorbing",
            (a.core.softmax.name,),
            f"stage {LOWER}: the Where mask at '{a.core.root.name}' fills {fill:g}, which the "
            "attention_bias adds to the score instead of replacing it: the same weights "
            "wherever a key is visible; a row whose every key is masked (a sequence of "
            "padding alone) attends as if unmasked where the model averages all values",
            {"stage": LOWER, "fill": float(fill), "softmax": a.core.softmax.name},
        )
    )


def _note_declared(a: Attention, cx) -> None:
    """An analysis remark when GroupQueryAttention rests on the user's declaration."""
    dims = current_dims()
    if ("int", 1) in (dims.key(a.q.x, 0), dims.key(a.q.x, 1)) or a.gqa.key.past is None:
        return
    cx.remarks.add(
        Remark(
            "analysis",
            "fuse-attention",
            "fuse-attention",
            "declared-decoder-steps",
            (a.core.softmax.name,),
            f"stage {LOWER}: GroupQueryAttention at '{a.core.root.name}' on the declaration "
            f"{OPTION}=generate: a step given a past with several new tokens needs batch 1 "
            "(the kernel refuses the others)",
            {"stage": LOWER, "tensor": a.q.x.name, "softmax": a.core.softmax.name},
        )
    )


def _shared_splits_kept(a: Attention, cx) -> list[Node]:
    """The fusion's nodes less the head splits that other nodes still read (the folded heads
    of bmm-style exports feed position terms too, DeBERTa's c2p); such a split stays."""
    nodes = a.nodes()
    splits = {id(n) for s in (a.q, a.k, a.v) for n in [*s.nodes, s.reshape] if n is not None}
    # a scale of q or Kᵀ read elsewhere too (the memory's keys of a decoder whose cloned layers
    # CSE merged, read by the next layer's Q·Kᵀ) stays, with the split under it
    splits |= {id(f.node) for f in a.core.factors if a.core.qk in f.node.outputs[0].outputs}
    inside = {id(n) for n in nodes}
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if id(n) not in splits or id(n) not in inside:
                continue
            for out in n.outputs:
                readers = [c for c in out.outputs if c.op != "Shape" and id(c) not in inside]
                if readers or cx.ir.is_graph_output(out):
                    inside.discard(id(n))
                    changed = True
                    break
    return [n for n in nodes if id(n) in inside]


def _mid_is_identity(a: Attention, dims: Dims) -> bool:
    """Whether the Reshape between P·V and the merge provably keeps [B,N,S,H]."""
    mid = a.core.mid_reshape
    if mid is None or (a.core.fold is not None and a.core.fold.probs is not None):
        # P·V over folded heads: checked by _check_fold
        return True
    c = a.core
    ctx = inputs(mid)[0]
    elems = shape_elements(inputs(mid)[1], dims)
    if elems is None or len(elems) != 4:
        return False
    want = [dims.key(ctx, i) for i in range(4)]
    seen = (c.q, c.scores, c.probs, c.ctx)
    alts = [
        {dims.key(a.q.x, a.axis("q", "batch"))} | {dims.key(x, 0) for x in seen},
        {dims.key(x, 1) for x in seen},
        {dims.key(a.q.x, a.axis("q", "seq"))} | {dims.key(x, 2) for x in seen},
        {dims.key(x, 3) for x in (c.q, c.v, c.ctx)},
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


def _out_direct(a: Attention, dims: Dims) -> bool:
    """Whether the merging Reshape provably yields [B,S,N·H]; else it is kept after the kernel."""
    root = a.merge_reshape
    if root is None:
        return False
    elems = shape_elements(inputs(root)[1], dims)
    if elems is None or len(elems) != 3 or a.core.out_layout == "sbd":
        # kept after the kernel: a 0 past axis 1 would copy a dim of [B|S,S|B,N,H] that the
        # kernel's [B|S,S|B,D] does not have
        target = constant_value(inputs(root)[1])
        if target is not None and 0 in list(target)[2:] and not root.attrs.get("allowzero", 0):
            raise _refused(
                "reshape-not-identity",
                LOWER,
                f"the merging Reshape copies a head dim with 0 in {list(target)}",
                a,
                root.outputs[0],
            )
        return False
    if elems[2] == ("int", 0):
        raise no_match()
    copy = () if root.attrs.get("allowzero", 0) else (("int", 0),)
    b_ok = elems[0] in (*copy, dims.key(a.q.x, a.axis("q", "batch")))
    s_ok = elems[1] in (*copy, dims.key(a.q.x, a.axis("q", "seq")))
    width = a.num_heads * a.v_head_size
    return b_ok and s_ok and elems[2] in (("int", -1), ("int", width))


def _qkv_bias(a: Attention, cx) -> QkvBias | None:
    """The q/k/v projections' constant bias vectors, when each source is MatMul + Add."""
    if "bnsh" in (a.k.layout, a.q.layout) or a.k.layout in ("bsnh", "bnht"):
        return None  # the kernel adds no bias to a key and value given per head; a per-head
        # query is computed from the biased projection
    hidden = a.num_heads * a.head_size
    if a.q.layout == "packed":
        found = _bias_add(a.q.x, cx)
        if found is None or found[1].size != 3 * hidden:
            return None
        src, vec, add = found
        return QkvBias((src, src, src), vec, (add,))
    parts = [_bias_add(t, cx) for t in (a.q.x, a.k.x, a.v.x)]
    if any(p is None for p in parts):
        return None
    for t, (_, vec, _) in zip((a.q.x, a.k.x, a.v.x), parts):
        width = t.shape[-1] if t.shape is not None else None
        if not isinstance(width, (int, np.integer)) or vec.size != width:
            return None
    return QkvBias(
        tuple(p[0] for p in parts),
        np.concatenate([p[1] for p in parts]),
        tuple(p[2] for p in parts),
    )


def _bias_add(t: Tensor, cx) -> tuple[Tensor, np.ndarray, Node] | None:
    """(MatMul output, bias vector, Add) when ``t`` = MatMul + constant vector, read only once."""
    add = producer(t, "Add")
    sc = split_const(add) if add is not None else None
    if sc is None or producer(sc[0], "MatMul") is None:
        return None
    vec = constant_value(sc[1])
    if vec.ndim != 1 or vec.dtype != dtype_of(t):
        return None
    if len(t.outputs) != 1 or cx.ir.is_graph_output(t):
        return None
    return sc[0], vec, add

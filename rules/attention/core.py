"""Stage 1 (core): the scaled-dot-product core, read back from the heads' merge.

::

    scores = MatMul(Q·c_q, Kᵀ·c_k) [÷ c | · c]                        scale = c_q·c_k·c
    capped = scores | tanh(scores ÷ cap) · cap                  (logit soft-capping, Gemma 2)
    z      = capped [+ bias …] | Where(cond, capped, −big) [+ bias …]
             [→ Swin's window regroup: Reshape(Reshape(z, [b,nW,N,S,T]) + W, [B,N,S,T])]
    P      = Softmax(z) [→ Where(IsNaN(P), 0, P)]        (SDPA exports of transformers ≥ 4.48)
    ctx    = MatMul(P, V) [→ Reshape to itself]
    out    = Transpose(ctx, (0,2,1,3) | (2,0,1,3))                       the rule's root

:func:`match_core` returns a typed :class:`Core` or raises: silently (``structure``) when there
is no Softmax between two MatMuls, else a missed ``unrecognized-layout`` that names stage 1 and
the tensor whose spelling is unknown.  The additive terms are kept in order; which of them are
masks the later stages decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphopt.opt.dims import current as current_dims
from graphopt.opt.dims import rank
from graphopt.opt.domains import MS, norm_domain
from graphopt.opt.ir import Node, Tensor, constant_value
from graphopt.opt.rewrite import NoMatch

from ..activation import inputs, no_match, producer, scalar

_MERGE_LAYOUTS = {(0, 2, 1, 3): "bsd", (2, 0, 1, 3): "sbd"}
_SCALED = ("MatMul", "Transpose", "Reshape", "Gather")  # what a scale multiplies, never is
_MAX_TERMS = 4  # additive bias terms between the scores and the Softmax


@dataclass
class Factor:
    """One constant factor of the attention scale: ``value`` multiplies, or divides."""

    value: Tensor
    divides: bool
    node: Node


@dataclass
class SoftCap:
    """Logit soft-capping ``Mul(Tanh(Div(s, cap) | Mul(s, 1/cap)), cap)`` of the scaled scores."""

    cap: float
    nodes: list[Node]  # consumers first: the outer Mul, the Tanh, the inner Div or Mul


@dataclass
class WindowRegroup:
    """Swin's ``merge(split(z) + mask [+ mask …])`` around the per-window masks ``masks``
    (Swin v2 adds its mask twice); ``adds`` consumers first."""

    split: Node
    adds: list[Node]
    merge: Node
    masks: list[Tensor]


@dataclass
class Core:
    """The recognized core; every node in ``nodes()`` belongs to the fusion."""

    root: Node  # the Transpose merging the heads
    out_layout: str  # "bsd" | "sbd"
    pv: Node
    softmax: Node
    qk: Node
    q: Tensor  # operands of Q·Kᵀ and P·V with the scale stripped: [B,N,S,H], [B,N,H,T], [B,N,T,H]
    kt: Tensor
    v: Tensor
    scores: Tensor  # Q·Kᵀ
    probs: Tensor  # Softmax output
    ctx: Tensor  # P·V
    factors: list[Factor] = field(default_factory=list)
    terms: list[Tensor] = field(default_factory=list)  # additive bias terms, innermost first
    term_adds: list[Node] = field(default_factory=list)
    where: Node | None = None  # Where(cond, scores, fill) masking
    window: WindowRegroup | None = None
    softcap: SoftCap | None = None
    nan_guard: tuple[Node, Node] | None = None  # (Where, IsNaN)
    mid_reshape: Node | None = None

    def nodes(self) -> list[Node]:
        """The core's nodes, consumers first."""
        found = [self.root]
        found += [self.mid_reshape] if self.mid_reshape is not None else []
        found += [self.pv] + (list(self.nan_guard) if self.nan_guard else []) + [self.softmax]
        if self.window is not None:
            found += [self.window.merge, *self.window.adds, self.window.split]
        found += self.term_adds[::-1] + ([self.where] if self.where is not None else [])
        found += self.softcap.nodes if self.softcap is not None else []
        return found + [f.node for f in self.factors] + [self.qk]


def unrecognized(stage: str, message: str, softmax: Node, tensor: Tensor | None) -> NoMatch:
    """A missed remark for an attention whose spelling is not known, naming its stage, its
    tensor and its Softmax (rules of later phases look refusals up by the Softmax)."""
    return NoMatch(
        "unrecognized-layout",
        f"stage {stage}: {message}",
        stage=stage,
        tensor=tensor.name if tensor is not None else None,
        softmax=softmax.name,
    )


def match_core(root: Node) -> Core:
    """Stage 1 from the heads' merging Transpose ``root``."""
    perm = tuple(root.attrs.get("perm", ()))
    ctx = inputs(root)[0]
    mid = producer(ctx, "Reshape")
    pv = producer(inputs(mid)[0] if mid is not None else ctx, "MatMul")
    if pv is None:
        raise no_match()
    probs, v = inputs(pv)
    guard = _nan_guard(probs)
    sm = producer(inputs(guard[0])[2] if guard else probs, "Softmax")
    if sm is None:
        raise no_match()
    # Softmax between two MatMuls: attention; an unknown spelling from here on is a missed remark
    if perm not in _MERGE_LAYOUTS or rank(ctx) not in (None, 4):
        raise no_match()  # not a head merge: e.g. a channel attention over [B, C, HW]
    z = inputs(sm)[0]
    if _scores_folded(z):
        raise no_match()  # a FusedMatMul fold took it after this rule refused it
    core = Core(
        root=root,
        out_layout=_MERGE_LAYOUTS[perm],
        pv=pv,
        softmax=sm,
        qk=pv,  # set by _peel_scores, with q, kt and scores
        q=z,
        kt=z,
        v=v,
        scores=z,
        probs=sm.outputs[0],
        ctx=pv.outputs[0],
        nan_guard=guard,
        mid_reshape=mid,
    )
    _peel_scores(core, z)
    return core


def _nan_guard(p: Tensor) -> tuple[Node, Node] | None:
    """``Where(IsNaN(P), 0, P)``: (Where, IsNaN), or None."""
    guard = producer(p, "Where")
    if guard is None:
        return None
    cond, zero, inner = inputs(guard)
    isnan = producer(cond, "IsNaN")
    if isnan is None or inputs(isnan)[0] is not inner or scalar(zero) != 0.0:
        return None
    return guard, isnan


def _peel_scores(core: Core, z: Tensor) -> None:
    """Fill the window regroup, bias terms, Where mask, scale and Q·Kᵀ of ``core`` from the
    Softmax input ``z``."""
    core.window = _window_regroup(z)
    if core.window is not None:
        z = inputs(core.window.split)[0]
    for _ in range(_MAX_TERMS):
        add = producer(z, "Add")
        if add is None:
            break
        a0, a1 = inputs(add)
        side = 0 if is_scores(a0) else 1 if is_scores(a1) else None
        if side is None:
            break
        z, term = (a0, a1) if side == 0 else (a1, a0)
        core.term_adds.append(add)
        core.terms.append(term)
    core.term_adds.reverse()
    core.terms.reverse()
    where = producer(z, "Where")
    if where is not None and is_scores(inputs(where)[1]):
        core.where, z = where, inputs(where)[1]
    core.softcap = soft_cap(z)
    if core.softcap is not None:
        z = inputs(core.softcap.nodes[-1])[0]
    scores, factors = strip_scale(z)
    mm = producer(scores, "MatMul")
    if mm is None:
        raise unrecognized(
            "1 (core)",
            f"the Softmax input '{inputs(core.softmax)[0].name}' is not a scaled, masked MatMul "
            f"of Q and Kᵀ (it is built from '{z.name}')",
            core.softmax,
            z,
        )
    q, fq = strip_scale(inputs(mm)[0])
    kt, fk = strip_scale(inputs(mm)[1])
    core.qk, core.scores, core.q, core.kt = mm, scores, q, kt
    core.factors = factors + fq + fk


def soft_cap(t: Tensor | None) -> SoftCap | None:
    """``t`` = ``tanh(s / cap) · cap`` (the inner step a Div by ``cap`` or a Mul by ``1/cap``,
    both positive scalar constants, within fp32 rounding of each other), else None."""
    outer = producer(t, "Mul")
    if outer is None:
        return None
    for th, c in (inputs(outer), inputs(outer)[::-1]):
        tanh = producer(th, "Tanh")
        cap = scalar(c)
        inner = producer(inputs(tanh)[0], ("Div", "Mul")) if tanh is not None else None
        if inner is None or cap is None or cap <= 0 or len(th.outputs) != 1:
            continue
        a, b = inputs(inner)
        if inner.op == "Mul" and scalar(a) is not None and scalar(b) is None:
            a, b = b, a
        d = scalar(b)
        if d is None or d <= 0:
            continue
        inv = d if inner.op == "Div" else 1.0 / d
        if abs(inv - cap) <= 1e-6 * cap:
            return SoftCap(float(cap), [outer, tanh, inner])
    return None


def strip_scale(t: Tensor | None) -> tuple[Tensor | None, list[Factor]]:
    """``t`` = ``u · c`` or ``u / c`` (at most one): (u, [factor])."""
    node = producer(t, ("Mul", "Div"))
    if node is None:
        return t, []
    ins = inputs(node)
    if node.op == "Div":
        if constant_value(ins[1]) is None and rank(ins[1]) not in (None, 0, 1):
            return t, []  # a computed per-row divisor: a norm (cosine attention), not a scale
        return ins[0], [Factor(ins[1], True, node)]
    for u, c in ((ins[0], ins[1]), (ins[1], ins[0])):
        scaled = producer(u, _SCALED) is not None or _rotated(u)
        if scaled and producer(c, _SCALED[1:]) is None:
            return u, [Factor(c, False, node)]
    return t, []


def past_empty_concat(t: Tensor | None) -> tuple[Tensor | None, list[Node]]:
    """``t`` = Concat(u, e) along the last axis with ``e`` provably empty there (Phi-3's
    partial-rotary spelling with nothing passed through): (u, [Concat]); else (t, [])."""
    cat = producer(t, "Concat")
    if cat is None or len(inputs(cat)) != 2 or cat.attrs.get("axis") not in (-1, 3):
        return t, []
    u, e = inputs(cat)
    if rank(u) != 4 or current_dims().key(e, 3) != ("int", 0):
        return t, []
    split = producer(e, "Split")  # of the rotated heads: the fusion's when only e is read
    return u, [cat] + ([split] if split is not None else [])


def _rotated(u: Tensor | None) -> bool:
    """``u`` is rotated heads: RotaryEmbedding, or Concat(rotated, pass-through) along the
    head axis (partial rotary)."""
    if rotary_of(past_empty_concat(u)[0]) is not None:
        return True
    cat = producer(u, "Concat")
    return (
        cat is not None
        and cat.attrs.get("axis") in (-1, 3)
        and rotary_of(inputs(cat)[0]) is not None
    )


def rotary_of(t: Tensor | None) -> Node | None:
    """The ``RotaryEmbedding`` (ONNX or com.microsoft) computing ``t``, or None."""
    return producer(t, "RotaryEmbedding") or producer(t, "RotaryEmbedding", MS)


def is_scores(t: Tensor | None, depth: int = _MAX_TERMS) -> bool:
    """Q·Kᵀ, possibly scaled, masked by a Where or biased: a MatMul whose right operand is a
    transposed tensor, reached through at most ``depth`` Adds."""
    where = producer(t, "Where")
    if where is not None:
        t = inputs(where)[1]
    cap = soft_cap(t)
    if cap is not None:
        t = inputs(cap.nodes[-1])[0]
    mm = producer(strip_scale(t)[0], "MatMul")
    if mm is not None:
        right = strip_scale(inputs(mm)[1])[0]
        return producer(right, ("Transpose", "Reshape")) is not None
    add = producer(t, "Add")
    return add is not None and depth > 0 and any(is_scores(a, depth - 1) for a in inputs(add))


def _window_regroup(z: Tensor) -> WindowRegroup | None:
    """``z`` = Reshape(Add(Reshape(z0, 5-D), M5) [+ M5' …], 4-D) with ``z0`` the (biased)
    scores."""
    merge = producer(z, "Reshape")
    if merge is None or rank(z) != 4:
        return None
    t, adds, masks = inputs(merge)[0], [], []
    for _ in range(_MAX_TERMS):
        add = producer(t, "Add")
        if add is None:
            return None
        for s_t, m_t in (inputs(add), inputs(add)[::-1]):
            split = producer(s_t, "Reshape")
            if split is not None and rank(s_t) == 5 and is_scores(inputs(split)[0]):
                return WindowRegroup(split, [*adds, add], merge, [*masks, m_t])
        inner = [s for s in inputs(add) if producer(s, "Add") is not None and rank(s) == 5]
        if len(inner) != 1:
            return None
        adds.append(add)
        masks.append(inputs(add)[1] if inputs(add)[0] is inner[0] else inputs(add)[0])
        t = inner[0]
    return None


def _scores_folded(t: Tensor) -> bool:
    """Whether the scores reaching a Softmax come from a com.microsoft.FusedMatMul (a fold of
    the linear phase, after this rule refused the attention)."""
    for _ in range(7):
        node = t.inputs[0] if t.inputs else None
        if node is None:
            return False
        if node.op == "FusedMatMul" and norm_domain(node.domain) == MS:
            return True
        if node.op not in ("Add", "Where", "Mul", "Div", "Reshape", "Tanh"):
            return False
        t = inputs(node)[1] if node.op == "Where" else inputs(node)[0]
    return False

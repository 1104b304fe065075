"""Stage 2 (lift): the additive terms and Where masking of the scores → one ``attention_bias``.

Every term added to the scores (a padding mask such as GPT-2's ``(1 − mask)·finfo.min`` or
BERT's, a causal mask, T5's relative position bias, or their sum shared by every layer) is an
input of the fusion, never an intermediate of it: the terms are summed into the kernel's
``attention_bias`` ``[B|1, N|1, S, T]``.  A ``Where(cond, scores, fill)`` mask becomes
``Where(cond, 0, fill)`` added to the bias — exact for ``fill ≤ −1e30`` (then
``s + fill == fill`` in fp32), the same weights wherever a key is visible for ``fill ≤ −1e4``
(see :func:`check_where_fill`).  Swin's per-window mask is tiled over the images (see
:class:`WindowPlan`).  A term that provably adds zeros (dynamo's ViT: ``Where(all-true, 0, min)``)
is dropped.  Refusals are ``mask-shape`` naming stage 2 and the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphopt.opt.graph.dims import Dims, Key, pins, rank, shape_elements
from graphopt.opt.graph.ir import Tensor, constant_value, dtype_of
from graphopt.opt.rewrite.engine import NoMatch

from ..activation import inputs, producer, scalar
from .core import MASK_FILL, Core

STAGE = "2 (lift)"


@dataclass
class WindowPlan:
    """Swin's shifted-window masks: each [1, nW, N|1, S, T] with static ``dims`` nW, N, S, T."""

    masks: list[Tensor]
    dims: list[int]


@dataclass
class BiasPlan:
    """How ``attention_bias`` is built: the sum of ``terms`` and of the Where mask, then tiled
    over Swin's windows, used as it is (``direct``: provably [.., S, T]) or expanded to
    [1, 1, S, T] at run time."""

    terms: list[Tensor] = field(default_factory=list)
    folded: list[Tensor] = field(default_factory=list)  # terms [B·N|1, S|1, T] of folded heads
    where: tuple[Tensor, float, bool] | None = None  # (cond, fill, fill where cond holds)
    window: WindowPlan | None = None
    direct: bool = False


def mask_refused(message: str, tensor: Tensor | None, softmax_name: str) -> NoMatch:
    return NoMatch(
        "mask-shape",
        f"stage {STAGE}: {message}",
        stage=STAGE,
        tensor=tensor.name if tensor is not None else None,
        softmax=softmax_name,
    )


#: a Where mask's fill at or below this absorbs any score it is added to, exactly
ABSORBING_FILL = -1e30


def check_where_fill(fill: Tensor, softmax_name: str) -> float:
    """The scalar fill of a Where mask of the scores, or the refusal.  A fill ≤
    :data:`ABSORBING_FILL` absorbs any score it is added to, exactly.  One ≤ ``MASK_FILL``
    (−1e4: ``masked_fill(mask, -1e9)``, float16's lowest −65504) does not, but weighs nothing
    after the Softmax beside any key the mask leaves visible (``exp(s + fill − max)``
    underflows to 0 in every precision): the fused attention differs only in a row whose every
    key is masked (a sequence of padding alone), where the model averages all values
    uniformly and the bias leaves the scores unmasked.  A higher fill is refused."""
    val = scalar(fill)
    if val is None or val > MASK_FILL:
        raise mask_refused(
            f"the Where mask fills {val if val is not None else fill.name}; only a fill "
            f"≤ {MASK_FILL:g}, which no visible key's weight survives, can move into an "
            "additive bias",
            fill,
            softmax_name,
        )
    return val


def plan_bias(core: Core, q_seq: Key, k_seq: Key, dims: Dims) -> BiasPlan | None:
    """The attention_bias plan of ``core`` (None: nothing masks the scores)."""
    qdt = dtype_of(core.q)
    sm = core.softmax.name
    terms = [t for t in core.terms if not is_zero(t)]
    folded = [t for t in core.fold.terms if not is_zero(t)] if core.fold is not None else []
    plan = BiasPlan(terms=terms, folded=folded)
    for t in folded:
        if rank(t) != 3 or dtype_of(t) != qdt:
            raise mask_refused(
                f"the additive term '{t.name}' of the folded scores is not a {qdt} tensor "
                "[B·N, S|1, T]",
                t,
                sm,
            )
    if core.where is not None:
        cond, a, b = inputs(core.where)
        val = check_where_fill(a if core.where_fills_true else b, sm)
        if dtype_of(cond) != np.dtype(bool) or rank(cond) is None or rank(cond) > 4:
            raise mask_refused(
                f"the Where mask condition '{cond.name}' is not a bool tensor of rank ≤ 4", cond, sm
            )
        plan.where = (cond, val, core.where_fills_true)
    for t in terms:
        if rank(t) is None or rank(t) > 4:
            raise mask_refused(
                f"the additive term '{t.name}' has rank {rank(t)}; attention_bias is 4-D", t, sm
            )
        if dtype_of(t) != qdt:
            raise mask_refused(
                f"the additive term '{t.name}' is {dtype_of(t)}, the scores are {qdt}", t, sm
            )
    if core.window is not None:
        plan.window = _window(core, dims, qdt)
    elif not terms and not folded and plan.where is None:
        return None
    shaped = terms + ([plan.where[0]] if plan.where is not None else [])  # the sum's operands
    plan.direct = plan.window is not None or (
        not folded and _provably(shaped, 2, q_seq, dims) and _provably(shaped, 3, k_seq, dims)
    )
    return plan


def _provably(terms: list[Tensor], axis: int, want: Key, dims: Dims) -> bool:
    """Whether the sum of 4-D-aligned ``terms`` has dim ``want`` at ``axis`` of 4."""
    found = set()
    for t in terms:
        a = axis - (4 - rank(t))
        k = dims.key(t, a) if a >= 0 else ("int", 1)
        if k != ("int", 1):
            found.add(k)
    return found == {want}


def _window(core: Core, dims: Dims, qdt) -> WindowPlan:
    """[nW, N, S, T] of a shifted-window regroup whose mask can be tiled over the batch."""
    w, sm = core.window, core.softmax.name
    want = [dims.key(core.scores, i) for i in (1, 2, 3)]
    split = shape_elements(inputs(w.split)[1], dims)
    merge = shape_elements(inputs(w.merge)[1], dims)
    static = split is not None and all(e[0] == "int" and e[1] > 0 for e in split[1:])
    if not (static and len(split) == 5 and pins(split[2:], want)):
        raise mask_refused(
            f"the window regroup {split} does not split the batch of scores "
            f"{want} into a static number of windows",
            w.split.outputs[0],
            sm,
        )
    if merge is None or len(merge) != 4 or not pins(merge[1:], want):
        raise mask_refused(
            f"the window regroup is not merged back into the scores' layout ({merge})",
            w.merge.outputs[0],
            sm,
        )
    for mask in w.masks:
        r = rank(mask)
        if r is None or r > 5 or (r == 5 and mask.shape[0] != 1) or dtype_of(mask) != qdt:
            raise mask_refused(
                f"the window mask '{mask.name}' is not a {qdt} tensor of rank ≤ 5 "
                "shared by every image",
                mask,
                sm,
            )
    cond = inputs(core.where)[0] if core.where is not None else None
    for t in [*core.terms, cond]:
        if t is not None and (rank(t) is None or (rank(t) >= 4 and t.shape[0] != 1)):
            raise mask_refused(f"the mask '{t.name}' varies over the windows' batch", t, sm)
    return WindowPlan(list(w.masks), [e[1] for e in split[1:]])


def _repeated_constant(t: Tensor | None) -> np.ndarray | None:
    """The constant value of ``t``, also seen through an Expand (which only repeats it)."""
    v = constant_value(t)
    if v is None and producer(t, "Expand") is not None:
        v = constant_value(inputs(producer(t, "Expand"))[0])
    return v


def is_zero(t: Tensor | None, depth: int = 2) -> bool:
    """Whether ``t`` is zeros for sure: a constant (maybe expanded) of zeros, a
    ConstantOfShape of 0 times a finite constant (``baddbmm``'s zero input times ``beta``), or
    a Where whose constant condition picks a branch of zeros everywhere."""
    v = _repeated_constant(t)
    if v is not None:
        return v.size > 0 and not np.any(v)
    filled = producer(t, "ConstantOfShape")
    if filled is not None:
        value = filled.attrs.get("value")
        return value is None or not np.any(np.asarray(getattr(value, "values", value)))
    mul = producer(t, "Mul")
    if mul is not None and depth > 0:
        for z, c in (inputs(mul), inputs(mul)[::-1]):
            f = constant_value(c)
            if f is not None and f.size == 1 and np.isfinite(f).all() and is_zero(z, depth - 1):
                return True
    where = producer(t, "Where")
    if where is None or depth == 0:
        return False
    cond, a, b = inputs(where)
    c = _repeated_constant(cond)
    if c is None or c.size == 0 or (c.any() and not c.all()):
        return False
    return is_zero(a if c.all() else b, depth - 1)

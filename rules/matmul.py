"""MatMul+Add → Gemm (level 2), only where Gemm is legal and safe; a Gemm flattened between two
Reshapes → MatMul+Add; a per-column scale after a linear layer (layer scale) → its weights.

A rank ≥ 3 linear layer becomes Reshape → Gemm → Reshape only where the target prefers it
(``prefers["linear-bias"] == "gemm"``) and every dim but the first is static.  These rules run in
the ``linear`` phase, after ``fuse-attention``, so q/k/v projections are left to its kernel.  In
fp16/bf16 the fusion moves where the bias is added relative to the accumulation, so it needs a
target whose Gemm accumulates in fp32.  Details and measurements: docs/rules.md (Linear layers).
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import shape_elements
from graphopt.opt.graph.ir import (
    Constant,
    Node,
    constant_value,
    dtype_of,
    static_shape,
    type_string,
)
from graphopt.opt.numerics.precision import require_refold_allowed, require_representable
from graphopt.opt.rewrite.engine import Alt, Const, Op, Rule, applies_only_if, opt, require
from graphopt.opt.rewrite.manager import register_rule
from graphopt.rules.activation import MS, inputs, producer


def _rank(t) -> int | None:
    return len(t.shape) if t.shape is not None else None


@register_rule
class MatMulAddToGemm(Rule):
    name = "matmul-add-to-gemm"
    root = "Add"
    phase = "linear"
    summary = "MatMul + bias Add → Gemm (rank ≥ 3: between two Reshapes, where preferred)"
    pattern = Op("Add", Op("MatMul", "A", "B", name="matmul", out="y"), "C", commute=True)

    def check(self, m, cx):
        ra, rb = _rank(m.A), _rank(m.B)
        flat = None
        if ra != 2 and rb == 2:
            flat = flat_linear(m.A, m.B, m.C, m.root, cx)
            require(
                not isinstance(flat, str),
                "rank-not-2",
                lambda: (
                    f"MatMul '{m.matmul.name}' has operands of rank {ra} and {rb}; Gemm "
                    f"needs rank 2 and {flat} (MatMul+Add stays)"
                ),
            )
            m.stash(flat=flat)
            return
        require(
            ra == 2 and rb == 2,
            "rank-not-2",
            f"MatMul '{m.matmul.name}' has operands of rank {ra} and {rb}; Gemm needs rank 2 "
            "(MatMul+Add stays)",
        )
        m.stash(flat=None)
        out = static_shape(m.y)
        c = m.C.shape
        require(
            c is not None and len(c) <= 2,
            "bias-rank",
            f"bias '{m.C.name}' has rank {len(c) if c is not None else '?'}; Gemm's C is ≤ 2-D",
        )
        if out is not None and all(isinstance(d, int) for d in c):
            aligned = (1,) * (2 - len(c)) + tuple(c)
            require(
                all(cd in (1, od) for cd, od in zip(aligned, out)),
                "bias-broadcast",
                f"bias shape {list(c)} does not broadcast to the MatMul output {list(out)}",
            )
        else:
            require(
                all(isinstance(d, int) and d == 1 for d in c[:-1]) if c else True,
                "bias-broadcast",
                "bias shape is not statically broadcastable to [M,N]",
            )
        dt = dtype_of(m.y) if dtype_of(m.y) is not None else dtype_of(m.B)
        require(dt is not None, "unknown-dtype", "the MatMul's dtype is unknown")
        tname = type_string(dt)
        require(
            cx.target.has_kernel("Gemm", "", cx.ir.opset, tname),
            "no-kernel",
            f"target {cx.target.name} has no Gemm kernel for {tname} at opset {cx.ir.opset}",
        )
        if dt.name in ("float16", "bfloat16"):
            require(
                cx.target.accumulates_fp32("Gemm"),
                "precision-accumulation",
                f"Gemm in {dt.name}: target {cx.target.name} does not declare fp32 "
                "accumulation for Gemm, so adding the bias inside the GEMM may lose accuracy",
            )

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        name = m.matmul.name
        if m.flat is None:
            return [b.op("Gemm", [m.A, m.B, m.C], like=like, name=f"{name}/gemm")]
        tail, n = m.flat
        a = b.op(
            "Reshape",
            [m.A, b.const(np.array([-1, tail[-1]], np.int64), "flat")],
            name=f"{name}/flat",
        )
        a.dtype = dtype_of(m.A)
        y = b.op("Gemm", [a, m.B, m.C], name=f"{name}/gemm")
        y.dtype = dtype_of(m.A)
        a.shape, y.shape = [None, tail[-1]], [None, n]  # rank 2 for the rules after
        back = b.const(np.array([-1, *tail[:-1], n], np.int64), "unflat")
        return [b.op("Reshape", [y, back], like=like, name=f"{name}/unflat")]


def flat_linear(x, w, c, add, cx) -> tuple[list[int], int] | str:
    """(x's dims after the first, N) when ``x·W + c`` (x of rank ≥ 3) should become
    Reshape → Gemm → Reshape on this target; else why not.

    Measured on onnxruntime CPU (``prefers["linear-bias"]``): the bias is added inside the GEMM
    and a following Gelu stays a plain Gelu instead of BiasGelu.  Both Reshape targets must be
    constants, so every dim of x but the first must be static.  q/k/v projections are left to
    ``fuse-attention`` (its kernel takes their bias; it ran in an earlier phase) and flatten
    only where it refused the attention for the target (Swin-T's 49-key windows on cpu are
    slower fused)."""
    if cx.target.prefers.get("linear-bias") != "gemm":
        return f"target {cx.target.name} prefers MatMul + Add"
    dt = dtype_of(x)
    if dt is None or dt.name not in ("float32", "float64"):
        return f"the flat form is used for float32/float64 only (not {dt})"
    tail = list(x.shape[1:]) if x.shape is not None and len(x.shape) >= 3 else None
    if tail is None or not all(isinstance(d, (int, np.integer)) and d > 0 for d in tail):
        return "every dim of the input but the first must be static"
    wv, cv = constant_value(w), constant_value(c)
    if wv is None or cv is None or wv.ndim != 2 or cv.ndim != 1 or cv.shape[0] != wv.shape[1]:
        return "the weight and bias must be constants, the bias a vector of N"
    steps = _attention_steps_fed(add.outputs[0])
    if not all(_attention_refused(mm, cx) or not _attention_rooted(mm) for mm in steps):
        return "it projects q, k or v of an attention, whose fusion takes the bias"
    return [int(d) for d in tail], int(wv.shape[1])


#: fuse-attention's refusals that hold whatever else is rewritten: the target's, not the spelling's
_TARGET_REFUSALS = ("slower-on-target", "no-kernel")

#: how a projection reaches its attention: head split, packed-q/k/v pick, scale
_TO_HEADS = (
    "Reshape",
    "Split",
    "Transpose",
    "Unsqueeze",
    "Squeeze",
    "Gather",
    "Slice",
    "Mul",
    "Div",
)


def _attention_steps_fed(t, depth: int = 8) -> list:
    """The attention MatMuls (Q·Kᵀ or P·V) that ``t`` reaches as an operand through at most
    ``depth`` head-splitting, packed-q/k/v and scaling nodes."""
    found, frontier = [], [t]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            for r in u.outputs:
                if r.op in ("MatMul", "FusedMatMul") and _softmax_of(r) is not None:
                    found.append(r)
                elif r.op in _TO_HEADS:
                    nxt += r.outputs
        frontier = nxt
    return found


@register_rule
class FlattenedGemmToMatMul(Rule):
    """``Reshape(Gemm(Reshape(x, [-1, K]), W, C), [*x.shape[:-1], N])`` → ``MatMul(x, W) + C``.

    GPT-2's Conv1D and other exporters flatten the leading dims around a Gemm and rebuild them
    from ``Shape(x)`` glue (Shape, Gather, Unsqueeze, Concat per layer).  A MatMul broadcasts over
    the leading dims itself, so the two Reshapes and their glue go.  The rebuilt target must be
    provably x's leading dims followed by N; W must be a constant (a transposed one is stored
    transposed when nothing else reads it).  In float16/bfloat16 the bias would be added after
    rounding instead of inside the accumulation, so only float32/float64 are rewritten.
    """

    name = "flattened-gemm-to-matmul"
    root = "Reshape"
    summary = "Reshape → Gemm → Reshape back → MatMul (+ Add)"
    pattern = Op(
        "Reshape",
        Op("Gemm", Op("Reshape", "x", "flat", name="inner"), "W", opt("C"), name="gemm"),
        "target",
    )

    def check(self, m, cx):
        a = m.gemm.attrs
        require(
            not a.get("transA", 0) and a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0,
            "gemm-attributes",
            "the Gemm transposes A or scales by alpha/beta",
        )
        r = _rank(m.x)
        k = m.x.shape[-1] if r else None
        require(
            r is not None and r >= 3 and isinstance(k, int),
            "unknown-shape",
            f"'{m.x.name}' is not of known rank ≥ 3 with a static last dim",
        )
        dims = current_dims()
        flat = shape_elements(m.flat, dims)
        require(
            flat in ([("int", -1), ("int", k)],),
            "reshape-not-flatten",
            f"the inner Reshape to {flat} is not [-1, {k}]",
        )
        w = constant_value(m.W)
        require(w is not None and w.ndim == 2, "non-constant-param", "the Gemm's B is not constant")
        trans_b = bool(a.get("transB", 0))
        # the flat form is what matmul-add-to-gemm writes where the target prefers it
        applies_only_if(
            m.C is None or trans_b or isinstance(flat_linear(m.x, m.W, m.C, m.root, cx), str)
        )
        n = w.shape[0] if trans_b else w.shape[1]
        require(
            (w.shape[1] if trans_b else w.shape[0]) == k,
            "shape-mismatch",
            f"B {list(w.shape)} does not take {k} inputs",
        )
        require(
            not trans_b or len(m.W.outputs) == 1,
            "shared-weight",
            f"the transposed weight '{m.W.name}' is read elsewhere; transposing it would copy it",
        )
        want = [dims.key(m.x, i) for i in range(r - 1)] + [("int", int(n))]
        target = shape_elements(m.target, dims)
        copy = () if m.root.attrs.get("allowzero", 0) else (("int", 0),)
        ok = (
            target is not None
            and len(target) == r
            and all(
                e == w_ or (i < r - 1 and e in copy) for i, (e, w_) in enumerate(zip(target, want))
            )
        )
        require(
            ok,
            "reshape-not-identity",
            f"the outer Reshape to {target} does not provably restore {want}",
        )
        if m.C is not None:
            c = m.C.shape
            require(
                c is not None and len(c) <= 2 and all(d == 1 for d in c[:-1]),
                "bias-broadcast",
                f"the Gemm's C {c} is not a row vector",
            )
        dt = dtype_of(m.x)
        require(
            dt is not None and dt.name in ("float32", "float64"),
            "precision-accumulation",
            f"in {dt} the bias would be added after rounding, not inside the accumulation",
        )
        m.stash(weight=(np.ascontiguousarray(w.T) if trans_b else None))

    def rewrite(self, m, b):
        w = m.W if m.weight is None else b.const(m.weight, f"{m.W.name}_t")
        like = m.root.outputs[0]
        y = b.op("MatMul", [m.x, w], like=like)  # the row-vector bias does not broadcast it
        if m.C is None:
            return [y]
        return [b.op("Add", [y, m.C], like=like)]


def _axis_vector(c: np.ndarray, out_rank: int, axis: int, n: int) -> np.ndarray | None:
    """``c`` as a vector along ``axis`` of a rank-``out_rank`` tensor with n there, or None if
    it varies along another axis or would broadcast the tensor to a larger rank."""
    if c.ndim > out_rank:
        return None
    shape = (1,) * (out_rank - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(shape) if i != axis):
        return None
    if c.size == 1:
        return np.full(n, c.reshape(-1)[0])
    return c.reshape(-1) if shape[axis] == n else None


_MATMUL_CONST_W = Op("MatMul", "x", Const("W"), name="matmul")
#: x·W, x·W + b, or the flat form matmul-add-to-gemm writes on cpu: Reshape(Gemm(x, W, b))
LINEAR = Alt(
    Op(
        "Reshape",
        Op(
            "Gemm",
            "x",
            Const("W"),
            Const("b"),
            attrs={"transA": 0, "transB": 0, "alpha": 1.0, "beta": 1.0},
            name="matmul",
        ),
        "shape",
        name="reshape",
    ),
    Op("Add", _MATMUL_CONST_W, Const("b"), commute=True, name="add"),
    _MATMUL_CONST_W,
)


@register_rule
class FoldLinearScale(Rule):
    """``(x·W [+ b]) [→ Transpose] · c`` → ``x·(W·c) [+ b·c] [→ Transpose]``, c a constant per
    output column.

    ConvNeXt, CaiT and DeiT-III scale each residual branch by a learned vector γ right after the
    last linear layer ("layer scale"; torchvision's ConvNeXt applies it after permuting back to
    NCHW, so a Transpose may sit between).  The multiplication moves into the weights: one pass
    over the activations fewer per block.  W must be a 2-D constant read only here (folding a
    shared weight would copy it); the values are computed in float64 and stored behind the
    precision guards of the Conv folds.
    """

    name = "fold-linear-scale"
    root = "Mul"
    summary = "per-column constant Mul after MatMul (+ bias) → folded into W and b"
    pattern = Op(
        "Mul",
        Alt(Op("Transpose", LINEAR, name="transpose"), LINEAR),
        Const("c"),
        commute=True,
        name="mul",
    )

    def structure(self, m, cx):
        m.stash(**{k: m.get(k) for k in ("transpose", "add", "b", "reshape")})

    def check(self, m, cx):
        w = constant_value(m.W)
        out = m.mul.outputs[0]
        rank = len(out.shape) if out.shape is not None else None
        applies_only_if(w.ndim == 2 and rank is not None and rank >= 2)
        n = w.shape[1]
        dt = dtype_of(m.W)
        require(
            dt.kind == "f" and all(dtype_of(t) == dt for t in (m.c, m.b) if t is not None),
            "dtype-mismatch",
            f"the scale, bias and weights are not all one float dtype ({dt})",
        )
        axis = rank - 1
        if m.transpose is not None:
            perm = list(m.transpose.attrs.get("perm", range(rank)[::-1]))
            axis = perm.index(rank - 1)
        vec = _axis_vector(constant_value(m.c), rank, axis, n)
        require(
            vec is not None,
            "not-per-channel",
            f"the scale '{m.c.name}' of shape {list(constant_value(m.c).shape)} does not "
            f"broadcast over the {n} output columns only",
        )
        if m.reshape is not None:  # [M, N] → [..., N]: the columns stay the last axis
            target = constant_value(inputs(m.reshape)[1])
            applies_only_if(target is not None and target.size and int(target[-1]) == n)
        bias = None
        if m.b is not None:
            add_rank = len(m.add.outputs[0].shape or ()) if m.add is not None else 1
            bias = _axis_vector(constant_value(m.b), add_rank, add_rank - 1, n)
            require(
                bias is not None,
                "bias-broadcast",
                f"the bias '{m.b.name}' does not broadcast over the output columns only",
            )
        for node in (m.matmul, m.add, m.reshape, m.transpose):
            t = node.outputs[0] if node is not None else None
            require(
                t is None or len(t.outputs) == 1 and not cx.ir.is_graph_output(t),
                "shared-intermediate",
                f"'{t.name if t is not None else ''}' is also read elsewhere; the unscaled value "
                "would be lost",
            )
        require(
            len(m.W.outputs) == 1,
            "shared-weight",
            f"the weight '{m.W.name}' is read elsewhere; folding would copy it",
        )
        scale = vec.astype(np.float64)
        w_new = require_representable(w.astype(np.float64) * scale, dt, "MatMul weights")
        b_new = None
        if bias is not None:
            b_new = require_representable(bias.astype(np.float64) * scale, dt, "MatMul bias")
        require_refold_allowed(cx, dt, "MatMul weights", int(w_new.size))
        m.stash(w_new=w_new, b_new=b_new)

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        name = m.matmul.name or "MatMul"
        w = b.const(m.w_new, "W")
        # each step has the shape of the node it replaces (the dims of the heads split after
        # it are derived through them)
        if m.reshape is not None:  # Gemm(x, W·c, b·c) → the same Reshape
            steps = [("Gemm", [m.x, w, b.const(m.b_new, "b")], {}, "scaled", m.matmul)]
            steps.append(("Reshape", [inputs(m.reshape)[1]], {}, "unflat", m.reshape))
        else:  # MatMul(x, W·c) [+ b·c]
            steps = [("MatMul", [m.x, w], {}, "scaled", m.matmul)]
            if m.b_new is not None:
                steps.append(("Add", [b.const(m.b_new, "b")], {}, "scaled_bias", m.add))
        if m.transpose is not None:
            steps.append(("Transpose", [], dict(m.transpose.attrs), "permuted", m.transpose))
        y = None
        for i, (op, extra, attrs, suffix, old) in enumerate(steps):
            ins = extra if y is None else [y, *extra]
            last = i == len(steps) - 1
            shaped = like if last else old.outputs[0] if old is not None else None
            y = b.op(op, ins, attrs, like=shaped, name=f"{name}/{suffix}")
            y.dtype = like.dtype
            if y.shape is None and op in ("Gemm", "MatMul") and m.x.shape is not None:
                y.shape = [*m.x.shape[:-1], m.w_new.shape[1]]  # a product nothing inferred
        return [y]


# ------------------------------------------------------- FusedMatMul: transposes and scale
def _swaps_last_two(node) -> bool:
    perm = node.attrs.get("perm")
    n = len(perm) if perm is not None else 0
    return n >= 2 and list(perm) == [*range(n - 2), n - 1, n - 2]


def _softmax_of(mm):
    """The Softmax of the attention MatMul ``mm`` is a step of: its result reaches it through at
    most six scale/mask/reshape nodes (Swin's window regroup has five), or its left operand is
    its probabilities; else None."""
    frontier = [mm.outputs[0]]
    for _ in range(7):
        nxt = []
        for t in frontier:
            for r in t.outputs:
                if r.op == "Softmax":
                    return r
                if r.op in ("Mul", "Div", "Add", "Where", "Reshape", "FusedMatMul"):
                    nxt += r.outputs
        frontier = nxt
    a = inputs(mm)[0]
    guard = producer(a, "Where")
    return producer(inputs(guard)[2] if guard is not None else a, "Softmax")


def _attention_misses(mm, cx) -> list[str]:
    """The codes of fuse-attention's refusals (an earlier phase) at the attention of ``mm``."""
    sm = _softmax_of(mm)
    return [
        r.code
        for r in cx.misses.get("fuse-attention", ())
        if mm.name in r.nodes or (sm is not None and r.args.get("softmax") == sm.name)
    ]


def _attention_rooted(mm) -> bool:
    """Whether fuse-attention looks at the attention step ``mm`` at all (it roots at the
    merging Reshape, after this MatMul)."""
    sm = _softmax_of(mm)
    return sm is not None and _heads_merged_after(sm)


def _attention_refused(mm, cx) -> bool:
    """Whether fuse-attention refused the attention of ``mm`` because of the target."""
    return any(code in _TARGET_REFUSALS for code in _attention_misses(mm, cx))


def _heads_merged_after(sm) -> bool:
    """Whether the attention of Softmax ``sm`` ends the way fuse-attention roots it: P·V, then a
    Transpose (maybe after a Reshape).  Without one (YOLO11's attention merges heads with a
    Reshape only) that rule never looks, and the MatMuls are free to fold."""
    ts = list(sm.outputs[0].outputs)
    ts += [c for w in ts if w.op == "Where" for c in w.outputs[0].outputs]
    for pv in ts:
        if pv.op != "MatMul":
            continue
        after = list(pv.outputs[0].outputs)
        after += [c for r in after if r.op == "Reshape" for c in r.outputs[0].outputs]
        if any(n.op == "Transpose" for n in after):
            return True
    return False


def _last_two_swapped(x: str, name: str) -> Op:
    """A Transpose of ``x`` that swaps its last two axes."""
    return Op("Transpose", x, attrs=_swaps_last_two, name=name)


#: a product: MatMul or com.microsoft.FusedMatMul
PRODUCT = Alt(
    Op("MatMul", "a", "b", name="matmul"),
    Op("FusedMatMul", "a", "b", domain=MS, name="matmul"),
)


def _fused_matmul_kernel(cx, t, matmul: Node) -> None:
    """The target runs a FusedMatMul in place of ``matmul`` (whose output is ``t``)."""
    dt = dtype_of(t)
    tname = type_string(dt) if dt is not None else None
    opset = cx.ir.opset if matmul.op == "MatMul" else 1
    require(
        tname is not None
        and cx.target.runs_fused("FusedMatMul", MS, 1, tname, (matmul.op, matmul.domain, opset)),
        "no-kernel",
        f"target {cx.target.name} has no com.microsoft.FusedMatMul kernel for {tname}",
    )


@register_rule
class FuseMatMulTranspose(Rule):
    """``MatMul(Transpose(a), b)`` / ``MatMul(a, Transpose(b))`` with the Transpose swapping the
    last two axes → ``com.microsoft.FusedMatMul(a, b, transA|transB)``: the GEMM reads the
    operand transposed, no copy.  An attention's Q·Kᵀ is left to ``fuse-attention`` first.

    A transposed 2-D constant read elsewhere too (a GPT LM head ``MatMul(x, Transpose(wte))``
    on the token embedding; fold-constants refuses to copy it, ``tied-weight``) is read in
    place the same way, so the weight stays stored once; where A is 2-D too this is the
    standard ``Gemm(a, W, transB=1)``, where the target has a Gemm kernel."""

    name = "fuse-matmul-transpose"
    root = "MatMul"
    phase = "linear"
    summary = "MatMul of a last-two-axes Transpose → FusedMatMul(transA/transB) or Gemm(transB)"
    pattern = Alt(
        Op(
            "MatMul",
            _last_two_swapped("a", "t_transA"),
            _last_two_swapped("b", "t_transB"),
            name="matmul",
        ),
        Op("MatMul", _last_two_swapped("a", "t_transA"), "b", name="matmul"),
        Op("MatMul", "a", _last_two_swapped("b", "t_transB"), name="matmul"),
    )

    def structure(self, m, cx):
        for key in ("t_transA", "t_transB"):  # the transposed copy is read only here
            applies_only_if(key not in m.bindings or len(m.bindings[key].outputs[0].outputs) == 1)

    def check(self, m, cx):
        m.stash(gemm=self._gemm(m, cx))
        if not m.gemm:
            _fused_matmul_kernel(cx, m.matmul.outputs[0], m.matmul)

    @staticmethod
    def _gemm(m, cx) -> bool:
        """Whether ``A · Wᵀ`` (A 2-D, W a 2-D constant) becomes a standard Gemm(transB=1)."""
        if "t_transA" in m.bindings or "t_transB" not in m.bindings:
            return False
        a, w = inputs(m.matmul)[0], inputs(m.t_transB)[0]
        if _rank(a) != 2 or not isinstance(w, Constant) or _rank(w) != 2:
            return False
        dt = dtype_of(m.matmul.outputs[0])
        return dt is not None and cx.target.has_kernel("Gemm", "", cx.ir.opset, type_string(dt))

    def rewrite(self, m, b):
        a, c = inputs(m.matmul)
        attrs = {"alpha": 1.0}
        if "t_transA" in m.bindings:
            a, attrs["transA"] = self._operand(m.t_transA, attrs), 1
        if "t_transB" in m.bindings:
            c, attrs["transB"] = self._operand(m.t_transB, attrs), 1
        like = m.root.outputs[0]
        if m.gemm:
            return [b.op("Gemm", [a, c], attrs, like=like, name=f"{m.root.name}/gemm")]
        return [
            b.op("FusedMatMul", [a, c], attrs, domain=MS, like=like, name=f"{m.root.name}/fused")
        ]

    @staticmethod
    def _operand(transpose, attrs: dict):
        """The transposed tensor; a scalar scale right before the Transpose (YOLO11's q·s)
        moves into alpha when nothing else reads the scaled tensor."""
        t = inputs(transpose)[0]
        mul = producer(t, "Mul")
        if mul is None or len(t.outputs) != 1:
            return t
        for x, c in (inputs(mul), inputs(mul)[::-1]):
            v = constant_value(c) if isinstance(c, Constant) else None
            if (
                v is not None
                and v.size == 1
                and v.dtype.kind == "f"
                and not isinstance(x, Constant)
            ):
                attrs["alpha"] *= float(v.reshape(()))
                return x
        return t


@register_rule
class FoldMatMulScale(Rule):
    """``MatMul(a, b) · c`` or ``/ c`` with a scalar constant c → ``FusedMatMul(alpha=c)``
    (an existing FusedMatMul's alpha is multiplied): the scale is applied inside the GEMM."""

    name = "fold-matmul-scale"
    root = "Mul"
    phase = "linear"
    summary = "MatMul · scalar → FusedMatMul(alpha)"
    pattern = Op("Mul", PRODUCT, Const("c"), commute=True, name="scale")

    def check(self, m, cx):
        c = constant_value(m.c)
        applies_only_if(c is not None and c.size == 1 and c.dtype.kind == "f")
        require(
            len(m.matmul.outputs[0].outputs) == 1
            and not cx.ir.is_graph_output(m.matmul.outputs[0]),
            "shared-intermediate",
            f"the product '{m.matmul.outputs[0].name}' is also read unscaled",
        )
        _fused_matmul_kernel(cx, m.matmul.outputs[0], m.matmul)
        k = float(c.reshape(()))
        require(k != 0.0, "scale-mismatch", "the scale is zero")
        alpha = float(m.matmul.attrs.get("alpha", 1.0)) if m.matmul.op == "FusedMatMul" else 1.0
        m.stash(alpha=alpha * (1.0 / k if m.root.op == "Div" else k))

    def rewrite(self, m, b):
        attrs = dict(m.matmul.attrs) if m.matmul.op == "FusedMatMul" else {}
        attrs["alpha"] = m.alpha
        like = m.root.outputs[0]
        ins = inputs(m.matmul)
        return [b.op("FusedMatMul", ins, attrs, domain=MS, like=like, name=f"{m.root.name}/fused")]


@register_rule
class FoldMatMulDivScale(FoldMatMulScale):
    name = "fold-matmul-div-scale"
    root = "Div"
    summary = "MatMul / scalar → FusedMatMul(alpha)"
    pattern = Op("Div", PRODUCT, Const("c"), name="scale")


# ------------------------------------------- a spelling onnxruntime's CPU session dies on
@register_rule
class TransposeAfterHalfMatMul(Rule):
    """``MatMul(Transpose(x, perm), W)`` in float16, W a 2-D constant and ``perm`` keeping the
    last axis last → ``Transpose(MatMul(x, W), perm)``: the same products (a permutation of
    the batch axes commutes with the product over the last one).

    onnxruntime 1.32's CPU session at ``ORT_ENABLE_ALL`` dies (SIGSEGV, in its
    MatMul-transpose fusion and NCHWc transformer) building a session of a float16
    ``Transpose(x, (1,0,2))`` that feeds a MatMul of a constant weight; the sequence-first
    models (fairseq, Longformer) transpose back that way right before a projection, and the
    model's other nodes no longer hide it once graphopt is done.  The model.onnx a user loads
    in a bare session must not kill their program, whatever the target.  A Transpose that
    several projections read (q, k and v of one input) is moved after each of them."""

    name = "transpose-after-half-matmul"
    root = "MatMul"
    phase = "lower"
    exclusive = False  # a Transpose shared by projections (q, k, v) is moved after each
    summary = "float16 MatMul(Transpose(x), W) → Transpose(MatMul(x, W)) (onnxruntime CPU crash)"
    pattern = Op("MatMul", Op("Transpose", "x", name="transpose"), Const("w"), name="matmul")

    def structure(self, m, cx):
        perm = m.transpose.attrs.get("perm")
        applies_only_if(perm is not None and len(perm) >= 3 and int(perm[-1]) == len(perm) - 1)
        applies_only_if(dtype_of(m.matmul.outputs[0]) == np.float16)
        w = constant_value(m.w)
        applies_only_if(w is not None and w.ndim == 2)

    def rewrite(self, m, b):
        like = m.root.outputs[0]
        y = b.op("MatMul", [m.x, m.w], name=f"{m.root.name}/before_transpose")
        y.dtype = like.dtype
        return [b.op("Transpose", [y], dict(m.transpose.attrs), like=like, name=f"{m.root.name}/t")]

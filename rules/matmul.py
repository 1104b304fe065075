"""MatMul+Add → Gemm (level 2), only where Gemm is legal and safe; a Gemm flattened between two
Reshapes → MatMul+Add.

Gemm is rank-2 only: ``Y = A·B + C`` with A [M,K], B [K,N] and C unidirectionally broadcastable
to [M,N].  A rank-3 MatMul+Add (every transformer's linear layer) is left alone and the reason
is said (onnxruntime 1.32 keeps them as MatMul + Add too: its MatMulAddFusion is rank-2 only,
and a Reshape-Gemm-Reshape spelling measured no faster).  In fp16/bf16 the fusion changes where
the bias is added relative to the accumulation, so it is allowed only when the target declares
that its Gemm kernel accumulates in fp32.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.ir import constant_value, dtype_of, static_shape, type_string
from graphopt.opt.manager import register_rule
from graphopt.opt.rewrite import Op, Rule, opt, require
from graphopt.rules.attention import Dims, shape_elements


def _rank(t) -> int | None:
    return len(t.shape) if t.shape is not None else None


@register_rule
class MatMulAddToGemm(Rule):
    name = "matmul-add-to-gemm"
    root = "Add"
    summary = "rank-2 MatMul + bias Add → Gemm"
    pattern = Op("Add", Op("MatMul", "A", "B", name="matmul", out="y"), "C", commute=True)

    def check(self, m, cx):
        ra, rb = _rank(m.A), _rank(m.B)
        require(
            ra == 2 and rb == 2,
            "rank-not-2",
            f"MatMul '{m.matmul.name}' has operands of rank {ra} and {rb}; Gemm needs rank 2 "
            "(MatMul+Add stays)",
        )
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
        return [b.op("Gemm", [m.A, m.B, m.C], like=m.root.outputs[0], name=f"{m.matmul.name}/gemm")]


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
        dims = Dims()
        flat = shape_elements(m.flat, dims)
        require(
            flat in ([("int", -1), ("int", k)],),
            "reshape-not-flatten",
            f"the inner Reshape to {flat} is not [-1, {k}]",
        )
        w = constant_value(m.W)
        require(w is not None and w.ndim == 2, "non-constant-param", "the Gemm's B is not constant")
        trans_b = bool(a.get("transB", 0))
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

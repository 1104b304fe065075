"""MatMul+Add → Gemm (level 2), only where Gemm is legal and safe.

Gemm is rank-2 only: ``Y = A·B + C`` with A [M,K], B [K,N] and C unidirectionally broadcastable
to [M,N].  A rank-3 MatMul+Add (every transformer's linear layer) is left alone and the reason
is said; onnxruntime fuses those itself at session time.  In fp16/bf16 the fusion changes where
the bias is added relative to the accumulation, so it is allowed only when the target declares
that its Gemm kernel accumulates in fp32.
"""

from __future__ import annotations

from graphopt.opt.ir import dtype_of, static_shape, type_string
from graphopt.opt.manager import register_rule
from graphopt.opt.rewrite import Op, Rule, require


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
            "(MatMul+Add stays; onnxruntime fuses it at session time)",
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

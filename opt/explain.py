"""``graphopt explain``: which rules fired where, which were refused where and why, with hints.

Built from an optimization report: per rule, the attempts, fires, misses grouped by guard code
and time; every fired rewrite (nodes before → nodes created); every miss with its code, sentence
and a hint for the fix; and the rules of the pipeline that never matched anything.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .manager import PASSES
from .optimizer import Report

#: guard code → what the user can do about it
HINTS = {
    "non-constant-param": "the value is a graph input or computed at run time; if it is really a "
    "weight exported with keep_initializers_as_inputs=True, run `graphopt lint MODEL "
    "--freeze-initializers -o FROZEN.onnx` and optimize that",
    "shared-intermediate": "another node reads the intermediate result; fusing would compute it "
    "twice. Nothing to fix unless that reader is dead code",
    "rank-not-2": "Gemm is rank-2 only; a batched MatMul + bias Add stays two nodes (onnxruntime "
    "keeps them too), nothing to fix",
    "no-kernel": "the target's kernel table has no such kernel; see `graphopt targets show T`",
    "precision-overflow": "the folded values do not fit the weight dtype; keep this layer in fp32 "
    "or fix the tiny BatchNorm running_var",
    "precision-underflow": "folded values flush to zero in this dtype; keep the layer in fp32",
    "precision-loss": "storing the folded values loses more than the tolerance; keep it unfused",
    "precision-accumulation": "the fused kernel would accumulate in fp16/bf16; run in fp32 or on a "
    "target whose kernel accumulates in fp32",
    "precision-refold": "folding into fp16/bf16 weights re-rounds them; run with -O3 to allow "
    "it (parity then shows the effect), or keep the model's BatchNorm as is",
    "precision-range": "with the calibration inputs the fused kernel's accumulator may overflow; "
    "keep this layer unfused or in fp32",
    "dynamic-shape": "the shape is only known at run time; pass --shape for a static deployment",
    "fold-size-limit": "folding would store a large generated constant; raise --fold-size-limit "
    "if the bigger file is acceptable",
    "not-per-channel": "the constant broadcasts along spatial/batch axes, not per output channel: "
    "folding it into the Conv or MatMul weights would change results",
    "training-mode": "the node runs in training mode; export with model.eval()",
    "narrowing-cast": "the round trip loses values (e.g. float→int→float), so it is kept",
    "mask-used": "the Dropout mask is read; export in eval mode",
    "unrecognized-layout": "a Softmax between two MatMuls (attention) whose Q/K/V head split or "
    "head merge is spelled in a way the rule does not know; the message names the tensor",
    "unsupported-activation": "the target's fused kernel does not run this activation; it stays a "
    "separate node",
    "shape-mismatch": "the operands' shapes are not provably what the fused kernel requires "
    "(e.g. a broadcast residual); export with static shapes or pass --shape",
    "shared-weight": "another node reads the weight, so it cannot be stored transposed or scaled "
    "in place without copying it",
    "reshape-not-identity": "a Reshape in the pattern is not provably a no-op for these shapes",
    "opset-too-old": "the fused op is standard only from a newer opset; `graphopt optimize "
    "--opset N` upgrades the model first (parity still compares with the original)",
}


def explain(
    report: Report, *, rule: str | None = None, node: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The explanation as data (the JSON schema of `graphopt explain --format json`)."""
    remarks = [
        r
        for r in report.remarks
        if (rule is None or r.rule == rule)
        and (node is None or node in r.nodes)
        and (code is None or r.code == code)
    ]
    fired = [r for r in remarks if r.kind == "passed"]
    missed = [r for r in remarks if r.kind == "missed"]
    other = [r for r in remarks if r.kind in ("analysis", "failure")]
    summary = {}
    for name, st in report.rules.items():
        if rule is not None and name != rule:
            continue
        by_code = Counter(r.code for r in missed if r.rule == name)
        summary[name] = {**st, "missed_by_code": dict(sorted(by_code.items()))}
    never = sorted(
        n
        for n, st in summary.items()
        if n not in PASSES and st["attempts"] == 0 and st["fired"] == 0
    )
    return {
        "schema": "graphopt.explain/1",
        "model": report.model,
        "target": report.target,
        "level": report.level,
        "pipeline": report.pipeline,
        "rules": summary,
        "never_matched": never,
        "fired": [
            {
                "rule": r.rule,
                "nodes": list(r.nodes),
                "created": r.args.get("created", []),
                "message": r.message,
            }
            for r in fired
        ],
        "missed": [
            {
                "rule": r.rule,
                "node": r.nodes[0] if r.nodes else "",
                "nodes": list(r.nodes),
                "code": r.code,
                "message": r.message,
                "hint": HINTS.get(r.code, ""),
                "args": r.args,
            }
            for r in missed
        ],
        "notes": [r.to_dict() for r in other],
    }

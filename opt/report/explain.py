"""``graphopt explain``: which rules fired where, which were refused where and why, with hints.

Built from an optimization report: per rule, the attempts, fires, misses grouped by guard code
and time; every fired rewrite (nodes before → nodes created); every miss with its code, sentence
and a hint for the fix; and the rules of the pipeline that never matched anything.

Filters (``--rule``, ``--node``, ``--code``, ``--op``) that name nothing in the model or the run
are usage errors suggesting the nearest names; op names take the short form when unambiguous
(``FusedConv`` for ``com.microsoft.FusedConv``).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from ..errors import UsageError
from ..rewrite.manager import PASSES, RULES
from ..verify.gate import op_vocabulary, resolve_op, suggest
from .schema import Report

#: guard code → what the user can do about it
HINTS = {
    "non-constant-param": "the value is a graph input or computed at run time; if it is really a "
    "weight exported with keep_initializers_as_inputs=True, run `graphopt lint MODEL "
    "--freeze-initializers -o FROZEN.onnx` and optimize that (optimize freezes them itself "
    "where every initializer is listed, unless --keep-initializer-inputs)",
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
    "tied-weight": "the constant is read by other nodes too (tied embeddings): folding would "
    "store it twice; its reader takes it transposed in place (Gemm / FusedMatMul transB), "
    "nothing to fix",
    "reshape-not-identity": "a Reshape in the pattern is not provably a no-op for these shapes",
    "opset-too-old": "the fused op is standard only from a newer opset; `graphopt optimize "
    "--opset N` upgrades the model first (parity still compares with the original)",
}


#: guard code → the flag that can turn such misses into fusions (the "to get more" list)
LEVERS = {
    "opset-too-old": "--opset {needs}",
    "dynamic-shape": "--shape NAME=D0,D1,...",
    "shape-mismatch": "--shape NAME=D0,D1,...",
    "non-constant-param": "graphopt lint --freeze-initializers",
    "fold-size-limit": "--fold-size-limit MIB",
    "precision-refold": "-O3",
}


def group_misses(report: Report) -> list[dict[str, Any]]:
    """Missed and failed remarks grouped by (rule, code): count, one example node, the hint;
    groups the user can act on (a flag in ``LEVERS``) first, then by count."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in report.remarks:
        if r.kind not in ("missed", "failure"):
            continue
        g = groups.setdefault(
            (r.kind, r.rule, r.code),
            {
                "kind": r.kind,
                "rule": r.rule,
                "code": r.code,
                "count": 0,
                "example": r.nodes[0] if r.nodes else "",
                "message": r.message,
                "hint": HINTS.get(r.code, ""),
                "lever": _lever(r),
            },
        )
        g["count"] += 1
    return sorted(
        groups.values(),
        key=lambda g: (g["kind"] != "failure", g["lever"] is None, -g["count"], g["rule"]),
    )


def _lever(remark) -> str | None:
    text = LEVERS.get(remark.code)
    if text is None or "{needs}" not in text:
        return text
    needs = remark.args.get("needs")
    if needs is None:  # rules that say the opset in their sentence only
        m = re.search(r"--opset (\d+)", remark.message) or re.search(
            r"opset (?:≥ )?(\d+)", remark.message
        )
        needs = m.group(1) if m else None
    return text.format(needs=needs) if needs is not None else None


def levers(groups: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The flags that would let more fuse, with how many misses each addresses, most first."""
    counts: Counter[str] = Counter()
    for g in groups:
        if g["lever"] and g["kind"] == "missed":
            counts[g["lever"]] += g["count"]
    return counts.most_common()


def check_rule(rule: str | None) -> None:
    """An unknown ``--rule`` is a usage error naming the nearest rules and passes."""
    if rule is not None and rule not in RULES and rule not in PASSES:
        near = suggest(rule, [*RULES, *PASSES])
        raise UsageError(f"--rule: unknown rule or pass '{rule}'{near} (see `graphopt rules`)")


def check_filters(
    report: Report, node_ops: dict[str, str], *, node: str | None, code: str | None
) -> None:
    """``--node`` must name a node of the model (before or after) or of a remark; ``--code`` a
    guard code of this run or a documented one."""
    if node is not None:
        names = set(node_ops) | {n for r in report.remarks for n in r.nodes}
        if node not in names:
            raise UsageError(f"--node: no node '{node}' in the model{suggest(node, names)}")
    if code is not None:
        codes = {r.code for r in report.remarks if r.code} | set(HINTS)
        if code not in codes:
            raise UsageError(f"--code: unknown guard code '{code}'{suggest(code, codes)}")


def resolve_explain_op(op: str, report: Report) -> str:
    """``--op`` in full: the model's ops before and after and the standard ONNX ops."""
    return resolve_op(op, op_vocabulary(report.ops_before, report.ops_after), "--op")


def explain(
    report: Report,
    *,
    rule: str | None = None,
    node: str | None = None,
    code: str | None = None,
    op: str | None = None,
    node_ops: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The explanation as data (the JSON schema of `graphopt explain --format json`).

    ``op`` keeps the remarks whose first node has that op type (``node_ops``: node name → op,
    ``domain.op`` outside the default domain)."""
    node_ops = node_ops or {}
    remarks = [
        r
        for r in report.remarks
        if (rule is None or r.rule == rule)
        and (node is None or node in r.nodes)
        and (code is None or r.code == code)
        and (op is None or (bool(r.nodes) and node_ops.get(r.nodes[0]) == op))
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


def node_ops(*models) -> dict[str, str]:
    """Node name → op type (``domain.op`` outside the default domain) over the models' graphs,
    subgraphs included (a name in a later model wins): what ``--op`` and ``--node`` read."""
    from ..graph.domains import is_default
    from ..graph.ir import all_graphs

    return {
        n.name: n.op_type if is_default(n.domain) else f"{n.domain}.{n.op_type}"
        for model in models
        for graph in all_graphs(model.graph)
        for n in graph.node
    }

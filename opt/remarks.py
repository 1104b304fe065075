"""Optimization remarks, after LLVM: what fired (passed), what was tried and refused (missed),
facts worth knowing (analysis) and what went wrong (failure).

Only the final outcome per (rule, node) is kept: a rule that was refused at a node in one fixpoint
iteration and fired there in the next reports "passed" once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Kind = Literal["passed", "missed", "analysis", "failure"]


@dataclass(frozen=True)
class Remark:
    kind: Kind
    pass_name: str
    rule: str
    code: str
    nodes: tuple[str, ...]
    message: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pass"] = d.pop("pass_name")
        d["nodes"] = list(self.nodes)
        return d


def _stage(remark: Remark) -> int | None:
    """The stage number a staged rule's miss names (``stage`` "2 (lift)" → 2), else None."""
    head = str(remark.args.get("stage", "")).split(" ", 1)[0]
    return int(head) if head.isdigit() else None


class RemarkLog:
    """Collects remarks, keeping the last outcome per (rule, anchor node)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, str], Remark] = {}
        self._softmax_miss: dict[tuple[str, str], tuple[str, str, str]] = {}

    def add(self, remark: Remark) -> None:
        """Record ``remark`` as the outcome at its anchor; a miss that got less far through a
        staged rule's stages than the miss already there does not replace it (a later round
        retrying the node on a graph other rules have since rewritten for their own ends).  A
        miss naming a Softmax replaces the rule's miss of that Softmax at another anchor (the
        same attention, refused again after another rule rewrote its merge)."""
        anchor = remark.nodes[0] if remark.nodes else ""
        key = (remark.rule, anchor, remark.code if remark.kind in ("analysis", "failure") else "")
        softmax = remark.args.get("softmax") if remark.kind == "missed" else None
        at = key  # where the outcome this remark replaces is kept
        if key not in self._by_key and softmax:
            earlier = self._softmax_miss.get((remark.rule, softmax))
            if earlier in self._by_key and self._by_key[earlier].kind == "missed":
                at = earlier
        old = self._by_key.get(at)
        if old is not None and old.kind == remark.kind == "missed":
            if (_stage(old) or 0) > (_stage(remark) or 0) and _stage(remark) is not None:
                return
        self._by_key.pop(at, None)
        self._by_key.pop(key, None)
        self._by_key[key] = remark
        if softmax:
            self._softmax_miss[(remark.rule, softmax)] = key

    def forget_miss(self, rule: str, anchor: str) -> None:
        """Drop the miss recorded for ``rule`` at node ``anchor``: the rule did its work there
        after all (a fold refused once, done at a later iteration)."""
        key = (rule, anchor, "")
        if key in self._by_key and self._by_key[key].kind == "missed":
            del self._by_key[key]

    def __iter__(self):
        return iter(self._by_key.values())

    def final(self) -> list[Remark]:
        """The remarks, less misses that a fusion made moot: their anchor node is one whose work
        that fusion took over (its ``absorbed`` nodes: a q/k/v bias Add taken into the attention
        kernel is no longer a MatMul + Add that stays), whichever was recorded first (a rule of a
        later phase may still try the node before dce removes it)."""
        absorbed = {
            name
            for r in self._by_key.values()
            if r.kind == "passed"
            for name in r.args.get("absorbed", ())
        }
        return [
            r
            for r in self._by_key.values()
            if not (r.kind == "missed" and r.nodes and r.nodes[0] in absorbed)
        ]

    def __len__(self) -> int:
        return len(self._by_key)

    def of_kind(self, kind: Kind) -> list[Remark]:
        return [r for r in self if r.kind == kind]

    def to_jsonl(self) -> str:
        return "".join(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in self)

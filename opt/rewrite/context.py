"""The state a pass runs with (:class:`PassContext`: the target, remarks, rule statistics,
refusals later phases read) and the records the pass manager keeps of what ran."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from ..graph.ir import ModelIR
from ..remarks import Remark, RemarkLog
from .target import Target


@dataclass
class RuleStats:
    attempts: int = 0
    fired: int = 0
    missed: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Miss:
    """A rule's refusal at a node, as later phases read it: the guard's code, the matched
    nodes (the root first) and the guard's arguments."""

    rule: str
    code: str
    nodes: tuple[str, ...]
    args: dict[str, Any]


@dataclass
class PhaseRun:
    """What a rule-set phase did on a graph it left unchanged: the remarks it added (in order),
    the refusals it recorded and its attempts and misses per rule; ``mutations``, ``shapes``
    (the graph's last shape inference, held) and ``misses`` (other rules' refusals when it
    ended) say on which graph and after what."""

    mutations: int
    shapes: Any
    misses: dict[str, int]
    remarks: list[Remark]
    refusals: dict[str, list[Miss]]
    counts: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    changed: bool
    iteration: int = 0


@dataclass(eq=False)
class Original:
    """The model as the user gave it, beside the IR being optimized, and what passes learned
    of it (``memo``: keyed by the pass that computed it), once per ``optimize`` call however
    often the pipeline runs (the safety nets run it again).  legalize compares the output's
    fallback nodes with the original's."""

    model: onnx.ModelProto
    memo: dict[Any, Any] = field(default_factory=dict)


@dataclass
class PassContext:
    """Everything a pass may read or record besides the IR itself."""

    target: Target
    level: int
    ir: ModelIR | None = None
    #: max |value| of each tensor of the original model on calibration inputs (``--inputs``)
    ranges: dict[str, float] | None = None
    #: (rule, node) rewrites not to apply: reverted by a safety net (invalid output, broken
    #: parity, slower on the target)
    skip: frozenset[tuple[str, str]] = frozenset()
    #: per rule, the nodes of each match that ``skip`` (or the bisect limit) withheld
    withheld: dict[str, list[list]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: the input model (None when passes run on an IR alone)
    original: Original | None = None
    remarks: RemarkLog = field(default_factory=RemarkLog)
    bisect_limit: int | None = None
    verify_each: bool = False
    rewrites: int = 0
    applied: list[tuple[int, str, str]] = field(default_factory=list)
    records: list[PassRecord] = field(default_factory=list)
    stats: dict[str, RuleStats] = field(default_factory=dict)
    #: every refusal so far, per rule, for rules of later phases that depend on the outcome
    misses: dict[str, list[Miss]] = field(default_factory=dict)
    #: per (graph, pass text): ``ir.mutations`` when the pass last ran there and changed nothing
    settled: dict[tuple[int, str], int] = field(default_factory=dict)
    #: the IR ``settled`` speaks of (held, so that its graphs' ids stay theirs)
    settled_ir: ModelIR | None = None
    #: per (graph, phase's rule names): what the phase did when it last left that graph unchanged
    phases: dict[tuple[int, tuple[str, ...]], PhaseRun] = field(default_factory=dict)

    def is_settled(self, p: Pass, ir: ModelIR) -> bool:
        """Whether ``p`` already ran on this very graph (no pass changed it since) and changed
        nothing: running it again would change nothing either."""
        if self.settled_ir is not ir:
            return False
        return self.settled.get((id(ir.graph), p.text())) == ir.mutations

    def mark_settled(self, p: Pass, ir: ModelIR, changed: bool) -> None:
        if self.settled_ir is not ir:
            self.settled_ir, self.settled, self.phases = ir, {}, {}
        key = (id(ir.graph), p.text())
        if changed:
            self.settled.pop(key, None)
        else:
            self.settled[key] = ir.mutations

    def record_miss(self, rule: str, code: str, nodes: Sequence[str], args: dict) -> None:
        self.misses.setdefault(rule, []).append(Miss(rule, code, tuple(nodes), dict(args)))

    def rule_stats(self, rule: str) -> RuleStats:
        stats = self.stats.get(rule)
        if stats is None:
            stats = self.stats[rule] = RuleStats()
        return stats

    def take_bisect_step(self, rule: str, node: str) -> bool:
        """Count one rewrite; False when past the bisect limit or reverted (``skip``)."""
        if (rule, node) in self.skip:
            return False
        self.rewrites += 1
        if self.bisect_limit is not None and self.rewrites > self.bisect_limit:
            return False
        self.applied.append((self.rewrites, rule, node))
        return True

    def remark(
        self,
        kind: str,
        pass_name: str,
        rule: str,
        code: str,
        nodes: Sequence[str],
        message: str,
        **args: Any,
    ) -> None:
        self.remarks.add(Remark(kind, pass_name, rule, code, tuple(nodes), message, args))


class Pass:
    """Base of whole-graph passes. Subclasses set ``name`` and implement ``run``."""

    name: str = ""
    summary: str = ""
    level: int = 1
    #: run inside subgraph bodies too (whole-model passes such as legalize set this False)
    recurse: bool = True

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        raise NotImplementedError

    def text(self) -> str:
        return self.name

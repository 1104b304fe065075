"""The pass manager: runs a pipeline of passes and rule sets over a :class:`ModelIR`.

* A pass is ``run(ir, cx) -> bool`` (changed). Rules are grouped into rule-set passes driven by
  :func:`opt.rewrite.apply_rules`, one phase after the other (:data:`opt.rewrite.PHASES`: a
  rule's ``phase``, by default ``cleanup`` at level 1 and ``fuse`` above).  A rule that depends
  on an earlier phase's outcome reads its typed refusals (``PassContext.misses``), never the
  remark log.
* ``fixpoint(...)`` repeats its children until nothing changes, up to ``max-iterations``; when the
  cap is hit a *failure* remark ("did-not-converge") is recorded, naming the passes still changing.
  A pass is not run again on the graph it last left unchanged (``ir.mutations`` counts the passes
  that changed it): a confirming round runs only the passes a later change may have given work.
* A rule-set phase that left the main graph unchanged is not run again on that same graph with
  the same rules (e.g. the cleanup phase of ``rules{level=2}`` right after ``rules{level=1}``
  settled): what it did -- its remarks (under the new pass's name), refusals and attempt counts
  -- is replayed instead, so the report is the one a run would give.
* ``verify_each`` exports the model after every pass and runs onnx.checker and shape inference on
  it; the first pass that breaks the model is named.
* ``bisect_limit`` (as LLVM's opt-bisect): only the first N rewrites are applied; every later one
  is skipped, so a binary search on N finds the first rewrite that breaks parity.
* Time is recorded per pass and per rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import onnx

from ..environment import env_number
from ..errors import GraphoptError, UsageError
from ..graph.domains import is_default
from ..graph.ir import ModelIR, subgraphs
from ..registry import Registry
from .context import Pass, PassContext, PassRecord, PhaseRun
from .engine import PHASES, Rule, apply_rules


class RuleSetPass(Pass):
    """Applies rules with the greedy driver: the named ones, or every rule up to ``max_level``,
    one phase after the other (:data:`opt.rewrite.PHASES`), each phase to its own fixpoint."""

    name = "rules"

    def __init__(self, rules: Sequence[Rule] | None = None, max_level: int | None = None):
        self.rules = list(rules) if rules is not None else None
        self.max_level = max_level

    def selected(self, cx: PassContext) -> list[Rule]:
        if self.rules is not None:
            chosen = self.rules
        else:
            level = cx.level if self.max_level is None else self.max_level
            chosen = [r for r in RULES.values() if r.level <= level]
        return [r for r in chosen if cx.target.allows_rule(r.name)]

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        chosen = self.selected(cx)
        changed = False
        for phase in PHASES:
            rules = [r for r in chosen if r.rule_phase() == phase]
            if not rules:
                continue
            if changed or ir.in_subgraph or cx.bisect_limit is not None:
                changed |= apply_rules(ir, rules, cx, self.text())
            else:  # the graph is still the one this pass was given
                changed = _run_phase(ir, rules, cx, self.text())
        return changed

    def text(self) -> str:
        if self.rules is not None:
            return ",".join(r.name for r in self.rules)
        return "rules" if self.max_level is None else f"rules{{level={self.max_level}}}"


def _run_phase(ir: ModelIR, rules: list[Rule], cx: PassContext, pass_name: str) -> bool:
    """Apply one phase's rules to the main graph, unchanged so far in this pass: replayed when
    the same rules last left this very graph unchanged, its shapes inferred no later, and no
    other rule has refused anything since (a rule reads the graph and earlier phases' refusals,
    nothing else), else run and, when they change nothing, recorded for a replay."""
    names = tuple(sorted(r.name for r in rules))
    key = (id(ir.graph), names)
    last = cx.phases.get(key) if cx.settled_ir is ir else None
    if (
        last is not None
        and last.mutations == ir.mutations
        and last.shapes is ir.inferred.get(key[0])
        and last.misses == _others(cx, names)
    ):
        _replay(last, cx, pass_name)
        return False
    before = list(cx.remarks)
    own = {name: len(cx.misses.get(name, ())) for name in names}
    counts = {name: _counts(cx, name) for name in names}
    if apply_rules(ir, rules, cx, pass_name):
        return True
    if cx.settled_ir is not ir:
        cx.settled_ir, cx.settled, cx.phases = ir, {}, {}
    held = {id(r) for r in before}
    cx.phases[key] = PhaseRun(
        ir.mutations,
        ir.inferred.get(key[0]),
        _others(cx, names),
        [r for r in cx.remarks if id(r) not in held],
        {name: cx.misses[name][n:] for name, n in own.items() if len(cx.misses.get(name, ())) > n},
        {name: _delta(_counts(cx, name), was) for name, was in counts.items()},
    )
    return False


def _others(cx: PassContext, names: tuple[str, ...]) -> dict[str, int]:
    """How many refusals each rule outside ``names`` has recorded."""
    return {r: len(m) for r, m in cx.misses.items() if r not in names and m}


def _counts(cx: PassContext, rule: str) -> tuple[int, int]:
    stats = cx.rule_stats(rule)
    return stats.attempts, stats.missed


def _delta(now: tuple[int, int], was: tuple[int, int]) -> tuple[int, int]:
    return now[0] - was[0], now[1] - was[1]


def _replay(run: PhaseRun, cx: PassContext, pass_name: str) -> None:
    """What running the phase again would do: the same remarks (under ``pass_name``) and
    refusals in the same order, the same attempts and misses counted."""
    cx.ir = cx.settled_ir
    for r in run.remarks:
        cx.remarks.add(r if r.pass_name == pass_name else replace(r, pass_name=pass_name))
    for rule, refusals in run.refusals.items():
        cx.misses.setdefault(rule, []).extend(refusals)
    for rule, (attempts, missed) in run.counts.items():
        stats = cx.rule_stats(rule)
        stats.attempts += attempts
        stats.missed += missed


class Fixpoint(Pass):
    """Repeat children until none reports a change, at most ``max_iterations`` times.  A child
    that already ran on the current graph and changed nothing (no pass changed the graph since:
    the pass before it in the last round, or the same pass at the end of an earlier fixpoint)
    is not run again: it would change nothing.  It has no pass record for that round and its
    rules count no attempts there."""

    name = "fixpoint"

    def __init__(self, children: Sequence[Pass], max_iterations: int = 10):
        self.children = list(children)
        self.max_iterations = max_iterations

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        any_change = False
        for iteration in range(1, self.max_iterations + 1):
            changed_now = [
                c.text()
                for c in self.children
                if not cx.is_settled(c, ir) and run_pass(c, ir, cx, iteration)
            ]
            if not changed_now:
                return any_change
            any_change = True
        cx.remark(
            "failure",
            "fixpoint",
            "fixpoint",
            "did-not-converge",
            [],
            f"pipeline still changing after {self.max_iterations} iterations "
            f"(last changes by: {', '.join(changed_now)})",
            max_iterations=self.max_iterations,
            still_changing=changed_now,
        )
        return any_change

    def text(self) -> str:
        inner = ",".join(c.text() for c in self.children)
        return f"fixpoint({inner}){{max-iterations={self.max_iterations}}}"


def run_pass(p: Pass, ir: ModelIR, cx: PassContext, iteration: int = 0) -> bool:
    """Run one pass with timing and optional verification; local passes also run inside
    If/Loop/Scan bodies (outer-scope values are shared objects, so they resolve naturally)."""
    t0 = time.perf_counter()
    _within_budget(p)
    changed = bool(p.run(ir, cx))
    if p.recurse and not isinstance(p, Fixpoint):
        changed |= _run_in_subgraphs(p, ir, cx)
    if not isinstance(p, Fixpoint):  # a fixpoint's changes are its children's, counted there
        if changed:
            ir.mutations += 1
        cx.mark_settled(p, ir, changed)
    if not isinstance(p, Fixpoint):
        cx.records.append(PassRecord(p.text(), time.perf_counter() - t0, changed, iteration))
    if cx.verify_each and changed and not isinstance(p, Fixpoint):
        verify(ir, p.text())
    return changed


#: when this process started its optimization budget (``GRAPHOPT_TIME_BUDGET``, seconds)
_STARTED = time.monotonic()


def _within_budget(p: Pass) -> None:
    """GraphoptError (exit 1) naming the pass about to run when the process has run past
    ``GRAPHOPT_TIME_BUDGET`` seconds (unset: no budget)."""
    budget = env_number("GRAPHOPT_TIME_BUDGET", None)
    if budget is not None and time.monotonic() - _STARTED > budget:
        raise GraphoptError(
            f"the optimization ran past its time budget of {budget:g} s "
            f"(GRAPHOPT_TIME_BUDGET) before {p.text()}; nothing was written"
        )


def _run_in_subgraphs(p: Pass, ir: ModelIR, cx: PassContext) -> bool:
    changed = False
    for node in list(ir.graph.nodes):
        if not node.attrs:  # bodies are attributes: most nodes have none to look through
            continue
        for sub in subgraphs(node):
            with ir.scoped(sub):
                changed |= bool(p.run(ir, cx))
                changed |= _run_in_subgraphs(p, ir, cx)
    return changed


def verify(ir: ModelIR, after: str) -> None:
    """onnx.checker + strict shape inference on the current graph."""
    model = ir.to_onnx()
    try:
        onnx.checker.check_model(model)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        first = str(e).strip().splitlines()[0]
        raise GraphoptError(f"verify-each: model invalid after pass '{after}': {first}") from None


# ----------------------------------------------------------------------- registries
PASSES: dict[str, type[Pass]] = Registry()
RULES: dict[str, Rule] = Registry()
#: checks of the finished graph, run once after the pipeline (``FINAL_CHECKS[rule]``: only when
#: that rule ran): they file the remarks a rule owes for what it never looked at
FINAL_CHECKS: dict[str, Callable[[ModelIR, PassContext], None]] = {}


def run_final_checks(ir: ModelIR, cx: PassContext) -> None:
    """The :data:`FINAL_CHECKS` of the rules this optimization ran."""
    for rule, check in sorted(FINAL_CHECKS.items()):
        if rule in cx.stats:
            check(ir, cx)


def register_pass(cls: type[Pass]) -> type[Pass]:
    if cls.name in PASSES or cls.name in RULES:
        raise ValueError(f"duplicate pass name {cls.name}")
    PASSES[cls.name] = cls
    return cls


def register_rule(cls: type[Rule]) -> type[Rule]:
    """Class decorator: validate the rule's root ops against onnx.defs and its phase, and
    register it."""
    if cls.name in RULES or cls.name in PASSES:
        raise ValueError(f"duplicate rule name {cls.name}")
    for op in cls.roots:
        if is_default(cls.domain) and not onnx.defs.has(op):
            raise ValueError(f"rule {cls.name}: root '{op}' is not an ONNX operator")
    if cls.phase and cls.phase not in PHASES:
        raise ValueError(f"rule {cls.name}: phase '{cls.phase}' is not one of {PHASES}")
    RULES[cls.name] = cls()
    return cls


def lookup_rule(name: str) -> Rule:
    if name not in RULES:
        raise UsageError(f"unknown rule or pass '{name}' in pipeline")
    return RULES[name]

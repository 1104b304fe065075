"""Rules and the driver that applies them.

A rule is three things: a *pattern* (:mod:`opt.patterns`: ops or op alternatives, commuted
inputs, constant and attribute leaves, optional inputs, alternatives) rooted at one or more op
types, read-only *guards* that check the operator contract (constants, dtypes, shapes,
attributes) and fail with a stable kebab-case code plus a sentence, and a pure *rewrite* that
builds the replacement.

* Structure that does not match is silent (the rule simply does not apply there).
* A pattern may match one node several ways (commuted operands, alternatives): each candidate
  goes through ``structure``, exclusivity, the quantization barrier and ``check`` in pattern
  order, and the first that passes fires.  When every candidate fails a guard, the *missed*
  remark is the first candidate's failure: the user sees which clause of the contract failed at
  which node.  So is a non-structural :class:`NoMatch` raised by a rule's own ``match`` once it
  has recognized the pattern's core (attention's Softmax between two MatMuls) but not the
  exporter's spelling around it.
* Only :class:`NoMatch` is caught; any other exception is a bug and surfaces.
* Quantization is a barrier (:mod:`opt.quant`): unless a rule is ``quantization_aware``, a match
  holding a Q/DQ/QOperator node, or a Conv/MatMul/Gemm reading a DequantizeLinear output, is
  refused, and so is a DQ output where a rule requires a constant (code ``quantized-boundary``).

The driver is a greedy work queue over nodes in topological order, with rules indexed by root op
type and ordered by ``priority`` (then name).  A rule is tried at a node only when its pattern
may fit there (:func:`opt.patterns.feasible`: op types, domains and input counts along the
pattern, constant leaves), so a mismatch costs no candidate.  After a rewrite, the new nodes and
the readers of their outputs are queued again.  Rules that depend on another rule's outcome do
not wait for it here: rule sets run in :data:`PHASES` (:class:`opt.manager.RuleSetPass`), so
the later rule runs once the earlier phase is done and reads its typed outcomes
(``PassContext.misses``).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph import dims
from ..graph.ir import Constant, ModelIR, Node, Tensor, Variable, constant_value
from ..graph.quant import boundary_violation, dequantized_by
from ..remarks import Remark
from .patterns import Alt, Const, Op, Pattern, Var, feasibility, opt, root_domain
from .patterns import match as match_pattern
from .patterns import roots as pattern_roots

if TYPE_CHECKING:
    from .context import PassContext


class NoMatch(Exception):
    """A guard failed: ``code`` is stable kebab-case, ``message`` a sentence for humans."""

    def __init__(self, code: str, message: str, *, structural: bool = False, **args: Any):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.structural = structural
        self.args_ = args


def require(cond: Any, code: str, message: str | Callable[[], str], **args: Any) -> None:
    """Guard: raise NoMatch(code, message) unless ``cond`` holds."""
    if not cond:
        raise NoMatch(code, message() if callable(message) else message, **args)


def applies_only_if(cond: Any) -> None:
    """A structural condition checked in code: failing it is silent, not a missed remark."""
    if not cond:
        raise NoMatch("structure", "condition not met", structural=True)


# ------------------------------------------------------------------------------ match
class Match:
    """Bindings of one successful structural match; rules may ``stash`` computed values."""

    def __init__(self, root: Node, bindings: dict[str, Any]):
        self.root = root
        self.bindings = dict(bindings)
        self._nodes: list[Node] | None = None  # the bound nodes, until a stash

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["bindings"][name]
        except KeyError:
            raise AttributeError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        """A binding that only some alternatives of the pattern make, else ``default``."""
        return self.bindings.get(name, default)

    def stash(self, **values: Any) -> None:
        self.bindings.update(values)
        self._nodes = None

    def nodes(self) -> list[Node]:
        """The bound nodes, in binding order (a new list each call)."""
        if self._nodes is None:
            self._nodes = [v for v in self.bindings.values() if isinstance(v, gs.Node)]
        return list(self._nodes)


# ------------------------------------------------------------------------------- rules
#: structural candidates tried per rule and node at most (commuted orders, alternatives)
MAX_CANDIDATES = 64


class Rule:
    """Subclass and set ``name``, ``level``, ``summary`` and ``pattern`` (``root`` and ``domain``
    default to the pattern's root op types and domain).

    ``structure`` holds structural conditions checked in code (``applies_only_if``), ``check``
    the guards (``require``) and may stash values; ``rewrite`` returns the tensors that replace
    the root node's outputs, built with the :class:`Builder`.  ``phase`` orders rule sets (see
    :data:`PHASES`); ``priority`` orders rules of one phase rooted at the same op (higher first,
    then by name).
    """

    name: ClassVar[str]
    root: ClassVar[str]
    #: every op type the rule is rooted at (derived from the pattern unless ``root`` is set)
    roots: ClassVar[tuple[str, ...]] = ()
    domain: ClassVar[str] = ""
    level: ClassVar[int] = 2
    phase: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = ""
    pattern: ClassVar[Pattern | None] = None
    #: intermediate (non-root) matched nodes must feed only the match; else "shared-intermediate"
    exclusive: ClassVar[bool] = True
    #: set True for rules that may change numerics beyond rounding (allowed at -O3 only)
    changes_numerics: ClassVar[bool] = False
    #: set True for rules written for Q/DQ nodes (else a match touching one is refused)
    quantization_aware: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "root" in own:
            cls.roots = (cls.root,)
        elif "pattern" in own and cls.pattern is not None:
            cls.roots = pattern_roots(cls.pattern)
            cls.root = cls.roots[0]
            if "domain" not in own:
                cls.domain = root_domain(cls.pattern)

    def rule_phase(self) -> str:
        return self.phase or default_phase(self.level)

    def candidates(self, node: Node, cx: PassContext) -> Iterator[Match]:
        """The structural matches at ``node`` that pass ``structure``, in pattern order (each
        binding once, at most :data:`MAX_CANDIDATES`); a rule with its own ``match`` has one."""
        if type(self).match is not Rule.match:
            yield self.match(node, cx)
            return
        found = [{}] if self.pattern is None else match_pattern(self.pattern, node)
        # the bindings seen, each once; built from the second on (most nodes have one)
        first: dict | None = None
        seen: set[frozenset] | None = None
        for bindings in islice(found, MAX_CANDIDATES):
            if first is None:
                first = bindings
            else:
                if seen is None:
                    seen = {_binding_key(first)}
                key = _binding_key(bindings)
                if key in seen:
                    continue
                seen.add(key)
            m = Match(node, bindings)
            try:
                self.structure(m, cx)
            except NoMatch:
                continue
            yield m

    def match(self, node: Node, cx: PassContext) -> Match:
        """The first candidate (rules with an own matcher override this)."""
        for m in self.candidates(node, cx):
            return m
        raise NoMatch("structure", "pattern did not match", structural=True)

    def structure(self, m: Match, cx: PassContext) -> None:
        """Structural conditions checked in code (``applies_only_if``): silent when unmet."""

    def check(self, m: Match, cx: PassContext) -> None:
        """Guards; raise NoMatch via ``require``."""

    def rewrite(self, m: Match, b: Builder) -> Sequence[Tensor | None]:
        raise NotImplementedError


def _binding_key(bindings: dict) -> frozenset:
    """What tells two bindings apart: the objects bound under each name."""
    return frozenset([(k, id(v)) for k, v in bindings.items()])


#: rule-set phases, in the order ``rules`` runs them: cleanups, local fusions (norms,
#: activations, Conv), attention, the linear-layer rules that would otherwise take attention's
#: MatMuls, target lowering
PHASES = ("cleanup", "fuse", "attention", "linear", "lower")


def default_phase(level: int) -> str:
    return "cleanup" if level <= 1 else "fuse"


def check_exclusive(m: Match, ir: ModelIR) -> None:
    """Intermediate nodes of a match may not feed anything outside it."""
    inside = {id(n) for n in m.nodes()}
    for node in m.nodes():
        if node is m.root:
            continue
        for out in node.outputs:
            require(
                not ir.is_graph_output(out),
                "shared-intermediate",
                f"'{out.name}' is a graph output, so node '{node.name}' must stay",
            )
            outside = [c.name for c in out.outputs if id(c) not in inside]
            require(
                not outside,
                "shared-intermediate",
                f"'{out.name}' also feeds {', '.join(outside[:3])}; fusing would duplicate work",
            )


# ----------------------------------------------------------------------------- builder
@dataclass
class Builder:
    """Creates nodes and constants for one rewrite, named uniquely and tagged with the rule."""

    ir: ModelIR
    rule: str
    anchor: str
    created: list[Node] = field(default_factory=list)

    def op(
        self,
        op_type: str,
        inputs: Sequence[Tensor | None],
        attrs: dict | None = None,
        *,
        domain: str = "",
        outputs: int = 1,
        like: Tensor | None = None,
        name: str | None = None,
    ) -> Tensor | list[Tensor]:
        node_name = self.ir.fresh_name(name or f"{self.anchor}/{op_type}")
        outs = []
        for i in range(outputs):
            t = Variable(
                self.ir.fresh_name(f"{node_name}_out{i}" if outputs > 1 else f"{node_name}_out")
            )
            if like is not None and i == 0:
                t.dtype, t.shape = like.dtype, like.shape
            outs.append(t)
        ins = [t if t is not None else Variable.empty() for t in inputs]
        node = gs.Node(
            op_type,
            name=node_name,
            attrs=dict(attrs or {}),
            inputs=ins,
            outputs=outs,
            domain=domain or None,
        )
        self.ir.graph.nodes.append(node)
        self.ir.provenance[node_name] = self.rule
        self.created.append(node)
        return outs[0] if outputs == 1 else outs

    def const(self, value: np.ndarray, base: str = "const", *, shared: bool = False) -> Constant:
        """A new constant; ``shared``: the constant an earlier rewrite made with the same
        dtype, shape and bytes, if any (:meth:`ModelIR.shared_constant`; named ``base``)."""
        if shared:
            return self.ir.shared_constant(value, base)
        name = self.ir.fresh_name(f"{self.anchor}/{base}")
        return Constant(name, np.asarray(value, order="C"))


# ------------------------------------------------------------------------------ driver
#: a rule's compiled pattern prefilter (:func:`opt.patterns.feasibility`)
Prefilter = Callable[[Node], bool]


def apply_rules(ir: ModelIR, rules: Sequence[Rule], cx: PassContext, pass_name: str) -> bool:
    """Apply ``rules`` greedily until none fires; return whether anything changed.  Rules rooted
    at the same op are tried by ``priority`` (higher first), then by name."""
    cx.ir = ir
    index: dict[str, list[tuple[Rule, Prefilter | None]]] = {}
    for r in sorted(rules, key=lambda r: (-r.priority, r.name)):
        # a rule with its own matcher is always tried; a pattern is checked first (feasible)
        fits = type(r).match is Rule.match and r.pattern is not None
        prefilter = feasibility(r.pattern) if fits else None
        for op in r.roots:
            index.setdefault(op, []).append((r, prefilter))
        cx.rule_stats(r.name)  # every rule of the set appears in the report, matched or not
    ir.toposort()
    queue = deque(n for n in ir.graph.nodes if n.op in index)
    queued = {id(n) for n in queue}
    budget = 4 * len(queue) + 100  # rewrites; more means rules undo each other
    try:
        with dims.sharing():  # the rules' dim questions, answered once per graph state
            return _drain(ir, queue, queued, index, cx, pass_name, budget)
    finally:
        ir.graph.nodes = [n for n in ir.graph.nodes if n.outputs]  # drop rewritten-away nodes


def _drain(
    ir: ModelIR,
    queue: deque,
    queued: set,
    index: dict[str, list[tuple[Rule, Prefilter | None]]],
    cx: PassContext,
    pass_name: str,
    budget: int,
) -> bool:
    changed = False
    # A value's readers include nodes of nested If/Loop/Scan bodies (outer-scope values are shared
    # objects): only nodes of the graph being worked on may be queued, or a rule would rewrite a
    # body node under the wrong scope (and, e.g., drop the producer of a branch output).
    members = {id(n) for n in ir.graph.nodes}
    while queue:
        node = queue.popleft()
        queued.discard(id(node))
        if not node.outputs:  # removed by an earlier rewrite
            continue
        for rule, fits in index.get(node.op, ()):
            if fits is not None and not fits(node):
                continue  # no candidate: nothing to count or say
            new_nodes = _try_rule(ir, rule, node, cx, pass_name)
            if new_nodes is None:
                continue
            changed = True
            budget -= 1
            if budget < 0:
                cx.remarks.add(
                    Remark(
                        "failure",
                        pass_name,
                        rule.name,
                        "did-not-converge",
                        (node.name,),
                        "rules keep rewriting the same nodes (two rules undo each other?); stopped",
                        {"rule": rule.name},
                    )
                )
                return True
            members.update(id(n) for n in new_nodes)
            readers = [c for n in new_nodes for t in n.outputs for c in t.outputs]
            _enqueue([c for c in readers if id(c) in members] + new_nodes, queue, queued, index)
            break
    return changed


def _enqueue(nodes: list[Node], queue: deque, queued: set, index: dict) -> None:
    """Queue the nodes some rule roots at, each once."""
    for n in nodes:
        if n.op in index and id(n) not in queued:
            queue.append(n)
            queued.add(id(n))


def _try_rule(
    ir: ModelIR, rule: Rule, node: Node, cx: PassContext, pass_name: str
) -> list[Node] | None:
    t0 = time.perf_counter()
    stats = cx.rule_stats(rule.name)
    try:
        m = _first_passing(ir, rule, node, cx, pass_name)
        if m is None:
            return None
        if not cx.take_bisect_step(rule.name, node.name):
            cx.withheld.setdefault(rule.name, []).append(m.nodes())
            return None
        with dims.unshared():  # the graph changes as the rewrite is built
            applied = _apply(ir, rule, m, cx, pass_name)
        dims.changed()
        return applied
    finally:
        stats.seconds += time.perf_counter() - t0


def _first_passing(
    ir: ModelIR, rule: Rule, node: Node, cx: PassContext, pass_name: str
) -> Match | None:
    """The first candidate that passes exclusivity, the quantization barrier and ``check``;
    when every candidate fails a guard, the first failure is the missed remark."""
    stats = cx.rule_stats(rule.name)
    first: tuple[Match, NoMatch] | None = None
    candidates = rule.candidates(node, cx)
    while True:
        try:
            m = next(candidates, None)
        except NoMatch as e:  # an own matcher recognized the core, then an unknown spelling
            if not e.structural:
                _missed(cx, pass_name, rule, e, (node.name,))
            return None
        if m is None:
            break
        if first is None:
            stats.attempts += 1
        try:
            _guards(ir, rule, m, cx)
            return m
        except NoMatch as e:
            if first is None and not e.structural:
                first = (m, e)
    if first is not None:
        _missed(cx, pass_name, rule, first[1], _names(first[0], node))
    return None


def _guards(ir: ModelIR, rule: Rule, m: Match, cx: PassContext) -> None:
    if rule.exclusive:
        check_exclusive(m, ir)
    if not rule.quantization_aware:
        crossing = boundary_violation(m.nodes())
        require(crossing is None, "quantized-boundary", lambda: str(crossing))
    try:
        rule.check(m, cx)
    except RecursionError:  # an analysis followed a chain deeper than the interpreter allows
        raise NoMatch(
            "analysis-too-deep",
            f"proving this rewrite safe follows a chain of more than {sys.getrecursionlimit()} "
            "calls; it is left as it is",
        ) from None


def _missed(cx: PassContext, pass_name: str, rule: Rule, e: NoMatch, nodes: tuple) -> None:
    cx.rule_stats(rule.name).missed += 1
    cx.record_miss(rule.name, e.code, nodes, e.args_)
    cx.remarks.add(Remark("missed", pass_name, rule.name, e.code, nodes, e.message, e.args_))


def _apply(ir: ModelIR, rule: Rule, m: Match, cx: PassContext, pass_name: str) -> list[Node]:
    """Rewrite the match: replace the root's outputs, drop the matched nodes left dead."""
    node = m.root
    b = Builder(ir, rule.name, _anchor(node))
    replacements = list(rule.rewrite(m, b))
    if len(replacements) != len(node.outputs):
        raise RuntimeError(
            f"rule {rule.name} returned {len(replacements)} values for "
            f"{len(node.outputs)} outputs of {node.name}"
        )
    matched = m.nodes()
    for old, new in zip(list(node.outputs), replacements):
        if new is not None and new is not old:
            ir.replace_all_uses(old, new)
    removed = True
    while removed:  # a matched node may die only once its matched consumer is gone
        removed = False
        for n in matched:
            if n.outputs and (
                n is node or all(not t.outputs and not ir.is_graph_output(t) for t in n.outputs)
            ):
                ir.remove_node(n)
                removed = True
    cx.rule_stats(rule.name).fired += 1
    cx.remarks.add(
        Remark(
            "passed",
            pass_name,
            rule.name,
            "fired",
            _names(m, node),
            f"{rule.summary or rule.name} at '{node.name}'",
            {"created": [n.name for n in b.created]}
            | ({"absorbed": list(m.absorbed)} if "absorbed" in m.bindings else {}),
        )
    )
    return b.created


def _anchor(node: Node) -> str:
    """Base for names of nodes a rewrite creates: the rewritten node's name, kept short."""
    name = node.name or node.op
    return name if len(name) <= 96 else name[:48] + "~" + name[-47:]


def _names(m: Match | None, root: Node) -> tuple[str, ...]:
    names = [root.name]
    if m is not None:
        names += [n.name for n in m.nodes() if n is not root]
    return tuple(names)


# -------------------------------------------------------------------- guard helpers
def require_forwardable(ir: ModelIR, out: Tensor, src: Tensor) -> None:
    """Replacing graph output ``out`` by ``src`` needs ``src`` to be a node's private result."""
    if not ir.is_graph_output(out):
        return
    if not ir.can_rename(src):
        raise NoMatch(
            "graph-output-alias",
            f"graph output '{out.name}' would alias "
            f"'{src.name}'; the node stays to keep the output name",
            structural=True,
        )


def require_constant(cx: PassContext, ir: ModelIR, *named: tuple[str, Tensor | None]) -> None:
    """Each (role, tensor) must be known at optimization time; name the culprit if not."""
    for role, tensor in named:
        if tensor is None:
            continue
        if isinstance(tensor, Constant):
            continue
        dq = dequantized_by(tensor)
        if dq is not None:
            raise NoMatch(
                "quantized-boundary",
                f"{role} '{tensor.name}' is dequantized by '{dq.name}' at run time; quantized "
                "weights stay quantized",
                tensor=tensor.name,
            )
        if ir.is_graph_input(tensor):
            hint = (
                " (an initializer listed as a graph input, e.g. exported with "
                "keep_initializers_as_inputs=True: it can be overridden at run time)"
                if tensor.name in ir.input_defaults
                else ""
            )
            raise NoMatch(
                "non-constant-param",
                f"{role} comes from graph input '{tensor.name}', not a constant{hint}",
                tensor=tensor.name,
            )
        raise NoMatch(
            "non-constant-param",
            f"{role} '{tensor.name}' is computed at run time, not a constant",
            tensor=tensor.name,
        )


def value(t: Tensor) -> np.ndarray:
    v = constant_value(t)
    assert v is not None, f"{t.name} is not constant"
    return v


def onnx_dtype_name(dtype: Any) -> str:
    try:
        return onnx.helper.tensor_dtype_to_string(
            onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        )
    except Exception:  # noqa: BLE001 - a name for a message only
        return str(dtype)


__all__ = [
    "PHASES",
    "Alt",
    "Builder",
    "Const",
    "Match",
    "NoMatch",
    "Op",
    "Pattern",
    "Rule",
    "Var",
    "applies_only_if",
    "apply_rules",
    "check_exclusive",
    "onnx_dtype_name",
    "opt",
    "require",
    "require_constant",
    "require_forwardable",
    "value",
]

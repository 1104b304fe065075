"""Rules and the driver that applies them.

A rule is three things: a *pattern* rooted at one op type (structure only), read-only *guards*
that check the operator contract (constants, dtypes, shapes, attributes) and fail with a stable
kebab-case code plus a sentence, and a pure *rewrite* that builds the replacement.

* Structure that does not match is silent (the rule simply does not apply there).
* A guard that fails after the structure matched is a *missed* remark: the user sees which
  clause of the contract failed at which node.  So is a non-structural :class:`NoMatch` raised by
  a rule's own ``match`` once it has recognized the pattern's core (attention's Softmax between
  two MatMuls) but not the exporter's spelling around it.
* Only :class:`NoMatch` is caught; any other exception is a bug and surfaces.
* Quantization is a barrier (:mod:`opt.quant`): unless a rule is ``quantization_aware``, a match
  holding a Q/DQ/QOperator node, or a Conv/MatMul/Gemm reading a DequantizeLinear output, is
  refused, and so is a DQ output where a rule requires a constant (code ``quantized-boundary``).

The driver is a greedy work queue over nodes in topological order, with rules indexed by root op
type.  After a rewrite, the new nodes and the readers of their outputs are queued again.  A rule
whose decision depends on another rule's verdict (a FusedMatMul fold inside an attention that
``fuse-attention`` may still take) calls :func:`wait_for`: the node is parked, silently, and
queued again once that rule has recorded a new remark.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .ir import Constant, ModelIR, Node, Tensor, Variable, constant_value
from .quant import boundary_violation, dequantized_by
from .remarks import Remark

if TYPE_CHECKING:
    from .manager import PassContext


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


def wait_for(rule: str, pending: Any) -> None:
    """Not yet, while ``pending``: ``rule`` has not said whether it takes this pattern.  Silent;
    the node is tried again once ``rule`` records a new remark."""
    if pending:
        raise NoMatch("waiting", f"waits for {rule}", structural=True, waiting_for=rule)


# --------------------------------------------------------------------------- patterns
class Pattern:
    """Base of pattern nodes; a pattern describes structure only, never constness or dtype."""


@dataclass(frozen=True)
class Var(Pattern):
    """Any tensor, bound to ``name``. ``optional`` also matches an absent input."""

    name: str
    optional: bool = False


def opt(name: str) -> Var:
    return Var(name, optional=True)


@dataclass(frozen=True)
class Op(Pattern):
    """A node of type ``op`` whose inputs match ``inputs``; its first output binds to ``out``."""

    op: str
    inputs: tuple[Pattern, ...]
    name: str | None = None
    out: str | None = None
    domain: str = ""
    commute: bool = False
    extra_inputs: bool = False

    def __init__(
        self,
        op: str,
        *inputs: Pattern | str,
        name: str | None = None,
        out: str | None = None,
        domain: str = "",
        commute: bool = False,
        extra_inputs: bool = False,
    ):
        object.__setattr__(self, "op", op)
        object.__setattr__(
            self, "inputs", tuple(Var(i) if isinstance(i, str) else i for i in inputs)
        )
        object.__setattr__(self, "name", name or op)
        object.__setattr__(self, "out", out)
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "commute", commute)
        object.__setattr__(self, "extra_inputs", extra_inputs)


def _same_domain(a: str | None, b: str) -> bool:
    return (a or "") in (("", "ai.onnx") if b in ("", "ai.onnx") else (b,))


def _match_tensor(pat: Pattern, tensor: Tensor | None, b: dict) -> Iterator[dict]:
    if isinstance(pat, Var):
        if tensor is None:
            if pat.optional:
                yield {**b, pat.name: None}
            return
        bound = b.get(pat.name, tensor)
        if bound is tensor:
            yield {**b, pat.name: tensor}
        return
    assert isinstance(pat, Op)
    if not isinstance(tensor, Variable) or not tensor.inputs:
        return
    node = tensor.inputs[0]
    if node.outputs[0] is not tensor:
        return
    yield from _match_node(pat, node, b)


def _match_node(pat: Op, node: Node, b: dict) -> Iterator[dict]:
    if node.op != pat.op or not _same_domain(node.domain, pat.domain):
        return
    if pat.name in b and b[pat.name] is not node:
        return
    inputs = [
        None if (t is None or (isinstance(t, Variable) and t.name == "")) else t
        for t in node.inputs
    ]
    if len(inputs) > len(pat.inputs) and not pat.extra_inputs:
        return
    inputs += [None] * (len(pat.inputs) - len(inputs))
    b = {**b, pat.name: node}
    if pat.out:
        b[pat.out] = node.outputs[0]
    orders = [list(pat.inputs)]
    if pat.commute and len(pat.inputs) == 2:
        orders.append(list(reversed(pat.inputs)))
    for order in orders:
        yield from _match_list(order, inputs, b)


def _match_list(pats: list[Pattern], tensors: list, b: dict) -> Iterator[dict]:
    if not pats:
        yield b
        return
    for b1 in _match_tensor(pats[0], tensors[0], b):
        yield from _match_list(pats[1:], tensors[1:], b1)


# ------------------------------------------------------------------------------ match
class Match:
    """Bindings of one successful structural match; rules may ``stash`` computed values."""

    def __init__(self, root: Node, bindings: dict[str, Any]):
        self.root = root
        self.bindings = dict(bindings)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["bindings"][name]
        except KeyError:
            raise AttributeError(name) from None

    def stash(self, **values: Any) -> None:
        self.bindings.update(values)

    def nodes(self) -> list[Node]:
        return [v for v in self.bindings.values() if isinstance(v, gs.Node)]


# ------------------------------------------------------------------------------- rules
class Rule:
    """Subclass and set ``name``, ``root``, ``level``, ``summary`` and ``pattern``.

    ``check`` holds the guards (``require``) and may stash values; ``rewrite`` returns the
    tensors that replace the root node's outputs, built with the :class:`Builder`.
    """

    name: ClassVar[str]
    root: ClassVar[str]
    domain: ClassVar[str] = ""
    level: ClassVar[int] = 2
    summary: ClassVar[str] = ""
    pattern: ClassVar[Op | None] = None
    #: intermediate (non-root) matched nodes must feed only the match; else "shared-intermediate"
    exclusive: ClassVar[bool] = True
    #: set True for rules that may change numerics beyond rounding (allowed at -O3 only)
    changes_numerics: ClassVar[bool] = False
    #: set True for rules written for Q/DQ nodes (else a match touching one is refused)
    quantization_aware: ClassVar[bool] = False

    def match(self, node: Node, cx: PassContext) -> Match:
        """The first structural match (over commuted alternatives) that passes ``structure``."""
        candidates = [{}] if self.pattern is None else _match_node(self.pattern, node, {})
        for bindings in candidates:
            m = Match(node, bindings)
            try:
                self.structure(m, cx)
            except NoMatch:
                continue
            return m
        raise NoMatch("structure", "pattern did not match", structural=True)

    def structure(self, m: Match, cx: PassContext) -> None:
        """Structural conditions checked in code (``applies_only_if``): silent when unmet."""

    def check(self, m: Match, cx: PassContext) -> None:
        """Guards; raise NoMatch via ``require``."""

    def rewrite(self, m: Match, b: Builder) -> Sequence[Tensor | None]:
        raise NotImplementedError


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

    def const(self, value: np.ndarray, base: str = "const") -> Constant:
        name = self.ir.fresh_name(f"{self.anchor}/{base}")
        return Constant(name, np.asarray(value, order="C"))


# ------------------------------------------------------------------------------ driver
def apply_rules(ir: ModelIR, rules: Sequence[Rule], cx: PassContext, pass_name: str) -> bool:
    """Apply ``rules`` greedily until none fires; return whether anything changed."""
    cx.ir = ir
    index: dict[str, list[Rule]] = {}
    for r in rules:
        index.setdefault(r.root, []).append(r)
        cx.rule_stats(r.name)  # every rule of the set appears in the report, matched or not
    ir.toposort()
    queue = deque(n for n in ir.graph.nodes if n.op in index)
    queued = {id(n) for n in queue}
    budget = 4 * len(queue) + 100  # rewrites; more means rules undo each other
    try:
        return _drain(ir, queue, queued, index, cx, pass_name, budget)
    finally:
        ir.graph.nodes = [n for n in ir.graph.nodes if n.outputs]  # drop rewritten-away nodes


def _drain(
    ir: ModelIR,
    queue: deque,
    queued: set,
    index: dict[str, list[Rule]],
    cx: PassContext,
    pass_name: str,
    budget: int,
) -> bool:
    changed = False
    parked: list[tuple[Node, str, int]] = []  # (node, awaited rule, its verdicts when parked)
    # A value's readers include nodes of nested If/Loop/Scan bodies (outer-scope values are shared
    # objects): only nodes of the graph being worked on may be queued, or a rule would rewrite a
    # body node under the wrong scope (and, e.g., drop the producer of a branch output).
    members = {id(n) for n in ir.graph.nodes}
    while True:
        while queue:
            node = queue.popleft()
            queued.discard(id(node))
            if not node.outputs:  # removed by an earlier rewrite
                continue
            for rule in index.get(node.op, ()):
                new_nodes = _try_rule(ir, rule, node, cx, pass_name, parked)
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
                            "rules keep rewriting the same nodes (two rules undo each other?); "
                            "stopped",
                            {"rule": rule.name},
                        )
                    )
                    return True
                members.update(id(n) for n in new_nodes)
                readers = [c for n in new_nodes for t in n.outputs for c in t.outputs]
                _enqueue(
                    [c for c in readers if id(c) in members] + new_nodes,
                    queue,
                    queued,
                    index,
                )
                break
        # nodes that waited for another rule's verdict go again once that rule said more
        said = cx.remarks.verdicts
        ready = [node for node, rule, seen in parked if said.get(rule, 0) > seen]
        if not ready:
            return changed
        parked = [(node, rule, seen) for node, rule, seen in parked if said.get(rule, 0) <= seen]
        _enqueue([n for n in ready if n.outputs], queue, queued, index)


def _enqueue(nodes: list[Node], queue: deque, queued: set, index: dict) -> None:
    """Queue the nodes some rule roots at, each once."""
    for n in nodes:
        if n.op in index and id(n) not in queued:
            queue.append(n)
            queued.add(id(n))


def _try_rule(
    ir: ModelIR, rule: Rule, node: Node, cx: PassContext, pass_name: str, parked: list
) -> list[Node] | None:
    t0 = time.perf_counter()
    stats = cx.rule_stats(rule.name)
    try:
        try:
            m = rule.match(node, cx)
        except NoMatch as e:
            if not e.structural:  # recognized as the pattern's core, then an unknown spelling
                stats.missed += 1
                cx.remarks.add(
                    Remark("missed", pass_name, rule.name, e.code, [node.name], e.message, e.args_)
                )
            return None
        stats.attempts += 1
        try:
            if rule.exclusive:
                check_exclusive(m, ir)
            if not rule.quantization_aware:
                crossing = boundary_violation(m.nodes())
                require(crossing is None, "quantized-boundary", lambda: str(crossing))
            rule.check(m, cx)
        except NoMatch as e:
            if "waiting_for" in e.args_:
                awaited = e.args_["waiting_for"]
                parked.append((node, awaited, cx.remarks.verdicts.get(awaited, 0)))
            elif not e.structural:
                stats.missed += 1
                cx.remarks.add(
                    Remark(
                        "missed", pass_name, rule.name, e.code, _names(m, node), e.message, e.args_
                    )
                )
            return None
        if not cx.take_bisect_step(rule.name, node.name):
            return None
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
        stats.fired += 1
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
    finally:
        stats.seconds += time.perf_counter() - t0


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

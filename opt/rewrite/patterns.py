"""The pattern language of rules: structure only, matched by backtracking.

* :class:`Var` binds any tensor (``opt(name)`` also an absent optional input); a name bound twice
  must bind the same tensor.
* :class:`Const` binds a tensor known at optimization time, optionally one element, of a dtype
  kind, or with every element equal to ``value``.
* :class:`Op` binds a node of one op type or one of several (``Op(("Relu", "LeakyRelu"), "x")``;
  the node bound under ``name`` says which), in ``domain`` or one of a tuple of domains (each
  in any spelling, see :mod:`opt.domains`), whose
  attributes satisfy ``attrs`` (a value, a callable on the value, or a callable on the node;
  an absent attribute reads its ONNX schema default).  ``commute=True`` tries every ordering of
  its inputs (at most :data:`MAX_COMMUTED`), a tuple of positions only those; its first output
  binds to ``out``.
* :class:`Alt` tries each alternative in order, e.g. the associations of a product.

:func:`match` yields every binding (a dict name → node or tensor), first the one with the inputs
in the written order; the rule driver tries them in that order.  :func:`roots` is the op types a
pattern can be rooted at (a rule is indexed under each).  :func:`feasible` is a cheap necessary
condition for :func:`match` to yield anything (op types, domains and input counts along the
pattern, constant and present leaves, no bindings, attributes or values): the driver skips a
node it rejects without building a single candidate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import onnx

from ..graph.domains import norm_domain, spellings
from ..graph.ir import Constant, Node, Tensor, Variable, constant_value, dtype_of

#: most inputs ``commute=True`` permutes (4! orderings)
MAX_COMMUTED = 4
#: elements of a constant a value leaf reads at most
VALUE_LIMIT = 1 << 16


class Pattern:
    """Base of pattern nodes; a pattern describes structure, never a guard's contract."""


@dataclass(frozen=True)
class Var(Pattern):
    """Any tensor, bound to ``name``. ``optional`` also matches an absent input."""

    name: str
    optional: bool = False


def opt(name: str) -> Var:
    return Var(name, optional=True)


@dataclass(frozen=True)
class Const(Pattern):
    """A constant tensor bound to ``name``: with ``scalar`` of one element, with ``kind`` of a
    dtype kind (``"f"``, ``"i"``, ...), with ``value`` every element equal to it (within ``rel``
    relative); ``optional`` also matches an absent input."""

    name: str
    value: float | None = None
    scalar: bool = False
    kind: str | None = None
    rel: float = 0.0
    optional: bool = False

    def accepts(self, t: Tensor) -> bool:
        if not isinstance(t, Constant):
            return False
        if self.kind is not None and (dtype_of(t) is None or dtype_of(t).kind not in self.kind):
            return False
        if not (self.scalar or self.value is not None):
            return True
        v = constant_value(t, VALUE_LIMIT)
        if v is None or v.size == 0 or v.dtype.kind not in "fiub" or (self.scalar and v.size != 1):
            return False
        if self.value is None:
            return True
        if v.size == 1:
            return self._near_one(v.flat[0])
        return self._near(v.flat[0]) and self._near(v)

    def _near_one(self, x: Any) -> bool:
        """:meth:`_near` of one element, in plain arithmetic (the same float64 operations)."""
        if self.rel == 0:
            return bool(x == self.value)
        return abs(float(x) - self.value) <= self.rel * abs(self.value)

    def _near(self, v: Any) -> bool:
        if self.rel == 0:
            return bool(np.all(v == self.value))
        return bool(
            np.all(np.abs(np.asarray(v, np.float64) - self.value) <= self.rel * abs(self.value))
        )


@dataclass(frozen=True)
class Op(Pattern):
    """A node whose type is ``op`` (or one of a tuple) and whose inputs match ``inputs``."""

    op: str | tuple[str, ...]
    inputs: tuple[Pattern, ...]
    name: str | None = None
    out: str | None = None
    domain: str | tuple[str, ...] = ""
    commute: bool | tuple[int, ...] = False
    extra_inputs: bool = False
    attrs: Any = None

    def __init__(
        self,
        op: str | tuple[str, ...],
        *inputs: Pattern | str,
        name: str | None = None,
        out: str | None = None,
        domain: str | tuple[str, ...] = "",
        commute: bool | tuple[int, ...] = False,
        extra_inputs: bool = False,
        attrs: dict[str, Any] | Callable[[Node], bool] | None = None,
    ):
        ins = tuple(Var(i) if isinstance(i, str) else i for i in inputs)
        if commute is True and len(ins) > MAX_COMMUTED:
            raise ValueError(f"commute=True over {len(ins)} inputs; name the positions instead")
        set_ = object.__setattr__
        set_(self, "op", op)
        set_(self, "inputs", ins)
        set_(self, "name", name or (op if isinstance(op, str) else op[0]))
        set_(self, "out", out)
        set_(self, "domain", domain)
        set_(self, "commute", commute)
        set_(self, "extra_inputs", extra_inputs)
        set_(self, "attrs", attrs)
        set_(self, "_orders", tuple(_orders(ins, commute)))
        set_(self, "_free", _commuted(ins, commute))
        set_(self, "_ops", frozenset(self.ops))
        domains = (domain,) if isinstance(domain, str) else domain
        set_(self, "_domains", frozenset(norm_domain(d) for d in domains))
        # the spellings of those domains a node may carry as they are (no normalizing call)
        set_(self, "_spellings", spellings(self._domains))

    @property
    def ops(self) -> tuple[str, ...]:
        return (self.op,) if isinstance(self.op, str) else tuple(self.op)


@dataclass(frozen=True)
class Alt(Pattern):
    """The first of several patterns that matches, tried in order (each yields its bindings)."""

    options: tuple[Pattern, ...]

    def __init__(self, *options: Pattern):
        object.__setattr__(self, "options", tuple(options))


def roots(p: Pattern) -> tuple[str, ...]:
    """The op types a pattern can be rooted at, in order, each once."""
    if isinstance(p, Op):
        return p.ops
    if isinstance(p, Alt):
        return tuple(dict.fromkeys(op for o in p.options for op in roots(o)))
    raise TypeError(f"a rule's pattern is rooted at an Op, not {type(p).__name__}")


def root_domain(p: Pattern) -> str:
    """The domain of a pattern's root (the first alternative's)."""
    if isinstance(p, Alt):
        return root_domain(p.options[0])
    return p.domain if isinstance(p.domain, str) else p.domain[0]


def feasible(p: Pattern, node: Node) -> bool:
    """False only when :func:`match` of ``p`` at ``node`` yields nothing: every Op of the pattern
    must find a node of its op type and domain, with no more inputs than it names (unless
    ``extra_inputs``), producing the tensor its parent reads as first output; every Const leaf a
    constant, every non-optional leaf a present input.  Commuted inputs need each pattern to fit
    one of the commuted tensors.  Bindings, attributes and constant values are left to
    :func:`match`.  The check is compiled once per pattern (:func:`feasibility`)."""
    return feasibility(p)(node)


#: compiled feasibility checks by pattern identity (the pattern is held so its id stays its own)
_COMPILED: dict[int, tuple[Pattern, Callable[[Node], bool]]] = {}


def feasibility(p: Pattern) -> Callable[[Node], bool]:
    """:func:`feasible` of ``p`` as one function of the node, built once per pattern: the
    pattern's structure is walked when compiling, not at every node."""
    hit = _COMPILED.get(id(p))
    if hit is None or hit[0] is not p:
        if isinstance(p, Alt):
            options = [feasibility(o) for o in p.options]
            fn = lambda node: any(f(node) for f in options)  # noqa: E731
        else:
            fn = _compile_node(p)
        hit = _COMPILED[id(p)] = (p, fn)
    return hit[1]


def _compile_node(p: Op) -> Callable[[Node], bool]:
    ops, domains, n, extra = p._ops, p._domains, len(p.inputs), p.extra_inputs
    free = sorted(p._free)
    # a leaf that accepts an absent input accepts anything: nothing to check there
    fixed = [
        (i, _compile_tensor(q))
        for i, q in enumerate(p.inputs)
        if i not in p._free and not _accepts_anything(q)
    ]
    pooled = [_compile_tensor(p.inputs[i]) for i in free]

    spelled = p._spellings

    def check(node: Node) -> bool:
        if node.op not in ops:
            return False
        if node.domain not in spelled and norm_domain(node.domain) not in domains:
            return False
        ins = node.inputs
        count = len(ins)
        if count > n and not extra:
            return False
        for i, fits in fixed:
            t = ins[i] if i < count else None
            if isinstance(t, Variable) and t.name == "":
                t = None
            if not fits(t):
                return False
        if not free:
            return True
        pool = []
        for i in free:
            t = ins[i] if i < count else None
            pool.append(None if isinstance(t, Variable) and t.name == "" else t)
        for fits in pooled:  # each commuted pattern fits one of the commuted tensors
            for t in pool:
                if fits(t):
                    break
            else:
                return False
        return True

    return check


def _accepts_anything(p: Pattern) -> bool:
    return isinstance(p, Var) and p.optional


def _compile_tensor(p: Pattern) -> Callable[[Tensor | None], bool]:
    """Whether a tensor (None: absent) can be what ``p`` binds, as :func:`feasible` reads it."""
    if isinstance(p, Var):
        if p.optional:
            return lambda _t: True
        return lambda t: t is not None
    if isinstance(p, Const):
        optional = p.optional
        return lambda t: isinstance(t, Constant) if t is not None else optional
    if isinstance(p, Alt):
        options = [_compile_tensor(o) for o in p.options]
        return lambda t: any(f(t) for f in options)
    node_fits = _compile_node(p)

    def produced(t: Tensor | None) -> bool:
        if not isinstance(t, Variable) or not t.inputs:
            return False
        node = t.inputs[0]
        return node.outputs[0] is t and node_fits(node)

    return produced


def match(p: Pattern, node: Node, b: dict | None = None) -> Iterator[dict]:
    """Every binding of ``p`` rooted at ``node``."""
    b = {} if b is None else b
    if isinstance(p, Alt):
        for o in p.options:
            yield from match(o, node, b)
        return
    assert isinstance(p, Op), p
    yield from _match_node(p, node, b)


def _match_tensor(p: Pattern, tensor: Tensor | None, b: dict) -> Iterator[dict]:
    if isinstance(p, Alt):
        for o in p.options:
            yield from _match_tensor(o, tensor, b)
        return
    if isinstance(p, (Var, Const)):
        if tensor is None:
            if p.optional:
                yield {**b, p.name: None}
            return
        if isinstance(p, Const) and not p.accepts(tensor):
            return
        if b.get(p.name, tensor) is tensor:
            yield {**b, p.name: tensor}
        return
    if not isinstance(tensor, Variable) or not tensor.inputs:
        return
    node = tensor.inputs[0]
    if node.outputs[0] is not tensor or (isinstance(p, Op) and node.op not in p._ops):
        return
    yield from match(p, node, b)


def _match_node(p: Op, node: Node, b: dict) -> Iterator[dict]:
    if node.op not in p._ops:
        return
    if node.domain not in p._spellings and norm_domain(node.domain) not in p._domains:
        return
    if b.get(p.name, node) is not node or not _attrs_ok(p, node):
        return
    inputs = [
        None if (t is None or (isinstance(t, Variable) and t.name == "")) else t
        for t in node.inputs
    ]
    if len(inputs) > len(p.inputs) and not p.extra_inputs:
        return
    inputs += [None] * (len(p.inputs) - len(inputs))
    b = {**b, p.name: node}
    if p.out:
        b[p.out] = node.outputs[0]
    for order in p._orders:
        yield from _match_list(order, inputs, b)


def _orders(pats: tuple[Pattern, ...], commute: bool | tuple[int, ...]) -> Iterator[list]:
    """The input patterns in each ordering ``commute`` allows, the written one first."""
    pats = list(pats)
    if not commute:
        yield pats
        return
    where = range(len(pats)) if commute is True else commute
    where = [i for i in where if i < len(pats)]
    for perm in itertools.permutations(where):
        order = list(pats)
        for dst, src in zip(where, perm):
            order[dst] = pats[src]
        yield order


def _commuted(pats: tuple[Pattern, ...], commute: bool | tuple[int, ...]) -> frozenset[int]:
    """The input positions whose patterns ``commute`` permutes."""
    if not commute:
        return frozenset()
    where = range(len(pats)) if commute is True else commute
    return frozenset(i for i in where if i < len(pats))


def _match_list(pats: list[Pattern], tensors: list, b: dict) -> Iterator[dict]:
    if not pats:
        yield b
        return
    for b1 in _match_tensor(pats[0], tensors[0], b):
        yield from _match_list(pats[1:], tensors[1:], b1)


def _attrs_ok(p: Op, node: Node) -> bool:
    if p.attrs is None:
        return True
    if callable(p.attrs):
        return bool(p.attrs(node))
    for key, want in p.attrs.items():
        have = attr(node, key)
        if not (want(have) if callable(want) else _same_value(have, want)):
            return False
    return True


def _same_value(have: Any, want: Any) -> bool:
    if isinstance(want, (list, tuple)):
        return isinstance(have, (list, tuple)) and list(have) == list(want)
    return have == want


def attr(node: Node, key: str) -> Any:
    """A node's attribute, its ONNX schema default when absent (None without one); strings as
    ``str``."""
    if key in node.attrs:
        v = node.attrs[key]
    else:
        v = _schema_default(node.op, norm_domain(node.domain), key)
    return v.decode() if isinstance(v, bytes) else v


@lru_cache(maxsize=512)
def _schema_default(op: str, domain: str, key: str) -> Any:
    try:
        a = onnx.defs.get_schema(op, domain=domain).attributes.get(key)
    except onnx.defs.SchemaError:
        return None
    if a is None or not a.default_value.name:
        return None
    v = onnx.helper.get_attribute_value(a.default_value)
    return list(v) if isinstance(v, (list, tuple)) else v

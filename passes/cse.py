"""Common-subexpression elimination and duplicate-constant sharing.

Exporters repeat work per layer: the same mask ``Where(cond, 0, -inf)``, the same
``Shape(x) → Gather`` glue, the same small constants under per-layer names.  Two nodes with the
same op, domain, attributes and the very same inputs compute the same values, so the second's
readers are moved to the first's outputs; two constants with equal dtype, shape and bytes become
one.  Both only ever merge values, never change one, so the outputs are bit-identical.

Not merged: nodes of non-deterministic ops (Random*, Multinomial, Bernoulli, Dropout), nodes
with subgraphs, nodes of unknown domains (their kernels might keep state), nodes whose output
is a graph output (its name must stay), and constants over 4096 elements: what exporters repeat
per layer is scalars and shapes, and weights are never read just to compare them (they may be
memory-mapped external data).
"""

from __future__ import annotations

import hashlib

import numpy as np

from graphopt.opt.graph.domains import RANDOM_OPS
from graphopt.opt.graph.ir import Constant, ModelIR, Node, Tensor, constant_value, subgraphs
from graphopt.opt.rewrite.context import Pass, PassContext
from graphopt.opt.rewrite.manager import register_pass

NONDETERMINISTIC = RANDOM_OPS | {"Dropout"}
KNOWN_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})
MAX_CONSTANT_ELEMENTS = 4096


def _attr_key(value) -> object:
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, Constant):  # a large or non-numeric tensor is only equal to itself
        key = _constant_key(value)
        return ("tensor", key) if key is not None else ("tensor-object", id(value))
    if isinstance(value, float):
        return ("float", np.float64(value).tobytes())  # -0.0 and NaN kept apart and equal
    return value


def _constant_key(t: Constant) -> tuple | None:
    """(dtype, shape, digest) of a numeric constant of at most 4096 elements, else None;
    remembered on the constant (its values never change in place)."""
    cached = getattr(t, "_cse_key", False)
    if cached is False:
        cached = t._cse_key = _compute_constant_key(t)
    return cached


def _compute_constant_key(t: Constant) -> tuple | None:
    try:
        numeric = np.dtype(t.dtype).kind in "biufc"
    except TypeError:
        numeric = False
    if not numeric:  # strings: loading them would also change how they are written back
        return None
    values = constant_value(t, MAX_CONSTANT_ELEMENTS)
    if values is None:
        return None
    digest = hashlib.blake2b(values.tobytes(), digest_size=16).digest()  # C order, any layout
    return (values.dtype.str, values.shape, digest)


@register_pass
class CommonSubexpressionElimination(Pass):
    name = "cse"
    summary = "merge nodes computing the same values and constants holding the same bytes"
    level = 1

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        ir.toposort()
        constants = self._canonical_constants(ir, cx)
        seen: dict[tuple, Node] = {}
        merged = 0
        graph_outputs = {id(t) for t in ir.graph.outputs}  # merging never changes them
        for node in list(ir.graph.nodes):
            self._share_constants(node, constants)
            key = self._key(node, graph_outputs)
            if key is None:
                continue
            first = seen.setdefault(key, node)
            if first is node or not cx.take_bisect_step(self.name, node.name):
                continue
            for dup, keep in zip(node.outputs, first.outputs):
                ir.replace_all_uses(dup, keep)
            ir.remove_node(node)
            merged += 1
        merged += constants.pop(None, 0)
        if merged:
            cx.rule_stats(self.name).fired += merged
        return merged > 0

    def _canonical_constants(self, ir: ModelIR, cx: PassContext) -> dict:
        """Constant → the first constant with the same key; the count of merges under None."""
        first: dict[tuple, Constant] = {}
        canon: dict = {None: 0}
        for node in ir.graph.nodes:
            for t in node.inputs:
                if not isinstance(t, Constant) or id(t) in canon:
                    continue
                key = _constant_key(t)
                if key is None:
                    continue
                keep = first.setdefault(key, t)
                if keep is not t and not cx.take_bisect_step(self.name, t.name):
                    keep = t
                canon[id(t)] = keep
                canon[None] += keep is not t
        return canon

    @staticmethod
    def _share_constants(node: Node, canon: dict) -> None:
        for i, t in enumerate(node.inputs):
            c = canon.get(id(t)) if isinstance(t, Constant) else None
            if c is not None and c is not t:
                node.inputs[i] = c

    @staticmethod
    def _key(node: Node, graph_outputs: set[int]) -> tuple | None:
        """What makes two nodes compute the same values; None for a node never merged
        (``graph_outputs``: the ids of the graph's outputs)."""
        if (
            node.op in NONDETERMINISTIC
            or (node.domain or "") not in KNOWN_DOMAINS
            or not node.outputs
            or (node.attrs and subgraphs(node))
            or any(id(t) in graph_outputs for t in node.outputs)
        ):
            return None
        ins = tuple([None if _absent(t) else id(t) for t in node.inputs])
        attrs: tuple = ()
        if node.attrs:
            attrs = tuple(sorted((k, _attr_key(v)) for k, v in node.attrs.items()))
            try:
                hash(attrs)
            except TypeError:
                return None
        return (node.op, node.domain or "", attrs, ins, len(node.outputs))


def _absent(t: Tensor) -> bool:
    return t is None or (not isinstance(t, Constant) and t.name == "")

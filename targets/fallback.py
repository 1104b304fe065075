"""Whose fallback is it: the nodes the ORIGINAL model already ran on the fallback provider.

On a target with a fallback (cuda -> cpu), a node without a device kernel runs on the fallback
provider at the cost of device<->host copies.  Many models come that way: onnxruntime places
ReduceProd on int64 or ArgMax on int32 (detector post-processing, CLIP pooling) and the whole of
``ai.onnx.ml`` (tree ensembles, Scaler) on its CPU provider as a matter of course.  legalize
(``passes/legalize.py``) blames graphopt only for the fallbacks its rewrites introduced; this
module tells the two apart.

:func:`original_fallbacks` is the census of the original model: every node (subgraphs included)
that falls back under the same target table (:func:`graphopt.targets.kernels.resolve`), by
(op, domain, dtype) and by node label.  It needs element types only: they are read from the
model's own declarations and, where a candidate node's type is missing, from one ONNX type
inference of a weightless view of the model (no session, no weights read).  Only nodes of the
(op, domain) pairs asked about are resolved.

:func:`classify` decides, per fallback node of graphopt's output, ``original`` or
``introduced``: a node that survived (its label is one of the original's fallbacks with the
same key) is the original's; otherwise a key's nodes are the original's as long as the output
has no more of them than the original had (a rewrite may rename or rebuild a node it does not
change in kind); the excess is graphopt's, nodes a rule made (provenance) first.  A node whose
type could not be inferred (in the original or the output) matches any dtype of its (op, domain).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from graphopt.opt.graph.compat import function_id, proto_nodes
from graphopt.opt.graph.domains import norm_domain
from graphopt.opt.rewrite.target import Target
from graphopt.targets.kernels import (
    _type_proto_string,
    model_opsets,
    primary_slots,
    resolve,
    resolve_call,
)

#: (op, domain, dtype): the identity of a fallback, "same op, domain and dtype"
Key = tuple[str, str, str | None]
ORIGINAL, INTRODUCED = "original", "introduced"


@dataclass(frozen=True)
class Census:
    """The original model's fallback nodes: how many per key, and each one's key by label."""

    counts: dict[Key, int] = field(default_factory=dict)
    labels: dict[str, Key] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def proto_label(node: onnx.NodeProto) -> str:
    """A node's name, or ``Op@first-output`` (as legalize labels IR nodes)."""
    if node.name:
        return node.name
    return f"{node.op_type}@{node.output[0] if node.output else '?'}"


def original_fallbacks(
    target: Target, model: onnx.ModelProto, ops: Iterable[tuple[str, str]] | None = None
) -> Census:
    """The census of ``model``'s nodes that fall back on ``target`` (only of the (op, domain)
    pairs in ``ops`` when given)."""
    if target.fallback is None:
        return Census()
    wanted = None if ops is None else {(op, norm_domain(d)) for op, d in ops}
    nodes = [
        n
        for n in proto_nodes(model.graph.node)
        if wanted is None or (n.op_type, norm_domain(n.domain)) in wanted
    ]
    if not nodes:
        return Census()
    opsets = model_opsets(model.opset_import)
    opsets.setdefault("", 1)
    functions = {function_id(f): f for f in model.functions}
    types = declared_types(model)
    if any(_primary(n, opsets.get(norm_domain(n.domain)), types) is None for n in nodes):
        types = {**inferred_types(model), **types}
    counts: Counter[Key] = Counter()
    labels: dict[str, Key] = {}
    for n in nodes:
        domain = norm_domain(n.domain)
        dtype = _primary(n, opsets.get(domain), types)
        if function_id(n) in functions:
            res = resolve_call(target, function_id(n), functions, opsets, dtype)
        else:
            res = resolve(target, n.op_type, domain, opsets.get(domain), dtype)
        if res.status == "fallback":
            key = (n.op_type, domain, dtype)
            counts[key] += 1
            labels[proto_label(n)] = key
    return Census(dict(counts), labels)


def classify(nodes: Sequence[tuple[str, Key, str | None]], census: Census | None) -> dict[str, str]:
    """label -> ``original`` / ``introduced`` for the output's fallback nodes, each given as
    (label, key, the rule that made it or None); without a census every one is introduced."""
    if census is None:
        return {label: INTRODUCED for label, _, _ in nodes}
    left = Counter(census.counts)
    out: dict[str, str] = {}
    for label, key, _ in nodes:  # survivors first: they are the original's by name
        if census.labels.get(label) == key and left[key] > 0:
            left[key] -= 1
            out[label] = ORIGINAL
    rest = [(label, key, rule) for label, key, rule in nodes if label not in out]
    rest.sort(key=lambda n: n[2] is not None)  # nodes a rule made take the blame first
    for label, key, _ in rest:
        wild = (key[0], key[1], None)
        if left[key] > 0:
            left[key] -= 1
            out[label] = ORIGINAL
        elif left[wild] > 0:
            left[wild] -= 1
            out[label] = ORIGINAL
        elif key[2] is None and (some := _any_dtype(left, key)) is not None:
            left[some] -= 1
            out[label] = ORIGINAL
        else:
            out[label] = INTRODUCED
    return {label: out[label] for label, _, _ in nodes}


def _any_dtype(left: Counter[Key], key: Key) -> Key | None:
    """An original key of ``key``'s (op, domain) with nodes left, any dtype (first by name)."""
    keys = [k for k, n in left.items() if n > 0 and k[:2] == key[:2]]
    return min(keys, key=lambda k: k[2] or "") if keys else None


# ------------------------------------------------------------------------------- types
def declared_types(model: onnx.ModelProto) -> dict[str, str]:
    """{tensor: type string} as the model declares them (inputs, outputs, value_info,
    initializers), in every graph."""
    out: dict[str, str] = {}

    def visit(g: onnx.GraphProto) -> None:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            name = _type_proto_string(vi.type) if vi.name else None
            if name is not None:
                out.setdefault(vi.name, name)
        for t in g.initializer:
            out.setdefault(t.name, _tensor_string(t.data_type))
        for n in g.node:
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    visit(sub)

    visit(model.graph)
    return {k: v for k, v in out.items() if v is not None}


def inferred_types(model: onnx.ModelProto) -> dict[str, str]:
    """{tensor: type string} from ONNX type inference of a weightless view of ``model`` (main
    graph initializers as typed inputs); empty where inference fails."""
    g = model.graph
    view = onnx.ModelProto()
    view.ir_version = max(model.ir_version, 4)
    view.opset_import.extend(model.opset_import)
    view.functions.extend(model.functions)
    vg = view.graph
    vg.name = g.name
    vg.node.extend(g.node)
    inits = {t.name for t in g.initializer}
    vg.input.extend(vi for vi in g.input if vi.name not in inits)
    vg.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer
    )
    vg.output.extend(g.output)
    vg.value_info.extend(g.value_info)
    try:
        inferred = onnx.shape_inference.infer_shapes(
            view, check_type=False, strict_mode=False, data_prop=False
        )
    except Exception:  # noqa: BLE001 - best effort: an untyped node counts for any dtype
        return {}
    return declared_types(inferred)


def _tensor_string(elem_type: int) -> str | None:
    try:
        return f"tensor({TensorProto.DataType.Name(elem_type).lower()})" if elem_type else None
    except ValueError:
        return None


def _primary(node: onnx.NodeProto, opset: int | None, types: dict[str, str]) -> str | None:
    """The kernel-selecting type, as :func:`graphopt.targets.kernels.primary_dtype` finds it."""
    for kind, i, takes in primary_slots(node.op_type, norm_domain(node.domain), opset):
        names = node.input if kind == "input" else node.output
        if i >= len(names) or not names[i]:
            continue
        name = types.get(names[i])
        return name if name is not None and name.split("(")[0] in takes else None
    return None


__all__ = [
    "INTRODUCED",
    "ORIGINAL",
    "Census",
    "Key",
    "classify",
    "declared_types",
    "inferred_types",
    "original_fallbacks",
    "proto_label",
]

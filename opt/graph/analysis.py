"""Analyses over the IR that passes share: shape inference and node evaluation.

* :func:`infer_shapes` runs onnx shape inference (with data propagation) on a *weightless* view of
  the graph -- large constants travel as typed inputs, not data -- and writes the inferred dtypes
  and shapes back onto the graph's tensors.  Declared graph-output types are never overridden.
  A node that is the same object with the same op, names and plain attributes as at the last
  inference of its graph keeps the proto exported then (at the first, the proto it was read
  from).  A graph using a custom domain the model does not import is not exported at all: onnx
  refuses it (inference fails, as before).
* :func:`evaluate` runs a set of nodes whose inputs are all known, in one onnxruntime session
  with graph optimizations disabled, so folded values are exactly what the runtime computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from .domains import is_default
from .ir import (
    Constant,
    ModelIR,
    Node,
    Tensor,
    Variable,
    _held,
    _node_key,
    subgraphs,
    walk_nodes,
)

log = logging.getLogger(__name__)

#: constants up to this many elements travel with data (shape tensors, axes); larger as types
SMALL_CONSTANT = 4096


def _opsets(ir: ModelIR) -> list[onnx.OperatorSetIdProto]:
    return list(ir.template.opset_import) or [onnx.helper.make_opsetid("", ir.graph.opset)]


def _value_info(t: Tensor) -> onnx.ValueInfoProto:
    return OnnxExporter.export_value_info_proto(t, do_type_check=False)


def _elem_type(dtype) -> int:
    """The TensorProto element type of a tensor's dtype; types numpy cannot hold (float8,
    int4...) are kept by the IR as their TensorProto enum already."""
    if isinstance(dtype, (int, np.integer)):
        return int(dtype)
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError, ValueError):
        return onnx.TensorProto.UNDEFINED


def infer_shapes(ir: ModelIR) -> bool:
    """Infer and record shapes; False when onnx shape inference itself failed.  Skipped when no
    pass changed the graph since the last inference of it, and when the graph (its nodes, their
    inputs and outputs, its bodies, the types it reads from outside) is the one inferred last:
    a pass that changed one body leaves every other body's shapes as they are."""
    g = ir.graph
    last = ir.inferred.get(id(g))
    if last is not None and last[0] == ir.mutations:
        return True
    # a flat model has one graph: any pass that changed something changed it
    nested = ir.in_subgraph or any(subgraphs(n) for n in g.nodes if n.attrs)
    if nested and last is not None and last[1] == _fingerprint(g)[0]:
        ir.inferred[id(g)] = (ir.mutations, *last[1:])
        return True
    protos = last[3] if last is not None else ir.node_protos.pop(id(g), {})
    ok = _infer(ir, g, protos)
    # with the types inference filled in; the objects stay alive so that their ids stay theirs
    fingerprint = _fingerprint(g) if nested else (None, None)
    ir.inferred[id(g)] = (ir.mutations, *fingerprint, protos)
    return ok


def _typed(t: Tensor) -> tuple:
    shape = t.shape
    return (id(t), type(t), str(t.dtype), None if shape is None else tuple(shape))


def _fingerprint(g) -> tuple[tuple, list]:
    """What the inference of ``g`` depends on, by identity: every node (bodies included), the
    tensors it reads and writes (and whether they lack a type), and the types known of the values
    it reads (the graph's inputs, enclosing-scope values, constants, contrib outputs).  Equal
    fingerprints, equal results (inference only fills in types a tensor lacks).  Returns the
    fingerprint and the objects whose ids it holds."""
    nodes = list(walk_nodes(g))
    made = {id(t) for n in nodes for t in n.outputs}
    own = {id(n) for n in g.nodes}  # bodies' own types are their inferences' business
    parts: list = [tuple(_typed(t) for t in g.inputs), tuple(map(id, g.outputs))]
    for n in nodes:
        parts.append((id(n), n.op, n.domain, len(n.attrs)))
        if id(n) in own:
            parts.append(tuple((id(t), t.dtype is None, t.shape is None) for t in n.outputs))
        else:
            parts.append(tuple(map(id, n.outputs)))
        parts.append(tuple(id(t) if id(t) in made else _typed(t) for t in n.inputs))
        if not is_default(n.domain):
            parts.append(tuple(_typed(t) for t in n.outputs))
    return tuple(parts), [nodes, [t for n in nodes for t in n.inputs], list(g.inputs)]


def _export_nodes(nodes: Sequence[Node], protos: dict) -> list[bytes]:
    """The nodes' serialized protos, each taken from ``protos`` (id → node, key, bytes: the last
    inference's) when the node is the same object with the same key; ``protos`` is left holding
    exactly these nodes.  Bytes, not messages: a message object costs over a kilobyte where a
    node's bytes are tens of them (a million-node graph holds them all between inferences)."""
    out, kept = [], {}
    for n in nodes:
        key = _node_key(n)
        last = protos.get(id(n))
        if key is not None and last is not None and last[0] is n and last[1] == key:
            proto = last[2]
        else:
            proto = _serialized(OnnxExporter.export_node(n))
        if key is not None:
            kept[id(n)] = (n, key, proto, _held(n))
        out.append(proto)
    protos.clear()
    protos.update(kept)
    return out


def _unimported_domain(ir: ModelIR, g) -> str | None:
    """A custom domain a node of ``g`` uses that the model does not import: onnx's inference
    refuses such a graph outright, so it is not exported for it."""
    imported = {o.domain for o in _opsets(ir)}
    for n in g.nodes:
        if not is_default(n.domain) and n.domain not in imported:
            return n.domain
    return None


#: the most elements a constant Range may have for shape inference to propagate its values
DATA_PROP_RANGE = 1 << 20


def _huge_range(nodes) -> bool:
    """Whether a Range with constant operands would make more than :data:`DATA_PROP_RANGE`
    elements (or its size cannot be told)."""
    for n in nodes:
        if n.op != "Range" or len(n.inputs) < 3:
            continue
        values = [np.asarray(t.values) for t in n.inputs[:3] if isinstance(t, Constant)]
        if len(values) < 3 or any(v.size != 1 for v in values):
            continue
        start, limit, delta = (float(v.reshape(())) for v in values)
        if not all(math.isfinite(x) for x in (start, limit, delta)) or delta == 0:
            return True
        if math.ceil((limit - start) / delta) > DATA_PROP_RANGE:
            return True
    return False


def _infer(ir: ModelIR, g, protos: dict) -> bool:
    missing = _unimported_domain(ir, g)
    if missing is not None:
        log.info("shape inference skipped: no opset import for domain %s", missing)
        return False
    # a node a pass unlinked (folded: no outputs) until the graph is swept computes nothing
    nodes = _export_nodes([n for n in g.nodes if n.outputs], protos)
    inits, inputs = [], [_value_info(t) for t in g.inputs]
    seen = {t.name for t in g.inputs}
    last_constants = ir.constant_protos.get(id(g), {})
    constants: dict[int, tuple] = {}
    for node in g.nodes:
        for t in node.inputs:
            if isinstance(t, Constant) and t.name not in seen:
                seen.add(t.name)
                if math.prod(t.shape) <= SMALL_CONSTANT:
                    inits.append(_constant_proto(t, last_constants, constants))
                else:
                    inputs.append(
                        onnx.helper.make_tensor_value_info(
                            t.name,
                            _elem_type(t.dtype),
                            list(t.shape),
                        )
                    )
    # In a subgraph body, values of the enclosing scopes are typed inputs of the view.
    walked = list(walk_nodes(g))
    defined = seen | {t.name for n in walked for t in n.outputs}
    defined |= {t.name for n in walked for sub in subgraphs(n) for t in sub.inputs}
    for n in walked:
        for t in n.inputs:
            if isinstance(t, Variable) and t.name and t.name not in defined:
                defined.add(t.name)
                if t.dtype is None:
                    return False
                inputs.append(_value_info(t))
    outputs = [_value_info(t) for t in g.outputs]
    # onnx does not know contrib ops; the types rules gave their outputs keep inference going.
    known = [
        _value_info(t)
        for n in g.nodes
        if not is_default(n.domain)
        for t in n.outputs
        if t.name and t.dtype is not None and t.shape is not None
    ]
    ir.constant_protos[id(g)] = constants
    graph = onnx.helper.make_graph([], "shape-view", inputs, outputs, inits, value_info=known)
    model = onnx.helper.make_model(graph, opset_imports=_opsets(ir))
    model.ir_version = max(ir.original_ir_version, 4)
    model.functions.extend(OnnxExporter.export_function(f) for f in g.functions)
    # onnx's data propagation computes a constant Range's values: 10^13 of them do not fit
    propagate = not _huge_range(walked)
    try:
        inferred = onnx.shape_inference.infer_shapes(
            _with_nodes(model, nodes), check_type=False, strict_mode=False, data_prop=propagate
        )
    except (onnx.shape_inference.InferenceError, RuntimeError, ValueError) as e:
        log.info("shape inference failed: %s", e)
        return False
    tensors = {t.name: t for n in g.nodes for t in n.outputs}
    outputs_ids = {id(t) for t in g.outputs}
    # a large graph repeats a few types ([B, S, 8] float) many times: each is read once
    read: dict[bytes, tuple | None] = {}
    for vi in inferred.graph.value_info:
        t = tensors.get(vi.name)
        if not isinstance(t, Variable) or id(t) in outputs_ids:
            continue
        shape = t.shape
        if t.dtype is not None and shape is not None and all(isinstance(d, int) for d in shape):
            continue  # nothing left to learn
        raw = vi.type.SerializeToString()
        parsed = read.get(raw, False)
        if parsed is False:
            parsed = read[raw] = _read_type(vi.type)
        if parsed is not None:
            _set_type(t, *parsed)
    return True


def infer_node(
    ir: ModelIR, node: Node, given: dict[int, tuple[int, tuple]] | None = None
) -> list[tuple[int, tuple | None] | None] | None:
    """The (element type, dims) onnx's shape inference gives each output of ``node`` when its
    inputs are constants (small ones' values given, for data propagation) or typed in
    ``given`` (id of the tensor → element type, dims), without inferring the graph; None when
    an input is neither or inference refuses the node."""
    given = given or {}
    ins = [t for t in node.inputs if t is not None and t.name]
    if not all(isinstance(t, Constant) or id(t) in given for t in ins):
        return None
    domain = node.domain or ""
    imports = _opsets(ir)
    try:
        version = next((o.version for o in imports if o.domain == domain), 1)
        schema = onnx.defs.get_schema(node.op, version, domain)
        types = {
            t.name: onnx.helper.make_tensor_type_proto(*given[id(t)])
            if id(t) in given
            else onnx.helper.make_tensor_type_proto(_elem_type(t.dtype), list(t.shape))
            for t in ins
        }
        data = {
            t.name: OnnxExporter.export_tensor_proto(t)
            for t in ins
            if isinstance(t, Constant) and math.prod(t.shape) <= SMALL_CONSTANT
        }
        out = onnx.shape_inference.infer_node_outputs(
            schema, OnnxExporter.export_node(node), types, data, opset_imports=imports
        )
    except (
        onnx.defs.SchemaError,
        onnx.shape_inference.InferenceError,
        RuntimeError,
        ValueError,
        TypeError,
        KeyError,
    ):
        return None
    return [_read_type(out[t.name]) if t.name in out else None for t in node.outputs]


def _constant_proto(t: Constant, last: dict, now: dict) -> onnx.TensorProto:
    """The proto of a small constant: the one the last inference exported when it is the same
    tensor, with the same values object and name (constants are replaced, not changed in
    place), else exported; ``now`` collects this inference's."""
    entry = last.get(id(t))
    if entry is None or entry[0] is not t or entry[1] is not t._values or entry[2] != t.name:
        entry = (t, t._values, t.name, OnnxExporter.export_tensor_proto(t))
    now[id(t)] = entry
    return entry[3]


def _read_type(type_proto: onnx.TypeProto) -> tuple[int, tuple | None] | None:
    """A tensor type's element type and dims (None: no shape), or None for another type."""
    if not type_proto.HasField("tensor_type"):
        return None
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return tt.elem_type, None
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tt.elem_type, tuple(dims)


def _with_nodes(model: onnx.ModelProto, nodes: Sequence[bytes]) -> bytes:
    """The bytes of ``model`` with ``nodes`` (serialized NodeProtos) as its graph's nodes, in
    this order: each node's bytes written as they are, not parsed into the graph message first
    (a protobuf message is its fields in any order, a repeated field's entries in theirs).
    ``model`` loses its graph."""
    graph = model.graph.SerializeToString()
    model.ClearField("graph")
    body = b"".join([_NODE_TAG + _varint(len(b)) + b for b in nodes])
    body += graph
    return model.SerializeToString() + _GRAPH_TAG + _varint(len(body)) + body


_serialized = onnx.NodeProto.SerializeToString
#: length-delimited field tags: GraphProto.node (1), ModelProto.graph (7)
_NODE_TAG, _GRAPH_TAG = bytes([1 << 3 | 2]), bytes([7 << 3 | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _set_type(t: Variable, elem_type: int, dims: tuple | None) -> None:
    """What a tensor lacks of an inferred type: its dtype, a (more static) shape."""
    if elem_type and t.dtype is None:
        try:
            t.dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        except KeyError:
            return
    if dims is not None:
        old = t.shape
        if old is None or _more_static(dims, old):
            t.shape = list(dims)


def _more_static(new: list, old) -> bool:
    count = lambda s: sum(isinstance(d, int) for d in s)  # noqa: E731
    return len(new) == len(old) and count(new) > count(old)


class EvaluationError(Exception):
    """onnxruntime could not run the nodes (unsupported op/type, invalid attributes...)."""


def evaluate(
    ir: ModelIR, nodes: Sequence[Node], known: dict[str, np.ndarray], wanted: Sequence[str]
) -> dict[str, np.ndarray]:
    """Run ``nodes`` (topologically ordered) given ``known`` input values; return ``wanted``."""
    inits = [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in known.items()]
    outputs = [onnx.ValueInfoProto(name=n) for n in wanted]
    graph = onnx.helper.make_graph(
        [OnnxExporter.export_node(n) for n in nodes], "eval", [], outputs, inits
    )
    model = onnx.helper.make_model(graph, opset_imports=_opsets(ir))
    model.ir_version = max(min(ir.original_ir_version, onnx.IR_VERSION), 7)
    model.functions.extend(OnnxExporter.export_function(f) for f in ir.graph.functions)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        sess = ort.InferenceSession(
            model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        results = sess.run(list(wanted), {})
    except Exception as e:  # noqa: BLE001 - onnxruntime raises many unrelated types
        raise EvaluationError(
            str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        ) from None
    return dict(zip(wanted, results))

"""Static shapes of a model at given input shapes, and its activation memory plan.

:func:`shape_view` runs onnx shape inference (with data propagation) on a *weightless* copy of the
model — initializers above 4096 elements travel as typed graph inputs, not data — with the graph
inputs pinned to concrete shapes (the parity shapes).  It returns every tensor's element type and
dims; this is what the manifest's shapes, dtypes and workspace estimates and the memory plan read.

:func:`memory_plan` is the runtime's view of activation memory at those shapes:

* ``sum_bytes``: every activation (node output) allocated on its own, never reused;
* ``no_reuse_bytes``: the same with the runtime's aliasing applied — onnxruntime's CPU kernels
  for Reshape, Squeeze, Unsqueeze, Flatten and Identity return a view of their input, no buffer;
* ``peak_bytes``: liveness-based reuse with a perfect allocator — nodes run in the model's
  (topological) order, a buffer is allocated when its producer runs and freed after its last
  reader ran (graph outputs live to the end); the peak of live bytes is the least memory any
  buffer-reuse scheme needs for this order;
* ``exact_size_reuse_bytes``: reuse as onnxruntime's allocation planner does it for static
  shapes: a freed buffer is handed to a later tensor only if the byte sizes are equal; the total
  of buffers ever created.

Weights (initializers) and the caller's inputs are reported apart, not counted as activations.
Where static inference cannot type a tensor (ops ONNX does not define, such as com.microsoft
fusions, or data-dependent shapes), :func:`measured_view` takes its shape from an onnxruntime run
at the same inputs.  Tensors whose size stays unknown are listed and left out.  Subgraph bodies
(If/Loop/Scan) are not planned.
"""

from __future__ import annotations

import os
from collections import defaultdict
from functools import lru_cache
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from graphopt.opt.verify.hazards import runtime_hazard

SMALL = 4096
#: measured_view hands initializers over this many bytes to onnxruntime as arrays
STUB_BYTES = 1024
CPU = "CPUExecutionProvider"
#: element types numpy holds natively (others stay in the model: bfloat16, float8, strings)
PLAIN_TYPES = frozenset(
    getattr(TensorProto, n)
    for n in (
        "FLOAT",
        "FLOAT16",
        "DOUBLE",
        "BOOL",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
    )
)
#: ops whose onnxruntime CPU kernel returns a view of input 0 (no new buffer)
ALIASING_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})

TypeInfo = tuple[int, list]  # (onnx elem type, dims: int | str | None)


def _numel(init: TensorProto) -> int:
    return int(np.prod(init.dims, dtype=np.int64)) if len(init.dims) else 1


def shape_view(
    model: onnx.ModelProto, input_shapes: dict[str, list[int]] | None = None
) -> dict[str, TypeInfo]:
    """{tensor name: (elem_type, dims)} for every typed tensor of the main graph."""
    input_shapes = input_shapes or {}
    g = model.graph
    inputs = []
    init_names = {t.name for t in g.initializer}
    for vi in g.input:
        if vi.name in init_names:
            continue
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(vi)
        if vi.name in input_shapes and vi.type.HasField("tensor_type"):
            shape = copy.type.tensor_type.shape
            del shape.dim[:]
            for d in input_shapes[vi.name]:
                shape.dim.add().dim_value = int(d)
        inputs.append(copy)
    small, large = [], []
    for t in g.initializer:
        external = t.HasField("data_location") and t.data_location == TensorProto.EXTERNAL
        if _numel(t) <= SMALL and not external:
            small.append(t)
        else:
            large.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    outputs = [onnx.ValueInfoProto(name=o.name) for o in g.output]
    graph = helper.make_graph(list(g.node), "shape-view", inputs + large, outputs, small)
    view = helper.make_model(graph, opset_imports=list(model.opset_import))
    view.ir_version = max(model.ir_version, 4)
    view.functions.extend(model.functions)
    try:
        # data propagation computes constant values (a Range of 10^13): not where it is unsafe
        propagate = runtime_hazard(view, branches=True) is None
        inferred = onnx.shape_inference.infer_shapes(
            view, check_type=False, strict_mode=False, data_prop=propagate
        )
    except Exception:  # noqa: BLE001 - inference is best effort; unknown shapes are reported
        inferred = view
    out: dict[str, TypeInfo] = {}
    for vi in (
        list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output)
    ):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        dims = None
        if tt.HasField("shape"):
            dims = [
                int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
                for d in tt.shape.dim
            ]
        out[vi.name] = (tt.elem_type, dims)
    for t in g.initializer:
        out[t.name] = (t.data_type, [int(d) for d in t.dims])
    return out


def measured_view(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    names: list[str],
    base_dir: str | os.PathLike | None = None,
) -> dict[str, TypeInfo]:
    """Types and shapes of ``names`` as onnxruntime computes them on ``feeds`` (CPU, graph
    optimizations disabled): for tensors static inference cannot type (contrib ops, data-
    dependent shapes).  The session is built from a weightless copy of the model with those
    tensors as outputs, its weights handed to onnxruntime as arrays (:func:`_weightless`): the
    model is neither serialized with its weights nor parsed again, and onnxruntime does not
    pre-pack them for a single run.  ``base_dir``: where weights still in external files
    resolve.  A model too large for one session (:func:`graphopt.opt.verify.parity.too_large`) runs
    in pieces instead, one piece's weights mapped at a time."""
    from graphopt.opt.errors import GraphoptError
    from graphopt.opt.verify.customops import register_libraries
    from graphopt.opt.verify.parity import run_lean, too_large

    if too_large(model):  # more weights than one session should hold: measured in pieces
        wanted = list(dict.fromkeys(names))
        return _typed(names, wanted, run_lean(model, feeds, wanted, base_dir))
    light, weights = _weightless(model, names)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    # one run: packing the weights for faster kernels would only copy them once more
    so.add_session_config_entry("session.disable_prepacking", "1")
    if base_dir is not None:
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(base_dir)
        )
    try:
        register_libraries(so, model)
        if weights:
            so.add_external_initializers(
                list(weights), [ort.OrtValue.ortvalue_from_numpy(v) for v in weights.values()]
            )
        sess = ort.InferenceSession(light.SerializeToString(), so, providers=[CPU])
        wanted = [o.name for o in sess.get_outputs()]
        ins = {i.name for i in sess.get_inputs()}
        values = sess.run(wanted, {k: v for k, v in feeds.items() if k in ins})
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
        text = str(e).strip()
        raise GraphoptError(
            f"onnxruntime cannot measure the shapes: {text.splitlines()[0] if text else e}"
        ) from None
    return _typed(names, wanted, values)


def schema_elem_types(model: onnx.ModelProto, elems: dict[str, int]) -> dict[str, int]:
    """Element types of main-graph node outputs that ``elems`` (name → known element type) lacks,
    from their ops' schemas (ONNX's, or onnxruntime's for its contrib ops), in node order: an
    output whose type variable an input shares has that input's type, one whose constraint
    allows a single type has that type.  What no schema decides stays out."""
    known = dict(elems)
    opsets = {o.domain or "": o.version for o in model.opset_import}
    out: dict[str, int] = {}
    for node in model.graph.node:
        todo = [(i, o) for i, o in enumerate(node.output) if o and not known.get(o)]
        if not todo:
            continue
        schema = _schema(node.op_type, node.domain or "", opsets.get(node.domain or ""))
        if schema is None:
            continue
        formal_in, formal_out, single = schema
        bound: dict[str, int] = {}
        for i, name in enumerate(node.input):
            if name and known.get(name) and formal_in:
                var = formal_in[min(i, len(formal_in) - 1)]
                bound.setdefault(var, known[name])
        for i, name in todo:
            if not formal_out:
                break
            var = formal_out[min(i, len(formal_out) - 1)]
            elem = bound.get(var) or single.get(var)
            if elem:
                known[name] = out[name] = elem
    return out


_TENSOR_TYPES = {
    f"tensor({name.lower()})": value
    for name, value in TensorProto.DataType.items()
    if value != TensorProto.UNDEFINED
}
_TENSOR_TYPES |= {"tensor(float)": TensorProto.FLOAT, "tensor(double)": TensorProto.DOUBLE}


@lru_cache(maxsize=1)
def _contrib_schemas() -> dict[tuple[str, str], Any]:
    """onnxruntime's schemas of ops outside the ONNX domain, the latest version of each."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    out: dict[tuple[str, str], Any] = {}
    try:
        schemas = C.get_all_operator_schema()
    except Exception:  # noqa: BLE001 - a build without schemas: nothing decided from them
        return out
    for sc in schemas:
        if sc.domain in ("", "ai.onnx"):
            continue
        key = (sc.domain, sc.name)
        if key not in out or sc.since_version > out[key].since_version:
            out[key] = sc
    return out


@lru_cache(maxsize=1024)
def _schema(op: str, domain: str, opset: int | None):
    """(input type strings, output type strings, {type string: the one element type it
    allows}) of an op, or None when no schema is known."""
    if domain in ("", "ai.onnx"):
        try:
            sc = onnx.defs.get_schema(op, opset or onnx.defs.onnx_opset_version(), "")
        except onnx.defs.SchemaError:
            return None
        ins = tuple(f.type_str for f in sc.inputs)
        outs = tuple(f.type_str for f in sc.outputs)
        constraints = [
            (tc.type_param_str, list(tc.allowed_type_strs)) for tc in sc.type_constraints
        ]
    else:
        sc = _contrib_schemas().get((domain, op))
        if sc is None:
            return None
        ins = tuple(f.typeStr for f in sc.inputs)
        outs = tuple(f.typeStr for f in sc.outputs)
        constraints = [
            (tc.type_param_str, list(tc.allowed_type_strs)) for tc in sc.type_constraints
        ]
    single = {t: _TENSOR_TYPES[t] for t in ins + outs if t in _TENSOR_TYPES}
    for var, allowed in constraints:
        if len(allowed) == 1 and allowed[0] in _TENSOR_TYPES:
            single[var] = _TENSOR_TYPES[allowed[0]]
    return ins, outs, single


def _typed(names: list[str], wanted: list[str], values: list) -> dict[str, TypeInfo]:
    out: dict[str, TypeInfo] = {}
    for name, v in zip(wanted, values):
        if isinstance(v, np.ndarray) and name in names:
            try:
                elem = helper.np_dtype_to_tensor_dtype(v.dtype)
            except (KeyError, TypeError, ValueError):
                continue
            out[name] = (elem, [int(d) for d in v.shape])
    return out


def _weightless(
    model: onnx.ModelProto, names: list[str]
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of ``model`` with ``names`` added as outputs whose main-graph initializers over
    :data:`STUB_BYTES` are stubs marked external, and {name: array} of their data (what
    ``SessionOptions.add_external_initializers`` supplies in their place)."""
    g = model.graph
    light = onnx.ModelProto()
    light.ir_version = max(model.ir_version, 4)
    light.producer_name = model.producer_name
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    lg = light.graph
    lg.name = g.name
    lg.node.extend(g.node)
    lg.input.extend(g.input)
    lg.output.extend(g.output)
    lg.value_info.extend(g.value_info)
    lg.sparse_initializer.extend(g.sparse_initializer)
    have = {o.name for o in g.output}
    lg.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in have)
    weights: dict[str, np.ndarray] = {}
    for t in g.initializer:
        plain = t.data_type in PLAIN_TYPES and t.data_location != TensorProto.EXTERNAL
        if not plain or len(t.raw_data) <= STUB_BYTES:
            lg.initializer.append(t)
            continue
        weights[t.name] = numpy_helper.to_array(t)
        stub = lg.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        stub.data_location = TensorProto.EXTERNAL
        stub.external_data.add(key="location", value="graphopt-supplied-in-memory")
    return light, weights


def itemsize(elem_type: int) -> int | None:
    try:
        return int(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except (KeyError, TypeError, ValueError):
        return None


def nbytes(info: TypeInfo | None) -> int | None:
    """Byte size of a tensor with static dims, else None."""
    if info is None or info[1] is None:
        return None
    elem, dims = info
    if any(not isinstance(d, int) or d < 0 for d in dims):
        return None
    size = itemsize(elem)
    if size is None:
        return None
    return int(np.prod(dims, dtype=np.int64)) * size


def dtype_name(elem_type: int) -> str | None:
    try:
        return TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return None


def memory_plan(
    model: onnx.ModelProto, view: dict[str, TypeInfo], input_shapes: dict[str, list[int]]
) -> dict[str, Any]:
    g = model.graph
    init_names = {t.name for t in g.initializer}
    input_names = [i.name for i in g.input if i.name not in init_names]
    output_names = {o.name for o in g.output}
    nodes = list(g.node)
    # Buffers: every node output owns one, except aliasing ops' outputs, which share their
    # input's buffer (none when that input is a weight or a graph input).
    buffer_of: dict[str, int | None] = {}
    sizes: list[int] = []
    unknown: list[str] = []
    activations, sum_bytes = 0, 0
    for node in nodes:
        for i, name in enumerate(node.output):
            if not name:
                continue
            activations += 1
            size = nbytes(view.get(name))
            if size is None:
                unknown.append(name)
                size = 0
            sum_bytes += size
            src = node.input[0] if node.input else ""
            if node.op_type in ALIASING_OPS and i == 0 and src:
                buffer_of[name] = buffer_of.get(src)  # None for weights / graph inputs
                continue
            buffer_of[name] = len(sizes)
            sizes.append(size)
    # Last reader of each buffer (index of the node); graph outputs live to the end.
    end = len(nodes)
    last_use = [-1] * len(sizes)
    produced_at: dict[int, int] = {}
    for idx, node in enumerate(nodes):
        for name in node.output:
            b = buffer_of.get(name)
            if b is not None and b not in produced_at:
                produced_at[b] = idx
                last_use[b] = max(last_use[b], idx)
        for name in list(node.input) + _subgraph_inputs(node):
            b = buffer_of.get(name)
            if b is not None:
                last_use[b] = max(last_use[b], idx)
    for name, b in buffer_of.items():
        if b is not None and name in output_names:
            last_use[b] = end
    frees_at: dict[int, list[int]] = defaultdict(list)
    for b, idx in enumerate(last_use):
        frees_at[idx].append(b)
    live = peak = 0
    peak_node = ""
    free_by_size: dict[int, int] = defaultdict(int)  # exact-size free list (count per size)
    arena = 0
    for idx, node in enumerate(nodes):
        for name in node.output:
            b = buffer_of.get(name)
            if b is None or produced_at.get(b) != idx:
                continue
            live += sizes[b]
            if free_by_size[sizes[b]]:
                free_by_size[sizes[b]] -= 1
            else:
                arena += sizes[b]
        if live > peak:
            peak, peak_node = live, node.name or f"{node.op_type}@{node.output[0]}"
        for b in frees_at.get(idx, ()):
            live -= sizes[b]
            free_by_size[sizes[b]] += 1
    weights = sum(_numel(t) * (itemsize(t.data_type) or 0) for t in g.initializer)
    inputs_bytes = sum(nbytes(view.get(n)) or 0 for n in input_names)
    no_reuse = sum(sizes)
    return {
        "shapes": {k: list(v) for k, v in sorted(input_shapes.items())},
        "activations": activations,
        "sum_bytes": sum_bytes,
        "no_reuse_bytes": no_reuse,
        "peak_bytes": peak,
        "peak_at_node": peak_node,
        "exact_size_reuse_bytes": arena,
        "reuse_saving": round(1 - peak / no_reuse, 4) if no_reuse else 0.0,
        "weights_bytes": weights,
        "inputs_bytes": inputs_bytes,
        "unknown_size": unknown[:50],
        "unknown_size_count": len(unknown),
        "aliasing_ops": sorted(ALIASING_OPS),
        "order": "the model's node order (topological)",
        "scope": "main graph; subgraph bodies not planned",
    }


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope names a node's subgraphs read (they keep those buffers alive)."""
    names: list[str] = []
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for n in sub.node:
                names.extend(n.input)
                for a in n.attribute:
                    if a.HasField("g") or len(a.graphs):
                        names.extend(_subgraph_inputs(n))
                        break
    return names

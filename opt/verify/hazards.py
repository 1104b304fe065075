"""What would crash or exhaust the machine if onnxruntime ran a model, told before it runs.

onnxruntime computes what a model says: an integer Div/Mod of INT_MIN by -1 or by zero kills
the process with SIGFPE, a Range of 10^13 elements fills the memory until the kernel's OOM
killer ends the process, a Loop of 10^9 iterations runs for half an hour.  graphopt runs the
user's model (parity, the performance net, the bundle's checks), so it must end with a clear
line instead.  :func:`runtime_hazard` finds the first two statically where their operands are
constants, and any node of constants that would make a tensor past the bound (an Einsum outer
product, an Expand, a Tile: a run computes them whatever its inputs), in the graphs
a run executes (Loop and Scan bodies, and If branches for shape inference, which visits both);
:data:`RUN_SECONDS` bounds every run (``GRAPHOPT_RUN_SECONDS``, checked by
:func:`run_deadline`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import GraphoptError


class HazardError(GraphoptError):
    """A run refused for a hazard of the model itself: no other input would run it."""


#: the most bytes one constant-sized tensor a run makes may take (Range, ConstantOfShape)
MAX_RUN_TENSOR_BYTES = 8 << 30
#: the seconds one onnxruntime run of a model may take before it is cut short
RUN_SECONDS = 900.0


def _graphs(graph: onnx.GraphProto, branches: bool) -> Iterator[onnx.GraphProto]:
    """``graph`` and its bodies (If branches only with ``branches``: a run takes one)."""
    yield graph
    for node in graph.node:
        if node.op_type == "If" and not node.domain and not branches:
            continue
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g, branches)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graphs(g, branches)


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Small constants of ``graph`` by name (initializers and Constant nodes of at most 64
    elements: operands of a Div, a Range, a ConstantOfShape)."""
    found = {
        t.name: t for t in graph.initializer if math.prod(t.dims) <= 64 and not t.external_data
    }
    for n in graph.node:
        if n.op_type == "Constant" and not n.domain and n.output:
            for a in n.attribute:
                if a.name == "value" and math.prod(a.t.dims) <= 64:
                    found[n.output[0]] = a.t
    return found


def _value(consts: dict, name: str) -> np.ndarray | None:
    t = consts.get(name)
    if t is None:
        return None
    try:
        return numpy_helper.to_array(t)
    except (ValueError, TypeError, KeyError):
        return None


def _label(node: onnx.NodeProto) -> str:
    return node.name or f"{node.op_type}@{node.output[0] if node.output else '?'}"


def _division(node: onnx.NodeProto, consts: dict) -> str | None:
    if len(node.input) < 2:
        return None
    a, b = _value(consts, node.input[0]), _value(consts, node.input[1])
    if a is None or b is None or b.dtype.kind not in "iu":
        return None
    if np.any(b == 0):
        return f"integer {node.op_type} '{_label(node)}' divides by zero"
    if b.dtype.kind == "i":
        lo = np.iinfo(b.dtype).min
        try:
            both = np.broadcast_arrays(a, b)
        except ValueError:
            return None
        if np.any((both[0] == lo) & (both[1] == -1)):
            return f"integer {node.op_type} '{_label(node)}' divides {lo} by -1"
    return None


def _scanned(loop: onnx.NodeProto, consts: dict) -> tuple[float, int] | None:
    """(elements, 1) of the scan outputs a Loop with a constant trip count stacks: every
    iteration's static-shaped values, trip count times (bytes as elements of one byte)."""
    trips = _value(consts, loop.input[0])
    body = next((a.g for a in loop.attribute if a.name == "body"), None)
    if trips is None or trips.size != 1 or body is None:
        return None
    carried = len(loop.input) - 2
    per_trip = 0
    for out in body.output[1 + carried :]:
        t = out.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if not t.HasField("shape") or None in dims or t.elem_type not in _ITEM_BYTES:
            continue  # not known statically: not counted
        per_trip += math.prod(dims) * _ITEM_BYTES[t.elem_type]
    return float(max(int(trips.reshape(())), 0)) * per_trip, 1


#: bytes per element of the tensor types whose size a hazard check counts
_ITEM_BYTES = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.INT64: 8,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.BOOL: 1,
}


def _size(node: onnx.NodeProto, consts: dict) -> tuple[float, int] | None:
    """(elements, bytes per element) of a Range or ConstantOfShape with constant operands, or
    of the scan outputs of a Loop with a constant trip count."""
    if node.op_type == "Range" and len(node.input) >= 3:
        vals = [_value(consts, i) for i in node.input[:3]]
        if any(v is None or v.size != 1 for v in vals):
            return None
        start, limit, delta = (float(v.reshape(())) for v in vals)
        if delta == 0 or not all(math.isfinite(x) for x in (start, limit, delta)):
            return None
        return max(math.ceil((limit - start) / delta), 0), vals[0].dtype.itemsize
    if node.op_type == "Loop" and node.input and node.input[0]:
        return _scanned(node, consts)
    if node.op_type == "ConstantOfShape" and node.input:
        shape = _value(consts, node.input[0])
        if shape is None:
            return None
        item = 4
        for a in node.attribute:
            if a.name == "value":
                item = max(numpy_helper.to_array(a.t).dtype.itemsize, 1)
        return float(np.prod(shape.astype(np.float64))), item
    return None


def runtime_hazard(model: onnx.ModelProto, branches: bool = False) -> str | None:
    """One line saying what would crash or exhaust the machine if onnxruntime ran ``model``
    (its operands constant), or None.  If branches are looked at with ``branches`` (shape
    inference visits both; a run takes one, which may be a safe one)."""
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    for g in _graphs(model.graph, branches):
        consts = shapes = None
        for node in g.node:
            if node.domain or node.op_type not in _LOOKED_AT:
                continue
            consts = _constants(g) if consts is None else consts
            if node.op_type in GROWING:
                shapes = _constant_shapes(g) if shapes is None else shapes
                made = _grown(node, shapes, consts, opsets)
                if made is not None and made[1] > MAX_RUN_TENSOR_BYTES:
                    return (
                        f"{node.op_type} '{_label(node)}' of constants makes {made[0]:.3g} "
                        f"elements ({made[1] / 2**30:.3g} GiB), more than the "
                        f"{MAX_RUN_TENSOR_BYTES >> 30} GiB one tensor of a run may take, "
                        "whatever the inputs"
                    )
                continue
            if node.op_type in ("Div", "Mod"):
                why = _division(node, consts)
                if why:
                    return f"{why}: onnxruntime would die of SIGFPE running it"
                continue
            size = _size(node, consts)
            if size is not None and size[0] * size[1] > MAX_RUN_TENSOR_BYTES:
                gib = size[0] * size[1] / 2**30
                made = (
                    f"stacks {gib:.3g} GiB of scan outputs"
                    if node.op_type == "Loop"
                    else f"makes {size[0]:.3g} elements ({gib:.3g} GiB)"
                )
                return (
                    f"{node.op_type} '{_label(node)}' {made}, more than the "
                    f"{MAX_RUN_TENSOR_BYTES >> 30} GiB one tensor of a run may take"
                )
    return None


#: ops whose output may be far larger than their operands: with constant operands only, a run
#: computes them whatever its inputs
GROWING = frozenset(
    {"Einsum", "MatMul", "Gemm", "Expand", "Tile", "Pad", "Resize", "Upsample", "Concat", "OneHot"}
)
_LOOKED_AT = GROWING | {"Div", "Mod", "Range", "ConstantOfShape", "Loop"}


def _constant_shapes(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Every constant of ``graph`` by name (initializers and Constant nodes): their dims and
    element types tell the shapes a node of constants makes."""
    found = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and not n.domain and n.output:
            for a in n.attribute:
                if a.name == "value":
                    found[n.output[0]] = a.t
    return found


def _grown(node: onnx.NodeProto, shapes: dict, consts: dict, opsets) -> tuple[float, int] | None:
    """(elements, bytes) of the largest output of a node whose operands are all constants, as
    onnx infers the node alone (the small operands by value: shapes, pads, repeats, scales);
    None when an operand is computed or the shape does not come out static."""
    names = [i for i in node.input if i]
    if not names or any(i not in shapes for i in names):
        return None
    inputs, inits = [], []
    for name in dict.fromkeys(names):
        t = shapes[name]
        if name in consts:  # small: by value
            value = onnx.TensorProto()
            value.CopyFrom(consts[name])
            value.name = name  # a Constant node's tensor has none
            inits.append(value)
        else:
            inputs.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    outs = [onnx.helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = onnx.helper.make_graph([node], "alone", inputs, outs, inits)
    try:
        model = onnx.helper.make_model(graph, opset_imports=opsets)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - onnx's inference errors have no common type
        return None
    worst = None
    for vi in inferred.graph.output:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if not t.HasField("shape") or None in dims or t.elem_type not in _ITEM_BYTES:
            continue
        count = float(math.prod(dims))
        if worst is None or count * _ITEM_BYTES[t.elem_type] > worst[1]:
            worst = (count, int(count) * _ITEM_BYTES[t.elem_type])
    return worst


def run_seconds() -> float:
    from ..environment import env_number

    return env_number("GRAPHOPT_RUN_SECONDS", RUN_SECONDS)


@contextmanager
def run_deadline(options, seconds: float | None = None):
    """Cut an onnxruntime run (its ``RunOptions``) short after ``seconds`` (default
    :func:`run_seconds`); yields a flag that says whether it was."""
    limit = run_seconds() if seconds is None else seconds
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        options.terminate = True

    if limit <= 0:
        stop()  # no time at all: cut short before it starts
    timer = threading.Timer(max(limit, 0.0), stop)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()

"""Models onnxruntime runs that onnx's checker or graphsurgeon would refuse: fix-ups and notes.

graphopt accepts every model onnxruntime accepts.  Where the two disagree, the model is fixed
up *in memory* (the input file is never written) and the fix-up is reported as an analysis
remark, so the user knows what the optimized model differs in besides the rewrites:

* **IR version < 4 with initializers not listed as graph inputs.**  onnx's checker demands that
  every initializer of an IR < 4 model is also a graph input; onnxruntime does not.  In IR < 4 an
  initializer listed as an input is a constant (not an overridable default), so listing the
  missing ones (:func:`accept_on_load`, called by ``load_model`` before the checker) changes
  nothing; the IR then exports the model at IR version 4 with them as plain initializers.
* **Model-local functions** (``ModelProto.functions``).  They are inlined into the graph when the
  IR is built (:func:`inline_functions`), recursively, calls inside If/Loop/Scan bodies too;
  functions the graph never calls are kept as they are.  Why inline rather than optimize inside
  each body: onnxruntime (and TensorRT's ONNX parser) inline local functions when they load a
  model, so the structure does not survive to run time either way, while graphopt's fusions,
  folding and legalize only see through a call once it is inlined.  Measured on 6 calls of
  a pre-LayerNorm MLP block function (LayerNorm and erf-Gelu spelled out, MatMul+Add; input
  1x128x256; onnxruntime 1.32, CPU, 1 thread, median of 60 interleaved runs, two runs on a
  shared machine): inlined, -O2 gives 126 → 36 nodes (6 LayerNormalization, 6 Gemm, 6 Gelu)
  and runs in 6.7 ms vs 7.1-7.6 ms kept (ORT_ENABLE_ALL; 4.6-7.5 ms vs 6.4-8.1 ms with
  onnxruntime's own fusions off); kept, the calls stay opaque to every rule.  A function the
  inliner cannot take (e.g. an opset it cannot convert) is kept; legalize then judges its
  calls by their bodies.
* **Weights listed as graph inputs** (exported with ``keep_initializers_as_inputs=True``).  In
  IR >= 4 an initializer listed as an input is an overridable default, so neither onnxruntime
  nor graphopt may fold it, and no Conv+BN fold, no constant folding reaches the weights.  When
  *every* initializer of the main graph is listed and at least one is a weight (a float tensor
  of rank 2 or more): the exporter flag's signature, not a deliberate default (those are a few
  listed among unlisted weights: scalars, thresholds), they become constants and leave the
  inputs (:func:`weights_as_inputs`), as onnxruntime's load-time warning advises, onnxsim and
  onnxslim do.  Callers that feed only the model's real inputs see no change; a feed for a
  frozen weight is refused.  ``--keep-initializer-inputs`` keeps them overridable.
* **Nodes not topologically sorted** (onnxruntime's float16 converter, hand-edited graphs).
  onnx's checker refuses a graph whose nodes read a value before the node making it;
  onnxruntime sorts the graph when it loads it.  :func:`sort_on_load` (called by ``load_model``
  when the checker refuses the order, so that a sorted model costs no walk over its nodes in
  Python) sorts the nodes of the main graph, of every If/Loop/Scan body and of every model-local
  function in memory: a stable sort (Kahn's algorithm over the nodes' original
  positions), which reorders the node messages where they are (no copy, no weight read: external
  data stays on disk).  A node with bodies depends on the producers of the outer values its
  bodies read.  A graph with a cycle is refused (:class:`CycleError`, naming nodes on it).  The
  sort is recorded in the model's ``metadata_props`` under :data:`SORTED_KEY` (in memory only;
  the IR drops the key, so no output carries it) and reported as a ``graph-sorted`` remark.
* **String tensors** and **sequence/map values** (ai.onnx.ml ZipMap) pass through the IR
  untouched (:mod:`graphopt.opt.graph.ir` exports them faithfully).

:func:`remarks` turns what happened to one model into analysis remarks (pass ``load``), for the
optimizer to add to the report.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.inliner
from onnx import helper

from ..remarks import Remark

PASS = "load"
#: doc_string of a graph input listed on load (an IR < 4 initializer the checker wants listed)
LISTED_ON_LOAD = "graphopt: IR<4 initializer listed on load (a constant, not an input)"

FunctionId = tuple[str, str]
#: metadata_props key under which :func:`sort_on_load` records, in memory, what it sorted
SORTED_KEY = "graphopt.load.sorted"
#: metadata keys that describe the loading of a model, never written into an output
LOAD_KEYS = frozenset({SORTED_KEY})


@dataclass(frozen=True)
class Note:
    """One thing graphopt did to accept a model: a stable code and a one-line message."""

    code: str
    message: str


# ------------------------------------------------------------------------- on load
def accept_on_load(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fix up, in place, what onnx's checker refuses and onnxruntime runs; returns ``model``.

    IR < 4: initializers missing from the graph inputs are listed there (a constant either way
    in IR < 4); :func:`load_notes` reports them.
    """
    if len(model.graph.sparse_initializer):
        _densify(model.graph)
    if model.ir_version < 4:
        listed = {i.name for i in model.graph.input}
        for t in model.graph.initializer:
            if t.name in listed:
                continue
            info = helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
            info.doc_string = LISTED_ON_LOAD
            model.graph.input.append(info)
    return model


#: a sparse initializer is made dense only up to this many bytes (its values stay sparse in
#: the file; dense, they are what every pass and onnxruntime's kernels read)
DENSE_LIMIT = 1 << 30


def _densify(graph: onnx.GraphProto) -> None:
    """The main graph's sparse initializers as dense ones (as onnxruntime reads them), or
    ModelLoadError when one is malformed or too large."""
    from onnx import numpy_helper

    from ..errors import ModelLoadError

    for sp in graph.sparse_initializer:
        name = sp.values.name
        dims = [int(d) for d in sp.dims]
        try:
            values = numpy_helper.to_array(sp.values).reshape(-1)
            indices = numpy_helper.to_array(sp.indices).astype(np.int64)
            size = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if any(d < 0 for d in dims) or size * max(values.itemsize, 1) > DENSE_LIMIT:
                raise ValueError(f"{dims} is too large to hold dense")
            if indices.ndim == 2:  # [NNZ, rank] coordinates
                indices = np.ravel_multi_index(tuple(indices.T), dims) if dims else indices[:, 0]
            indices = indices.reshape(-1)
            if len(indices) != len(values) or (
                len(indices) and (indices.min() < 0 or indices.max() >= size)
            ):
                raise ValueError("its indices do not match its values and dims")
            dense = np.zeros(size, dtype=values.dtype)
            dense[indices] = values
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"sparse initializer '{name}' cannot be read: {e}") from None
        graph.initializer.append(numpy_helper.from_array(dense.reshape(dims), name))
    del graph.sparse_initializer[:]


def load_notes(model: onnx.ModelProto) -> list[Note]:
    """What :func:`accept_on_load` and :func:`sort_on_load` changed in ``model`` (empty for a
    model they left alone)."""
    notes = []
    sorted_what = next((p.value for p in model.metadata_props if p.key == SORTED_KEY), None)
    if sorted_what is not None:
        notes.append(_sorted_note(sorted_what))
    listed = [i.name for i in model.graph.input if i.doc_string == LISTED_ON_LOAD]
    if not listed:
        return notes
    shown = ", ".join(listed[:4]) + (" ..." if len(listed) > 4 else "")
    return notes + [
        Note(
            "ir-initializers-listed",
            f"IR version {model.ir_version}: {len(listed)} initializer(s) not listed as graph "
            f"inputs ({shown}), which onnx's checker requires and onnxruntime does not; accepted "
            "as constants (the input file is not modified)",
        )
    ]


# ------------------------------------------------------------------------ node order
class CycleError(ValueError):
    """A graph whose nodes cannot be sorted: some of them depend on each other in a cycle."""


def sort_on_load(model: onnx.ModelProto) -> bool:
    """Sort, in place, the nodes of every graph of ``model`` that is not topologically sorted
    (main graph, If/Loop/Scan bodies, model-local functions); record what was sorted under
    :data:`SORTED_KEY`.  Whether anything moved.  Raises :class:`CycleError` for a cycle."""
    moved = _walk_orders(model, apply=True)
    if not moved:
        return False
    kept = [p for p in model.metadata_props if p.key != SORTED_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=SORTED_KEY, value=_describe_sorted(moved))
    return True


def unsorted_notes(model: onnx.ModelProto) -> list[Note]:
    """For a model given in memory (not loaded by ``load_model``, which sorts): a
    ``graph-sorted`` note when its nodes are out of order (the IR sorts them on export)."""
    unsorted = unsorted_graphs(model)
    return [_sorted_note(_describe_sorted(unsorted))] if unsorted else []


def _sorted_note(what: str) -> Note:
    return Note(
        "graph-sorted",
        f"nodes not topologically sorted ({what}), which onnx's checker refuses and "
        "onnxruntime accepts (it sorts them on load): sorted in memory, the output is sorted "
        "(the input file is not modified)",
    )


def unsorted_graphs(model: onnx.ModelProto) -> list[tuple[str, int, int]]:
    """The graphs of ``model`` whose nodes are not topologically sorted, as (where, nodes out
    of place, nodes), without changing the model; [] for a sorted model (and for one with a
    cycle: loading refuses it, the IR's export says so)."""
    try:
        return _walk_orders(model, apply=False)
    except CycleError:
        return []


def _walk_orders(model: onnx.ModelProto, apply: bool) -> list[tuple[str, int, int]]:
    """(where, nodes out of place, nodes) for each graph of ``model`` not sorted; with
    ``apply``, each is sorted in place."""
    moved: list[tuple[str, int, int]] = []

    def visit(nodes, where: str) -> None:
        for n in nodes:
            for attr in n.attribute:
                bodies = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
                for body in bodies:
                    label = n.name or n.op_type
                    visit(body.node, f"'{attr.name}' of {n.op_type} '{label}' in {where}")
        rank = _order(nodes, where)
        if rank is None:
            return
        moved.append((where, sum(r != i for i, r in enumerate(rank)), len(rank)))
        if apply:
            ranks = iter(rank)
            # list.sort calls the key once per element, in the current order; the messages
            # are reordered where they are, not copied
            nodes.sort(key=lambda _node: next(ranks))

    visit(model.graph.node, "main graph")
    for f in model.functions:
        visit(f.node, f"function '{f.domain + '.' if f.domain else ''}{f.name}'")
    return moved


def _node_reads(node: onnx.NodeProto) -> list[str]:
    """What a node reads: its inputs and, for a node with bodies, what their nodes read."""
    reads = [name for name in node.input if name]
    if len(node.attribute):
        for inner in proto_nodes([node]):
            if inner is not node:
                reads.extend(name for name in inner.input if name)
    return reads


def stable_order(reads_from: list) -> tuple[list[int], list[int], list[list[int]]]:
    """Kahn's algorithm over a min-heap of the original positions: (the positions in a
    topological order that keeps the given one where it is free, each node's count of
    producers left unplaced, each node's readers).  ``reads_from[i]``: the positions node ``i``
    reads from (itself excluded).  Fewer positions than nodes: the rest lie on cycles."""
    sets = [set(deps) for deps in reads_from]
    pending = [len(deps) for deps in sets]
    users: list[list[int]] = [[] for _ in sets]
    for i, deps in enumerate(sets):
        for p in deps:
            users[p].append(i)
    ready = [i for i, k in enumerate(pending) if not k]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if not pending[u]:
                heapq.heappush(ready, u)
    return order, pending, users


def _order(nodes, where: str) -> list[int] | None:
    """Each node's position in a stable topological order (Kahn's algorithm over a min-heap of
    the original positions), or None when the nodes are in one already.  Values no node of
    ``nodes`` makes (inputs, initializers, the outer scope, undefined ones for the checker to
    name) are not dependencies.  Raises :class:`CycleError`."""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for name in n.output:
            if name:
                producer.setdefault(name, i)
    reads_from = [{p for p in map(producer.get, _node_reads(n)) if p is not None} for n in nodes]
    if all(p < i for i, deps in enumerate(reads_from) for p in deps):
        return None
    order, pending, users = stable_order(reads_from)
    if len(order) != len(reads_from):
        stuck = _on_cycles({i for i, k in enumerate(pending) if k}, users, reads_from)
        names = [nodes[i].name or f"#{i} ({nodes[i].op_type})" for i in stuck]
        shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        raise CycleError(
            f"{where} has a cycle: {len(stuck)} node(s) depend on each other ({shown})"
        )
    rank = [0] * len(order)
    for position, i in enumerate(order):
        rank[i] = position
    return rank


def _on_cycles(stuck: set[int], users: list[list[int]], reads_from: list[set[int]]) -> list[int]:
    """The nodes Kahn's algorithm left that lie on a cycle (or between cycles): those merely
    downstream of one are peeled off, sinks first."""
    left = set(stuck)
    waiting = {i: sum(u in left for u in users[i]) for i in left}
    sinks = [i for i, k in waiting.items() if not k]
    while sinks:
        i = sinks.pop()
        left.discard(i)
        for p in reads_from[i]:
            if p in left:
                waiting[p] -= 1
                if not waiting[p]:
                    sinks.append(p)
    return sorted(left)


def _describe_sorted(moved: list[tuple[str, int, int]]) -> str:
    parts = [f"{where}: {k} of {n} node(s) out of order" for where, k, n in moved[:3]]
    more = f"; and {len(moved) - 3} more graph(s)" if len(moved) > 3 else ""
    return "; ".join(parts) + more


# ----------------------------------------------------------------------- functions
def function_id(f: onnx.FunctionProto | onnx.NodeProto) -> FunctionId:
    if isinstance(f, onnx.FunctionProto):
        return (f.domain, f.name)
    return (f.domain, f.op_type)


def proto_nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """Nodes with those of their subgraph attributes, recursively."""
    for n in nodes:
        yield n
        for a in n.attribute:
            subs = ([a.g] if a.HasField("g") else []) + list(a.graphs)
            for g in subs:
                yield from proto_nodes(g.node)


def called_functions(model: onnx.ModelProto) -> dict[FunctionId, int]:
    """Local functions the graph calls, directly or through other functions: id -> calls."""
    if not len(model.functions):
        return {}
    table = {function_id(f): f for f in model.functions}
    calls: dict[FunctionId, int] = {}
    todo = [n for n in proto_nodes(model.graph.node) if function_id(n) in table]
    seen: set[FunctionId] = set()
    while todo:
        fid = function_id(todo.pop())
        calls[fid] = calls.get(fid, 0) + 1
        if fid not in seen:
            seen.add(fid)
            todo += [n for n in proto_nodes(table[fid].node) if function_id(n) in table]
    return calls


#: the element types of weights (:func:`weights_as_inputs`)
_FLOAT_TYPES = frozenset(
    getattr(onnx.TensorProto, name) for name in ("FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE")
)


def weights_as_inputs(model: onnx.ModelProto) -> list[str]:
    """The initializers of a model exported with its weights as graph inputs, to be frozen
    into constants: every initializer of the main graph is listed as an input (IR >= 4) and
    one at least is a weight (float, rank 2 or more); else [] (only some listed: deliberate
    overridable defaults, kept)."""
    if model.ir_version < 4:
        return []  # listed initializers are constants in IR < 4 anyway
    inits = model.graph.initializer
    listed = {i.name for i in model.graph.input}
    if not inits or any(t.name not in listed for t in inits):
        return []
    if not any(t.data_type in _FLOAT_TYPES and len(t.dims) >= 2 for t in inits):
        return []
    return [t.name for t in inits]


def frozen_note(names: list[str]) -> Note:
    """The note of :func:`weights_as_inputs`'s freezing."""
    return Note(
        "weights-frozen",
        f"{len(names)} initializers were also graph inputs (every weight, as "
        "keep_initializers_as_inputs=True exports them): they are constants in the output, "
        "which no longer lists them as inputs (so they fold, and feeds for them are refused); "
        "--keep-initializer-inputs keeps them overridable",
    )


def inline_functions(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[Note]]:
    """``model`` with every call to a model-local function inlined (a new model; the input is
    not modified).  Functions the graph does not call are kept.  When the inliner refuses the
    model, it is returned unchanged with a note saying why."""
    opaque = [f for f in model.functions if f.domain in OPAQUE_FUNCTION_DOMAINS]
    calls = {
        k: v for k, v in called_functions(model).items() if k[0] not in OPAQUE_FUNCTION_DOMAINS
    }
    if not calls:
        return model, []
    if opaque:  # graphopt's own kernels stay calls: their bodies are for other runtimes
        model = _without_functions(model, opaque)
    try:
        inlined = onnx.inliner.inline_local_functions(model, convert_version=True)
    except Exception as e:  # noqa: BLE001 - the C++ inliner raises several unrelated types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return model, [
            Note(
                "functions-kept",
                f"model-local functions not inlined ({first}); kept, and legalize judges "
                "their calls by their bodies",
            )
        ]
    del inlined.functions[:]
    inlined.functions.extend(f for f in model.functions if function_id(f) not in calls)
    inlined.functions.extend(opaque)
    return inlined, []


#: domains of model-local functions that are never inlined on import: the portable bodies of
#: graphopt's generated kernels (``graphopt.fused``), whose calls are the kernels' nodes
OPAQUE_FUNCTION_DOMAINS = frozenset({"graphopt.fused"})


def _without_functions(model: onnx.ModelProto, drop: list) -> onnx.ModelProto:
    """A copy of ``model`` without the functions ``drop`` (the inliner works on the copy)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    ids = {function_id(f) for f in drop}
    del out.functions[:]
    out.functions.extend(f for f in model.functions if function_id(f) not in ids)
    return out


def _inlined_note(model: onnx.ModelProto, kept: Iterable[FunctionId]) -> list[Note]:
    calls = {
        k: v
        for k, v in called_functions(model).items()
        if k not in set(kept) and k[0] not in OPAQUE_FUNCTION_DOMAINS
    }
    if not calls:
        return []
    names = sorted(f"{d}.{n}" if d else n for d, n in calls)
    return [
        Note(
            "functions-inlined",
            f"{sum(calls.values())} call(s) of {len(calls)} model-local function(s) inlined "
            f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}): onnxruntime inlines "
            "them at load too, and the rules see through them",
        )
    ]


# ------------------------------------------------------------------------ remarks
def remarks(model: onnx.ModelProto, ir=None, notes: Iterable[Note] = ()) -> list[Remark]:
    """Analysis remarks for what loading ``model`` (and building ``ir``, a ModelIR of it or of
    its opset-upgraded version) changed beyond the pipeline's rewrites; ``notes``: the
    caller's own (:func:`unsorted_notes`)."""
    notes = load_notes(model) + list(notes) + list(getattr(ir, "notes", []))
    if ir is not None:
        notes += _inlined_note(model, getattr(ir, "functions", {}))
    if model.ir_version < 4 and ir is not None:
        notes.append(
            Note(
                "ir-version-raised",
                f"IR version {model.ir_version} → 4 on export (initializers stay constants; "
                "the input file is not modified)",
            )
        )
    return [Remark("analysis", PASS, PASS, n.code, (), n.message) for n in notes]


@dataclass(frozen=True)
class DimSplit:
    """A dim_param the ``--inputs`` arrays disagree on: every graph-input axis declaring it,
    as (input, axis, the size given there or None)."""

    param: str
    axes: tuple[tuple[str, int, int | None], ...]

    def message(self) -> str:
        given = [f"{n}[{a}]={v}" for n, a, v in self.axes if v is not None]
        others = [f"{n}[{a}]" for n, a, v in self.axes if v is None]
        rest = f" (also declared by {', '.join(others)})" if others else ""
        return (
            f"the inputs given contradict the shared dim_param '{self.param}': "
            f"{', '.join(given)}{rest}; onnxruntime runs the model so, and the passes treat "
            "these axes as distinct (each its own symbol: no rewrite relies on their equality); "
            f"the output still declares '{self.param}'"
        )

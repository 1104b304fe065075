"""The in-memory IR: an onnx-graphsurgeon graph plus what graphsurgeon would otherwise lose.

graphsurgeon gives use-lists (``tensor.inputs`` = producer, ``tensor.outputs`` = consumers) that
stay in sync under mutation, which is what a rewrite engine needs.  It also drops information on
import/export; :class:`ModelIR` keeps it and restores it:

* model-level fields (ir_version, producer, doc_string, metadata_props, training_info, opset
  imports) and the model-local functions the graph does not call, verbatim;
* model-local functions the graph calls are inlined on import (:mod:`graphopt.opt.graph.compat` says
  why); one the inliner refuses is kept verbatim;
* node ``doc_string`` and ``metadata_props``, carried by the node object itself (two nodes of the
  same name keep their own), plus provenance tags for nodes made by rules;
* the declared interface: graph inputs' and outputs' doc_strings, and every ``dim_param`` the
  model declared on them stays, even when the pipeline proved the dim static (except for inputs
  legalize pinned on a static-shape target, see :meth:`ModelIR.pin_input`);
* string tensors (graphsurgeon would write them as raw bytes, which ONNX forbids), and sequence,
  map and optional types (graphsurgeon represents tensors only);
* initializers that are also graph inputs (``keep_initializers_as_inputs``): graphsurgeon turns
  them into constants, silently changing the interface.  In IR >= 4 they are *overridable
  defaults*, so they stay graph inputs here (rules see them as non-constant and say so); in IR < 4
  they are constants by definition and the IR version is raised to 4 on export.

Only ``opt/`` touches graphsurgeon objects raw; passes and rules use the helpers below.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import math
import os
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import (
    OnnxExporter,
    check_duplicate_node_names,
    update_import_domains,
)
from onnx_graphsurgeon.importers import onnx_importer as gs_importer
from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues
from onnx_graphsurgeon.util import misc as gs_misc

from .compat import (
    LOAD_KEYS,
    DimSplit,
    Note,
    frozen_note,
    function_id,
    inline_functions,
    stable_order,
    weights_as_inputs,
)
from .domains import is_default

PROVENANCE_KEY = "graphopt.rule"

gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR  # its warnings are not ours to print

Node = gs.Node
Tensor = gs.Tensor
Constant = gs.Constant
Variable = gs.Variable


def export_model(root: gs.Graph, consume: bool = False) -> onnx.ModelProto:
    """``gs.export_onnx(root, do_type_check=False)``, built inside the model: each weight is
    copied into it once (gs.export_onnx copies every weight into a GraphProto, then that graph
    into the model: BERT-base, 0.85 s of its 0.94 s export).  The same message, field for field.
    ``consume``: a weight computed in memory (a fold's result) is read from the export from
    then on and its array let go, so the arrays and their copies are never all held at once."""
    model = onnx.ModelProto(ir_version=onnx.IR_VERSION)
    graph = model.graph
    check_duplicate_node_names(root.nodes, level=gs.logger.G_LOGGER.WARNING)
    hoisted = _outer_constants(root)
    graph.node.extend(_export_scoped_node(n, hoisted) for n in root.nodes)
    graph.name = root.name
    graph.input.extend(OnnxExporter.export_value_info_proto(t, False) for t in root.inputs)
    graph.output.extend(OnnxExporter.export_value_info_proto(t, False) for t in root.outputs)
    tensors = root.tensors()
    for t in hoisted.values():
        tensors.setdefault(t.name, t)
    for t in tensors.values():
        if isinstance(t, gs.Constant):
            if isinstance(t._values, SparseValues):
                graph.sparse_initializer.append(OnnxExporter.export_sparse_tensor_proto(t))
            else:
                graph.initializer.append(OnnxExporter.export_tensor_proto(t))
                if consume and not isinstance(t._values, LazyValues):
                    t._values = LazyValues(graph.initializer[-1])
    for t in root.inputs + root.outputs:
        tensors.pop(t.name, None)
    graph.value_info.extend(
        OnnxExporter.export_value_info_proto(t, False)
        for t in tensors.values()
        if isinstance(t, gs.Variable) and (t.dtype is not None or t.shape is not None)
    )
    if root.doc_string:
        graph.doc_string = root.doc_string
    model.opset_import.extend(update_import_domains(root))
    model.functions.extend(OnnxExporter.export_function(f) for f in root.functions)
    model.producer_name = root.producer_name
    model.producer_version = root.producer_version
    if root.ir_version is not None:
        model.ir_version = root.ir_version
    return model


def _outer_constants(root: gs.Graph) -> dict[int, gs.Constant]:
    """Constants a subgraph reads that the root graph, or another graph, reads too (optimum's
    merged decoders: both branches of the If read every weight from the outer graph).  They are
    written once, as initializers of the root graph, which every body sees; gs would write a
    copy into each body that reads one.  A hoisted constant whose name a body also gives to
    another value is renamed, so that no body shadows it."""
    readers: dict[int, set[int]] = {}
    found: dict[int, gs.Constant] = {}
    names: dict[str, set[int]] = {}
    stack, graphs = [root], 0
    while stack:
        g = stack.pop()
        for node in g.nodes:
            for t in node.inputs:
                if isinstance(t, gs.Constant):
                    readers.setdefault(id(t), set()).add(id(g))
                    found[id(t)] = t
            for t in list(node.inputs) + list(node.outputs):
                names.setdefault(t.name, set()).add(id(t))
            stack.extend(subgraphs(node))
        graphs += 1
    if graphs == 1:
        return {}
    hoisted = {key: t for key, t in found.items() if len(readers[key]) > 1}
    taken = set(names)
    for t in hoisted.values():
        if len(names.get(t.name, ())) > 1:
            base, i = t.name, 1
            while f"{base}_{i}" in taken:
                i += 1
            t.name = f"{base}_{i}"
            taken.add(t.name)
    return hoisted


def _export_scoped_node(node: Node, hoisted: dict[int, gs.Constant]) -> onnx.NodeProto:
    """The node's export; a body leaves out the constants the root graph holds."""
    bodies = subgraphs(node)
    if not bodies or not hoisted:
        return OnnxExporter.export_node(node)
    proto = onnx.helper.make_node(
        node.op,
        inputs=[t.name for t in node.inputs],
        outputs=[t.name for t in node.outputs],
        name=node.name,
        domain=node.domain,
    )
    for key, value in node.attrs.items():
        if isinstance(value, gs.Graph):
            proto.attribute.append(onnx.helper.make_attribute(key, _export_body(value, hoisted)))
        elif isinstance(value, list) and value and isinstance(value[0], gs.Graph):
            proto.attribute.append(
                onnx.helper.make_attribute(key, [_export_body(g, hoisted) for g in value])
            )
        else:
            proto.attribute.extend(OnnxExporter.export_attributes({key: value}))
    return _restore_node_fields(node, proto)


def _export_body(graph: gs.Graph, hoisted: dict[int, gs.Constant]) -> onnx.GraphProto:
    """``OnnxExporter.export_graph(graph, do_type_check=False)`` without the hoisted constants
    (and with nested bodies exported the same way)."""
    tensors = graph.tensors()
    initializer, sparse = [], []
    for t in tensors.values():
        if isinstance(t, gs.Constant) and id(t) not in hoisted:
            if isinstance(t._values, SparseValues):
                sparse.append(OnnxExporter.export_sparse_tensor_proto(t))
            else:
                initializer.append(OnnxExporter.export_tensor_proto(t))
    for t in graph.inputs + graph.outputs:
        tensors.pop(t.name, None)
    value_info = [
        OnnxExporter.export_value_info_proto(t, False)
        for t in tensors.values()
        if isinstance(t, gs.Variable) and (t.dtype is not None or t.shape is not None)
    ]
    return onnx.helper.make_graph(
        nodes=[_export_scoped_node(n, hoisted) for n in graph.nodes],
        name=graph.name,
        inputs=[OnnxExporter.export_value_info_proto(t, False) for t in graph.inputs],
        outputs=[OnnxExporter.export_value_info_proto(t, False) for t in graph.outputs],
        initializer=initializer,
        sparse_initializer=sparse,
        doc_string=graph.doc_string,
        value_info=value_info,
    )


class ModelIR:
    """One model being optimized: the graph and everything needed to write it back faithfully."""

    def __init__(
        self,
        model: onnx.ModelProto,
        base_dir: str | os.PathLike | None = None,
        *,
        inline: bool = True,
        freeze_weights: bool = False,
        split_dims: Sequence[DimSplit] = (),
    ):
        """``inline=False`` keeps model-local functions (verbatim, opaque to the passes);
        ``freeze_weights``: weights an export listed as graph inputs become constants
        (:func:`~graphopt.opt.graph.compat.weights_as_inputs`); ``split_dims``: dim_params the given
        inputs contradict (:func:`~graphopt.opt.verify.feeds.split_dims`), whose axes the passes see
        apart (:meth:`_split_dims`)."""
        self.original_ir_version = model.ir_version
        #: what importing changed beyond the pipeline (see opt/graph/compat.py)
        self.notes: list[Note] = []
        if inline:
            model, self.notes = inline_functions(model)
        self.template = _model_shell(model)
        if any(p.key in LOAD_KEYS for p in self.template.metadata_props):
            # what loading noted in memory (opt/graph/compat.py) is reported, never written
            kept = [p for p in self.template.metadata_props if p.key not in LOAD_KEYS]
            del self.template.metadata_props[:]
            self.template.metadata_props.extend(kept)
        #: value_info names the model itself annotated (any graph): kept on export
        self.annotated = {vi.name for g in all_graphs(model.graph) for vi in g.value_info}
        #: model-local functions still in the model (kept verbatim): (domain, name) -> proto
        self.functions = {function_id(f): f for f in model.functions}
        #: the lowest IR version the output may be written at (a pass that adds a model-local
        #: function raises it to 8: :meth:`add_function`)
        self.min_ir_version = 4
        #: graph inputs and outputs as the model declared them (doc_string, dim_params)
        self.declared = {
            vi.name: _declared(vi) for vi in list(model.graph.input) + list(model.graph.output)
        }
        #: graph inputs legalize pinned to static shapes (their dim_params are not restored)
        self.pinned: set[str] = set()
        input_names = {i.name for i in model.graph.input}
        frozen = weights_as_inputs(model) if freeze_weights else []
        if frozen:
            self.notes.append(frozen_note(frozen))
        overridable = model.ir_version >= 4 and not frozen
        self.input_defaults: dict[str, onnx.TensorProto] = {}
        init_names = {t.name for t in model.graph.initializer}
        if init_names & input_names and overridable:
            self.input_defaults = {
                t.name: t for t in model.graph.initializer if t.name in input_names
            }
            stripped = _graph_copy(model, skip=("initializer",))
            stripped.graph.initializer.extend(
                t for t in model.graph.initializer if t.name not in input_names
            )
            model = stripped
        elif init_names & input_names:
            # IR < 4 or frozen: initializers listed as inputs are constants; drop them there
            stripped = _graph_copy(model, skip=("input",))
            stripped.graph.input.extend(i for i in model.graph.input if i.name not in init_names)
            model = stripped
        self.graph: gs.Graph = gs.import_onnx(model)
        # graphsurgeon keeps the input's opset_import field itself and appends to it on export:
        # a copy keeps the caller's model untouched
        self.graph.import_domains = [copy.deepcopy(o) for o in model.opset_import] or None
        self.root = self.graph
        self.base_dir = base_dir
        if base_dir is not None and _has_external(model):
            _map_external_values(self.graph, base_dir)
        _keep_unsupported_types(model.graph, self.graph)
        _keep_node_annotations(model.graph, self.graph)
        _unique_node_names(self.graph)
        if split_dims:
            self._split_dims(split_dims)
        self.provenance: dict[str, str] = {}
        #: bumped by the pass manager whenever a pass changes the graph; analyses key on it
        self.mutations = 0
        #: per graph (by id): the mutation count and fingerprint its shapes were inferred at
        self.inferred: dict[int, tuple] = {}
        self.sorted: dict[int, int] = {}
        self._names = _NameSource(self.graph)
        #: per graph (by id): its nodes' protos as read, for its first shape inference to reuse
        self.node_protos: dict[int, dict] = {}
        self.node_protos[id(self.graph)] = read_protos(self.graph.nodes, model.graph.node)
        #: per graph (by id): the small constants its last shape inference exported, by id
        self.constant_protos: dict[int, dict] = {}
        #: constants rewrites made to be shared by content (:meth:`shared_constant`):
        #: (graph id, dtype, shape, digest) -> the constant
        self._by_content: dict[tuple, Constant] = {}

    def _split_dims(self, splits: Sequence[DimSplit]) -> None:
        """Each graph-input axis declaring a split dim_param gets a symbol of its own, and every
        other tensor's dim of that name (values the model annotated, declared outputs, in any
        body) becomes unknown: shape inference derives the new symbols from the inputs, so no
        pass takes the axes for equal.  The output's interface keeps the declared dim_params
        (:meth:`_restore_interface`)."""
        graphs = [self.graph] + [b for n in walk_nodes(self.graph) for b in subgraphs(n)]
        taken = {
            d
            for g in graphs
            for t in g.tensors().values()
            if t.shape is not None
            for d in t.shape
            if isinstance(d, str)
        }
        fresh: dict[tuple[str, int], str] = {}
        for split in splits:
            for name, axis, _ in split.axes:
                symbol, k = f"{split.param}@{name}[{axis}]", 1
                while symbol in taken:
                    symbol, k = f"{split.param}@{name}[{axis}]#{k}", k + 1
                taken.add(symbol)
                fresh[(name, axis)] = symbol
            self.notes.append(Note("dim-param-split", split.message()))
        params = {split.param for split in splits}
        inputs = {id(t) for t in self.graph.inputs}
        for g in graphs:
            for t in g.tensors().values():
                if isinstance(t, Constant) or t.shape is None:
                    continue
                if not any(isinstance(d, str) and d in params for d in t.shape):
                    continue
                own = id(t) in inputs
                t.shape = [
                    (fresh.get((t.name, axis)) if own else None)
                    if isinstance(d, str) and d in params
                    else d
                    for axis, d in enumerate(t.shape)
                ]

    # ----------------------------------------------------------------- export
    def to_onnx(self, consume: bool = False) -> onnx.ModelProto:
        """Export the graph, restoring model fields, node metadata and overridable defaults;
        ``consume``: the last export, its computed weights let go as they are copied
        (:func:`export_model`)."""
        self.root.cleanup(remove_unused_graph_inputs=False)
        for g in [self.root] + [s for n in walk_nodes(self.root) for s in subgraphs(n)]:
            toposort(g)
        exported = export_model(self.root, consume)
        added = [
            onnx.OperatorSetIdProto(domain=o.domain, version=o.version)
            for o in exported.opset_import
        ]
        # The exported graph is kept where it is (copying it would copy every inline weight):
        # the model's other fields are replaced by the template's.
        model = exported
        for fd, _ in model.ListFields():
            if fd.name != "graph":
                model.ClearField(fd.name)
        _copy_fields(self.template, model, skip=("graph",))
        model.graph.name = self.template.graph.name or model.graph.name
        model.graph.doc_string = self.template.graph.doc_string
        self._restore_interface(model.graph)
        self._prune_value_info(model.graph)
        model.ir_version = max(self.original_ir_version, self.min_ir_version)
        # Opsets: keep the original imports, add any domain a rule introduced, by name (the
        # exporter gathers them in a set: their order changed from one process to the next)
        have = {o.domain for o in model.opset_import}
        for imp in sorted(added, key=lambda o: o.domain):
            if imp.domain not in have and not is_default(imp.domain):
                model.opset_import.append(imp)
        present = {i.name for i in model.graph.input}
        for name, tensor in self.input_defaults.items():
            if name in present:
                model.graph.initializer.append(tensor)
        for node in model.graph.node:
            if node.name in self.provenance:
                kept = [p for p in node.metadata_props if p.key != PROVENANCE_KEY]
                del node.metadata_props[:]
                node.metadata_props.extend(kept)
                node.metadata_props.add(key=PROVENANCE_KEY, value=self.provenance[node.name])
        return model

    def _restore_interface(self, graph: onnx.GraphProto) -> None:
        """Graph inputs and outputs keep their declared doc_string, type and dim_params."""
        restore_outputs = not self.pinned  # a pinned (static-shape) model's outputs follow it
        for vi in graph.input:
            if vi.name in self.declared:
                _restore_declared(vi, self.declared[vi.name], dims=vi.name not in self.pinned)
        for vi in graph.output:
            if vi.name in self.declared:
                _restore_declared(vi, self.declared[vi.name], dims=restore_outputs)

    def _prune_value_info(self, graph: onnx.GraphProto) -> None:
        """The output annotates what the input annotated, plus the outputs of nodes outside the
        default domain (onnx's shape inference cannot type those when the model is read again);
        every other inferred annotation is dropped: an optimized model is never bigger for
        shapes onnxruntime infers itself."""
        for g in all_graphs(graph):
            typed = {o for n in g.node if not is_default(n.domain) for o in n.output if o}
            keep = [vi for vi in g.value_info if vi.name in self.annotated or vi.name in typed]
            if len(keep) != len(g.value_info):
                del g.value_info[:]
                g.value_info.extend(keep)

    def pin_input(self, tensor: Tensor, shape: list[int]) -> None:
        """Give a graph input a static shape (a static-shape target's parity shape): the only
        change of a declared input shape; the optimized model then declares ``shape``."""
        tensor.shape = list(shape)
        self.pinned.add(tensor.name)

    def add_function(self, proto: onnx.FunctionProto) -> None:
        """Add a model-local function that new nodes call (once per domain and name); the
        output is then written at IR version 8 or later, where such functions exist."""
        key = function_id(proto)
        if key not in self.functions:
            self.functions[key] = proto
            self.template.functions.append(proto)
        self.min_ir_version = max(self.min_ir_version, 8)

    # ------------------------------------------------------------ inspection
    @property
    def opset(self) -> int:
        for imp in self.template.opset_import:
            if is_default(imp.domain):
                return imp.version
        return self.graph.opset

    def nodes(self) -> list[Node]:
        return list(self.graph.nodes)

    def op_histogram(self) -> dict[str, int]:
        return op_histogram(self.graph.nodes)

    def is_graph_output(self, tensor: Tensor) -> bool:
        return any(t is tensor for t in self.graph.outputs)

    def is_graph_input(self, tensor: Tensor) -> bool:
        return any(t is tensor for t in self.graph.inputs)

    def toposort(self) -> None:
        """Topologically sort the current graph, unless no pass changed it since last time."""
        if self.sorted.get(id(self.graph)) != self.mutations:
            toposort(self.graph)
            self.sorted[id(self.graph)] = self.mutations

    def can_rename(self, tensor: Tensor) -> bool:
        """Whether a graph output's name can move onto ``tensor``: it must be the private result
        of a node of the graph being worked on (not an input, output or enclosing-scope value)."""
        if not isinstance(tensor, Variable) or not tensor.inputs:
            return False
        if self.is_graph_output(tensor) or self.is_graph_input(tensor):
            return False
        producer = tensor.inputs[0]
        return not self.in_subgraph or any(n is producer for n in self.graph.nodes)

    def fresh_name(self, base: str) -> str:
        return self._names.fresh(base)

    def shared_constant(self, value: np.ndarray, name: str) -> Constant:
        """A constant holding ``value`` for the graph being worked on: the one an earlier call
        made with the same dtype, shape and bytes, else a new one named ``name`` (made unique).

        For tables a rewrite computes once per layer that are the same for every layer (rotary
        caches): cse compares only small constants (it never reads weights to compare them), so
        equal large values made apart would stay apart; shared here, the model holds one copy.
        Constants are never changed in place, so a shared one stays equal to every value it
        stands for."""
        value = np.asarray(value, order="C")
        key = self._content_key(value)
        found = self._by_content.get(key)
        if found is None:
            found = self._by_content[key] = Constant(self.fresh_name(name), value)
        return found

    def has_shared_constant(self, value: np.ndarray) -> bool:
        """Whether :meth:`shared_constant` already made a constant holding ``value`` here."""
        return self._content_key(np.asarray(value, order="C")) in self._by_content

    def _content_key(self, value: np.ndarray) -> tuple:
        digest = hashlib.blake2b(value.tobytes(), digest_size=16).digest()
        return (id(self.graph), value.dtype.str, value.shape, digest)

    @contextlib.contextmanager
    def scoped(self, graph: gs.Graph):
        """Make a subgraph (If/Loop/Scan body) the graph passes and rewrites work on."""
        saved = self.graph
        self.graph = graph
        try:
            yield graph
        finally:
            self.graph = saved

    @property
    def in_subgraph(self) -> bool:
        return self.graph is not self.root

    # --------------------------------------------------------------- mutation
    def replace_all_uses(self, old: Tensor, new: Tensor) -> None:
        """Make every reader of ``old`` read ``new``; a graph output keeps its name."""
        for consumer in list(old.outputs):
            for i, t in enumerate(consumer.inputs):
                if t is old:
                    consumer.inputs[i] = new
        if not self.is_graph_output(old):
            return
        movable = self.can_rename(new)
        producer = new.inputs[0] if movable else None
        unlink_all(old.inputs)
        if movable:
            if old.dtype is None:
                old.dtype = new.dtype
            if old.shape is None:
                old.shape = new.shape
            for consumer in list(new.outputs):
                for i, t in enumerate(consumer.inputs):
                    if t is new:
                        consumer.inputs[i] = old
            producer.outputs[producer.outputs.index(new)] = old
        else:
            # The output name must survive and cannot be moved onto ``new``: keep an Identity.
            node = gs.Node(
                "Identity",
                name=self.fresh_name(old.name + "/identity"),
                inputs=[new],
                outputs=[old],
            )
            self.graph.nodes.append(node)

    def remove_node(self, node: Node) -> None:
        """Detach a node; ``cleanup`` drops it (and anything only it used) on export."""
        unlink_all(node.inputs)
        unlink_all(node.outputs)


def unlink_all(links: list) -> None:
    """Empty a node's inputs or outputs (or a tensor's producers or consumers), dropping the
    owner from each element's opposite list.  What graphsurgeon's ``clear`` does, finding the
    owner by identity: its ``list.remove`` compares it by ``==`` with every element before it,
    and a node's ``==`` formats a log line and compares names, attributes and tensors (a third
    of Swin-T's fold-constants)."""
    field, owner = links.field_name, links.parent_obj
    for elem in links:
        opposite = getattr(elem, field)
        for i, x in enumerate(opposite):
            if x is owner:
                list.__delitem__(opposite, i)
                break
    list.clear(links)


def op_histogram(nodes: Iterable[Node | onnx.NodeProto]) -> dict[str, int]:
    """Op type counts (``domain.op`` outside the default domain) of IR or protobuf nodes."""

    def key(n) -> str:
        op = n.op_type if isinstance(n, onnx.NodeProto) else n.op
        return op if is_default(n.domain) else f"{n.domain}.{op}"

    return dict(sorted(Counter(key(n) for n in nodes).items()))


def constant_value(tensor: Tensor | None, max_elements: int | None = None) -> np.ndarray | None:
    """The value of a tensor known at optimization time, or None.  With ``max_elements``, a
    larger constant is not read at all (its values may be a memory-mapped multi-GB weight).
    String constants are never read: strings pass through untouched (their bytes need not even
    be UTF-8, which numpy's conversion requires)."""
    if isinstance(tensor, Constant) and not _is_string(tensor):
        if max_elements is not None and math.prod(tensor.shape) > max_elements:
            return None
        lazy = tensor._values
        if isinstance(lazy, LazyValues) and (
            lazy.nbytes >= UNCACHED_BYTES or lazy.tensor.data_location == onnx.TensorProto.EXTERNAL
        ):
            # read for this use, not kept: the model read holds these bytes already (or they
            # are mapped from a file: a mapping kept would hold its pages until the graph, a
            # web of reference cycles, is collected), and a rewrite that replaces the weight (a
            # Conv+BN fold) would leave another copy alive; uncached, the constant still exports
            # as it was read
            return np.asarray(lazy.load())
        return np.asarray(tensor.values)
    return None


def standalone_tensor_proto(tensor: Constant) -> onnx.TensorProto:
    """``tensor`` as a TensorProto holding its values: a weight left in its model file or in
    an external data file is read, so that a model built from it (a gate's sub-model, loaded
    from bytes) needs no file beside it."""
    lazy = tensor._values
    if isinstance(lazy, LazyValues) and lazy.tensor.data_location == onnx.TensorProto.EXTERNAL:
        return numpy_helper.from_array(np.asarray(lazy.load()), tensor.name)
    return OnnxExporter.export_tensor_proto(tensor)


#: weights read from the model of at least this many bytes are read anew for each use
UNCACHED_BYTES = 1 << 20


def _is_string(tensor: Tensor) -> bool:
    lazy = getattr(tensor, "_values", None)
    if isinstance(lazy, LazyValues):
        return lazy.tensor.data_type == onnx.TensorProto.STRING
    return dtype_of(tensor) == np.dtype(object)


def producer(tensor: Tensor) -> Node | None:
    return tensor.inputs[0] if tensor.inputs else None


def consumers(tensor: Tensor) -> list[Node]:
    return list(tensor.outputs)


def static_shape(tensor: Tensor) -> tuple[int, ...] | None:
    """The fully known shape of a tensor, or None when unknown or symbolic."""
    if isinstance(tensor, Constant):
        return tuple(int(d) for d in tensor.shape)
    shape = tensor.shape
    if shape is None or any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def subgraphs(node: Node) -> list[gs.Graph]:
    """The node's subgraph attributes (If/Loop/Scan bodies); cheap when there are none."""
    found = []
    for value in node.attrs.values():
        if isinstance(value, gs.Graph):
            found.append(value)
        elif isinstance(value, list) and value and isinstance(value[0], gs.Graph):
            found.extend(value)
    return found


def walk_nodes(graph: gs.Graph) -> Iterator[Node]:
    """All nodes, including those inside subgraphs (If/Loop/Scan bodies)."""
    for node in graph.nodes:
        yield node
        for sub in subgraphs(node):
            yield from walk_nodes(sub)


def toposort(graph: gs.Graph) -> None:
    """Order ``graph.nodes`` topologically in O(nodes + edges), keeping the existing order where
    it is free (Kahn's algorithm over a min-heap of original positions: an order that is already
    topological stays as it is, found in one pass without the heap).  A node with subgraphs also
    depends on the producers of the outer values its bodies read."""
    nodes = graph.nodes
    producer_at: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for t in n.outputs:
            producer_at[id(t)] = i
    get = producer_at.get
    if _ordered(nodes, get):
        return
    #: per node, the positions of the nodes it reads from (once per edge, itself excluded)
    reads_from: list[list[int]] = []
    for i, n in enumerate(nodes):
        mine = [p for p in map(get, map(id, _reads(n))) if p is not None and p != i]
        reads_from.append(mine)
    order = stable_order(reads_from)[0]
    if len(order) != len(nodes):
        raise ValueError(f"graph '{graph.name}' has a cycle")
    graph.nodes = [nodes[i] for i in order]


def _reads(node: Node) -> list[Tensor]:
    """What a node reads: its inputs, and for a node with bodies, what their nodes read."""
    subs = subgraphs(node) if node.attrs else ()
    if not subs:
        return node.inputs
    reads = list(node.inputs)
    for sub in subs:
        reads += [t for inner in walk_nodes(sub) for t in inner.inputs]
    return reads


def _ordered(nodes: list[Node], producer_at) -> bool:
    """Whether no node reads a tensor made by a later node (``producer_at``: id → position)."""
    for i, n in enumerate(nodes):
        for t in _reads(n):
            p = producer_at(id(t))
            if p is not None and p > i:
                return False
    return True


def dtype_of(tensor: Tensor) -> np.dtype | None:
    if tensor.dtype is None:
        return None
    try:
        return np.dtype(tensor.dtype)
    except TypeError:
        return None


def _copy_fields(src, dst, skip: tuple[str, ...] = ()) -> None:
    """Copy protobuf fields one by one (repeated fields are extended, not deep-copied twice)."""
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        if field.is_repeated:
            getattr(dst, field.name).extend(value)
        elif field.message_type:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _model_shell(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model's fields without the (possibly huge) graph."""
    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip=("graph",))
    shell.graph.name = model.graph.name
    shell.graph.doc_string = model.graph.doc_string
    return shell


def _graph_copy(model: onnx.ModelProto, skip: tuple[str, ...]) -> onnx.ModelProto:
    """The model with its graph copied except the named repeated fields (filled by the caller)."""
    copy = _model_shell(model)
    _copy_fields(model.graph, copy.graph, skip=skip)
    return copy


# graphsurgeon represents tensor, sequence and sparse types only; optional/map types would be
# lost on export.  Such tensors carry their original TypeProto, and the exporter uses it.
_TYPE_ATTR = "graphopt_type_proto"
_gs_export_value_info = OnnxExporter.export_value_info_proto


def _export_value_info(tensor: Tensor, do_type_check: bool) -> onnx.ValueInfoProto:
    type_proto = getattr(tensor, _TYPE_ATTR, None)
    if type_proto is None:
        return _gs_export_value_info(tensor, do_type_check)
    info = onnx.ValueInfoProto(name=tensor.name)
    info.type.CopyFrom(type_proto)
    return info


OnnxExporter.export_value_info_proto = staticmethod(_export_value_info)

# Likewise graphsurgeon reduces TYPE_PROTO attributes (Optional's ``type``) to a dtype.
_ATTR_ATTR = "graphopt_type_attributes"
_gs_export_node = OnnxExporter.export_node


def _export_node(node: Node) -> onnx.NodeProto:
    return _restore_node_fields(node, _gs_export_node(node))


def _restore_node_fields(node: Node, proto: onnx.NodeProto) -> onnx.NodeProto:
    """What graphsurgeon's node export drops: TYPE_PROTO attributes, doc_string, metadata."""
    kept = getattr(node, _ATTR_ATTR, None)
    if kept:
        attrs = [kept.get(a.name, a) for a in proto.attribute]
        attrs += [a for name, a in kept.items() if name not in {x.name for x in proto.attribute}]
        del proto.attribute[:]
        proto.attribute.extend(attrs)
    annotations = getattr(node, _NOTE_ATTR, None)
    if annotations is not None:
        proto.doc_string = annotations.doc_string
        proto.metadata_props.extend(annotations.metadata_props)
    return proto


OnnxExporter.export_node = staticmethod(_export_node)


# graphsurgeon builds every node and tensor it imports through its generic constructors and
# synchronized lists (a Python call per attribute set and per use-list entry): about a third
# of importing a large graph.  The same objects, with the same use-lists, are built directly
# (nodes, the tensors they name first, initializers).
_gs_import_node = OnnxImporter.import_node


def _sync_list(owner: object, field: str, items: list) -> gs_misc.SynchronizedList:
    """``SynchronizedList(owner, field, items)``: each item's ``field`` list gets ``owner``."""
    synced = _new_list(_SyncList)
    synced.__dict__ = {"parent_obj": owner, "field_name": field}  # one dict, made whole
    if items:
        list.extend(synced, items)
        for item in items:
            list.append(getattr(item, field), owner)
    return synced


_SyncList = gs_misc.SynchronizedList
_new_list = _SyncList.__new__


def _new_variable(name: str) -> Variable:
    """``Variable(name)``: no type, no producer, no readers."""
    t = object.__new__(Variable)
    fields = t.__dict__
    fields["name"] = name
    fields["inputs"] = _sync_list(t, "outputs", [])
    fields["outputs"] = _sync_list(t, "inputs", [])
    fields.update(dtype=None, shape=None, type="tensor_type")
    return t


def _import_node(
    onnx_node: onnx.NodeProto,
    tensor_map: dict,
    subgraph_tensor_map: dict,
    opset,
    import_domains,
) -> Node:
    """graphsurgeon's ``OnnxImporter.import_node``, its objects built directly: a name resolves
    in this graph first, then (inputs only) in the enclosing ones; an empty name is an omitted
    optional tensor; any other name is a new untyped tensor of this graph."""

    def tensor(name: str, outer: bool) -> Tensor:
        t = subgraph_tensor_map.get(name)
        if t is None and outer:
            t = tensor_map.get(name)
        if t is None:
            if not name:
                return Variable.empty()
            t = subgraph_tensor_map[name] = _new_variable(name)
        return t

    # attributes first: a body imported there sees only the tensors known before this node
    if onnx_node.attribute:
        attrs = OnnxImporter.import_attributes(
            onnx_node.attribute, tensor_map, subgraph_tensor_map, opset, import_domains
        )
    else:
        attrs = OrderedDict()
    inputs = [tensor(name, True) for name in onnx_node.input]
    outputs = [tensor(name, False) for name in onnx_node.output]
    node = object.__new__(Node)
    fields = node.__dict__
    fields.update(op=onnx_node.op_type, name=onnx_node.name, attrs=attrs)
    fields["inputs"] = _sync_list(node, "outputs", inputs)
    fields["outputs"] = _sync_list(node, "inputs", outputs)
    fields["domain"] = onnx_node.domain if onnx_node.HasField("domain") else None
    return node


OnnxImporter.import_node = staticmethod(_import_node)
_gs_import_tensor = OnnxImporter.import_tensor


def _import_tensor(onnx_tensor) -> Tensor:
    """graphsurgeon's ``OnnxImporter.import_tensor``, a dense TensorProto's Constant built
    directly (its values still read lazily by graphsurgeon's LazyValues)."""
    if not isinstance(onnx_tensor, onnx.TensorProto):
        return _gs_import_tensor(onnx_tensor)
    c = object.__new__(Constant)
    fields = c.__dict__
    fields["name"] = onnx_tensor.name
    fields["inputs"] = _sync_list(c, "outputs", [])
    fields["outputs"] = _sync_list(c, "inputs", [])
    fields["_values"] = _lazy_values(onnx_tensor)
    fields["data_location"] = (
        int(onnx_tensor.data_location) if onnx_tensor.HasField("data_location") else None
    )
    fields["_export_dtype"] = None
    return c


OnnxImporter.import_tensor = staticmethod(_import_tensor)

#: a TensorProto data type's (LazyValues.dtype, item size): the same for every tensor of it
_LAZY_TYPES: dict[int, tuple] = {}


def _lazy_values(onnx_tensor: onnx.TensorProto) -> LazyValues:
    """``LazyValues(onnx_tensor)``, the dtype and item size looked up once per data type
    (graphsurgeon rebuilds onnx's list of every data type twice per tensor)."""
    lazy = object.__new__(LazyValues)
    lazy.tensor = onnx_tensor
    lazy.shape = onnx_tensor.dims
    known = _LAZY_TYPES.get(onnx_tensor.data_type)
    if known is None:
        dtype = gs_importer.get_onnx_tensor_dtype(onnx_tensor)
        known = _LAZY_TYPES[onnx_tensor.data_type] = (dtype, gs_importer.get_itemsize(dtype))
    lazy.dtype = known[0]
    lazy.nbytes = gs_misc.volume(lazy.shape) * known[1]
    return lazy


# graphsurgeon writes every constant it holds as raw bytes; ONNX stores strings in string_data
# and packs int4/uint4 two to a byte.
_gs_export_tensor_proto = OnnxExporter.export_tensor_proto
_PACKED_TYPES = frozenset({"int4", "uint4", "int2", "uint2", "float4_e2m1fn"}) | {
    f"float8_{k}" for k in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "e8m0fnu")
}


def _export_tensor_proto(tensor: Constant) -> onnx.TensorProto:
    if isinstance(tensor._values, LazyValues):
        return _gs_export_tensor_proto(tensor)
    values = np.asarray(tensor.values)
    if values.dtype.name in _PACKED_TYPES:  # int4/fp8 (ml_dtypes): onnx packs them itself
        return numpy_helper.from_array(values, tensor.name)
    if values.dtype.kind not in "OSU":
        return _gs_export_tensor_proto(tensor)
    return onnx.helper.make_tensor(
        tensor.name,
        onnx.TensorProto.STRING,
        list(values.shape),
        [v if isinstance(v, bytes) else str(v).encode() for v in values.flat],
    )


OnnxExporter.export_tensor_proto = staticmethod(_export_tensor_proto)

# Nodes carry their doc_string and metadata_props (graphsurgeon drops both) by identity: a
# proto holding only those fields, restored by _export_node.
_NOTE_ATTR = "graphopt_annotations"


def _unique_node_names(root: gs.Graph) -> None:
    """A body node named like a node of another graph gets its body's name in front (optimum's
    merged decoders: both branches of the If are the same decoder, node names and all), so that
    remarks, provenance and the rules that look a node up by name see one node per name."""
    seen = {n.name for n in root.nodes if n.name}
    bodies = [b for n in root.nodes for b in subgraphs(n)]
    while bodies:
        body = bodies.pop(0)
        for node in body.nodes:
            if node.name in seen:
                base = f"{body.name or 'body'}/{node.name}"
                name, i = base, 1
                while name in seen:
                    name, i = f"{base}_{i}", i + 1
                node.name = name
            if node.name:
                seen.add(node.name)
            bodies.extend(subgraphs(node))


def _keep_node_annotations(proto: onnx.GraphProto, graph: gs.Graph) -> None:
    for node, node_proto in zip(graph.nodes, proto.node):
        if node_proto.doc_string or len(node_proto.metadata_props):
            kept = onnx.NodeProto(doc_string=node_proto.doc_string)
            kept.metadata_props.extend(node_proto.metadata_props)
            setattr(node, _NOTE_ATTR, kept)
        if not node_proto.attribute:  # bodies are attributes
            continue
        subs = [
            sub
            for a in node_proto.attribute
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs)
        ]
        for sub, sub_proto in zip(node.subgraphs(), subs):
            _keep_node_annotations(sub_proto, sub)


def _declared(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    kept = onnx.ValueInfoProto()
    kept.CopyFrom(vi)
    return kept


def _restore_declared(vi: onnx.ValueInfoProto, declared: onnx.ValueInfoProto, dims: bool) -> None:
    """Put back what the model declared on a graph input/output: doc_string and metadata, the
    whole type when the export has none, and (with ``dims``) every declared dim_param."""
    vi.doc_string = declared.doc_string
    if len(declared.metadata_props) and not len(vi.metadata_props):
        vi.metadata_props.extend(declared.metadata_props)
    if declared.type.WhichOneof("value") is None:
        return
    kind = vi.type.WhichOneof("value")
    if kind is None or (kind == "tensor_type" and not vi.type.tensor_type.elem_type):
        vi.type.CopyFrom(declared.type)
        return
    if not dims or kind != "tensor_type" or declared.type.WhichOneof("value") != kind:
        return
    want, have = declared.type.tensor_type, vi.type.tensor_type
    if not want.HasField("shape"):
        return
    if not have.HasField("shape") or len(have.shape.dim) != len(want.shape.dim):
        have.shape.CopyFrom(want.shape)
        return
    for d_have, d_want in zip(have.shape.dim, want.shape.dim):
        if d_want.HasField("dim_param"):
            d_have.dim_param = d_want.dim_param
        if d_want.denotation:
            d_have.denotation = d_want.denotation


_TYPED_ATTRS = (onnx.AttributeProto.TYPE_PROTO, onnx.AttributeProto.TYPE_PROTOS)


def _keep_unsupported_types(graph_proto: onnx.GraphProto, graph: gs.Graph) -> None:
    unsupported = {}
    typed_attrs = False

    def collect(g: onnx.GraphProto) -> None:
        nonlocal typed_attrs
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            kind = vi.type.WhichOneof("value")
            seq_elem = (
                vi.type.sequence_type.elem_type.WhichOneof("value")
                if kind == "sequence_type"
                else "tensor_type"
            )
            if kind not in ("tensor_type", "sparse_tensor_type", None) or seq_elem != "tensor_type":
                unsupported[vi.name] = vi.type
        for node in g.node:
            for attr in node.attribute:
                typed_attrs = typed_attrs or attr.type in _TYPED_ATTRS
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    collect(sub)

    collect(graph_proto)
    if not unsupported and not typed_attrs:
        return  # nothing to attach: no walk over every node and tensor

    def attach(g: gs.Graph, proto: onnx.GraphProto) -> None:
        for name, t in g.tensors().items() if unsupported else ():
            if name in unsupported:
                setattr(t, _TYPE_ATTR, unsupported[name])
        for node, node_proto in zip(g.nodes, proto.node):
            typed = {a.name: a for a in node_proto.attribute if a.type in _TYPED_ATTRS}
            if typed:
                setattr(node, _ATTR_ATTR, typed)
            subs = [a.g for a in node_proto.attribute if a.HasField("g")]
            for sub, sub_proto in zip(node.subgraphs(), subs):
                attach(sub, sub_proto)

    attach(graph, graph_proto)


class ExternalValues(LazyValues):
    """Values of a tensor kept in an external data file: memory-mapped on first use, so a
    multi-GB model is never read whole; exporting reuses the original reference."""

    def __init__(self, tensor: onnx.TensorProto, base_dir: str | os.PathLike):
        super().__init__(tensor)
        self.base_dir = base_dir

    def load(self) -> np.ndarray:
        from .io import external_region

        path, offset, length = external_region(self.tensor, self.base_dir)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(self.tensor.data_type)
        if length == 0:
            return np.zeros(tuple(self.tensor.dims), dtype)
        return np.memmap(
            path,
            dtype=dtype,
            mode="r",
            offset=offset,
            shape=tuple(int(d) for d in self.tensor.dims),
        )


def _has_external(model: onnx.ModelProto) -> bool:
    """Whether any tensor of the model (subgraphs included) lives in an external file: the
    tensors ``external_data_helper._get_all_tensors`` walks (initializers of the graph and its
    bodies, tensor attributes there and in model-local functions), read without a generator
    per node."""
    external = onnx.TensorProto.EXTERNAL
    graphs = list(all_graphs(model.graph))
    if any(t.data_location == external for g in graphs for t in g.initializer):
        return True
    nodes = [n for g in graphs for n in g.node]
    for f in model.functions:
        nodes += [n for fn in f.node for g in _bodies(fn) for n in g.node]
        nodes += f.node
    for node in nodes:
        for a in node.attribute:
            if a.HasField("t") and a.t.data_location == external:
                return True
            if any(t.data_location == external for t in a.tensors):
                return True
    return False


def _bodies(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """Every graph in a node's attributes, at any depth."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield from all_graphs(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for sub in attr.graphs:
                yield from all_graphs(sub)


def _map_external_values(graph: gs.Graph, base_dir) -> None:
    for g in [graph] + [sub for node in walk_nodes(graph) for sub in subgraphs(node)]:
        for t in g.tensors().values():
            lazy = getattr(t, "_values", None)
            if (
                isinstance(lazy, LazyValues)
                and not isinstance(lazy, ExternalValues)
                and (lazy.tensor.data_location == onnx.TensorProto.EXTERNAL)
            ):
                t._values = ExternalValues(lazy.tensor, base_dir)
                # Once its values are read (and maybe changed), it exports as a plain tensor.
                t.data_location = None


class _NameSource:
    """Unique, deterministic names for tensors and nodes a rewrite creates."""

    def __init__(self, graph: gs.Graph):
        # the names of ``graph.tensors()`` (its inputs, outputs and its nodes' tensors, the
        # unnamed omitted ones aside), without building that map
        used = {t.name for t in graph.inputs} | {t.name for t in graph.outputs}
        for n in graph.nodes:
            used.update([t.name for t in n.inputs])
            used.update([t.name for t in n.outputs])
        used.discard("")
        self.used = used | {n.name for n in walk_nodes(graph) if n.name}
        self.counter = itertools.count()

    def fresh(self, base: str) -> str:
        name = base
        while name in self.used:
            name = f"{base}_{next(self.counter)}"
        self.used.add(name)
        return name


def type_string(dtype: np.dtype) -> str:
    """onnxruntime's kernel type-constraint spelling of a dtype: float32 → 'tensor(float)'."""
    proto = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return f"tensor({onnx.TensorProto.DataType.Name(proto).lower()})"


def to_tensor_proto(value: np.ndarray, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """A graph and every subgraph of its nodes' attributes, at any depth."""
    yield graph
    for node in graph.node:
        yield from _bodies(node)


#: attribute values a node's proto is rebuilt from when they compare equal (with their types)
_PLAIN = (int, float, str)


def _node_key(n: Node) -> tuple | None:
    """Everything the exported proto of ``n`` is made of, or None when an attribute is not a
    plain value or a constant tensor (a graph...): such a node is exported every time.  A
    constant tensor attribute (ConstantOfShape's value) counts by its identity, its values' and
    its name.  One flat tuple:
    op, domain, name, the number of inputs, the input names, the output names, then the
    attributes (name, type, value) and what the exporter restores (ir: TYPE_PROTO attributes,
    doc_string/metadata)."""
    fields = n.__dict__  # plain attributes: read without a lookup through the class
    ins = fields["inputs"]
    key = [fields["op"], fields["domain"], fields["name"], len(ins)]
    key += [t.name for t in ins]
    key += [t.name for t in fields["outputs"]]
    key.append(_ATTRS)  # the output names end here (a name is a str, never this marker)
    if fields["attrs"]:
        for k, v in fields["attrs"].items():
            if isinstance(v, _PLAIN):
                key += (k, type(v), v)
            elif isinstance(v, list) and all(isinstance(x, _PLAIN) for x in v):
                key += (k, list, tuple([(type(x), x) for x in v]))
            elif isinstance(v, Constant):  # by identity (the entry holds it: see _held)
                key += (k, Constant, id(v), id(v._values), v.name)
            else:
                return None
    key += (fields.get(_ATTR_ATTR), fields.get(_NOTE_ATTR))
    return tuple(key)


#: ends the output names in a node key
_ATTRS = object()


def read_protos(nodes: Sequence[Node], read: Sequence[onnx.NodeProto]) -> dict:
    """The protos a graph's nodes were imported from, serialized, as :func:`_export_nodes`
    holds its own exports (id → node, key, bytes): an untouched node is not exported for the
    graph's first inference.  ``read`` is the imported graph's node list, node for node."""
    if len(nodes) != len(read):
        return {}
    protos = {}
    for n, proto in zip(nodes, read):
        key = _node_key(n)
        if key is not None:
            protos[id(n)] = (n, key, proto.SerializeToString(), _held(n))
    return protos


def _held(n: Node) -> tuple:
    """The constant tensors among ``n``'s attributes: an entry keyed on their ids keeps them
    alive, so that no other object takes an id while the entry stands."""
    return tuple(v for v in n.attrs.values() if isinstance(v, Constant)) if n.attrs else ()

"""Constant folding, shape folding included, with an output-size guard.

Every node whose inputs are all known at optimization time is evaluated by onnxruntime (all such
nodes of one round in a single session) and replaced by its value.  ``Shape``/``Size`` of a tensor
whose shape is static after shape inference are known too, so exporter shape glue
(Shape→Gather→Unsqueeze→Concat→Reshape) collapses into a constant Reshape target.

Never an accident: a node whose output would be larger than ``fold-size-limit`` bytes (default
1 MiB) *and* more than twice its inputs -- ConstantOfShape / Expand / Tile building weights, as in
the ONNX zoo's "light" models -- is not folded; the refusal is a missed remark with the sizes.
"""

from __future__ import annotations

import numpy as np
from onnx_graphsurgeon import Graph

from graphopt.opt.analysis import EvaluationError, evaluate, infer_shapes
from graphopt.opt.ir import Constant, ModelIR, Node, Variable, static_shape
from graphopt.opt.manager import Pass, PassContext, register_pass

DEFAULT_SIZE_LIMIT = 1 << 20

#: results depend on randomness or state, or are not plain tensors: never folded
NEVER_FOLD = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Dropout",
        "If",
        "Loop",
        "Scan",
        "SequenceAt",
        "SequenceConstruct",
        "SequenceEmpty",
        "SequenceErase",
        "SequenceInsert",
        "SequenceLength",
        "SequenceMap",
        "SplitToSequence",
        "ConcatFromSequence",
        "Optional",
        "OptionalGetElement",
        "OptionalHasElement",
        "StringSplit",
        "StringConcat",
        "StringNormalizer",
        "RegexFullMatch",
        "TfIdfVectorizer",
        "Identity",
    }
)
#: numpy dtypes onnxruntime hands back faithfully
FOLDABLE_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float16,
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.bool_,
    )
)


def _known(t) -> bool:
    return t is None or isinstance(t, Constant) or (isinstance(t, Variable) and t.name == "")


def _dtype_ok(t) -> bool:
    if isinstance(t, Constant):
        return np.dtype(t.dtype) in FOLDABLE_DTYPES
    try:
        return t.dtype is not None and np.dtype(t.dtype) in FOLDABLE_DTYPES
    except TypeError:
        return False


@register_pass
class FoldConstants(Pass):
    name = "fold-constants"
    summary = "evaluate nodes whose inputs are constants (and Shape/Size of static shapes)"
    level = 1

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        infer_shapes(ir)
        limit = int(cx.options.get("fold_size_limit", DEFAULT_SIZE_LIMIT))
        pending: set[int] = set()  # ids of tensors computed by this round's batch
        batch: list[Node] = []
        direct: list[tuple[Node, np.ndarray]] = []
        ir.toposort()
        for node in ir.graph.nodes:
            if not node.outputs:
                continue
            if node.domain not in (None, "", "ai.onnx") or node.op in NEVER_FOLD:
                continue
            if any(a for a in node.attrs.values() if _is_graph_attr(a)):
                continue
            shape_value = _shape_value(node)
            if shape_value is not None:
                direct.append((node, shape_value))
                continue
            if not all(_known(t) or id(t) in pending for t in node.inputs):
                continue
            if not all(_dtype_ok(t) for t in node.outputs if t.name):
                continue
            if not all(_known(t) or id(t) in pending or _dtype_ok(t) for t in node.inputs):
                continue
            batch.append(node)
            pending.update(id(t) for t in node.outputs)

        changed = False
        for node, v in direct:
            changed |= self._materialize(ir, cx, node, [v], limit)
        if batch:
            for node, values in self._evaluate(ir, cx, batch):
                changed |= self._materialize(ir, cx, node, values, limit)
        return changed

    def _evaluate(self, ir: ModelIR, cx: PassContext, batch: list[Node]):
        """Yield (node, output values) for the batch; one session, or node by node on error."""
        known = {}
        for node in batch:
            for t in node.inputs:
                if isinstance(t, Constant) and t.name not in known:
                    known[t.name] = np.asarray(t.values)
        wanted = [t.name for n in batch for t in n.outputs if t.name]
        try:
            results = evaluate(ir, batch, known, wanted)
            for node in batch:
                yield node, [results.get(t.name) for t in node.outputs]
            return
        except EvaluationError:
            pass
        done: dict[str, np.ndarray] = {}
        for node in batch:
            ins = {}
            ok = True
            for t in node.inputs:
                if t is not None and t.name in done:
                    ins[t.name] = done[t.name]
                elif isinstance(t, Constant):  # includes values folded earlier in this loop
                    ins[t.name] = np.asarray(t.values)
                elif t is not None and t.name:
                    if t.name not in done:
                        ok = False
                        break
                    ins[t.name] = done[t.name]
            if not ok:
                continue
            outs = [t.name for t in node.outputs if t.name]
            try:
                res = evaluate(ir, [node], ins, outs)
            except EvaluationError as e:
                cx.remark(
                    "analysis",
                    self.name,
                    self.name,
                    "fold-eval-failed",
                    [node.name],
                    f"onnxruntime could not evaluate {node.op} '{node.name}': {e}",
                )
                continue
            done.update(res)
            yield node, [res.get(t.name) for t in node.outputs]

    def _materialize(
        self, ir: ModelIR, cx: PassContext, node: Node, values: list, limit: int
    ) -> bool:
        outs = list(node.outputs)
        if any(v is None or not isinstance(v, np.ndarray) for v, t in zip(values, outs) if t.name):
            return False
        if ir.in_subgraph and any(ir.is_graph_output(t) for t in outs):
            return False  # a body's outputs stay produced by nodes
        out_bytes = sum(v.nbytes for v, t in zip(values, outs) if t.name)
        in_bytes = sum(np.asarray(t.values).nbytes for t in node.inputs if isinstance(t, Constant))
        if out_bytes > limit and out_bytes > 2 * in_bytes:
            cx.remark(
                "missed",
                self.name,
                self.name,
                "fold-size-limit",
                [node.name],
                f"{node.op} '{node.name}' would become a {out_bytes / 2**20:.1f} MiB constant "
                f"from {in_bytes} bytes of inputs (limit {limit / 2**20:.1f} MiB; raise it "
                "with --fold-size-limit to fold anyway)",
                output_bytes=out_bytes,
                input_bytes=in_bytes,
                limit=limit,
            )
            return False
        if not cx.take_bisect_step(self.name, node.name):
            return False
        node.outputs.clear()
        node.inputs.clear()
        for t, v in zip(outs, values):
            if t.name:
                t.to_constant(np.asarray(v, order="C"))
        cx.rule_stats(self.name).fired += 1
        return True


def _is_graph_attr(a) -> bool:
    return isinstance(a, Graph) or (isinstance(a, list) and any(isinstance(x, Graph) for x in a))


def _shape_value(node: Node) -> np.ndarray | None:
    """Value of Shape/Size when the input's shape is fully static, else None."""
    if node.op not in ("Shape", "Size") or not node.inputs:
        return None
    shape = static_shape(node.inputs[0])
    if shape is None:
        return None
    if node.op == "Size":
        return np.array(int(np.prod(shape)), dtype=np.int64)
    rank = len(shape)
    start = int(node.attrs.get("start", 0))
    end = node.attrs.get("end")
    end = rank if end is None else int(end)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(shape[start:end], dtype=np.int64)

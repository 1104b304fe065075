"""Constant folding, shape folding included, with size, arithmetic and quantization guards.

Every node whose inputs are all known at optimization time is evaluated by onnxruntime (all such
nodes of one round in a single session); ``Shape``/``Size`` of a static shape are known too.  Each
refusal is a missed remark with its code, so that folding never grows a model by accident, never
copies a tied weight, never evaluates what would kill the process (integer Div/Mod by zero or
INT_MIN / -1) and never folds through a DequantizeLinear: ``fold-size-limit``,
``fold-size-budget``, ``tied-weight``, ``fold-division-by-zero``, ``fold-integer-overflow``.
What each bound is and how a constant cone is judged: docs/rules.md (fold-constants).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx_graphsurgeon import Graph

from graphopt.opt.graph.analysis import EvaluationError, evaluate, infer_node, infer_shapes
from graphopt.opt.graph.domains import RANDOM_OPS, is_default
from graphopt.opt.graph.ir import (
    Constant,
    ModelIR,
    Node,
    Tensor,
    Variable,
    static_shape,
    unlink_all,
)
from graphopt.opt.graph.quant import DEQUANTIZE, is_low_bit
from graphopt.opt.rewrite.context import Pass, PassContext
from graphopt.opt.rewrite.manager import register_pass

DEFAULT_SIZE_LIMIT = 1 << 20
#: ordinary folds together may add at most fold-size-limit / GROWTH_SHARE bytes of constants
GROWTH_SHARE = 64
#: ... or 1 / MODEL_SHARE of the model's own constant bytes, whichever is larger
MODEL_SHARE = 100

#: results depend on randomness or state, or are not plain tensors: never folded
NEVER_FOLD = RANDOM_OPS | frozenset(
    {
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
        DEQUANTIZE,
    }
)
#: ops whose output size is computed from their operands before they are evaluated
GENERATORS = frozenset({"ConstantOfShape", "Expand", "Tile", "Range"})
#: integer ops that trap (SIGFPE) on a zero divisor or INT_MIN / -1
INTEGER_DIVISION = frozenset({"Div", "Mod"})
#: key of the growth counter in the pass context's options (shared by every run of the pass)
GROWTH_KEY = "fold_constants_growth"
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
    """Whether onnxruntime hands the tensor's type back to numpy faithfully (not int4, fp8)."""
    try:
        return t.dtype is not None and np.dtype(t.dtype) in FOLDABLE_DTYPES
    except TypeError:
        return False


@dataclass
class _Growth:
    """Net bytes of constants folding has added to the model so far (all runs of the pass):
    ``used`` by ordinary folds, ``weights`` by folds that build weights; and the model's
    ``largest`` initializer and ``total`` initializer bytes as loaded (weight-fold bounds)."""

    used: int = 0
    weights: int = 0
    largest: int = 0
    total: int = 0

    def bounds(self, weight: bool, limit: int) -> tuple[int, int, int]:
        """(per-node limit, growth used so far, growth budget) for a fold of this kind."""
        if weight:
            return max(limit, self.largest), self.weights, max(limit, self.total)
        share = self.total // MODEL_SHARE if limit else 0  # a zero limit grows nothing
        return limit, self.used, max(limit // GROWTH_SHARE, share)

    def add(self, weight: bool, nbytes: int) -> None:
        if weight:
            self.weights += nbytes
        else:
            self.used += nbytes


def _new_growth(ir: ModelIR) -> _Growth:
    sizes = [_nbytes(t.shape, t.dtype) for t in _all_tensors(ir.root) if isinstance(t, Constant)]
    return _Growth(largest=max(sizes, default=0), total=sum(sizes))


def _all_tensors(graph: Graph) -> Iterable[Tensor]:
    """The values of graphsurgeon's ``graph.tensors()`` (per name, the last tensor of that name
    among the inputs, each node's inputs and outputs, the outputs; unnamed ones left out),
    without its per-tensor call."""
    named = {t.name: t for t in graph.inputs}
    for node in graph.nodes:
        for t in node.inputs:
            named[t.name] = t
        for t in node.outputs:
            named[t.name] = t
    for t in graph.outputs:
        named[t.name] = t
    named.pop("", None)
    return named.values()


@dataclass(frozen=True)
class _Refusal:
    code: str
    message: str
    args: dict = field(default_factory=dict)


#: the verdict of a check that needs operands computed later in this round: retried next round
DEFER = "defer"


@register_pass
class FoldConstants(Pass):
    name = "fold-constants"
    summary = "evaluate nodes whose inputs are constants (and Shape/Size of static shapes)"
    level = 1

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        infer_shapes(ir)
        limit = int(cx.options.get("fold_size_limit", DEFAULT_SIZE_LIMIT))
        if GROWTH_KEY not in cx.options:
            cx.options[GROWTH_KEY] = _new_growth(ir)
        growth = cx.options[GROWTH_KEY]
        ir.toposort()
        # a round's folds make constants of what later nodes read: those deferred for want of
        # their operands' values (a generator's shape, a divisor) are tried in the next round,
        # without waiting for the next iteration of the pipeline (no new shapes are needed)
        refused: set[int] = set()  # nodes a round refused: not tried again in this run
        changed = False
        while self._round(ir, cx, limit, growth, refused, later=changed):
            changed = True
        return changed

    def _round(
        self, ir: ModelIR, cx: PassContext, limit: int, growth, refused: set, later: bool
    ) -> bool:
        """Fold every node whose inputs are known (or computed in this round); whether any
        was folded.  ``later``: a round after the first of this run (see :meth:`_precheck`).

        The round's batch is judged against the growth budget cone by cone (see
        :func:`_cones`): by what a cone leaves in the model, not by its intermediates; a cone
        past the budget is judged node by node, in order, as far as it fits."""
        sizes: dict[int, int] = {}  # ids of tensors computed by this round's batch → bytes
        batch: list[Node] = []
        direct: list[tuple[Node, np.ndarray]] = []
        weights: set[int] = set()  # ids of the batch's nodes that build weights
        typed: dict[int, tuple] = {}  # a later round's inferred output types, by tensor id
        for node in ir.graph.nodes:
            if id(node) in refused or not self._candidate(node):
                continue
            shape_value = _shape_value(node)
            if shape_value is not None:
                direct.append((node, shape_value))
                continue
            if not all(_known(t) or id(t) in sizes for t in node.inputs):
                continue
            if not all(_dtype_ok(t) for t in node.outputs if _named(t)):
                continue
            if any(is_low_bit(t) for t in node.inputs if _named(t)):
                continue  # int4/fp8: no numpy type onnxruntime takes or gives back
            # a copy of a constant read elsewhere builds nothing: the weight exists already
            weight = _builds_weight(node) and _shared_copy(ir, node, sizes) is None
            node_limit = growth.bounds(weight, limit)[0]
            verdict = self._precheck(ir, node, sizes, node_limit, later, typed, limit)
            if verdict == DEFER:
                continue
            if isinstance(verdict, _Refusal):
                refused.add(id(node))
                self._missed(cx, node, verdict)
                continue
            if weight:
                weights.add(id(node))
            batch.append(node)
        cones = _cones(ir, batch)
        batch = self._within_budget(ir, cx, cones, sizes, weights, limit, growth, refused)

        changed = False
        for node, v in direct:
            changed |= self._folded(ir, cx, node, [v], limit, growth, False, refused)
        if batch:
            values = dict((id(n), v) for n, v in self._evaluate(ir, cx, batch))
            kept = {id(n) for n in batch}
            for cone in cones:
                cone = [n for n in cone if id(n) in kept]
                changed |= self._fold_cone(ir, cx, cone, values, limit, growth, weights, refused)
        return changed

    def _missed(self, cx: PassContext, node: Node, refusal: _Refusal) -> None:
        cx.remark(
            "missed",
            self.name,
            self.name,
            refusal.code,
            [node.name],
            refusal.message,
            **refusal.args,
        )

    def _within_budget(
        self, ir, cx, cones: list[list[Node]], sizes, weights: set, limit: int, growth, refused
    ) -> list[Node]:
        """The batch's nodes whose folds fit the growth budget, before evaluation (sizes as
        estimated): whole cones whose net growth fits; of the others, node by node in order,
        the nodes whose own growth fits, and none that reads a refused one."""
        projected = {False: 0, True: 0}  # growth the batch is expected to add, by kind
        kept: list[Node] = []
        for cone in cones:
            net, weight = _cone_growth(ir, cone, lambda t: sizes.get(id(t), 0), weights)
            _, used, budget = growth.bounds(weight, limit)
            if net <= 0 or used + projected[weight] + net <= budget:
                projected[weight] += net
                kept += cone
                continue
            dropped: set[int] = set()
            for node in cone:
                if any(_producer_id(t) in dropped for t in node.inputs):
                    dropped.add(id(node))  # an operand stays computed: so does this node
                    continue
                w = id(node) in weights
                _, used, budget = growth.bounds(w, limit)
                out = sum(sizes.get(id(t), 0) for t in node.outputs if _named(t))
                own = 0 if node.op == "Constant" else out - _input_bytes(ir, node, sizes)[1]
                refusal = _budget_refusal(node, out, own, used + projected[w], budget, cone, net)
                if refusal is not None:
                    refused.add(id(node))
                    dropped.add(id(node))
                    self._missed(cx, node, refusal)
                    continue
                projected[w] += own
                kept.append(node)
        return kept

    def _fold_cone(self, ir, cx, cone, values: dict, limit, growth, weights, refused) -> bool:
        """Materialize one cone's evaluated nodes: all of them when its net growth, measured
        on the values, fits the budget (the growth counted is what the folds leave in the
        model); else node by node, each judged alone (:meth:`_folded`)."""
        cone = [n for n in cone if id(n) in values]
        if not cone:
            return False
        by_tensor = {
            id(t): v.nbytes
            for n in cone
            for t, v in zip(n.outputs, values[id(n)])
            if _named(t) and isinstance(v, np.ndarray)
        }
        net, weight = _cone_growth(ir, cone, lambda t: by_tensor.get(id(t), 0), weights)
        _, used, budget = growth.bounds(weight, limit)
        changed = False
        if len(cone) > 1 and (net <= 0 or used + net <= budget):
            before = _cone_constants(cone)
            outputs = {id(n): [t for t in n.outputs if _named(t)] for n in cone}
            done = []
            for node in cone:
                if self._materialize(
                    ir, cx, node, values[id(node)], limit, growth, weight, counted=False
                ):
                    done.append(node)
                else:
                    refused.add(id(node))
            if done:
                growth.add(weight, _left_behind(ir, done, outputs, before))
                changed = True
            return changed
        for node in cone:
            w = id(node) in weights
            changed |= self._folded(ir, cx, node, values[id(node)], limit, growth, w, refused)
        return changed

    def _folded(self, ir, cx, node, values, limit, growth, weight, refused: set) -> bool:
        """:meth:`_materialize`; a node it leaves (refused, or not evaluated) is not tried
        again in this run."""
        if self._materialize(ir, cx, node, values, limit, growth, weight):
            return True
        refused.add(id(node))
        return False

    @staticmethod
    def _candidate(node: Node) -> bool:
        if not node.outputs or not is_default(node.domain):
            return False
        if node.op in NEVER_FOLD:
            return False
        return not any(a for a in node.attrs.values() if _is_graph_attr(a))

    def _precheck(
        self,
        ir: ModelIR,
        node: Node,
        sizes: dict[int, int],
        limit: int,
        later: bool = False,
        typed: dict | None = None,
        copy_limit: int | None = None,
    ) -> int | str | _Refusal:
        """Before evaluation: the bytes the node's outputs are expected to take (0 when not
        known), DEFER, or why it must not run (the per-node limits and hazards; the growth
        budget is judged per cone by the round).  In a ``later`` round of a run a node's
        outputs must have a known size (no inference has run since the last round's folds: a
        node of constants is inferred alone), else it waits for the pipeline's next
        inference: evaluated blind, a table too large to keep would be computed only to be
        refused.  ``typed``: the types so inferred of the outputs of this round's batch, by
        tensor id (filled in here).  ``copy_limit``: the size past which a copy of a constant
        read elsewhere is refused (``tied-weight``; default ``limit``)."""
        out_bytes = _estimate_output_bytes(node, sizes)
        if out_bytes is None and later:
            out_bytes = _inferred_output_bytes(ir, node, typed)
            if out_bytes is None:
                return DEFER
        if out_bytes == DEFER:
            return DEFER
        if out_bytes is None:
            out_bytes = _copy_bytes(node, sizes)
        if out_bytes is not None:
            in_bytes, _ = _input_bytes(ir, node, sizes)
            refusal = _limit_refusal(node, out_bytes, in_bytes, limit) or _tied_refusal(
                ir, node, out_bytes, sizes, limit if copy_limit is None else copy_limit
            )
            if refusal is not None:
                return refusal
        hazard = _arithmetic_hazard(node)
        if hazard is not None:
            return hazard
        named = [t for t in node.outputs if _named(t)]
        for t in named:
            shape = static_shape(t)
            sizes[id(t)] = _nbytes(shape, t.dtype) if shape is not None else 0
        if out_bytes is not None and len(named) == 1:
            sizes[id(named[0])] = out_bytes  # a generator's size is known before its shape
        return out_bytes or 0

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
        self,
        ir: ModelIR,
        cx: PassContext,
        node: Node,
        values: list,
        limit: int,
        growth: _Growth,
        weight: bool,
        counted: bool = True,
    ) -> bool:
        """Replace the node by its values.  ``counted``: judge the fold against the growth
        budget alone and count its growth; else its cone is (:meth:`_fold_cone`) and only the
        per-node limits apply."""
        outs = list(node.outputs)
        if any(v is None or not isinstance(v, np.ndarray) for v, t in zip(values, outs) if t.name):
            return False
        if ir.in_subgraph and any(ir.is_graph_output(t) for t in outs):
            return False  # a body's outputs stay produced by nodes
        if not all(_known(t) for t in node.inputs) and node.op not in ("Shape", "Size"):
            return False  # an operand's own fold was refused: this one would bypass that
        out_bytes = sum(v.nbytes for v, t in zip(values, outs) if t.name)
        in_bytes, dying = _input_bytes(ir, node, {})
        node_limit, used, budget = growth.bounds(weight, limit)
        refusal = _limit_refusal(node, out_bytes, in_bytes, node_limit) or _tied_refusal(
            ir, node, out_bytes, {}, limit
        )
        if refusal is None and counted:
            own = out_bytes - dying
            refusal = _budget_refusal(node, out_bytes, own, used, budget)
        if refusal is not None:
            self._missed(cx, node, refusal)
            return False
        if not cx.take_bisect_step(self.name, node.name):
            return False
        if counted and node.op != "Constant":  # a Constant's value was in the model: moved
            growth.add(weight, out_bytes - dying)
        cx.remarks.forget_miss(self.name, node.name)  # refused at an earlier try: folded now
        unlink_all(node.outputs)
        unlink_all(node.inputs)
        for t, v in zip(outs, values):
            if t.name:
                t.to_constant(np.asarray(v, order="C"))
        cx.rule_stats(self.name).fired += 1
        return True


def _named(t) -> bool:
    return t is not None and bool(t.name)


def _nbytes(shape, dtype) -> int:
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = 1
    return math.prod(int(d) for d in shape) * itemsize


def _tensor_bytes(t, sizes: dict[int, int]) -> int:
    if isinstance(t, Constant):
        return _nbytes(t.shape, t.dtype)
    return sizes.get(id(t), 0)


def _input_bytes(ir: ModelIR, node: Node, sizes: dict[int, int]) -> tuple[int, int]:
    """Bytes of the node's distinct constant (or batch-computed) inputs, and of those only this
    node reads, which its fold makes dead."""
    seen: dict[int, object] = {}
    for t in node.inputs:
        if _named(t) and (isinstance(t, Constant) or id(t) in sizes):
            seen.setdefault(id(t), t)
    total = dying = 0
    for t in seen.values():
        n = _tensor_bytes(t, sizes)
        total += n
        if ir.is_graph_output(t):
            continue
        readers = [c for c in t.outputs]
        if all(c is node for c in readers):
            dying += n
        elif all(_foldable_now(c) for c in readers):
            # every reader folds too (the four gate Slices of an LSTM weight): each fold
            # takes its share of the constant that dies with the last of them
            dying += n // len({id(c) for c in readers})
    return total, dying


def _foldable_now(node: Node) -> bool:
    """A node this round can fold: a foldable op whose inputs are all known."""
    return (
        FoldConstants._candidate(node)
        and node.op != "DequantizeLinear"
        and all(_known(t) for t in node.inputs)
    )


def _producer_id(t) -> int | None:
    """Identity of the node computing ``t`` (None for constants and inputs)."""
    if not _named(t) or isinstance(t, Constant) or not t.inputs:
        return None
    return id(t.inputs[0])


def _cones(ir: ModelIR, batch: list[Node]) -> list[list[Node]]:
    """The batch split into constant cones, each in batch (topological) order: nodes joined
    when one reads another's output, or when they are all the readers of one constant (which
    dies only when all of them fold)."""
    index = {id(n): i for i, n in enumerate(batch)}
    parent = list(range(len(batch)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    seen: set[int] = set()
    for i, node in enumerate(batch):
        for t in node.inputs:
            if not _named(t):
                continue
            j = index.get(_producer_id(t))
            if j is not None:
                parent[find(i)] = find(j)
            elif isinstance(t, Constant) and id(t) not in seen:
                seen.add(id(t))
                readers = [index.get(id(c)) for c in t.outputs]
                if len(readers) > 1 and None not in readers and not ir.is_graph_output(t):
                    for j in readers:
                        parent[find(j)] = find(i)
    groups: dict[int, list[Node]] = {}
    for i, node in enumerate(batch):
        groups.setdefault(find(i), []).append(node)
    return list(groups.values())


def _cone_growth(ir: ModelIR, cone: list[Node], size_of, weights: set) -> tuple[int, bool]:
    """(net bytes the cone's folds add to the model, whether to count them as weights):
    the outputs it leaves (read outside the cone, or graph outputs) minus the constants that
    die with it (read by its nodes only).  Weights when every output left builds one."""
    members = {id(n) for n in cone}
    net, kinds = 0, []
    for node in cone:
        for t in node.outputs:
            if not _named(t):
                continue
            left = ir.is_graph_output(t) or any(id(c) not in members for c in t.outputs)
            if node.op == "Constant":  # already in the model: it dies unless left
                net -= 0 if left else size_of(t)
            elif left:
                net += size_of(t)
                kinds.append(id(node) in weights)
    for t in _cone_constants(cone).values():
        if not ir.is_graph_output(t) and all(id(c) in members for c in t.outputs):
            net -= _nbytes(t.shape, t.dtype)
    return net, bool(kinds) and all(kinds)


def _cone_constants(cone: list[Node]) -> dict[int, Constant]:
    """The constants the cone's nodes read, by identity."""
    return {id(t): t for node in cone for t in node.inputs if _named(t) and isinstance(t, Constant)}


def _left_behind(ir: ModelIR, done: list[Node], outputs: dict, before: dict) -> int:
    """Net bytes the folded nodes ``done`` (``outputs``: their named outputs, by node id)
    added: their outputs still read (or graph outputs) minus the constants that were in the
    model before (``before``: read by the cone; a Constant node's value) and nothing reads now."""
    net = 0
    for node in done:
        for t in outputs[id(node)]:
            if node.op == "Constant":
                before[id(t)] = t
            elif t.outputs or ir.is_graph_output(t):
                net += _nbytes(t.shape, t.dtype)
    for t in before.values():
        if not t.outputs and not ir.is_graph_output(t):
            net -= _nbytes(t.shape, t.dtype)
    return net


def _limit_refusal(node: Node, out_bytes: int, in_bytes: int, limit: int) -> _Refusal | None:
    """The per-node limit: an output past ``limit`` and more than twice its inputs."""
    mib = 2**20
    if node.op == "Constant":  # its value is in the model already: folding only moves it
        return None
    if out_bytes > limit and out_bytes > 2 * in_bytes:
        return _Refusal(
            "fold-size-limit",
            f"{node.op} '{node.name}' would become a {out_bytes / mib:.1f} MiB constant "
            f"from {in_bytes} bytes of inputs (limit {limit / mib:.1f} MiB; raise it "
            "with --fold-size-limit to fold anyway)",
            {"output_bytes": out_bytes, "input_bytes": in_bytes, "limit": limit},
        )
    return None


def _budget_refusal(
    node: Node,
    out_bytes: int,
    growth: int,
    used: int,
    budget: int,
    cone: list[Node] | None = None,
    cone_growth: int = 0,
) -> _Refusal | None:
    """The growth budget, for a fold judged alone (its cone, when given, did not fit)."""
    if node.op == "Constant" or growth <= 0 or used + growth <= budget:
        return None
    mib = 2**20
    whole = ""
    args = {"output_bytes": out_bytes, "growth_bytes": used + growth, "limit": budget}
    if cone is not None and len(cone) > 1:
        whole = (
            f"; the constant cone of {len(cone)} nodes it is part of would leave "
            f"{_size(cone_growth)} more in the model"
        )
        args["cone_nodes"] = len(cone)
        args["cone_growth_bytes"] = cone_growth
    return _Refusal(
        "fold-size-budget",
        f"folding {node.op} '{node.name}' ({out_bytes / mib:.2f} MiB) would grow the "
        f"model's constants by {_size(used + growth)} in all, past the "
        f"{_size(budget)} that folding may add{whole} (raise it with --fold-size-limit)",
        args,
    )


def _size_refusal(
    node: Node, out_bytes: int, in_bytes: int, dying: int, limit: int, used: int, budget: int
) -> _Refusal | None:
    """The per-node limit, then the growth budget, for a fold judged alone."""
    return _limit_refusal(node, out_bytes, in_bytes, limit) or _budget_refusal(
        node, out_bytes, out_bytes - dying, used, budget
    )


#: ops that only re-lay out or convert their first operand: their fold is a copy of it
COPY_OPS = frozenset(
    {
        "Transpose",
        "Cast",
        "CastLike",
        "Reshape",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "DepthToSpace",
        "SpaceToDepth",
    }
)


def _copy_bytes(node: Node, sizes: dict[int, int]) -> int | None:
    """A copy op's output bytes from its operand's (its dtype's item size applied), when the
    inferred shape is unknown."""
    if node.op not in COPY_OPS or not node.inputs or not _named(node.inputs[0]):
        return None
    src, out = node.inputs[0], node.outputs[0] if node.outputs else None
    n = _tensor_bytes(src, sizes)
    try:
        return n * np.dtype(out.dtype).itemsize // np.dtype(src.dtype).itemsize
    except (TypeError, AttributeError, ZeroDivisionError):
        return n


def _other_readers(ir: ModelIR, t, node: Node) -> list[str]:
    """Who else keeps ``t`` in the model once ``node`` is folded: its readers that do not
    fold with it (not computed from constants only), and the graph's outputs."""
    memo: dict[int, bool] = {}
    names = []
    for c in t.outputs:
        if c is node:
            continue
        if FoldConstants._candidate(c) and all(
            _constant_derived(u, memo, WEIGHT_PATH_DEPTH) for u in c.inputs if _named(u)
        ):
            continue
        out = next((o.name for o in c.outputs if _named(o)), "")
        names.append(f"{c.op} '{c.name}'" if c.name else f"the {c.op} computing '{out}'")
    if ir.is_graph_output(t):
        names.append("the graph's outputs")
    return sorted(set(names))


def _shared_copy(ir: ModelIR, node: Node, sizes: dict[int, int]) -> tuple | None:
    """(the constant, its other readers) when the node is a copy (COPY_OPS) of a constant (or
    of a value this round computes) that other nodes keep reading; else None."""
    if node.op not in COPY_OPS or not node.inputs:
        return None
    src = node.inputs[0]
    if not _named(src) or not (isinstance(src, Constant) or id(src) in sizes):
        return None
    readers = _other_readers(ir, src, node)
    return (src, readers) if readers else None


def _tied_refusal(
    ir: ModelIR, node: Node, out_bytes: int, sizes: dict[int, int], limit: int
) -> _Refusal | None:
    """A copy (COPY_OPS) of a constant that other nodes still read would store the tensor
    twice: refused past ``limit`` (fold-size-limit), whatever the budget left, so that tied
    weights stay tied (a GPT LM head ``MatMul(x, Transpose(wte))`` on the token embedding:
    the MatMul reads the weight transposed instead, Gemm or FusedMatMul with transB)."""
    if node.op not in COPY_OPS or out_bytes <= limit:
        return None
    shared = _shared_copy(ir, node, sizes)
    if shared is None:
        return None
    src, readers = shared
    shown = ", ".join(readers[:4]) + (f" and {len(readers) - 4} more" if len(readers) > 4 else "")
    return _Refusal(
        "tied-weight",
        f"{node.op} '{node.name}' would copy '{src.name}' ({_size(out_bytes)}) into a second "
        f"constant while {shown} still read it; the weight stays stored once and the "
        f"{node.op} stays (a MatMul reads a transposed weight in place: Gemm or FusedMatMul "
        "with transB)",
        {"weight": src.name, "readers": readers, "output_bytes": out_bytes, "limit": limit},
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


#: weight slots of the ops whose fusions need constant weights: op → input indices
WEIGHT_SLOTS = {
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "MatMul": (1,),
    "Gemm": (1, 2),
    "BatchNormalization": (1, 2, 3, 4),
    "LayerNormalization": (1, 2),
}
#: ops a weight may pass through between where it is built and its slot
WEIGHT_PATH = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Neg",
        "Sqrt",
        "Reciprocal",
        "Cast",
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Expand",
        "Tile",
        "Identity",
    }
)
#: how many ops a weight may pass through
WEIGHT_PATH_DEPTH = 8


def _builds_weight(node: Node) -> bool:
    """Whether the node's output reaches a weight slot through WEIGHT_PATH ops whose other
    operands are constant-derived (so that the whole path folds and a fusion can use it)."""
    memo: dict[int, bool] = {}
    frontier = [t for t in node.outputs if _named(t)]
    for _ in range(WEIGHT_PATH_DEPTH):
        nxt = []
        for t in frontier:
            for user in t.outputs:
                slots = WEIGHT_SLOTS.get(user.op, ())
                if is_default(user.domain) and any(
                    i < len(user.inputs) and user.inputs[i] is t for i in slots
                ):
                    return True
                if user.op not in WEIGHT_PATH or not is_default(user.domain):
                    continue
                others = [u for u in user.inputs if _named(u) and u is not t]
                if all(_constant_derived(u, memo, WEIGHT_PATH_DEPTH) for u in others):
                    nxt += [o for o in user.outputs if _named(o)]
        if not nxt:
            return False
        frontier = nxt
    return False


def _constant_derived(t, memo: dict[int, bool], depth: int) -> bool:
    """Whether the tensor is a constant or computed from constants only (a bounded look back)."""
    if _known(t):
        return True
    if id(t) in memo:
        return memo[id(t)]
    node = t.inputs[0] if t.inputs else None
    ok = (
        depth > 0
        and node is not None
        and FoldConstants._candidate(node)
        and all(_constant_derived(u, memo, depth - 1) for u in node.inputs if _named(u))
    )
    memo[id(t)] = ok
    return ok


def _int_operand(t) -> np.ndarray | None:
    if not isinstance(t, Constant):
        return None
    return np.asarray(t.values).reshape(-1).astype(np.int64)


def _static_dims(t, sizes: dict[int, int]) -> tuple[int, ...] | None:
    if isinstance(t, Constant):
        return tuple(int(d) for d in t.shape)
    return static_shape(t) if t is not None else None


def _generator_shape(node: Node, sizes: dict[int, int]) -> tuple[int, ...] | str | None:
    """Output shape of ConstantOfShape/Expand/Tile/Range from its operands (never evaluated);
    DEFER while an operand is still being computed; None when the operands are invalid."""
    ins = list(node.inputs)
    if node.op == "ConstantOfShape":
        dims = _int_operand(ins[0]) if ins else None
        return DEFER if dims is None else tuple(max(int(d), 0) for d in dims)
    if node.op == "Range":
        if len(ins) < 3 or not all(isinstance(t, Constant) for t in ins[:3]):
            return DEFER
        start, stop, delta = (float(np.asarray(t.values).reshape(-1)[0]) for t in ins[:3])
        if delta == 0 or not all(math.isfinite(v) for v in (start, stop, delta)):
            return None
        return (max(int(math.ceil((stop - start) / delta)), 0),)
    if len(ins) < 2:
        return None
    x, param = _static_dims(ins[0], sizes), _int_operand(ins[1])
    if param is None or x is None:
        return DEFER
    if node.op == "Tile":
        if len(param) != len(x):
            return None
        return tuple(d * max(int(r), 0) for d, r in zip(x, param))
    try:  # Expand broadcasts both ways
        return tuple(np.broadcast_shapes(x, tuple(int(d) for d in param)))
    except ValueError:
        return None


def _estimate_output_bytes(node: Node, sizes: dict[int, int]) -> int | str | None:
    """Bytes the node's outputs will take, from shapes only; None when not known statically."""
    named = [t for t in node.outputs if _named(t)]
    if node.op in GENERATORS:
        shape = _generator_shape(node, sizes)
        if shape == DEFER or shape is None:
            return shape
        return _nbytes(shape, named[0].dtype)
    shapes = [static_shape(t) for t in named]
    if any(s is None for s in shapes):
        return None
    return sum(_nbytes(s, t.dtype) for s, t in zip(shapes, named))


def _inferred_output_bytes(ir: ModelIR, node: Node, typed: dict | None) -> int | None:
    """Bytes of the node's outputs as onnx infers the node alone (its inputs constants or
    typed earlier in the round: ``typed``, which gets its outputs' types), or None when not
    every output comes out of static shape."""
    got_types = infer_node(ir, node, typed)
    if got_types is None:
        return None
    total, mine = 0, {}
    for t, got in zip(node.outputs, got_types):
        if not _named(t):
            continue
        if got is None or got[1] is None or not all(isinstance(d, int) for d in got[1]):
            return None
        elem, dims = got
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else t.dtype
        except KeyError:
            dtype = t.dtype
        total += _nbytes(dims, dtype)
        mine[id(t)] = (elem, dims)
    if typed is not None:
        typed.update(mine)
    return total


def _arithmetic_hazard(node: Node) -> str | _Refusal | None:
    """Integer Div/Mod by zero or INT_MIN / -1: the runtime would die of SIGFPE evaluating it."""
    if node.op not in INTEGER_DIVISION or len(node.inputs) < 2:
        return None
    a, b = node.inputs[0], node.inputs[1]
    try:
        dt = np.dtype(b.dtype)
    except TypeError:
        return None
    if dt.kind not in "iu":
        return None
    if not (isinstance(a, Constant) and isinstance(b, Constant)):
        return DEFER  # operands computed this round: checked next round, before evaluation
    bv = np.asarray(b.values)
    if np.any(bv == 0):
        return _Refusal(
            "fold-division-by-zero",
            f"integer {node.op} '{node.name}' divides by zero; not evaluated (it would crash "
            "the runtime) and left for run time",
            {"dtype": dt.name},
        )
    if dt.kind == "i":
        av = np.asarray(a.values)
        lo = np.iinfo(dt).min
        if np.any(av == lo) and np.any(bv == -1) and np.any((av == lo) & (bv == -1)):
            return _Refusal(
                "fold-integer-overflow",
                f"integer {node.op} '{node.name}' computes {lo} / -1, which overflows "
                f"{dt.name}; not evaluated (it would crash the runtime)",
                {"dtype": dt.name},
            )
    return None


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

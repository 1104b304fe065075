"""``graphopt bisect``: find the first rewrite that breaks parity (LLVM's opt-bisect, automated).

Every rewrite the pipeline applies is numbered (``--bisect-limit N`` applies only the first N).
If the fully optimized model fails parity, a binary search on N finds the smallest N that fails:
rewrite N is the culprit.  That costs one full run plus ceil(log2(rewrites)) runs.  The culprit's
remark (rule, nodes) is returned with a minimal before/after pair of models: the nodes the rewrite
replaced, and the nodes it created, each cut out as a standalone model with the same inputs (for a
rewrite inside an If/Loop/Scan body, the whole models before and after it).
:func:`write_bisect_result` writes them with the result as ``report.json`` into a folder that
is replaced only when it is one bisect wrote (see :data:`BISECT_KIND`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from .errors import ModelSaveError
from .graph.io import (
    OutputDirKind,
    check_output_dir,
    discard,
    replace_dir,
    staging_dir,
    write_model_files,
)
from .optimizer import Report, optimize
from .remarks import Remark

BISECT_SCHEMA = "graphopt.bisect/1"
#: A bisect folder: marked by its report.json's schema, holding only what bisect writes.
BISECT_KIND = OutputDirKind(
    "graphopt bisect folder",
    "report.json",
    BISECT_SCHEMA,
    ("report.json", "before.onnx", "after.onnx"),
)


@dataclass
class BisectResult:
    found: bool
    message: str
    rewrites: int
    parity_runs: int
    culprit: dict[str, Any] | None = None
    remark: Remark | None = None
    before: onnx.ModelProto | None = field(default=None, repr=False)
    after: onnx.ModelProto | None = field(default=None, repr=False)
    report: Report | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "found": self.found,
            "message": self.message,
            "rewrites": self.rewrites,
            "parity_runs": self.parity_runs,
            "max_parity_runs": max_runs(self.rewrites),
            "culprit": self.culprit,
            "remark": self.remark.to_dict() if self.remark else None,
        }


def max_runs(rewrites: int) -> int:
    return 1 + math.ceil(math.log2(max(rewrites, 1))) + 1


def bisect(
    model: onnx.ModelProto, *, progress: Callable[[str], None] | None = None, **optimize_kw: Any
) -> BisectResult:
    """Binary-search the rewrite count against parity; ``optimize_kw`` as for ``optimize``."""
    say = progress or (lambda _m: None)
    runs = 0

    def attempt(limit: int | None) -> tuple[onnx.ModelProto, Report]:
        nonlocal runs
        runs += 1
        say(f"parity run {runs}: first {'all' if limit is None else limit} rewrites")
        return optimize(
            model, bisect_limit=limit, check=True, measure=False, parity_net=False, **optimize_kw
        )

    full_model, full = attempt(None)
    total = len(full.applied)
    if not full.parity.ran:
        return BisectResult(
            False, f"parity could not run: {full.parity.error}", total, runs, report=full
        )
    if full.parity.ok:
        return BisectResult(
            False,
            f"parity holds with all {total} rewrites; nothing to bisect",
            total,
            runs,
            report=full,
        )
    lo, hi = 1, total  # invariant: limit lo-1 passes (0 rewrites = the original), hi fails
    failing = full
    while lo < hi:
        mid = (lo + hi) // 2
        _, rep = attempt(mid)
        if rep.parity.ok:
            lo = mid + 1
        else:
            hi, failing = mid, rep
    before_model, _ = optimize(model, bisect_limit=lo - 1, check=False, **optimize_kw)
    after_model, after_rep = (
        (full_model, full)
        if lo == total
        else optimize(model, bisect_limit=lo, check=False, **optimize_kw)
    )
    index, rule, node = after_rep.applied[lo - 1]
    remark = _passed_remark(after_rep, rule, node)
    bad = [o.name for o in failing.parity.outputs if not o.ok]
    message = f"rewrite {index} of {total}: {rule} at '{node}' breaks parity" + (
        f" (outputs: {', '.join(bad)})" if bad else ""
    )
    before, after = minimal_pair(before_model, after_model, remark, node)
    if before is None:  # the rewrite is inside an If/Loop/Scan body: the whole models
        before, after = before_model, after_model
        message += " (inside a subgraph: before/after are the whole models)"
    culprit = {
        "index": index,
        "rule": rule,
        "node": node,
        "failing_outputs": bad,
        "first_divergence": failing.parity.first_divergence,
    }
    return BisectResult(True, message, total, runs, culprit, remark, before, after, failing)


def _passed_remark(report: Report, rule: str, node: str) -> Remark | None:
    """The remark of ``rule`` firing at ``node`` (the last one, when it fired more than once)."""
    return next(
        (
            r
            for r in reversed(report.remarks)
            if r.rule == rule and r.nodes and r.nodes[0] == node and r.kind == "passed"
        ),
        None,
    )


def default_bisect_dir(model: str | os.PathLike) -> Path:
    """``<stem>.bisect`` beside the model."""
    path = Path(model)
    return path.with_name(f"{path.stem}.bisect")


def write_bisect_result(
    result: BisectResult, dest: Path, protected: Sequence[Path] = ()
) -> dict[str, Any]:
    """The result as a dict; when a culprit was found, also before.onnx, after.onnx and
    report.json (its schema marks the folder as bisect's) written into ``dest`` — through a
    staging folder renamed into place, which never survives — and ``files`` names ``dest``.
    ``dest`` may replace only an empty folder or a bisect folder, never a ``protected`` path."""
    payload = result.to_dict()
    if not result.found or result.before is None:
        return payload
    try:
        staging = staging_dir(dest)
    except OSError as e:
        raise ModelSaveError(f"cannot write to {dest.parent}: {e.strerror or e}") from None
    try:
        write_model_files(result.before, staging / "before.onnx", external=False)
        if result.after is not None:
            write_model_files(result.after, staging / "after.onnx", external=False)
        marked = {"schema": BISECT_SCHEMA, **payload}
        (staging / "report.json").write_text(json.dumps(marked, indent=2, sort_keys=True))
        check_output_dir(dest, BISECT_KIND, list(protected))
        replace_dir(staging, dest)
    except OSError as e:
        raise ModelSaveError(f"cannot write {dest}: {e.strerror or e}") from None
    finally:
        discard(staging)
    return {**payload, "files": str(dest)}


def minimal_pair(
    before: onnx.ModelProto, after: onnx.ModelProto, remark: Remark | None, node: str
) -> tuple[onnx.ModelProto | None, onnx.ModelProto | None]:
    """The replaced nodes (from ``before``) and the created nodes (from ``after``) as models."""
    old_names = set(remark.nodes) if remark else {node}
    new_names = set(remark.args.get("created", [])) if remark else set()
    before, after = _typed(before), _typed(after)
    old = _cut(before, old_names)
    if old is None:
        return None, None
    outputs = [o.name for o in old.graph.output]
    new = _cut(after, new_names, want_outputs=outputs, inputs_like=old)
    return old, new


def _typed(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with inferred value_info, so cut-out pieces get typed inputs and outputs."""
    try:
        return onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, ValueError):
        return model


def _cut(
    model: onnx.ModelProto,
    names: set[str],
    want_outputs: list[str] | None = None,
    inputs_like: onnx.ModelProto | None = None,
) -> onnx.ModelProto | None:
    g = model.graph
    nodes = [n for n in g.node if n.name in names]
    inits = {t.name: t for t in g.initializer}
    infos = {v.name: v for v in list(g.input) + list(g.value_info) + list(g.output)}
    produced = {o for n in nodes for o in n.output}
    used_inside = {i for n in nodes for i in n.input}
    ext_inputs = [i for n in nodes for i in n.input if i and i not in produced]
    ext_inputs = list(dict.fromkeys(ext_inputs))
    consumers_outside = {i for n in g.node if n.name not in names for i in n.input}
    graph_outs = {o.name for o in g.output}
    if want_outputs is None:
        outs = [
            o
            for n in nodes
            for o in n.output
            if o and (o in consumers_outside or o in graph_outs or o not in used_inside)
        ]
    else:
        outs = list(want_outputs)
    if not nodes and want_outputs is None:
        return None
    extra_nodes: list[onnx.NodeProto] = []
    graph_inits_extra: list[onnx.TensorProto] = []
    if want_outputs is not None:
        # The created nodes' results have new names; find them by position and alias them.
        finals = [o for n in nodes for o in n.output if o and o not in used_inside]
        sources = finals if len(finals) == len(outs) else []
        for i, name in enumerate(outs):
            if name in produced:
                continue
            if name in inits:  # folded away: the output is now a constant
                graph_inits_extra.append(inits[name])
                continue
            src = sources[i] if sources else None
            if src is None and name not in produced:
                src = next((t for t in inits if t == name), None)
            if src is not None:
                extra_nodes.append(helper.make_node("Identity", [src], [name]))
    graph_inputs, graph_inits = [], list(graph_inits_extra)
    for i in ext_inputs:
        if i in inits:
            graph_inits.append(inits[i])
        elif inputs_like is not None and i in {x.name for x in inputs_like.graph.input}:
            graph_inputs.append(next(x for x in inputs_like.graph.input if x.name == i))
        else:
            graph_inputs.append(infos.get(i, onnx.ValueInfoProto(name=i)))
    if inputs_like is not None:
        have = {x.name for x in graph_inputs}
        graph_inputs += [x for x in inputs_like.graph.input if x.name not in have]
    if inputs_like is not None:
        infos.update({o.name: o for o in inputs_like.graph.output})
    out_infos = [infos.get(o, onnx.ValueInfoProto(name=o)) for o in outs]
    sub = helper.make_graph(
        nodes + extra_nodes, f"{g.name}-cut", graph_inputs, out_infos, graph_inits
    )
    m = helper.make_model(sub, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    return m

"""Legalize: every node must map to a kernel of the target, or the user hears which one does not.

Run last in the -O1..-O3 presets.  For each node (subgraphs included) the target's kernel table is
asked for (op, domain, opset, dtype) (:mod:`graphopt.targets.kernels`); a node that cannot run is
a *failure* remark naming op, dtype and node, with a stable code:

* ``no-kernel``: the target has no kernel for the op (e.g. Erf on the npu);
* ``dtype-unsupported`` / ``opset-unsupported``: it has the op, not for this type / opset;
* ``unknown-domain``: a custom or unknown domain the target cannot run (a call of a model-local
  function the IR kept is judged by its body instead, recursively: see targets/kernels.py);
* ``cpu-fallback``: no kernel on the device, but the fallback target (cuda -> cpu) runs it, and
  graphopt's rewrites introduced it (a fused op without a device kernel, a changed dtype): the
  original model had no such node there (:mod:`graphopt.targets.fallback` compares the output
  with the original under the same kernel table).  A fallback the original already had (ReduceProd
  on int64, ai.onnx.ml tree ensembles: onnxruntime places them on its CPU provider as usual) is
  an ``original-fallback`` analysis remark instead, a warning the user cannot act on; with
  ``options["strict_fallback"]`` (``--strict-fallback``) every fallback is a failure.  A fallback
  island costs a device->host and a host->device copy per crossing tensor and inference; an
  analysis remark per island (``fallback-island``) says how many copies and which nodes (the
  bundle's manifest lists them), and a model most of whose nodes fall back says so in one
  ``mostly-fallback`` remark;
* ``dynamic-shape``: on a target that needs static shapes, a tensor whose shape is not static.

On a static-shape target, graph inputs with symbolic dims are pinned to the parity shapes the user
gave (``--shape`` / ``--inputs``, passed as ``options["input_shapes"]``) and shapes are inferred
again (an analysis remark says so); without such a shape the input is a ``dynamic-shape`` failure
that says which ``--shape`` to pass.  After pinning, the exact cleanups (fold-constants,
simplify-shapes, dce) run once more: with static inputs the exporter's shape glue is constant
and folds away instead of counting as nodes the target cannot run.  A failure that a refused
rewrite would have fixed (a missed remark at the same node, e.g. the numerics-changing Gelu
approximation below -O3) says so.

The pass changes the graph only by pinning shapes (``ModelIR.pin_input``: the one change of a
declared input shape the exported model keeps).  ``optimize`` exits 4 when it reported a failure.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from graphopt.opt.graph.analysis import infer_shapes
from graphopt.opt.graph.domains import norm_domain
from graphopt.opt.graph.ir import Constant, ModelIR, Node, Tensor, Variable, walk_nodes
from graphopt.opt.rewrite.context import Pass, PassContext
from graphopt.opt.rewrite.manager import register_pass, run_pass
from graphopt.opt.rewrite.pipeline import parse
from graphopt.targets.fallback import INTRODUCED, ORIGINAL, Census, classify, original_fallbacks
from graphopt.targets.kernels import OK, Resolution, model_opsets, provider_of, resolve_node

PASS = "legalize"
#: run after pinning input shapes (exact cleanups only)
#: missed-remark codes worth quoting at a failing node: a rewrite that would have fixed it
HINT_CODES = frozenset({"numerics-changing"})
REFOLD = "fixpoint(fold-constants,simplify-shapes,dce){max-iterations=6}"


def node_label(node: Node) -> str:
    """A node's name, or ``Op@first-output`` for unnamed nodes."""
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else "?"
    return f"{node.op}@{out}"


def is_static(shape) -> bool:
    return shape is not None and all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape)


def infer_all_shapes(ir: ModelIR) -> bool:
    """Shape inference that also refines graph outputs (analysis.infer_shapes keeps them as
    declared, which would leave a pinned model's outputs symbolic)."""
    outputs = list(ir.graph.outputs)
    ir.graph.outputs = []
    getattr(ir, "inferred", {}).pop(id(ir.graph), None)  # not the cached, outputs-kept result
    try:
        return infer_shapes(ir)
    finally:
        ir.graph.outputs = outputs
        getattr(ir, "inferred", {}).pop(id(ir.graph), None)


@register_pass
class Legalize(Pass):
    name = PASS
    summary = "every node must map to a kernel of the target (failure remarks, exit 4)"
    level = 1
    recurse = False  # walks subgraph bodies itself, with the model's opsets

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        target = cx.target
        changed = self._pin_inputs(ir, cx) if target.static_shapes else False
        if changed:
            # With static inputs, the shape glue (Shape→Gather→Concat→Reshape...) is constant:
            # fold it, so it is not reported as nodes the target cannot run.
            for p in parse(REFOLD):
                run_pass(p, ir, cx)
        infer_all_shapes(ir)
        opsets = model_opsets(ir.template.opset_import)
        opsets.setdefault("", ir.opset)
        nodes = list(walk_nodes(ir.graph))
        for node in nodes:  # a domain a rule introduced is imported at version 1 on export
            opsets.setdefault(norm_domain(node.domain), 1)
        blocked = self._blocked_rewrites(cx)
        fallback: list[tuple[Node, Resolution]] = []
        legal = 0
        functions = getattr(ir, "functions", None)
        for node in nodes:
            res = resolve_node(target, node, opsets, functions)
            label = node_label(node)
            if res.status == OK:
                legal += 1
            elif res.status == "fallback":
                fallback.append((node, res))
            else:
                hint = blocked.get(label)
                cx.remark(
                    "failure",
                    PASS,
                    PASS,
                    res.status,
                    [label],
                    f"{_op_label(node)} ({res.dtype or 'unknown dtype'}) at '{label}' cannot run "
                    f"on {target.name}: {res.message}" + (f"; {hint}" if hint else ""),
                    op=node.op,
                    domain=norm_domain(node.domain) or "ai.onnx",
                    dtype=res.dtype,
                    opset=res.opset,
                    node=label,
                    target=target.name,
                )
        origins = self._origins(ir, cx, fallback) if fallback else {}
        if fallback:
            self._islands(ir, cx, fallback, origins)
            self._mostly(cx, nodes, fallback)
        static_bad = self._check_static(ir, cx) if target.static_shapes else 0
        inherited = sum(o == ORIGINAL for o in origins.values())
        split = (
            f" ({inherited} as in the original model, {len(fallback) - inherited} introduced)"
            if fallback and cx.original is not None
            else ""
        )
        cx.remark(
            "analysis",
            PASS,
            PASS,
            "summary",
            [],
            f"{legal} of {len(nodes)} nodes map to a {target.name} kernel"
            + (f"; {len(fallback)} fall back to {target.fallback}{split}" if fallback else "")
            + (f"; {static_bad} nodes with dynamic shapes" if static_bad else ""),
            total=len(nodes),
            legal=legal,
            fallback=len(fallback),
            fallback_original=inherited,
            dynamic=static_bad,
            target=target.name,
        )
        return changed

    # ---------------------------------------------------------------- static shapes
    def _pin_inputs(self, ir: ModelIR, cx: PassContext) -> bool:
        given = cx.options.get("input_shapes") or {}
        changed = False
        for t in ir.graph.inputs:
            shape = t.shape
            if shape is None or is_static(shape):
                continue
            want = given.get(t.name)
            if want is None:
                cx.remark(
                    "failure",
                    PASS,
                    PASS,
                    "dynamic-shape",
                    [t.name],
                    f"graph input '{t.name}' has shape {list(shape)}, and {cx.target.name} needs "
                    f"static shapes: pass --shape {t.name}="
                    + ",".join(str(d) if is_static([d]) else "N" for d in shape),
                    input=t.name,
                    shape=[str(d) for d in shape],
                )
                continue
            want = [int(d) for d in want]
            fits = len(want) == len(shape) and all(
                not is_static([d]) or int(d) == w for d, w in zip(shape, want)
            )
            if not fits:
                cx.remark(
                    "failure",
                    PASS,
                    PASS,
                    "dynamic-shape",
                    [t.name],
                    f"graph input '{t.name}' has shape {list(shape)}; the given shape {want} "
                    "does not fit it",
                    input=t.name,
                )
                continue
            cx.remark(
                "analysis",
                PASS,
                PASS,
                "pinned-shape",
                [t.name],
                f"graph input '{t.name}' pinned from {list(shape)} to {want}: "
                f"{cx.target.name} needs static shapes (the parity shapes)",
                input=t.name,
                shape=want,
            )
            ir.pin_input(t, want)
            changed = True
        if changed:  # shapes must be inferred again from the pinned inputs
            ir.mutations = getattr(ir, "mutations", 0) + 1
        return changed

    def _check_static(self, ir: ModelIR, cx: PassContext) -> int:
        bad = 0
        for node in ir.graph.nodes:
            dynamic = [
                t
                for t in list(node.inputs) + list(node.outputs)
                if isinstance(t, Variable) and t.name and not is_static(t.shape)
            ]
            if not dynamic:
                continue
            bad += 1
            t = dynamic[0]
            label = node_label(node)
            cx.remark(
                "failure",
                PASS,
                PASS,
                "dynamic-shape",
                [label],
                f"{_op_label(node)} at '{label}': tensor '{t.name}' has shape "
                f"{list(t.shape) if t.shape is not None else 'unknown'}; {cx.target.name} "
                "needs static shapes",
                op=node.op,
                tensor=t.name,
                node=label,
            )
        return bad

    # ------------------------------------------------------------- fallback islands
    def _origins(
        self, ir: ModelIR, cx: PassContext, fallback: list[tuple[Node, Resolution]]
    ) -> dict[int, str]:
        """id(node) -> ``original`` / ``introduced``: whether the original model already ran
        that node on the fallback provider (same op, domain and dtype; see targets/fallback)."""
        census = self._census(cx, {(n.op, norm_domain(n.domain)) for n, _ in fallback})
        provenance = getattr(ir, "provenance", {})
        labelled = [
            (node_label(n), (n.op, norm_domain(n.domain), res.dtype), provenance.get(n.name))
            for n, res in fallback
        ]
        by_label = classify(labelled, census)
        return {id(n): by_label[label] for (n, _), (label, _, _) in zip(fallback, labelled)}

    @staticmethod
    def _census(cx: PassContext, ops: set[tuple[str, str]]) -> Census | None:
        """The original's fallbacks among ``ops``, computed once per run (None: no original)."""
        if cx.original is None:
            return None
        key = (PASS, cx.target.name, frozenset(ops))
        memo = cx.original.memo
        if key not in memo:
            memo[key] = original_fallbacks(cx.target, cx.original.model, ops)
        return memo[key]

    def _islands(
        self,
        ir: ModelIR,
        cx: PassContext,
        fallback: list[tuple[Node, Resolution]],
        origins: dict[int, str],
    ) -> None:
        nodes = [n for n, _ in fallback]
        resolved = {id(n): res for n, res in fallback}
        members = {id(n): n for n in nodes}
        parent = {id(n): id(n) for n in nodes}

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for n in nodes:
            for t in n.inputs:
                src = t.inputs[0] if isinstance(t, Variable) and t.inputs else None
                if src is not None and id(src) in members:
                    parent[find(id(n))] = find(id(src))
        groups: dict[int, list[Node]] = defaultdict(list)
        for n in nodes:
            groups[find(id(n))].append(n)
        target, fb = cx.target, cx.target.fallback
        strict = bool(cx.options.get("strict_fallback"))
        census = self._census(cx, {(n.op, norm_domain(n.domain)) for n in nodes})
        provenance = getattr(ir, "provenance", {})
        for k, group in enumerate(groups.values()):
            inside = {id(n) for n in group}
            copies_in = _crossing_in(group, inside)
            copies_out = _crossing_out(ir, group, inside)
            copies = len(copies_in) + len(copies_out)
            labels = [node_label(n) for n in group]
            where = ""
            for n in group:
                res = resolved[id(n)]
                where = res.provider
                label = node_label(n)
                origin = origins.get(id(n), INTRODUCED)
                message = (
                    f"{_op_label(n)} ({res.dtype or 'unknown dtype'}) at '{label}' has no "
                    f"{provider_of(target)} kernel; it "
                    f"{'would run' if origin == INTRODUCED or strict else 'runs'} on "
                    f"{res.provider} (island {k} of {len(group)} node(s), {copies} copies per "
                    "inference)"
                )
                if origin == ORIGINAL:
                    message += f"; the original model runs it on {res.provider} too" + (
                        " (--strict-fallback)" if strict else ""
                    )
                elif census is not None:
                    rule = provenance.get(n.name)
                    message += "; graphopt introduced it: " + (
                        f"rule {rule} made it"
                        if rule
                        else f"the original model has no more {_op_label(n)} "
                        f"({res.dtype or 'unknown dtype'}) nodes on {res.provider}"
                    )
                cx.remark(
                    "analysis" if origin == ORIGINAL and not strict else "failure",
                    PASS,
                    PASS,
                    "original-fallback" if origin == ORIGINAL and not strict else "cpu-fallback",
                    [label],
                    message,
                    op=n.op,
                    domain=norm_domain(n.domain) or "ai.onnx",
                    dtype=res.dtype,
                    node=label,
                    island=k,
                    origin=origin,
                    fallback_kernel=res.kernel_def(),
                )
            cx.remark(
                "analysis",
                PASS,
                PASS,
                "fallback-island",
                [labels[0]],
                f"island {k}: {len(group)} node(s) on {fb} ({', '.join(labels[:4])}"
                f"{' ...' if len(labels) > 4 else ''}); {len(copies_in)} tensor(s) copied in, "
                f"{len(copies_out)} copied out per inference",
                island=k,
                members=labels,
                entries=[
                    {
                        "node": node_label(n),
                        "op": n.op,
                        "domain": norm_domain(n.domain) or "ai.onnx",
                        "dtype": resolved[id(n)].dtype,
                        "origin": origins.get(id(n), INTRODUCED),
                    }
                    for n in group
                ],
                provider=where,
                copied_in=sorted(copies_in),
                copied_out=sorted(copies_out),
                copies=copies,
                strict=strict,
            )

    @staticmethod
    def _mostly(cx: PassContext, nodes: list[Node], fallback: list[tuple[Node, Resolution]]):
        """One line when most of the model's compute nodes (constants aside) fall back: the
        target is the wrong place for this model, whoever's nodes they are."""
        compute = [n for n in nodes if not (n.op == "Constant" and not norm_domain(n.domain))]
        if not compute or 2 * len(fallback) <= len(compute):
            return
        counts: dict[str, int] = defaultdict(int)
        for n, _ in fallback:
            counts[n.op] += 1
        ops = sorted(counts, key=lambda op: (-counts[op], op))
        provider = fallback[0][1].provider
        cx.remark(
            "analysis",
            PASS,
            PASS,
            "mostly-fallback",
            [],
            f"most of this model runs on {provider} under {cx.target.name}: {len(fallback)} of "
            f"{len(compute)} nodes ({', '.join(ops[:4])}{', ...' if len(ops) > 4 else ''})",
            provider=provider,
            fallback=len(fallback),
            compute=len(compute),
            ops=dict(sorted(counts.items())),
            target=cx.target.name,
        )

    # ------------------------------------------------------------------- hints
    @staticmethod
    def _blocked_rewrites(cx: PassContext) -> dict[str, str]:
        """node -> 'rule X was refused here: code' for rewrites that would have made the node
        legal but were refused (e.g. a numerics-changing lowering below -O3)."""
        out: dict[str, str] = {}
        for r in cx.remarks:
            if r.kind != "missed" or not r.nodes:
                continue
            if r.code not in HINT_CODES:
                continue
            for n in r.nodes:
                out[n] = f"rewrite {r.rule} was refused here ({r.code}: {r.message})"
        return out


def _op_label(node: Node) -> str:
    d = norm_domain(node.domain)
    return f"{d}.{node.op}" if d else node.op


def _crossing_in(group: list[Node], inside: set[int]) -> set[str]:
    names = set()
    for n in group:
        for t in n.inputs:
            if isinstance(t, Constant) or not isinstance(t, Tensor) or not t.name:
                continue
            src = t.inputs[0] if t.inputs else None
            if src is not None and id(src) not in inside:
                names.add(t.name)
    return names


def _crossing_out(ir: ModelIR, group: list[Node], inside: set[int]) -> set[str]:
    names = set()
    for n in group:
        for t in n.outputs:
            if any(id(c) not in inside for c in t.outputs):
                names.add(t.name)
    return names

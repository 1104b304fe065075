"""Weight-only int4 (opt-in, -O3): ``MatMul(A, W)`` with a constant float ``W`` [K, N] →
``com.microsoft.MatMulNBits(A, Wq, scales[, zero_points])`` (bits 4, block 32 along K).

Opt-in, at ``-O3``: only when the optimization options say ``weights=int4`` (symmetric: no
zero points, the kernel's default zero point 8) or ``weights=int4-zp`` (per-block minimum/maximum
with 4-bit zero points); ``graphopt optimize -O3 --weights int4``.  It changes numerics beyond
rounding (``changes_numerics``): at a lower level the option only says ``needs-O3``.  Each
rewrite passes a *measured-error guard*: the model as it is, with this weight quantized on top of
those quantized before, runs on seeded random inputs at the parity shapes (``--shape``; seed 0)
against the model before any weight was quantized; per float output the error is
``max |Δ| / max |reference|``.  A weight whose quantization would take any output above
:data:`MAX_ERROR` (option ``int4_max_error``) is refused with the numbers
(``error-above-threshold``); each quantized weight leaves an ``analysis`` remark (code
``measured-error``) with the error per output after it.  Parity (and the bundle's deployed
parity, and the generation check's logits) are then held to that tolerance
(:func:`graphopt.opt.numerics.precision.quantized_weight_tolerances`).

Packing (onnxruntime's MatMulNBits contract): ``B`` uint8 [N, ⌈K/32⌉, 16] — the transpose of
``W``, two 4-bit values per byte, the first in the low nibble, the last block zero-padded;
``scales`` [N, ⌈K/32⌉] in ``A``'s float type; ``zero_points`` uint8 [N, ⌈⌈K/32⌉/2⌉] (two per
byte, low nibble first).  Symmetric: ``s = max|w| / 7``, ``q = clamp(round(w/s), −8, 7) + 8``.
With zero points: ``s = (max − min) / 15`` over a block that includes 0, ``z = round(−min/s)``,
``q = clamp(round(w/s) + z, 0, 15)``.  ``accuracy_level`` is left unset (the kernel dequantizes
to ``A``'s type; 4 would also quantize ``A`` to int8).

Guards (missed remarks): ``needs-O3`` (opted in at a lower level), ``non-constant-param`` (W
computed at run time), ``shape-mismatch`` (W not 2-D, A's last dim not K), ``non-float``,
``dtype-mismatch``, ``no-kernel`` (the target's table has no MatMulNBits for the type),
``too-small`` (K below one block), ``error-above-threshold``, ``could-not-measure``
(onnxruntime could not run the model to measure the error).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from graphopt.opt.errors import GraphoptError
from graphopt.opt.graph.ir import Constant, constant_value, dtype_of
from graphopt.opt.numerics.precision import QUANTIZED_REFERENCE
from graphopt.opt.remarks import Remark
from graphopt.opt.rewrite.engine import Const, Op, Rule, applies_only_if, require
from graphopt.opt.rewrite.manager import register_rule
from graphopt.opt.verify.parity import Session, make_inputs

from .activation import MS, float_type, last_dim, lowering

BITS = 4
BLOCK = 32
#: largest error per float output accepted, as a fraction of the output's largest magnitude.
#: Round-to-nearest int4 in blocks of 32 leaves a Gaussian weight ~8 % off in relative L2 (a
#: step is 2·max|w|/15, max|w| ≈ 2.1σ over 32 values), and one such layer puts 7-9 % of the
#: largest output off; the limit accepts that and refuses where the errors pile up.
MAX_ERROR = 0.15
#: option values that turn the rule on, and whether they use zero points
MODES = {"int4": False, "int4-zp": True}


def _limit(cx) -> float:
    return float(cx.options.get("int4_max_error", MAX_ERROR))


# ------------------------------------------------------------------------- quantization
def quantize(w: np.ndarray, zero_points: bool, block: int = BLOCK) -> dict[str, np.ndarray]:
    """``w`` [K, N] as MatMulNBits' packed ``B``, ``scales`` (float32) and, with
    ``zero_points``, packed ``zero_points``; ``dequantized`` [K, N] is what the kernel computes
    with."""
    k, n = w.shape
    blocks = -(-k // block)
    wt = np.zeros((n, blocks * block), np.float64)
    wt[:, :k] = w.T.astype(np.float64)
    wb = wt.reshape(n, blocks, block)
    if zero_points:
        lo = np.minimum(wb.min(axis=2), 0.0)
        hi = np.maximum(wb.max(axis=2), 0.0)
        scale = (hi - lo) / 15.0
        scale = np.where(scale == 0, 1.0, scale)
        zp = np.clip(np.round(-lo / scale), 0, 15)
        q = np.clip(np.round(wb / scale[..., None]) + zp[..., None], 0, 15)
    else:
        scale = np.abs(wb).max(axis=2) / 7.0
        scale = np.where(scale == 0, 1.0, scale)
        zp = np.full(scale.shape, 8.0)
        q = np.clip(np.round(wb / scale[..., None]), -8, 7) + 8
    scale = scale.astype(np.float32)
    deq = (q - zp[..., None]) * scale[..., None].astype(np.float64)
    q = q.astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # low nibble first
    out = {
        "B": packed,
        "scales": scale,
        "dequantized": deq.reshape(n, blocks * block)[:, :k].T,
    }
    if zero_points:
        z = zp.astype(np.uint8)
        if blocks % 2:
            z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
        out["zero_points"] = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    return out


# ---------------------------------------------------------------------- measured error
def _model(graph: gs.Graph, template: onnx.ModelProto) -> onnx.ModelProto:
    graph.toposort()
    exported = gs.export_onnx(graph, do_type_check=False)
    model = onnx.ModelProto()
    model.CopyFrom(template)
    model.graph.CopyFrom(exported.graph)
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS, 1))
    return model


def _run(model: onnx.ModelProto, feeds: dict | None, shapes: dict) -> tuple[dict, dict]:
    sess = Session(model)
    if feeds is None:
        feeds = make_inputs(sess.sess, shapes, seed=0)
    names = sess.output_names()
    return feeds, dict(zip(names, sess.run(feeds, names)))


def _errors(ref: dict, got: dict) -> dict[str, float]:
    """Per float output: max |Δ| / max |reference| (inf when the result is not finite)."""
    out = {}
    for name, want in ref.items():
        want = np.asarray(want)
        if want.dtype.kind != "f" or want.size == 0:
            continue
        have = np.asarray(got[name], np.float64)
        if not np.isfinite(have).all():
            out[name] = float("inf")
            continue
        scale = float(np.max(np.abs(want)))
        diff = float(np.max(np.abs(have - want)))
        out[name] = diff / scale if scale else diff
    return out


def measured_errors(
    cx, node: gs.Node, packed: list[Constant], attrs: dict
) -> tuple[dict[str, float], Callable[[], None]]:
    """The error per float output with ``node`` as MatMulNBits on top of the weights quantized
    so far, against the model before the first one, and the function that takes the candidate
    back out (for a refusal).

    The model is exported once per run (then only the candidate node and its weights change in
    it); a node created after that export (by another rewrite) exports the graph again, with the
    weights quantized so far."""
    shapes = cx.options.get("input_shapes") or {}
    ref = cx.options.get(QUANTIZED_REFERENCE)
    if ref is None:
        model = _model(cx.ir.graph.copy(), cx.ir.template)
        feeds, outputs = _run(model, None, shapes)
        ref = {"feeds": feeds, "outputs": outputs, "limit": _limit(cx), "quantized": 0}
        ref["model"] = model
        cx.options[QUANTIZED_REFERENCE] = ref
    model = ref["model"]
    index = _node_index(model, node.name)
    if index is None:
        model = ref["model"] = _model(cx.ir.graph.copy(), cx.ir.template)
        index = _node_index(model, node.name)
    before = onnx.NodeProto()
    before.CopyFrom(model.graph.node[index])
    names = [cx.ir.fresh_name(f"{node.name}/int4_{i}") for i in range(len(packed))]
    model.graph.node[index].CopyFrom(
        onnx.helper.make_node(
            "MatMulNBits",
            [before.input[0], *names],
            list(before.output),
            name=before.name,
            domain=MS,
            **attrs,
        )
    )
    model.graph.initializer.extend(
        onnx.numpy_helper.from_array(np.asarray(c.values), n) for c, n in zip(packed, names)
    )

    def undo() -> None:
        model.graph.node[index].CopyFrom(before)
        del model.graph.initializer[-len(packed) :]

    try:
        _, got = _run(model, ref["feeds"], shapes)
    except GraphoptError:
        undo()
        raise
    return _errors(ref["outputs"], got), undo


def _node_index(model: onnx.ModelProto, name: str) -> int | None:
    return next((i for i, n in enumerate(model.graph.node) if n.name == name), None)


def _fmt(errors: dict[str, float], limit: int = 4) -> str:
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:limit]
    more = f" (+{len(errors) - limit} more)" if len(errors) > limit else ""
    return ", ".join(f"{k} {v:.3g}" for k, v in worst) + more


# ---------------------------------------------------------------------------- the rule
@register_rule
class QuantizeWeightsInt4(Rule):
    name = "quantize-weights-int4"
    level = 2  # so that -O2 with the option says it needs -O3 (``needs-O3``)
    phase = "lower"
    changes_numerics = True
    summary = "MatMul(A, constant W) → com.microsoft.MatMulNBits (int4 weights, block 32)"
    pattern = Op("MatMul", "a", Const("w", kind="f"), name="matmul")

    def structure(self, m, cx):
        applies_only_if(cx.options.get("weights") in MODES and not cx.ir.in_subgraph)

    def check(self, m, cx):
        require(
            cx.level >= 3,
            "needs-O3",
            "int4 weights change numerics beyond rounding: they are applied at -O3 only",
            level=cx.level,
        )
        w = constant_value(m.w)
        require(
            w is not None and w.ndim == 2,
            "shape-mismatch",
            f"the weight '{m.w.name}' is not a 2-D [K, N] matrix",
        )
        k, n = w.shape
        require(k >= BLOCK, "too-small", f"K = {k} is below one block of {BLOCK}")
        require(
            last_dim(m.a) == k and m.a.shape is not None and len(m.a.shape) >= 2,
            "shape-mismatch",
            f"the input '{m.a.name}' is not [..., {k}] (last dim {last_dim(m.a)})",
        )
        tname = float_type(m.a)
        require(dtype_of(m.a) == w.dtype, "dtype-mismatch", "A and W differ in dtype")
        lowering(cx, [("MatMulNBits", MS, None, {})], tname, "int4 MatMul")
        zero_points = MODES[cx.options["weights"]]
        q = quantize(w, zero_points)
        packed = [
            Constant(cx.ir.fresh_name(f"{m.w.name}_int4"), q["B"]),
            Constant(cx.ir.fresh_name(f"{m.w.name}_scales"), q["scales"].astype(w.dtype)),
        ]
        if zero_points:
            packed.append(Constant(cx.ir.fresh_name(f"{m.w.name}_zp"), q["zero_points"]))
        attrs = {"K": k, "N": n, "bits": BITS, "block_size": BLOCK}
        try:
            errors, undo = measured_errors(cx, m.matmul, packed, attrs)
        except GraphoptError as e:
            require(False, "could-not-measure", f"the int4 error was not measured: {e}")
        limit = _limit(cx)
        worst = max(errors.values(), default=0.0)
        if worst > limit:
            undo()
        require(
            worst <= limit,
            "error-above-threshold",
            f"int4 weights here take an output {worst:.3g} of its largest magnitude off (limit "
            f"{limit:g}): {_fmt(errors)}",
            errors=errors,
            limit=limit,
        )
        m.stash(
            packed=packed, attrs=attrs, errors=errors, reference=cx.options[QUANTIZED_REFERENCE]
        )
        weight_error = float(np.max(np.abs(q["dequantized"] - w)) / (np.max(np.abs(w)) or 1.0))
        cx.remarks.add(
            Remark(
                "analysis",
                "rules",
                self.name,
                "measured-error",
                (m.matmul.name,),
                f"int4 weights of '{m.w.name}' [{k}, {n}]: error per output "
                f"(max |Δ| / max |reference|, with the weights quantized so far) {_fmt(errors)}; "
                f"weight max error {weight_error:.3g} of max |W|",
                {"errors": errors, "weight_error": weight_error, "limit": limit},
            )
        )

    def rewrite(self, m, b):
        m.reference["quantized"] += 1  # parity then holds the model to the int4 tolerance
        return [
            b.op(
                "MatMulNBits",
                [m.a, *m.packed],
                m.attrs,
                domain=MS,
                like=m.root.outputs[0],
                name=f"{m.root.name}/MatMulNBits",
            )
        ]

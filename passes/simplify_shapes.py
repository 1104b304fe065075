"""Symbolic shape arithmetic: fold exporter shape glue even when some dims are dynamic.

Exporters compute reshape targets at run time: ``Concat(Gather(Shape(x), 0), Gather(Shape(x),
1), 12, 64)``.  With dynamic batch/sequence axes this cannot be constant-folded, but each element
is still *known symbolically*: "dim 0 of x", "dim 1 of x", 12, 64.  This pass tracks such
element lists through Shape, Gather, Slice, Concat, Unsqueeze, Squeeze, Cast and Identity on
small int64 tensors, then

* replaces a tensor whose elements are all integers by a constant (partial shape folding), and
* rewrites a Reshape whose target is symbolic into a constant target: an element equal to the
  input's dim at the same position becomes 0 ("copy"), at most one other unknown becomes -1.

Symbolic dims are compared by name (onnx shape inference's ``dim_param``) or, when unnamed, by
(tensor, axis) identity — never by guess.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.analysis import infer_shapes
from graphopt.opt.graph.domains import is_default
from graphopt.opt.graph.ir import Constant, ModelIR, Node, Tensor, constant_value, unlink_all
from graphopt.opt.rewrite.context import Pass, PassContext
from graphopt.opt.rewrite.manager import register_pass

Dim = int | str | tuple  # int: known; str: named symbol; tuple: ("dim", id(tensor), axis)
MAX_ELEMENTS = 16


def _dim_of(tensor: Tensor, axis: int) -> Dim:
    shape = tensor.shape
    d = shape[axis] if shape is not None and axis < len(shape) else None
    if isinstance(d, (int, np.integer)) and d >= 0:
        return int(d)
    if isinstance(d, str) and d:
        return d
    return ("dim", id(tensor), axis)


class _Values:
    """Symbolic element lists of small integer tensors (scalar → list of one, flagged)."""

    def __init__(self) -> None:
        self.elems: dict[int, list[Dim]] = {}
        self.scalar: dict[int, bool] = {}

    def get(self, t: Tensor | None) -> list[Dim] | None:
        if t is None:
            return None
        if id(t) in self.elems:
            return self.elems[id(t)]
        v = constant_value(t, MAX_ELEMENTS)
        if v is not None and v.dtype.kind in "iu" and v.ndim <= 1 and v.size <= MAX_ELEMENTS:
            return [int(x) for x in v.reshape(-1)]
        return None

    def is_scalar(self, t: Tensor) -> bool:
        if id(t) in self.scalar:
            return self.scalar[id(t)]
        v = constant_value(t, MAX_ELEMENTS)
        return v is not None and v.ndim == 0

    def get_or_opaque(self, t: Tensor) -> tuple[list[Dim], bool] | None:
        """Known elements, or -- for a small int tensor computed some other way (a Mul of two
        dims, say) -- one opaque symbol per element, equal to nothing else."""
        known = self.get(t)
        if known is not None:
            return known, self.is_scalar(t)
        shape = t.shape
        if t.dtype is None or np.dtype(t.dtype).kind not in "iu" or shape is None:
            return None
        if len(shape) == 0:
            return [("opaque", id(t), 0)], True
        if len(shape) == 1 and isinstance(shape[0], int) and 0 < shape[0] <= MAX_ELEMENTS:
            return [("opaque", id(t), i) for i in range(shape[0])], False
        return None

    def set(self, t: Tensor, elems: list[Dim], scalar: bool = False) -> None:
        self.elems[id(t)] = elems
        self.scalar[id(t)] = scalar


def _ints(elems: list[Dim] | None) -> list[int] | None:
    return elems if elems is not None and all(isinstance(e, int) for e in elems) else None


def _propagate(node: Node, vals: _Values) -> None:
    op, ins = node.op, node.inputs
    out = node.outputs[0] if node.outputs else None
    if out is None or not is_default(node.domain):
        return
    if op == "Shape":
        x = ins[0]
        if x.shape is None:
            return
        rank = len(x.shape)
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        end = rank if end is None else int(end)
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        vals.set(out, [_dim_of(x, i) for i in range(start, end)])
    elif op in ("Identity", "Cast") and vals.get(ins[0]) is not None:
        if op == "Cast" and node.attrs.get("to") not in (6, 7):  # int32 / int64 only
            return
        vals.set(out, vals.get(ins[0]), vals.is_scalar(ins[0]))
    elif op == "Gather" and int(node.attrs.get("axis", 0)) == 0:
        data, idx = vals.get(ins[0]), constant_value(ins[1], MAX_ELEMENTS)
        if data is None or vals.is_scalar(ins[0]) or idx is None or idx.ndim > 1:
            return
        n = len(data)
        picked = [
            data[int(i) + n if i < 0 else int(i)] for i in idx.reshape(-1) if -n <= int(i) < n
        ]
        if len(picked) == idx.size:
            vals.set(out, picked, idx.ndim == 0)
    elif op == "Slice":
        data = vals.get(ins[0])
        params = [
            constant_value(t, MAX_ELEMENTS) if t is not None and t.name else None for t in ins[1:5]
        ]
        params += [None] * (4 - len(params))
        if data is None or vals.is_scalar(ins[0]) or params[0] is None or params[1] is None:
            return
        if params[2] is not None and list(params[2].reshape(-1)) not in ([0], [-1]):
            return
        step = int(params[3].reshape(-1)[0]) if params[3] is not None else 1
        start, end = int(params[0].reshape(-1)[0]), int(params[1].reshape(-1)[0])
        vals.set(out, list(data[slice(start, end, step)]) if step != 0 else data)
    elif op == "Concat" and int(node.attrs.get("axis", 0)) in (0, -1):
        parts = [vals.get_or_opaque(t) for t in ins]
        if all(p is not None and not p[1] for p in parts) and any(vals.get(t) for t in ins):
            vals.set(out, [e for p, _ in parts for e in p])
    elif op == "Unsqueeze":
        got = vals.get_or_opaque(ins[0])
        data = got[0] if got is not None else None
        axes = constant_value(ins[1], MAX_ELEMENTS) if len(ins) > 1 else node.attrs.get("axes")
        if (
            data is not None
            and got[1]
            and axes is not None
            and list(np.asarray(axes).reshape(-1)) in ([0], [-1])
        ):
            vals.set(out, data)
    elif op == "Squeeze":
        data = vals.get(ins[0])
        if data is not None and len(data) == 1 and not vals.is_scalar(ins[0]):
            vals.set(out, data, True)


@register_pass
class SimplifyShapes(Pass):
    name = "simplify-shapes"
    summary = "fold shape glue with dynamic dims: symbolic Shape/Gather/Concat, Reshape targets"
    level = 1

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        infer_shapes(ir)
        ir.toposort()
        vals = _Values()
        changed = False
        for node in list(ir.graph.nodes):
            if not node.outputs:
                continue
            _propagate(node, vals)
            out = node.outputs[0]
            known = _ints(vals.elems.get(id(out)))
            if (
                known is not None
                and len(node.outputs) == 1
                and node.op != "Constant"
                and not (ir.in_subgraph and ir.is_graph_output(out))
            ):
                if cx.take_bisect_step(self.name, node.name):
                    arr = np.array(known, dtype=np.int64)
                    if vals.scalar.get(id(out)):
                        arr = arr.reshape(())
                    if out.dtype is not None and np.dtype(out.dtype) != np.int64:
                        arr = arr.astype(out.dtype)
                    unlink_all(node.outputs)
                    unlink_all(node.inputs)
                    out.to_constant(arr)
                    changed = True
                continue
            if node.op == "Reshape" and not isinstance(node.inputs[1], Constant):
                changed |= self._reshape(node, vals, cx)
        if changed:
            cx.rule_stats(self.name).fired += 1
        return changed

    def _reshape(self, node: Node, vals: _Values, cx: PassContext) -> bool:
        target = vals.get(node.inputs[1])
        x = node.inputs[0]
        if target is None or x.shape is None or node.attrs.get("allowzero", 0):
            return False
        resolved: list[int] = []
        for i, e in enumerate(target):
            if isinstance(e, int):
                if e == 0:  # copy semantics already; keep
                    resolved.append(0)
                else:
                    resolved.append(e)
            elif i < len(x.shape) and _dim_of(x, i) == e:
                resolved.append(0)
            else:
                resolved.append(-1)
        if resolved.count(-1) > 1:
            return False
        if not cx.take_bisect_step(self.name, node.name):
            return False
        shape = Constant(cx.ir.fresh_name(f"{node.name}/shape"), np.array(resolved, np.int64))
        node.inputs[1] = shape
        cx.remark(
            "analysis",
            self.name,
            self.name,
            "symbolic-reshape",
            [node.name],
            f"Reshape '{node.name}' target resolved symbolically to {resolved}",
            target=resolved,
        )
        return True

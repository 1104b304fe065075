"""Symbolic dimension reasoning shared by the rule families.

:class:`Dims` says what each dimension of a tensor provably equals, as a hashable key:
``("int", n)`` for a static size, ``("param", name)`` for a graph input's named dim (or a dim
onnx shape inference proved equal to one), and ``("dim", tensor, axis)`` — the dim itself — when
nothing better is known.  Two equal keys mean equal dims at run time; unequal keys mean
"unknown", never "different".  Keys are derived through element-wise ops (broadcasting),
MatMul/Gemm, Transpose, Reshape (with constant or shape-glue targets), Split, Gather and Expand.

:func:`shape_elements` reads a small int64 shape tensor (a constant, or shape glue: Shape,
Concat, Gather, Slice, Unsqueeze, Cast) as a list of such keys; :func:`same_dim` compares two
dims; :func:`pins` says whether a Reshape target keeps given dims.
"""

from __future__ import annotations

import numpy as np

from .domains import MS, norm_domain
from .ir import Constant, Tensor, Variable, constant_value


def _inputs(node) -> list[Tensor | None]:
    """Node inputs with absent optional inputs as None."""
    return [
        None if t is None or (isinstance(t, Variable) and t.name == "") else t for t in node.inputs
    ]


Key = tuple

_UNARY = {
    "Cast",
    "Relu",
    "Erf",
    "Tanh",
    "Sigmoid",
    "Sqrt",
    "Neg",
    "Identity",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "Gelu",
    "BiasGelu",
    "FastGelu",
    "QuickGelu",
    "Dropout",
    "Abs",
    "Exp",
    "Log",
    "Reciprocal",
    "IsNaN",
    "Not",
    "Clip",
    "LeakyRelu",
    "HardSigmoid",
    "Softplus",
    "Mish",
    "HardSwish",
    "Elu",
    "Selu",
}
_BROADCAST = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "And",
    "Or",
    "Xor",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "Where",
    "Max",
    "Min",
    "Sum",
    "Mean",
}


def rank(t: Tensor | None) -> int | None:
    return len(t.shape) if t is not None and t.shape is not None else None


class Dims:
    """What each dimension of a tensor provably equals, as a key: ``("int", n)``, a graph input's
    named dim ``("param", name)``, or ``("dim", tensor, axis)`` — the dim itself, when nothing
    better is known.  Two equal keys mean equal dims at run time; unequal keys mean "unknown"."""

    def __init__(self) -> None:
        self.memo: dict[tuple[int, int], Key] = {}

    def key(self, t: Tensor, axis: int) -> Key:
        r = rank(t)
        if axis < 0:
            if r is None:
                return ("dim", t.name, axis)
            axis += r
        mk = (id(t), axis)
        if mk not in self.memo:
            self.memo[mk] = ("dim", t.name, axis)  # cycle guard
            self.memo[mk] = self._key(t, axis, r)
        return self.memo[mk]

    def _key(self, t: Tensor, axis: int, nd: int | None) -> Key:
        own = ("dim", t.name, axis)
        if t.shape is not None and axis < len(t.shape):
            d = t.shape[axis]
            if isinstance(d, (int, np.integer)) and d >= 0:
                return ("int", int(d))
            if isinstance(d, str) and d and not d.startswith("unk__"):
                # onnx shape inference names a dim after an input's only when it proved them
                # equal (a broadcast against an unknown dim yields a fresh ``unk__`` name)
                return ("param", d)
        if isinstance(t, Constant):
            return ("int", int(t.shape[axis])) if axis < len(t.shape) else own
        if not t.inputs:  # graph input
            d = t.shape[axis] if t.shape is not None and axis < len(t.shape) else None
            return ("param", d) if isinstance(d, str) and d else own
        node = t.inputs[0]
        ins = _inputs(node)
        op, out_index = node.op, node.outputs.index(t)
        if op in _UNARY or (op == "SkipLayerNormalization" and out_index in (0, 3)):
            return self.key(ins[0], axis) if ins and ins[0] is not None else own
        if op in _BROADCAST:
            return self._broadcast(t, axis, nd, [(i, None) for i in ins if i is not None])
        if op == "Expand":
            elems = shape_elements(ins[1], self)
            if elems is None:
                return own
            return self._broadcast(t, axis, len(elems), [(ins[0], None), (None, elems)])
        if op == "MatMul":
            return self._matmul(t, axis, ins)
        if op == "Gemm":
            if axis == 0:
                return self.key(ins[0], 1 if node.attrs.get("transA", 0) else 0)
            return self.key(ins[1], 0 if node.attrs.get("transB", 0) else 1)
        if op == "Transpose":
            perm = node.attrs.get("perm")
            if perm is None:
                r = rank(ins[0])
                return self.key(ins[0], r - 1 - axis) if r is not None else own
            return self.key(ins[0], int(perm[axis]))
        if op in ("Reshape", "Split", "Gather"):
            return getattr(self, f"_{op.lower()}")(node, ins, axis, own)
        if op == "MultiHeadAttention" and norm_domain(node.domain) == MS and axis < 2:
            return self.key(ins[0], axis)
        return own

    def _reshape(self, node, ins, axis: int, own: Key) -> Key:
        elems = shape_elements(ins[1], self)
        if elems is None or axis >= len(elems):
            return own
        e = elems[axis]
        if e == ("int", 0) and not node.attrs.get("allowzero", 0):
            return self.key(ins[0], axis)
        return own if e == ("int", -1) else e

    def _split(self, node, ins, axis: int, own: Key) -> Key:
        s = int(node.attrs.get("axis", 0))
        r = rank(ins[0])
        if r is not None and s < 0:
            s += r
        return self.key(ins[0], axis) if axis != s else own

    def _gather(self, node, ins, axis: int, own: Key) -> Key:
        g = int(node.attrs.get("axis", 0))
        r_idx = rank(ins[1])
        if r_idx is None:
            return own
        if g < 0 and rank(ins[0]) is not None:
            g += rank(ins[0])
        if axis < g:
            return self.key(ins[0], axis)
        if axis < g + r_idx:
            return self.key(ins[1], axis - g)
        return self.key(ins[0], axis - r_idx + 1)

    def _broadcast(self, t, axis, nd, operands) -> Key:
        own = ("dim", t.name, axis)
        if nd is None:
            ranks = [rank(o) if o is not None else len(e) for o, e in operands]
            if any(r is None for r in ranks):
                return own
            nd = max(ranks)
        found = set()
        for o, elems in operands:
            r = rank(o) if o is not None else len(elems)
            if r is None:
                return own
            a = axis - (nd - r)
            if a < 0:
                continue
            k = self.key(o, a) if o is not None else elems[a]
            if k != ("int", 1):
                found.add(k)
        if not found:
            return ("int", 1)
        return found.pop() if len(found) == 1 else own

    def _matmul(self, t, axis, ins) -> Key:
        own = ("dim", t.name, axis)
        a, b = ins[0], ins[1]
        ra, rb = rank(a), rank(b)
        if ra is None or rb is None or ra < 2 or rb < 2:
            return own
        r = max(ra, rb)
        if axis == r - 1:
            return self.key(b, rb - 1)
        if axis == r - 2:
            return self.key(a, ra - 2)
        found = set()
        for o, ro in ((a, ra), (b, rb)):
            ax = axis - (r - ro)
            if ax >= 0:
                k = self.key(o, ax)
                if k != ("int", 1):
                    found.add(k)
        if not found:
            return ("int", 1)
        return found.pop() if len(found) == 1 else own


def shape_elements(t: Tensor | None, dims: Dims | None = None) -> list[Key] | None:
    """The elements of a small int64 shape tensor as dim keys (constants as ``("int", v)``)."""
    dims = dims or Dims()
    if t is None:
        return None
    v = constant_value(t)
    if v is not None:
        if v.dtype.kind not in "iu" or v.ndim > 1:
            return None
        return [("int", int(x)) for x in v.reshape(-1)]
    if not t.inputs:
        return None
    node = t.inputs[0]
    ins = _inputs(node)
    if node.op == "Shape":
        r = rank(ins[0])
        if r is None:
            return None
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        start = start + r if start < 0 else start
        end = r if end is None else (int(end) + r if int(end) < 0 else min(int(end), r))
        return [dims.key(ins[0], i) for i in range(max(start, 0), end)]
    if node.op == "Concat":
        out: list[Key] = []
        for i in ins:
            e = shape_elements(i, dims)
            if e is None:
                return None
            out += e
        return out
    if node.op in ("Cast", "Identity"):
        return shape_elements(ins[0], dims)
    if node.op in ("Unsqueeze", "Squeeze", "Reshape"):  # scalar <-> [1]
        e = shape_elements(ins[0], dims)
        return e if e is not None and len(e) == 1 else None
    if node.op == "Gather" and int(node.attrs.get("axis", 0)) == 0:
        e = shape_elements(ins[0], dims)
        idx = constant_value(ins[1])
        if e is None or idx is None:
            return None
        try:
            return [e[int(i)] for i in np.asarray(idx).reshape(-1)]
        except IndexError:
            return None
    if node.op == "Slice":
        e = shape_elements(ins[0], dims)
        consts = [constant_value(i) if i is not None else None for i in ins[1:]]
        if e is None or any(c is None for c in consts[:2]):
            return None
        axes = consts[2] if len(consts) > 2 and consts[2] is not None else [0]
        steps = consts[3] if len(consts) > 3 and consts[3] is not None else [1]
        if list(np.asarray(axes).reshape(-1)) not in ([0], [-1]):
            return None
        s, en, st = (int(np.asarray(c).reshape(-1)[0]) for c in (consts[0], consts[1], steps))
        return e[slice(s, min(en, len(e)) if en >= 0 else en, st)]
    return None


def same_dim(a: Tensor, i: int, b: Tensor, j: int) -> bool:
    """Whether dim ``i`` of ``a`` provably equals dim ``j`` of ``b`` at run time."""
    d = Dims()
    return d.key(a, i) == d.key(b, j)


def pins(target: list[Key], dims: list[Key]) -> bool:
    """Whether Reshape ``target`` keeps ``dims``: equal keys, or a static size where the dim is
    symbolic (the graph then runs only when the dim has that size)."""
    return all(
        t == d or (t[0] == "int" and t[1] > 0 and d[0] != "int") for t, d in zip(target, dims)
    )


__all__ = ["Dims", "Key", "pins", "rank", "same_dim", "shape_elements"]

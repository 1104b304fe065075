"""Symbolic dimension reasoning shared by the rule families.

:class:`Dims` says what each dimension of a tensor provably equals, as a hashable key:
``("int", n)`` for a static size, ``("param", name)`` for a graph input's named dim (or a dim
onnx shape inference proved equal to one), ``("dim", tensor, axis)`` — the dim itself — when
nothing better is known, and ``("expr", op, a, b)`` for integer arithmetic on keys that does not
simplify (``B·4``, ``n + p``).  Two equal keys mean equal dims at run time; unequal keys mean
"unknown", never "different".  Keys are derived through element-wise ops (broadcasting),
MatMul/Gemm, Transpose, Reshape (with constant or shape-glue targets; a -1 is the input's size
over the other elements when those are static), Split, Gather, Expand, Pad (pads constant or
computed), Slice (constant bounds; the first or last c elements are ``min(d, c)``, and
``min(d, 1)`` broadcasts against d as d), Concat, Unsqueeze/Squeeze, ConstantOfShape, Resize
(computed sizes, a unit scale) and Conv (stride-1 spatial sizes as ``in + pads − span``) — so
a Swin window count computed from a padded, rolled input's shape is static when the input's
sizes are, and DETR's sine position embedding, computed from a resized mask, keeps the batch.

:func:`shape_elements` reads a small int64 shape tensor (a constant, or shape glue: Shape,
Concat, Gather, Slice, Unsqueeze, Squeeze, Reshape, Transpose, Cast, of any rank on the way, and
the integer arithmetic of :data:`ARITH`, computed by :func:`arith`, and a ``Where`` on an
``Equal`` it can decide) as a list of such keys;
:func:`same_dim` compares two dims; :func:`pins` says whether a Reshape target keeps given dims.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from .domains import MS, norm_domain
from .ir import Constant, Tensor, Variable, constant_value


def _inputs(node) -> list[Tensor | None]:
    """Node inputs with absent optional inputs as None."""
    return [
        None if t is None or (isinstance(t, Variable) and t.name == "") else t for t in node.inputs
    ]


Key = tuple

#: reductions over axes (an attribute before opset 18, ReduceSum's from 13, else an input)
_REDUCE = frozenset({"ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "ReduceProd", "ReduceL2"})
#: output 0 (the normalized sum) and 3 (the sum) have the shape of input 0
_SKIP_NORMS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")
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
    "Sin",
    "Cos",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "CumSum",
    "Trilu",
    "RotaryEmbedding",  # ONNX and com.microsoft: the shape of its input
    "ScatterND",  # the shape of the data scattered into (TorchScript's slice assignment)
    "ScatterElements",
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
        #: id(tensor) -> its value as an object array of keys (see :func:`shape_elements`)
        self.values_memo: dict[int, np.ndarray | None] = {}
        #: every tensor the memos key by id, held: no other object takes its id meanwhile
        self.held: list[Tensor] = []

    def key(self, t: Tensor, axis: int) -> Key:
        r = rank(t)
        if axis < 0:
            if r is None:
                return ("dim", t.name, axis)
            axis += r
        mk = (id(t), axis)
        if mk not in self.memo:
            self.held.append(t)
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
        if op in _UNARY or (op in _SKIP_NORMS and out_index in (0, 3)):
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
        if op in ("Reshape", "Split", "Gather", "Pad", "Slice", "Concat", "Resize", "Conv"):
            return getattr(self, f"_{op.lower()}")(node, ins, axis, own)
        if op in ("Unsqueeze", "Squeeze"):
            return self._squeeze(node, ins, axis, own)
        if op in _REDUCE:
            return self._reduce(node, ins, axis, own)
        if op == "Tile":
            reps = shape_elements(ins[1], self) if len(ins) > 1 else None
            if reps is None or axis >= len(reps):
                return own
            if reps[axis] == ("int", 1):
                return self.key(ins[0], axis)
            dim = self.key(ins[0], axis)
            return reps[axis] if dim == ("int", 1) else arith("Mul", dim, reps[axis])
        if op == "ConstantOfShape":
            elems = shape_elements(ins[0], self)
            return elems[axis] if elems is not None and axis < len(elems) else own
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
        if e == ("int", -1):
            return self._inferred(node, ins, elems, axis, own)
        # a computed element could be 0 or -1 at run time: only a dim's own key is trusted,
        # c·d of the input's own dim d at this axis (c > 0: never -1, and 0 only where d
        # is 0, which the copy of d gives too; bmm attention's [B·N, -1, H] of [B,N,S,H]),
        # and min(d, c) of a dim (c > 0: never -1, and 0 only where d is, as a dim's own key)
        if e[0] == "expr" and _capped(e):
            return e
        r = rank(ins[0])
        if e[0] == "expr" and r is not None and axis < r and _scales(e, self.key(ins[0], axis)):
            return e
        return own if e[0] == "expr" else e

    def _inferred(self, node, ins, elems: list[Key], axis: int, own: Key) -> Key:
        """The -1 of a Reshape target: the input's size over the other elements, symbolic
        factors cancelled (``[S, B, E]`` to ``[-1, B·N, H]`` is S when E = N·H); the input's
        symbolic dims that remain stay factors (``B·nW``)."""
        r = rank(ins[0])
        if r is None:
            return own
        size = [self.key(ins[0], i) for i in range(r)]
        zero = not node.attrs.get("allowzero", 0)
        rest_keys = [
            size[i] if e == ("int", 0) and zero and i < r else e
            for i, e in enumerate(elems)
            if i != axis
        ]
        total, symbolic = _factors(size)
        other, divisors = _factors(rest_keys)
        if total is None or other is None or total % other:
            return own
        for k in divisors:  # a symbolic element (copied by 0, or computed) cancels its own
            if k not in symbolic:
                return own
            symbolic.remove(k)
        key: Key = ("int", total // other)
        for k in sorted(symbolic, key=repr):
            key = arith("Mul", key, k)
        return key

    def _pad(self, node, ins, axis: int, own: Key) -> Key:
        """in + pads_begin + pads_end (pads an attribute before opset 11, else an input,
        possibly computed; ``axes`` from opset 18)."""
        pads = node.attrs.get("pads")
        if pads is not None:
            pads = [("int", int(p)) for p in pads]
        elif len(ins) > 1:
            pads = shape_elements(ins[1], self)
        r = rank(ins[0])
        if pads is None or r is None:
            return own
        axes = list(range(r))
        if len(ins) > 3 and ins[3] is not None:
            given = _const_ints(ins[3])
            if given is None:
                return own
            axes = _norm(given, r)
        if len(pads) != 2 * len(axes):
            return own
        k = self.key(ins[0], axis)
        if axis not in axes:
            return k
        i = axes.index(axis)
        return arith("Add", arith("Add", k, pads[i]), pads[i + len(axes)])

    def _slice(self, node, ins, axis: int, own: Key) -> Key:
        r = rank(ins[0])
        spec = _slice_spec(ins, r, self) if r is not None else None
        if spec is None:  # computed bounds: the axes not sliced still keep their dims
            sliced = _sliced_axes(ins, r) if r is not None else None
            return self.key(ins[0], axis) if sliced is not None and axis not in sliced else own
        k = self.key(ins[0], axis)
        if axis not in spec:
            return k
        s = spec[axis]
        if _int(k) is not None:
            return ("int", len(range(_int(k))[s]))
        big = np.iinfo(np.int64).max // 2
        if s.step != 1:
            return own
        if s.start == 0 and s.stop >= big:
            return k
        # the first c elements or the last c: min(dim, c) of any dim
        if s.start == 0 and 0 < s.stop < big or s.stop >= big and -big < s.start < 0:
            return arith("Min", k, ("int", s.stop if s.start == 0 else -s.start))
        return own

    def _resize(self, node, ins, axis: int, own: Key) -> Key:
        """Resize to computed ``sizes``, or by a constant scale of 1 on the axis."""
        if len(ins) > 3 and ins[3] is not None:
            elems = shape_elements(ins[3], self)
            return elems[axis] if elems is not None and axis < len(elems) else own
        scales = constant_value(ins[2], MAX_VALUES) if len(ins) > 2 else None
        if scales is None or axis >= scales.size or node.attrs.get("axes") is not None:
            return own
        return self.key(ins[0], axis) if float(scales.reshape(-1)[axis]) == 1.0 else own

    def _conv(self, node, ins, axis: int, own: Key) -> Key:
        """Conv: the batch of the input, the filters of the weight, and a spatial size
        ``in + pads − dilation·(kernel − 1)`` at stride 1 (static sizes at any stride)."""
        x, w = ins[0], ins[1]
        if axis == 0:
            return self.key(x, 0)
        if axis == 1:
            return self.key(w, 0)
        r = rank(w)
        i = axis - 2
        if r is None or node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
            return own
        n = r - 2
        kernel = node.attrs.get("kernel_shape") or [_int(self.key(w, a)) for a in range(2, r)]
        pads = node.attrs.get("pads") or [0] * 2 * n
        strides = node.attrs.get("strides") or [1] * n
        dil = node.attrs.get("dilations") or [1] * n
        if i >= n or kernel[i] is None:
            return own
        grow = int(pads[i]) + int(pads[i + n]) - int(dil[i]) * (int(kernel[i]) - 1)
        d = self.key(x, axis)
        if _int(d) is not None:
            return ("int", (_int(d) + grow - 1) // int(strides[i]) + 1)
        return arith("Add", d, ("int", grow)) if int(strides[i]) == 1 else own

    def _concat(self, node, ins, axis: int, own: Key) -> Key:
        r = rank(ins[0])
        c = int(node.attrs.get("axis", 0))
        if r is None or any(rank(i) != r for i in ins):
            return own
        c = c + r if c < 0 else c
        keys = [self.key(i, axis) for i in ins]
        if axis != c:  # every input has the output's dim here: the most informative key
            return min(keys, key=lambda k: ("int", "param", "dim", "expr").index(k[0]))
        total = keys[0]
        for k in keys[1:]:
            total = arith("Add", total, k)
        return own if total[0] == "expr" else total

    def _squeeze(self, node, ins, axis: int, own: Key) -> Key:
        r, axes = rank(ins[0]), _axes(node, ins)
        if r is None or axes is None:
            return own
        if node.op == "Unsqueeze":
            axes = _norm(axes, r + len(axes))
            if axis in axes:
                return ("int", 1)
            return self.key(ins[0], axis - sum(a < axis for a in axes))
        kept = [i for i in range(r) if i not in _norm(axes, r)]
        return self.key(ins[0], kept[axis]) if axis < len(kept) else own

    def _reduce(self, node, ins, axis: int, own: Key) -> Key:
        """A reduction's output: its reduced axes 1 (keepdims) or gone, the others kept."""
        r = rank(ins[0])
        axes = _axes(node, ins)
        if r is None or ins[0] is None:
            return own
        if axes is None:  # no axes: every axis, unless noop_with_empty_axes (then none)
            if node.attrs.get("noop_with_empty_axes", 0):
                return self.key(ins[0], axis)
            if len(ins) > 1 and ins[1] is not None:
                return own  # computed at run time
            axes = list(range(r))
        reduced = _norm(axes, r)
        if node.attrs.get("keepdims", 1):
            return ("int", 1) if axis in reduced else self.key(ins[0], axis)
        kept = [i for i in range(r) if i not in reduced]
        return self.key(ins[0], kept[axis]) if axis < len(kept) else own

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
        # min(d, 1) (``x[:, -1:]``) is 1, or 0 where d is: either way d against d
        found -= {arith("Min", d, ("int", 1)) for d in found}
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


#: most elements a shape value may have to be read as keys (shape glue is small)
MAX_VALUES = 64
#: element-wise integer ops on shape values that :func:`arith` computes
ARITH = frozenset({"Add", "Sub", "Mul", "Div", "Mod", "Max", "Min"})
_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min"})
#: ONNX element types a Cast of shape values may go to and keep them (u)int8..64
_INT_TYPES = frozenset({2, 3, 4, 5, 6, 7, 12, 13})


def _int(k: Key) -> int | None:
    return k[1] if k[0] == "int" else None


def _factors(keys: list[Key]) -> tuple[int | None, list[Key]]:
    """The product of ``keys`` as a static coefficient and its symbolic factors (products
    ``("expr", "Mul", …)`` opened up); the coefficient is None when a static factor is not a
    positive size."""
    coef, symbolic = 1, []
    todo = list(keys)
    while todo:
        k = todo.pop()
        if k[0] == "expr" and k[1] == "Mul":
            todo += [k[2], k[3]]
        elif _int(k) is None:
            symbolic.append(k)
        elif _int(k) <= 0:
            return None, symbolic
        else:
            coef *= _int(k)
    return coef, symbolic


def _eval(op: str, x: int, y: int, fmod: bool = False) -> int | None:
    """``x op y`` as onnxruntime computes it on int64 (Div truncates; Mod takes the divisor's
    sign unless ``fmod``); None for a zero divisor."""
    if op in ("Div", "Mod") and y == 0:
        return None
    if op == "Div":
        q = abs(x) // abs(y)
        return q if (x >= 0) == (y >= 0) else -q
    if op == "Mod":
        return x - y * _eval("Div", x, y) if fmod else x % y
    return {"Add": x + y, "Sub": x - y, "Mul": x * y, "Max": max(x, y), "Min": min(x, y)}[op]


def arith(op: str, a: Key, b: Key, fmod: bool = False) -> Key:
    """The key of ``a op b`` for ``op`` in :data:`ARITH`: computed for two static sizes,
    simplified for the identities (``x+0``, ``x-0``, ``x·1``, ``x/1``, ``(x·c)/c``), else the
    expression itself ``("expr", op, a, b)`` (equal expressions of equal keys are equal)."""
    x, y = _int(a), _int(b)
    if x is not None and y is not None:
        v = _eval(op, x, y, fmod)
        if v is not None:
            return ("int", v)
    if op in _COMMUTATIVE and x is not None:
        a, b, x, y = b, a, y, x
    if (op in ("Add", "Sub") and y == 0) or (op in ("Mul", "Div") and y == 1):
        return a
    if op in ("Add", "Sub") and y is not None:
        base, c = _offset(a)
        if base is not a:  # (x ± c) ± y: one offset (``cache_position[-1] + 1`` is the limit)
            c += y if op == "Add" else -y
            return base if c == 0 else arith("Add" if c > 0 else "Sub", base, ("int", abs(c)))
    if op == "Div" and y and a[0] == "expr" and a[1] == "Mul" and b in a[2:]:
        return a[3] if a[2] == b else a[2]
    if op in _COMMUTATIVE:
        a, b = sorted((a, b), key=repr)
    return ("expr", op, a, b) if not fmod else ("expr", "FMod", a, b)


def _scales(e: Key, d: Key) -> bool:
    """Whether ``e`` is ``c·d`` with a constant c > 0."""
    if e[0] != "expr" or e[1] != "Mul":
        return False
    a, b = e[2], e[3]
    c = _int(a) if b == d else _int(b) if a == d else None
    return c is not None and c > 0


def _capped(e: Key) -> bool:
    """Whether ``e`` is ``min(d, c)`` of a dim's own key d and a constant c > 0 (the length of
    a slice of its first or last c elements)."""
    if e[0] != "expr" or e[1] != "Min":
        return False
    a, b = e[2], e[3]
    c, d = (_int(a), b) if _int(a) is not None else (_int(b), a)
    return c is not None and c > 0 and d[0] in ("param", "dim")


def _offset(k: Key) -> tuple[Key, int]:
    """``k`` as ``base + c``: the operands of ``x + c`` or ``x − c`` with a static ``c``, else
    (k, 0)."""
    if k[0] != "expr" or k[1] not in ("Add", "Sub"):
        return k, 0
    a, b = k[2], k[3]
    if k[1] == "Sub":
        return (a, -_int(b)) if _int(b) is not None else (k, 0)
    if _int(b) is not None:
        return a, _int(b)
    return (b, _int(a)) if _int(a) is not None else (k, 0)


def _array(keys: list[Key], shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Keys as a numpy object array (element by element: a key is a tuple)."""
    a = np.empty(len(keys), dtype=object)
    for i, k in enumerate(keys):
        a[i] = k
    return a.reshape(shape if shape is not None else (len(keys),))


def _ints(a: np.ndarray | None) -> list[int] | None:
    """The elements of a key array as ints, when all are static."""
    if a is None:
        return None
    out = [_int(k) for k in a.reshape(-1)]
    return None if any(v is None for v in out) else out


def _const_ints(t: Tensor | None) -> list[int] | None:
    v = constant_value(t, MAX_VALUES)
    if v is None or v.dtype.kind not in "iu":
        return None
    return [int(x) for x in v.reshape(-1)]


def _axes(node, ins) -> list[int] | None:
    """Unsqueeze/Squeeze and reduction axes as written (an attribute, or an input); None when
    absent or computed at run time."""
    axes = node.attrs.get("axes")
    if axes is None and len(ins) > 1 and ins[1] is not None:
        return _const_ints(ins[1])
    return None if axes is None else [int(a) for a in axes]


def _norm(axes: list[int], r: int) -> list[int]:
    return [a + r if a < 0 else a for a in axes]


def _reshaped(a: np.ndarray, target: list[int], allowzero: bool) -> np.ndarray | None:
    shape = [
        a.shape[i] if v == 0 and not allowzero and i < a.ndim else v for i, v in enumerate(target)
    ]
    try:
        return a.reshape(shape)
    except ValueError:
        return None


def _slice_spec(ins, r: int, dims: Dims | None = None) -> dict[int, slice] | None:
    """Slice's constant starts/ends/axes/steps as a Python slice per axis (Python's clamping
    is ONNX's); with ``dims``, also those computed from static dims (TorchScript's
    ``w[E:]`` with E read from a shape)."""

    def ints(t: Tensor | None) -> list[int] | None:
        found = _const_ints(t)
        return found if found is not None or dims is None else _ints(_values(t, dims))

    starts, ends = ints(ins[1]), ints(ins[2])
    axes = ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    steps = ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
    if starts is None or ends is None or (len(ins) > 3 and ins[3] is not None and axes is None):
        return None
    if len(ins) > 4 and ins[4] is not None and steps is None:
        return None
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    if not (len(axes) == len(starts) == len(ends) == len(steps)) or 0 in steps:
        return None
    return {
        (a + r if a < 0 else a): slice(s, e, st) for a, s, e, st in zip(axes, starts, ends, steps)
    }


def _sliced_axes(ins, r: int) -> set[int] | None:
    """The axes a Slice slices, whatever its bounds: its constant ``axes``, else as many
    leading axes as its starts have elements (a static count); None when unknown."""
    if len(ins) > 3 and ins[3] is not None:
        axes = _const_ints(ins[3])
        return set(_norm(axes, r)) if axes is not None else None
    shape = ins[1].shape if ins[1] is not None else None
    n = shape[0] if shape is not None and len(shape) == 1 else None
    return set(range(n)) if isinstance(n, (int, np.integer)) else None


def _values(t: Tensor | None, dims: Dims, depth: int = 48) -> np.ndarray | None:
    """The value of a small integer tensor as an object array of keys, or None."""
    if t is None or depth == 0:
        return None
    memo = dims.values_memo
    if id(t) not in memo:
        dims.held.append(t)
        memo[id(t)] = None  # cycle guard
        v = _compute_values(t, dims, depth)
        if v is not None and not isinstance(v, np.ndarray):  # one element picked out
            v = _array([v], ())
        memo[id(t)] = v
    return memo[id(t)]


def _compute_values(t: Tensor, dims: Dims, depth: int) -> np.ndarray | None:
    v = constant_value(t, MAX_VALUES)
    if v is not None:
        if v.dtype.kind not in "iu":
            return None
        return _array([("int", int(x)) for x in v.reshape(-1)], v.shape)
    if isinstance(t, Constant) or not t.inputs:
        return None
    node = t.inputs[0]
    ins = _inputs(node)
    op = node.op
    if op == "Shape":
        r = rank(ins[0])
        if r is None:
            return None
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        start = min(max(start + r if start < 0 else start, 0), r)
        end = r if end is None else (int(end) + r if int(end) < 0 else min(int(end), r))
        return _array([dims.key(ins[0], i) for i in range(start, max(end, start))])
    if op == "Size" or not ins or ins[0] is None:
        return None
    if op in ARITH:
        return _binary(node, ins, dims, depth)
    if op == "Where":
        return _where(ins, dims, depth)
    if op == "Gather" and ins[0].inputs and ins[0].inputs[0].op == "Range":
        return _range_elements(ins[0].inputs[0], ins[1], dims, depth)
    x = _values(ins[0], dims, depth - 1)
    if x is None:
        return None
    if op == "Identity" or (op == "Cast" and node.attrs.get("to") in _INT_TYPES):
        return x
    if op == "Concat":
        parts = [x] + [_values(i, dims, depth - 1) for i in ins[1:]]
        if any(p is None or p.ndim != x.ndim for p in parts) or x.ndim == 0:
            return None
        try:
            return np.concatenate(parts, axis=int(node.attrs.get("axis", 0)))
        except ValueError:
            return None
    return _layout(node, ins, x)


def _layout(node, ins, x: np.ndarray) -> np.ndarray | None:
    """Unsqueeze, Squeeze, Reshape, Flatten, Transpose, Gather and Slice of a key array."""
    op, r = node.op, x.ndim
    try:
        axes = _axes(node, ins) if op in ("Unsqueeze", "Squeeze") else None
        if op == "Unsqueeze":
            return None if axes is None else np.expand_dims(x, tuple(_norm(axes, r + len(axes))))
        if op == "Squeeze":
            if axes is None:
                return np.squeeze(x) if len(ins) < 2 or ins[1] is None else None
            return np.squeeze(x, axis=tuple(_norm(axes, r)))
        if op == "Reshape":
            target = _const_ints(ins[1])
            return (
                None
                if target is None
                else _reshaped(x, target, bool(node.attrs.get("allowzero", 0)))
            )
        if op == "Flatten":
            a = int(node.attrs.get("axis", 1))
            a = a + r if a < 0 else a
            return x.reshape(int(np.prod(x.shape[:a])), -1)
        if op == "Transpose":
            perm = node.attrs.get("perm")
            return np.transpose(x, None if perm is None else [int(p) for p in perm])
        if op == "Gather":
            idx = constant_value(ins[1], MAX_VALUES)
            if idx is None or idx.dtype.kind not in "iu":
                return None
            return np.take(x, idx.astype(np.int64), axis=int(node.attrs.get("axis", 0)))
        if op == "Slice":
            spec = _slice_spec(ins, r)
            if spec is None or any(a >= r for a in spec):
                return None
            return x[tuple(spec.get(a, slice(None)) for a in range(r))]
    except (ValueError, IndexError, TypeError):
        return None
    return None


def _range_elements(rng, idx: Tensor | None, dims: Dims, depth: int) -> np.ndarray | None:
    """Constant indices into ``Range(start, limit, 1)``: ``start + i``, and ``limit + i`` for a
    negative ``i`` (torch's ``cache_position[-1]``); the Gather fails at run time where the
    index is out of the range."""
    bounds = [_values(t, dims, depth - 1) for t in _inputs(rng)]
    at = constant_value(idx, MAX_VALUES) if idx is not None else None
    if len(bounds) != 3 or any(b is None or b.ndim != 0 for b in bounds) or at is None:
        return None
    start, limit, delta = (b.reshape(-1)[0] for b in bounds)
    if delta != ("int", 1) or at.dtype.kind not in "iu" or at.ndim > 1:
        return None
    keys = [
        arith("Sub", limit, ("int", -int(i))) if i < 0 else arith("Add", start, ("int", int(i)))
        for i in at.reshape(-1)
    ]
    return _array(keys, at.shape)


def _equal(a: Key, b: Key) -> bool | None:
    """Whether two shape elements are equal, where that is known: equal keys are, two sizes
    are compared, and a dim is never a negative constant (torch's ``expand(B, -1, -1)``
    target)."""
    if a == b:
        return True
    x, y = _int(a), _int(b)
    if x is not None and y is not None:
        return x == y
    if x is not None and x < 0 and b[0] in ("param", "dim"):
        return False
    if y is not None and y < 0 and a[0] in ("param", "dim"):
        return False
    return None


def _where(ins, dims: Dims, depth: int) -> np.ndarray | None:
    """``Where(Equal(x, c), y, z)`` of shape values, where each comparison is known."""
    cond = ins[0]
    node = cond.inputs[0] if cond is not None and cond.inputs else None
    if node is None or node.op != "Equal" or len(ins) != 3:
        return None
    parts = [_values(i, dims, depth - 1) for i in (*_inputs(node)[:2], ins[1], ins[2])]
    if any(p is None for p in parts):
        return None
    try:
        a, b, y, z = np.broadcast_arrays(*parts)
    except ValueError:
        return None
    same = [_equal(i, j) for i, j in zip(a.reshape(-1), b.reshape(-1))]
    if None in same:
        return None
    picked = [i if e else j for e, i, j in zip(same, y.reshape(-1), z.reshape(-1))]
    return _array(picked, a.shape)


def _binary(node, ins, dims: Dims, depth: int) -> np.ndarray | None:
    """Element-wise integer arithmetic of shape values, broadcast."""
    a, b = (_values(i, dims, depth - 1) for i in ins[:2])
    if a is None or b is None or len(ins) != 2:
        return None
    try:
        a, b = np.broadcast_arrays(a, b)
    except ValueError:
        return None
    fmod = bool(node.attrs.get("fmod", 0))
    out = [arith(node.op, x, y, fmod) for x, y in zip(a.reshape(-1), b.reshape(-1))]
    return _array(out, a.shape)


def shape_elements(t: Tensor | None, dims: Dims | None = None) -> list[Key] | None:
    """The elements of a small int64 shape tensor (rank ≤ 1) as dim keys: constants as
    ``("int", v)``, shape glue (Shape, Concat, Gather, Slice, Unsqueeze, Squeeze, Reshape,
    Transpose, Cast) followed, integer arithmetic (:data:`ARITH`) computed by :func:`arith`."""
    a = _values(t, dims or current())
    if a is None or a.ndim > 1:
        return None
    return list(a.reshape(-1))


def same_dim(a: Tensor, i: int, b: Tensor, j: int) -> bool:
    """Whether dim ``i`` of ``a`` provably equals dim ``j`` of ``b`` at run time."""
    d = current()
    return d.key(a, i) == d.key(b, j)


#: the Dims the rules share while the rule engine works on a graph (innermost last; None while
#: a rewrite changes it)
_SHARED: list[Dims | None] = []


def current() -> Dims:
    """The Dims of the graph as it is now: while the rule engine works on a graph
    (:func:`sharing`), one for every question asked between two rewrites (:func:`changed`
    renews it), so that each tensor's dims are derived once, not once per question (each walks
    back towards the graph's inputs); elsewhere, and while a rewrite is being built
    (:func:`unshared`), a fresh one."""
    top = _SHARED[-1] if _SHARED else None
    return top if top is not None else Dims()


@contextmanager
def sharing() -> Iterator[None]:
    """Questions asked meanwhile share one :class:`Dims` (:func:`current`)."""
    _SHARED.append(Dims())
    try:
        yield
    finally:
        _SHARED.pop()


@contextmanager
def unshared() -> Iterator[None]:
    """Questions asked meanwhile (the graph changing under them) each get a fresh Dims."""
    _SHARED.append(None)
    try:
        yield
    finally:
        _SHARED.pop()


def changed() -> None:
    """The graph changed (a rewrite): what the shared Dims derived is forgotten."""
    if _SHARED and _SHARED[-1] is not None:
        _SHARED[-1] = Dims()


def pins(target: list[Key], dims: list[Key]) -> bool:
    """Whether Reshape ``target`` keeps ``dims``: equal keys, or a static size where the dim is
    symbolic (the graph then runs only when the dim has that size)."""
    return all(
        t == d or (t[0] == "int" and t[1] > 0 and d[0] != "int") for t, d in zip(target, dims)
    )


__all__ = [
    "ARITH",
    "Dims",
    "Key",
    "arith",
    "changed",
    "current",
    "pins",
    "rank",
    "same_dim",
    "shape_elements",
    "sharing",
    "unshared",
]

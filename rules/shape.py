"""Shape glue (level 1): collapse chains of layout-only ops that exporters emit.

When a chain cancels out entirely between a graph input and a graph output, one Identity is
left to keep the output's name (still one node instead of two).

* ``fuse-transposes``: Transpose∘Transpose → one Transpose (or nothing).
* ``transpose-through-binary``: a Transpose of ``a ⊕ Transpose⁻¹(b)`` moves onto ``a``.
* ``slices-to-split``: Slices that cut one axis of a tensor into consecutive pieces → one Split.
* ``collapse-reshape-chain``: Reshape/Squeeze/Unsqueeze/Flatten feeding a Reshape with a constant
  target, or any such chain whose final shape is static → one Reshape (or nothing).
* ``reshape-round-trip``: a Reshape back to the target its input was reshaped to → nothing.
* ``fuse-casts``: Cast∘Cast → one Cast when the middle type holds every value exactly.
* ``shape-through-transpose``: a dim read from a Transpose's shape is read from its input, so a
  Transpose kept alive only to be measured (T5's key length) can go.
* ``scatter-slices-to-concat``: ScatterNDs that write consecutive rows of a tensor, every row
  once (``new_empty`` filled by slice assignment) → one Concat of what they write.
* ``concat-of-transposes``: a Concat of Transposes of one perm → one Transpose of the Concat.
"""

from __future__ import annotations

import numpy as np

from graphopt.opt.graph.dims import current as current_dims
from graphopt.opt.graph.dims import rank, shape_elements
from graphopt.opt.graph.domains import MS
from graphopt.opt.graph.ir import Variable, constant_value, dtype_of, static_shape
from graphopt.opt.rewrite.engine import Match, NoMatch, Op, Rule, applies_only_if, require
from graphopt.opt.rewrite.manager import register_rule


@register_rule
class FuseTransposes(Rule):
    name = "fuse-transposes"
    root = "Transpose"
    level = 1
    exclusive = False
    summary = "Transpose∘Transpose → one Transpose"
    pattern = Op("Transpose", Op("Transpose", "x", name="first"), name="second")

    def check(self, m, cx):
        p1, p2 = m.first.attrs.get("perm"), m.second.attrs.get("perm")
        require(
            p1 is not None and p2 is not None,
            "implicit-perm",
            "a Transpose without perm (reversal) needs a known rank",
        )
        perm = [p1[i] for i in p2]
        m.stash(perm=perm)

    def rewrite(self, m, b):
        if m.perm == sorted(m.perm):
            return [m.x]
        return [b.op("Transpose", [m.x], {"perm": m.perm}, like=m.root.outputs[0])]


ELEMENTWISE_BINARY = ("Add", "Sub", "Mul", "Div")


@register_rule
class TransposeThroughBinary(Rule):
    """``T_p(a ⊕ T_q(b))`` with ``p∘q`` the identity → ``T_p(a) ⊕ b``: one Transpose instead of
    two.  torchvision's ConvNeXt permutes each block's branch back to NCHW for the residual Add,
    and the next stage's LayerNorm2d permutes the sum to NHWC again; the permute moves onto the
    residual operand instead (a constant operand is transposed by folding).  ``T_q(b)`` and the
    sum must be read only here; ``a`` must have the full rank (no broadcast re-alignment)."""

    name = "transpose-through-binary"
    root = "Transpose"
    level = 1
    summary = "Transpose(a ⊕ Transpose⁻¹(b)) → Transpose(a) ⊕ b"

    pattern = Op(
        "Transpose",
        Op(ELEMENTWISE_BINARY, Op("Transpose", "b", name="inner"), "a", commute=True, name="op"),
        name="outer",
    )

    def structure(self, m, cx):
        perm, q = m.outer.attrs.get("perm"), m.inner.attrs.get("perm")
        applies_only_if(perm is not None and q is not None and len(q) == len(perm))
        applies_only_if([q[i] for i in perm] == sorted(perm))

    def check(self, m, cx):
        perm = list(m.outer.attrs["perm"])
        a = m.a
        for t in (m.op.outputs[0], m.inner.outputs[0]):
            require(
                len(t.outputs) == 1 and not cx.ir.is_graph_output(t),
                "shared-intermediate",
                f"'{t.name}' is also read elsewhere",
            )
        require(
            a.shape is not None and len(a.shape) == len(perm),
            "rank-mismatch",
            f"'{a.name}' is not of rank {len(perm)}: transposing it would re-align a broadcast",
        )
        m.stash(perm=perm)

    def rewrite(self, m, b):
        ta = b.op("Transpose", [m.a], {"perm": m.perm}, name=f"{m.outer.name}/operand")
        ta.dtype = m.a.dtype
        ins = [m.b, ta] if m.op.inputs[0] is m.inner.outputs[0] else [ta, m.b]
        return [b.op(m.op.op, ins, like=m.outer.outputs[0], name=f"{m.op.name}/moved")]


#: element-wise ops of one input, indifferent to the shape they run on
UNARY_ELEMENTWISE = frozenset(
    {
        "Relu",
        "Sigmoid",
        "Tanh",
        "Erf",
        "Abs",
        "Neg",
        "Exp",
        "Log",
        "Sqrt",
        "Reciprocal",
        "Softplus",
        "LeakyRelu",
        "Elu",
        "Selu",
        "HardSigmoid",
        "HardSwish",
        "Mish",
        "Gelu",
        "FastGelu",
        "QuickGelu",
        "Clip",
    }
)


@register_rule
class ReshapeThroughUnary(Rule):
    """``Reshape(u(Reshape(x, s1)), s2)`` → ``u(x)`` when ``s2`` gives x's own shape back and u
    is element-wise: between two flat Gemms (``matmul-add-to-gemm`` on cpu) the activation runs
    on the flat tensor and both Reshapes go."""

    name = "reshape-through-unary"
    root = "Reshape"
    level = 1
    summary = "Reshape(u(Reshape(x))) back to x's shape → u(x) for element-wise u"

    pattern = Op(
        "Reshape",
        Op(
            tuple(sorted(UNARY_ELEMENTWISE)),
            Op("Reshape", "x", "s1", name="inner"),
            extra_inputs=True,
            domain=("", MS),
            name="u",
        ),
        "s2",
        name="outer",
    )

    def structure(self, m, cx):
        applies_only_if(not any(isinstance(t, Variable) and t.name for t in m.u.inputs[1:]))

    def check(self, m, cx):
        x = m.x
        for t in (m.inner.outputs[0], m.u.outputs[0]):
            require(
                len(t.outputs) == 1 and not cx.ir.is_graph_output(t),
                "shared-intermediate",
                f"'{t.name}' is also read elsewhere",
            )
        target = constant_value(m.outer.inputs[1])
        shape = _shape_or_gemm(x)
        require(
            target is not None and shape is not None and len(target) == len(shape),
            "reshape-not-identity",
            "the outer Reshape's target is not a constant of x's rank",
        )
        free = [i for i, d in enumerate(shape) if not isinstance(d, (int, np.integer))]
        ok = len(free) <= 1 and all(
            (t == -1 and i in free) or (isinstance(d, (int, np.integer)) and t == d)
            for i, (t, d) in enumerate(zip(target.tolist(), shape))
        )
        require(
            ok,
            "reshape-not-identity",
            f"the Reshape to {target.tolist()} does not restore {list(shape)}",
        )

    def rewrite(self, m, b):
        ins = [m.x, *m.u.inputs[1:]]
        return [
            b.op(
                m.u.op,
                ins,
                dict(m.u.attrs),
                domain=m.u.domain,
                like=m.outer.outputs[0],
                name=f"{m.u.name}/unreshaped",
            )
        ]


#: ops whose output has their (first) input's shape
SHAPE_KEEPING = frozenset({"Softmax", "LogSoftmax", "Cast", "Identity", *UNARY_ELEMENTWISE})


@register_rule
class ReshapeRoundTrip(Rule):
    """``Reshape(t, b)`` or ``Reshape(Reshape(t, a), b)`` → ``t`` when ``t`` was itself made by
    a Reshape to the very same target ``b`` (then shape-keeping ops: Softmax, Cast, unary
    element-wise), or — the second form — when ``b`` is provably ``t``'s own shape.  The eager
    bmm attention of XGLM unfolds its probabilities to [B,N,S,T] and folds them straight back
    with the target that folded its scores.  ``b`` is computed (the same tensor: the same
    values at run time) or a constant, without zeros unless both Reshapes take them literally
    (``allowzero``); a computed 0 is an empty dim."""

    name = "reshape-round-trip"
    root = "Reshape"
    level = 1
    summary = "Reshape back to the target its input was reshaped to → nothing"
    pattern = Op("Reshape", "t", "b", name="outer")

    def structure(self, m, cx):
        zero = m.outer.attrs.get("allowzero", 0)  # 1: a 0 is a 0, not a copy of the input's dim
        target = constant_value(m.b)
        applies_only_if(target is not None or isinstance(m.b, Variable))
        applies_only_if(zero or target is None or 0 not in target.tolist())
        src, inner = m.t, None
        if src.inputs and src.inputs[0].op == "Reshape" and len(src.outputs) == 1:
            inner = src.inputs[0]
            src = inner.inputs[0]
        applies_only_if(not cx.ir.is_graph_output(m.t))
        if inner is not None and _restores(m.b, src, zero):
            m.stash(source=src)
            return
        made = src
        while made.inputs and made.inputs[0].op in SHAPE_KEEPING:
            made = made.inputs[0].inputs[0]
        rs = made.inputs[0] if made.inputs else None
        applies_only_if(rs is not None and rs.op == "Reshape" and rs.inputs[1] is m.b)
        applies_only_if(rs.attrs.get("allowzero", 0) == zero)
        m.stash(source=src)

    def rewrite(self, m, b):
        return [m.source]


def _restores(target, t, allowzero: int) -> bool:
    """Whether the Reshape target ``target`` is provably ``t``'s own shape, element by element
    (symbolic dims: GroupViT's bmm attention unfolds its folded probabilities to [B,N,T,S]
    for the attention weights and folds them back to [B·N,T,S] with a target computed from
    shapes); a -1 may stand for the one dim not proven otherwise."""
    dims = current_dims()
    elems = shape_elements(target, dims)
    r = rank(t)
    if elems is None or r is None or len(elems) != r:
        return False
    if not allowzero and ("int", 0) in elems:
        return False  # a copy of the unfolded tensor's dim, not of t's
    free = [i for i, e in enumerate(elems) if e == ("int", -1)]
    return len(free) <= 1 and all(e == dims.key(t, i) for i, e in enumerate(elems) if i not in free)


@register_rule
class SlicesToSplit(Rule):
    """Slices of one tensor that cut one axis into consecutive pieces → one Split.

    torch traces ``chunk``/``split`` with computed bounds as one Slice per piece (YOLOv8's box
    distances after the DFL); once the bounds are folded they are a Split's sizes.  Every Slice
    of the tensor must take part: constant bounds on the same single axis, step 1, pieces that
    tile the static dim exactly; none of their outputs a graph output.
    """

    name = "slices-to-split"
    root = "Slice"
    level = 1
    exclusive = False
    summary = "Slices that tile one axis of a tensor → one Split"

    def match(self, node, cx):
        x = node.inputs[0] if node.inputs else None
        sibs = [c for c in x.outputs if c.op == "Slice"] if x is not None else []
        if len(sibs) < 2 or sibs[0] is not node:  # tried once, from the first Slice
            raise NoMatch("structure", "not the first of several Slices", structural=True)
        return Match(node, {f"slice{i}": s for i, s in enumerate(sibs)})

    def check(self, m, cx):
        slices = [n for n in m.nodes()]
        x = m.root.inputs[0]
        pieces, axes = [], set()
        for sl in slices:
            ins = list(sl.inputs) + [None] * 5
            vals = [constant_value(t) if t is not None and t.name else None for t in ins[1:5]]
            applies_only_if(vals[0] is not None and vals[1] is not None and not sl.attrs)
            rank = len(x.shape) if x.shape is not None else None
            applies_only_if(rank is not None and vals[0].size == 1)
            axis = int(vals[2].reshape(-1)[0]) if vals[2] is not None else 0
            axis = axis + rank if axis < 0 else axis
            step = int(vals[3].reshape(-1)[0]) if vals[3] is not None else 1
            dim = x.shape[axis] if 0 <= axis < rank else None
            applies_only_if(step == 1 and isinstance(dim, (int, np.integer)))
            start, end = int(vals[0].reshape(-1)[0]), int(vals[1].reshape(-1)[0])
            start = min(max(start + dim if start < 0 else start, 0), dim)
            end = min(max(end + dim if end < 0 else end, 0), dim)
            axes.add(axis)
            pieces.append((start, end, sl))
            applies_only_if(not cx.ir.is_graph_output(sl.outputs[0]))
        pieces.sort(key=lambda p: p[0])
        applies_only_if(len(axes) == 1 and _tile(pieces, int(dim)))
        m.stash(axis=axes.pop(), pieces=pieces)

    def rewrite(self, m, b):
        sizes = [end - start for start, end, _ in m.pieces]
        x = m.root.inputs[0]
        ins, attrs = [x], {"axis": m.axis}
        if b.ir.opset >= 13:
            ins.append(b.const(np.array(sizes, np.int64), "split"))
        else:
            attrs["split"] = sizes
        parts = b.op("Split", ins, attrs, outputs=len(sizes), name=f"{m.root.name}/split")
        root_out = None
        for (_, _, sl), part in zip(m.pieces, parts):
            old = sl.outputs[0]
            part.dtype, part.shape = old.dtype, old.shape
            if sl is m.root:
                root_out = part
            else:
                b.ir.replace_all_uses(old, part)
        return [root_out]


def _tile(pieces: list[tuple], dim: int) -> bool:
    """Whether ``(start, end, …)`` pieces, sorted by start, cut ``[0, dim)`` into consecutive,
    non-empty ranges."""
    return (
        pieces[0][0] == 0
        and pieces[-1][1] == dim
        and all(p[1] > p[0] for p in pieces)
        and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
    )


def _shape_or_gemm(x) -> list | None:
    """x's shape; for a Gemm output not yet inferred, [M, N] with N from the constant B."""
    if x.shape is not None:
        return list(x.shape)
    gemm = x.inputs[0] if x.inputs else None
    if gemm is None or gemm.op != "Gemm" or constant_value(gemm.inputs[1]) is None:
        return None
    w = constant_value(gemm.inputs[1])
    return ["M", int(w.shape[0] if gemm.attrs.get("transB", 0) else w.shape[1])]


@register_rule
class ShapeThroughTranspose(Rule):
    name = "shape-through-transpose"
    root = "Gather"
    level = 1
    exclusive = False
    summary = "Gather(Shape(Transpose(x, perm)), i) → Gather(Shape(x), perm[i])"
    pattern = Op("Gather", Op("Shape", Op("Transpose", "x", name="tr"), name="shape"), "idx")

    def check(self, m, cx):
        perm = m.tr.attrs.get("perm")
        idx = constant_value(m.idx)
        require(perm is not None, "implicit-perm", "a Transpose without perm needs a known rank")
        require(
            idx is not None and idx.dtype.kind in "iu" and idx.size <= 16,
            "non-constant-param",
            "the gathered dim index is computed at run time",
        )
        require(m.root.attrs.get("axis", 0) == 0, "structure", "Gather of a shape is on axis 0")
        rank = len(perm)
        start = int(m.shape.attrs.get("start", 0))
        end = m.shape.attrs.get("end")
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = rank if end is None else min(max(int(end) + rank if end < 0 else int(end), 0), rank)
        dims = list(perm)[start:end]
        flat = idx.reshape(-1).astype(np.int64)
        require(
            all(-len(dims) <= i < len(dims) for i in flat),
            "index-out-of-range",
            f"index {flat.tolist()} is outside the {len(dims)} dims of the shape",
        )
        m.stash(picked=np.array([dims[int(i)] for i in flat], np.int64).reshape(idx.shape))

    def rewrite(self, m, b):
        shape = b.op("Shape", [m.x], name=f"{m.shape.name}/of_input")
        idx = b.const(m.picked, "dim")
        return [b.op("Gather", [shape, idx], {"axis": 0}, like=m.root.outputs[0])]


SHAPE_ONLY = ("Reshape", "Squeeze", "Unsqueeze", "Flatten")


class CollapseShapeChain(Rule):
    """X → shape-only op → (root) shape-only op: read X directly with one Reshape."""

    level = 1
    exclusive = False
    summary = "chain of Reshape/Squeeze/Unsqueeze/Flatten → one Reshape"

    def check(self, m, cx):
        out = m.root.outputs[0]
        final = static_shape(out)
        if final is None and m.root.op == "Reshape":
            target = constant_value(m.root.inputs[1])
            require(target is not None, "dynamic-shape", "Reshape target is computed at run time")
            if np.any(target == 0) and not m.root.attrs.get("allowzero", 0):
                target = _resolve_copies(target, m.root.inputs[0].shape)
                require(
                    target is not None,
                    "zero-dim-copy",
                    "Reshape target copies dims (0) of the intermediate tensor that are neither "
                    "static nor the one dim left to infer",
                )
            final = tuple(int(d) for d in target)
        require(final is not None, "dynamic-shape", "the chain's output shape is not static")
        require(0 not in final, "empty-tensor", "empty tensors are left alone")
        m.stash(final=final)

    def rewrite(self, m, b):
        if static_shape(m.x) == m.final:
            return [m.x]
        shape = b.const(np.array(m.final, dtype=np.int64), "shape")
        return [b.op("Reshape", [m.x, shape], like=m.root.outputs[0])]


def _resolve_copies(target, dims) -> list[int] | None:
    """Reshape ``target`` with each 0 (copy the input's dim) spelled out: the dim itself where
    ``dims`` has it static, else -1 for one symbolic dim when the target infers no other; None
    when neither works."""
    if dims is None:
        return None
    out, free = [], -1 not in target
    for i, t in enumerate(target):
        d = dims[i] if i < len(dims) else None
        if t != 0:
            out.append(int(t))
        elif isinstance(d, (int, np.integer)) and d > 0:
            out.append(int(d))
        elif free and d is not None:
            out.append(-1)
            free = False
        else:
            return None
    return out


#: (rule, the chain's last op): each reads the chain's first input through one Reshape
SHAPE_CHAINS = (
    ("collapse-reshape-chain", "Reshape"),
    ("collapse-squeeze-chain", "Squeeze"),
    ("collapse-unsqueeze-chain", "Unsqueeze"),
    ("collapse-flatten-chain", "Flatten"),
)

for _rule, _op in SHAPE_CHAINS:
    register_rule(
        type(
            f"Collapse{_op}Chain",
            (CollapseShapeChain,),
            {
                "name": _rule,
                "pattern": Op(
                    _op,
                    Op(SHAPE_ONLY, "x", extra_inputs=True, name="inner"),
                    extra_inputs=True,
                    name="outer",
                ),
            },
        )
    )


# Which element types represent every value of another exactly.
_EXACT = {
    "bool": {
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    },
    "int8": {"int16", "int32", "int64", "float16", "float32", "float64"},
    "uint8": {
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    },
    "int16": {"int32", "int64", "float32", "float64"},
    "uint16": {"int32", "uint32", "int64", "uint64", "float32", "float64"},
    "int32": {"int64", "float64"},
    "uint32": {"int64", "uint64", "float64"},
    "float16": {"float32", "float64"},
    "float32": {"float64"},
}


@register_rule
class FuseCasts(Rule):
    name = "fuse-casts"
    root = "Cast"
    level = 1
    exclusive = False
    summary = "Cast∘Cast → one Cast (or none) when the middle type is exact"
    pattern = Op("Cast", Op("Cast", "x", name="first"), name="second")

    def check(self, m, cx):
        t0, t1 = dtype_of(m.x), dtype_of(m.first.outputs[0])
        t2 = dtype_of(m.second.outputs[0])
        require(
            all(t is not None for t in (t0, t1, t2)),
            "unknown-dtype",
            "a Cast's input dtype is unknown",
        )
        require(
            t1 == t0 or t1.name in _EXACT.get(t0.name, ()),
            "narrowing-cast",
            f"{t0.name}→{t1.name} loses values, so the first Cast is not removable",
        )
        m.stash(to=m.second.attrs["to"], identity=(t2 == t0))

    def rewrite(self, m, b):
        if m.identity:
            return [m.x]
        return [b.op("Cast", [m.x], {"to": m.to}, like=m.root.outputs[0])]


@register_rule
class ScatterSlicesToConcat(Rule):
    """``ScatterND`` steps that write rows ``[a, b)`` of axis 0, each its own range, together
    every row of the tensor → one Concat of the updates in row order: the tensor they start
    from is never read.  torch exports ``k = x.new_empty(...); k[..., :n] = a; k[..., n:] = b``
    (MiniCPM3's and DeepSeek's keys from their no-rotary and rotary parts) this way, between
    Transposes that bring the assigned axis first; a Concat is what the attention lift reads.
    The root is the last write; each earlier one must feed only the next."""

    name = "scatter-slices-to-concat"
    root = "ScatterND"
    level = 1
    exclusive = False
    summary = "ScatterNDs writing every row of axis 0 once → one Concat"

    def match(self, node, cx):
        out = node.outputs[0]
        if any(c.op == "ScatterND" and c.inputs[0] is out for c in out.outputs):
            raise NoMatch("structure", "not the last write", structural=True)
        steps, t = [node], node.inputs[0]
        while t.inputs and t.inputs[0].op == "ScatterND" and len(t.outputs) == 1:
            steps.append(t.inputs[0])
            t = t.inputs[0].inputs[0]
        if len(steps) < 2:
            raise NoMatch("structure", "a single write", structural=True)
        return Match(node, {f"step{i}": n for i, n in enumerate(steps)} | {"base": t})

    def check(self, m, cx):
        rows, dim = [], m.base.shape[0] if m.base.shape else None
        applies_only_if(isinstance(dim, (int, np.integer)))
        for step in m.nodes():
            idx = constant_value(step.inputs[1])
            applies_only_if(
                step.attrs.get("reduction", "none") == "none"
                and idx is not None
                and idx.ndim == 2
                and idx.shape[1] == 1
                and idx.size > 0
            )
            first = int(idx[0, 0])
            applies_only_if(np.array_equal(idx[:, 0], np.arange(first, first + len(idx))))
            applies_only_if(not cx.ir.is_graph_output(step.outputs[0]) or step is m.root)
            rows.append((first, first + len(idx), step.inputs[2]))
        rows.sort(key=lambda r: r[0])
        applies_only_if(_tile(rows, int(dim)))
        m.stash(parts=[r[2] for r in rows])

    def rewrite(self, m, b):
        return [b.op("Concat", m.parts, {"axis": 0}, like=m.root.outputs[0])]


@register_rule
class ConcatOfTransposes(Rule):
    """``Concat(T_p(a), T_p(b), …, axis=k)`` → ``T_p(Concat(a, b, …, axis=p[k]))``: one
    Transpose instead of one per input, which a Transpose after the Concat may then cancel.
    Every input is a Transpose of the same perm read only here."""

    name = "concat-of-transposes"
    root = "Concat"
    level = 1
    exclusive = False
    summary = "Concat of Transposes of one perm → Transpose of the Concat"

    def check(self, m, cx):
        ins = m.root.inputs
        trs = [t.inputs[0] if t.inputs else None for t in ins]
        applies_only_if(len(ins) >= 2 and all(n is not None and n.op == "Transpose" for n in trs))
        perms = [n.attrs.get("perm") for n in trs]
        applies_only_if(perms[0] is not None and all(p == perms[0] for p in perms))
        applies_only_if(all(len(t.outputs) == 1 and not cx.ir.is_graph_output(t) for t in ins))
        perm = list(perms[0])
        axis = int(m.root.attrs.get("axis", 0))
        axis = axis + len(perm) if axis < 0 else axis
        applies_only_if(0 <= axis < len(perm))
        m.stash(perm=perm, axis=perm[axis], sources=[n.inputs[0] for n in trs])

    def rewrite(self, m, b):
        cat = b.op("Concat", m.sources, {"axis": m.axis}, name=f"{m.root.name}/untransposed")
        out = m.root.outputs[0]
        cat.dtype = out.dtype
        if out.shape is not None:
            inv = np.argsort(m.perm)
            cat.shape = [out.shape[i] for i in inv]
        return [b.op("Transpose", [cat], {"perm": m.perm}, like=out)]

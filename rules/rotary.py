"""Rotary position embedding (level 2): ``x·cos + rotate(x)·sin`` → ``RotaryEmbedding``.

``fuse-rotary-embedding`` (root: the ``Add``) matches the rotation as decoder exporters write it
on a 4-D ``x`` in (batch, heads, sequence, head_dim) layout — or (batch, sequence, heads,
head_dim) (GPT-J, rotations before the head transpose), which runs as the op's 3-D form between
two Reshapes, ``num_heads`` set:

* half-rotated (``interleaved=0``, Hugging Face ``rotate_half``):
  ``Concat(Neg(Slice(x, D/2:)), Slice(x, :D/2), axis=−1)``, the two Slices also as one
  ``Split`` into halves (``slices-to-split`` writes them so; Phi-3's partial-rotary spelling
  adds an empty pass-through part, which may feed other nodes);
* interleaved (``interleaved=1``, even/odd pairs):
  ``Reshape(Concat(Unsqueeze(Neg(Slice(x, 1::2)), −1), Unsqueeze(Slice(x, 0::2), −1), −1))``.

Partial rotation (``Concat(rope(x[..., :R]), x[..., R:])``, GPT-NeoX, Phi-2) fuses the rotation
of the ``x[..., :R]`` slice; the Slice and Concat around it stay.

``cos`` and ``sin`` may be spelled any way that computes them per position from one integer
(batch, sequence) tensor — the position ids — and constants: on the fly (``Mul`` or
``MatMul`` of the positions by ``inv_freq``, ``Concat(f, f)``, ``Cos``/``Sin``, an attention
scaling ``Mul``, ``Cast``s, the ``Unsqueeze`` over the head axis) or gathered from cached
tables.  The rule collects that subgraph (ops in :data:`POSITION_OPS` only), runs it with
onnxruntime on the positions ``0..N−1`` to read the tables the model itself computes, checks on
a second, shuffled batch of positions that every row depends on its own position only, and that
the two halves (or the even/odd columns) of each row are equal; the half-width tables become the
op's ``cos_cache``/``sin_cache`` constants.

A static-shape export computes cos/sin from constants (the positions ``0..S−1`` folded): the
tables are read as they are, one row per position of x's static sequence of ``S``, and the
fused op takes the constant positions ``0..S−1``.

Positions a fused node can take are bounded by its cache: ``N`` is the row count of a gathered
table when the model has one (the original fails beyond it too; a table sliced to its first
rows at run time, ``cos_cached[:seq_len]`` as older exports gather from, counts as the whole
table: where the original's Gather finds a row, it is the table's), ``S`` for a static sequence's
constant tables, else ``GRAPHOPT_ROTARY_POSITIONS`` (default 8192); onnxruntime refuses a
position past the cache with an error, never a wrong value; the caches' first dim is ``N``.

Never bigger by construction: every layer (and q and k) whose caches are equal reads one cos and
one sin constant (:meth:`ModelIR.shared_constant`; cse leaves them apart, since it compares
constants of at most 4096 elements only), and half-width caches of ``N`` rows are no bigger than
a table of ``N`` rows the original gathers from.  Only caches for cos/sin the original computes
on the fly add to the model (one cos and one sin per distinct table); an analysis remark
(``rotary-cache-growth``) says by how much.

The op takes one position per token: positions whose dims are not provably x's batch and
sequence (they broadcast in the original's ``Mul``) are expanded to them at run time
(``Shape``, ``Gather``, ``Expand``).

Lowering: ONNX ``RotaryEmbedding`` (opset ≥ 23; inputs x, cos, sin, position_ids) or
``com.microsoft.RotaryEmbedding`` (inputs x, position_ids, cos, sin), whichever the target's
kernel table has first.

Guards (missed remarks): ``non-constant-param`` (Slice bounds or steps computed at run time),
``axes-not-last`` (the rotation slices another axis), ``constant-mismatch`` (the slices are not
the two halves / the even and odd columns of the head dimension, or the tables' halves differ),
``unknown-shape`` (rank or head dimension unknown, or odd; the head count of a (batch,
sequence, heads, head_dim) input unknown), ``position-source`` (cos/sin are not computed from
one integer (batch, sequence) tensor and constants only, or not per position), ``layout``
(cos/sin vary along neither sequence axis), ``shape-mismatch`` (the tables' shape or the
interleaved Reshape's), ``dtype-mismatch``, ``evaluation-failed`` (onnxruntime could not
compute the tables), ``no-kernel`` / ``opset-too-old``.
"""

from __future__ import annotations

import weakref

import numpy as np

from graphopt.opt.environment import env_number
from graphopt.opt.graph.analysis import EvaluationError, evaluate
from graphopt.opt.graph.dims import same_dim
from graphopt.opt.graph.domains import is_default
from graphopt.opt.graph.ir import Constant, Node, Tensor, Variable, constant_value, dtype_of
from graphopt.opt.rewrite.engine import (
    Match,
    Rule,
    check_exclusive,
    require,
    require_constant,
)
from graphopt.opt.rewrite.manager import register_rule

from .activation import MS, float_type, inputs, lowering, no_match, producer

#: ops that may compute cos/sin from the positions (elementwise, shape glue, table gathers)
POSITION_OPS = frozenset(
    {
        "Unsqueeze",
        "Squeeze",
        "Cast",
        "Mul",
        "Div",
        "Add",
        "Sub",
        "Neg",
        "MatMul",
        "Transpose",
        "Concat",
        "Cos",
        "Sin",
        "Gather",
        "Expand",
        "Reshape",
        "Shape",
        "Identity",
    }
)
DEFAULT_POSITIONS = 8192
_LARGE = 2**31  # a Slice end at or beyond this means "to the end"


def max_positions() -> int:
    """Rows of a computed cache: ``GRAPHOPT_ROTARY_POSITIONS`` or 8192."""
    return int(env_number("GRAPHOPT_ROTARY_POSITIONS", DEFAULT_POSITIONS))


# ------------------------------------------------------------------------- matching
def _rotated_half(t: Tensor) -> dict | None:
    """``Concat(Neg(Slice(x, hi)), Slice(x, lo), axis)``, or the two halves from one Split."""
    cat = producer(t, "Concat")
    if cat is None or len(inputs(cat)) != 2:
        return None
    neg = producer(inputs(cat)[0], "Neg")
    hi_t, lo_t = (inputs(neg)[0] if neg is not None else None), inputs(cat)[1]
    split = producer(hi_t, "Split")
    if split is not None and producer(lo_t, "Split") is split:
        if split.outputs[0] is lo_t and split.outputs[1] is hi_t:
            x = inputs(split)[0]
            return {"x": x, "concat": cat, "neg": neg, "split": split}
        return None
    hi, lo = producer(hi_t, "Slice"), producer(lo_t, "Slice")
    if hi is None or lo is None or inputs(hi)[0] is not inputs(lo)[0]:
        return None
    return {"x": inputs(hi)[0], "concat": cat, "neg": neg, "slice_hi": hi, "slice_lo": lo}


def _rotated_pairs(t: Tensor) -> dict | None:
    """``Reshape(Concat(Unsqueeze(Neg(Slice(x, 1::2))), Unsqueeze(Slice(x, 0::2)), −1))``."""
    reshape = producer(t, "Reshape")
    cat = producer(inputs(reshape)[0], "Concat") if reshape is not None else None
    if cat is None or len(inputs(cat)) != 2:
        return None
    u_odd, u_even = (producer(i, "Unsqueeze") for i in inputs(cat))
    if u_odd is None or u_even is None:
        return None
    neg = producer(inputs(u_odd)[0], "Neg")
    odd = producer(inputs(neg)[0], "Slice") if neg is not None else None
    even = producer(inputs(u_even)[0], "Slice")
    if odd is None or even is None or inputs(odd)[0] is not inputs(even)[0]:
        return None
    return {
        "x": inputs(odd)[0],
        "reshape": reshape,
        "concat": cat,
        "unsq_odd": u_odd,
        "unsq_even": u_even,
        "neg": neg,
        "slice_odd": odd,
        "slice_even": even,
    }


def _pairs(node: Node) -> list[tuple[Tensor, Tensor]]:
    a, b = inputs(node)[:2]
    return [(a, b), (b, a)]


# ------------------------------------------------------------------------- the tables
def _slice_params(node: Node, cx) -> tuple[int, int, int, int]:
    """(start, end, axis, step) of a one-axis Slice with constant parameters."""
    ins = inputs(node)
    require(len(ins) >= 4, "non-constant-param", f"'{node.name}' has no axes input")
    named = [("Slice start", ins[1]), ("Slice end", ins[2]), ("Slice axes", ins[3])]
    if len(ins) > 4:
        named.append(("Slice step", ins[4]))
    require_constant(cx, cx.ir, *named)
    vals = [np.asarray(constant_value(t)).reshape(-1) for _, t in named]
    require(
        all(v.size == 1 for v in vals),
        "axes-not-last",
        f"'{node.name}' slices {vals[2].size} axes; the rotation slices the last one only",
    )
    step = int(vals[3][0]) if len(vals) > 3 else 1
    return int(vals[0][0]), int(vals[1][0]), int(vals[2][0]), step


def _check_slice(node: Node, cx, want: tuple[int, int, int], rank: int, width: int) -> None:
    start, end, axis, step = _slice_params(node, cx)
    require(
        axis in (-1, rank - 1),
        "axes-not-last",
        f"'{node.name}' slices axis {axis} of a rank-{rank} tensor, not the head dimension",
    )
    end = min(end, width)
    got = (start + width if start < 0 else start, end + width if end < 0 else end, step)
    require(
        got == want,
        "constant-mismatch",
        f"'{node.name}' takes [{got[0]}:{got[1]}:{got[2]}] of a head dimension of {width}; "
        f"the rotation needs [{want[0]}:{want[1]}:{want[2]}]",
    )


def _check_exclusive(m: Match, cx) -> None:
    """The matched nodes feed only the match, except a Split's outputs after the two halves."""
    inner = {k: v for k, v in m.bindings.items() if k != "split"}
    check_exclusive(Match(m.root, inner), cx.ir)
    split = m.bindings.get("split")
    if split is None:
        return
    inside = {id(m.neg), id(m.concat)}
    for out in split.outputs[:2]:
        outside = [c.name for c in out.outputs if id(c) not in inside]
        require(
            not outside and not cx.ir.is_graph_output(out),
            "shared-intermediate",
            f"'{out.name}' also feeds {', '.join(outside[:3]) or 'a graph output'}; fusing would "
            "duplicate work",
        )


def _check_split(node: Node, cx, rank: int, width: int) -> None:
    """A Split of the head dimension whose first two parts are the two halves."""
    axis = int(node.attrs.get("axis", 0))
    require(
        axis in (-1, rank - 1),
        "axes-not-last",
        f"'{node.name}' splits axis {axis} of a rank-{rank} tensor, not the head dimension",
    )
    ins = inputs(node)
    if len(ins) > 1 and ins[1] is not None:
        require_constant(cx, cx.ir, ("the Split sizes", ins[1]))
        sizes = [int(v) for v in np.asarray(constant_value(ins[1])).reshape(-1)]
    else:
        sizes = [int(v) for v in node.attrs.get("split", [])] or [width // 2, width // 2]
    if len(node.outputs) > 2 and len(sizes) != len(node.outputs):
        sizes = []  # num_outputs > 2 splits evenly: never two halves
    require(
        sizes[:2] == [width // 2, width // 2] and not any(sizes[2:]),
        "constant-mismatch",
        f"'{node.name}' splits a head dimension of {width} into {sizes or 'equal parts'}; the "
        "rotation needs two halves (and empty parts after them)",
    )


def _position_subgraph(roots: list[Tensor]) -> tuple[list[Node], Tensor | None, str]:
    """The nodes computing ``roots`` from one integer rank-2 tensor and constants: (nodes,
    the position tensor, problem); from constants alone: (nodes, None, "")."""
    nodes: dict[int, Node] = {}
    leaves: dict[int, Tensor] = {}
    sliced: dict[str, Constant] = {}
    stack = list(roots)
    while stack:
        t = stack.pop()
        if t is None or isinstance(t, Constant):
            continue
        dt = dtype_of(t)
        is_positions = (
            dt is not None and dt.kind in "iu" and t.shape is not None and len(t.shape) == 2
        )
        node = t.inputs[0] if t.inputs else None
        if is_positions or node is None:
            leaves[id(t)] = t
            continue
        if node.op == "Constant" or id(node) in nodes:
            if node.op == "Constant":
                nodes[id(node)] = node
            continue
        table = _sliced_table(node)
        if table is not None:  # table[:n], n computed at run time: the rows it keeps are table's
            sliced[t.name] = table
            continue
        if node.op not in POSITION_OPS or not is_default(node.domain):
            return [], None, f"'{t.name}' comes from a {node.op} node ('{node.name}')"
        nodes[id(node)] = node
        stack.extend(inputs(node))
    if sliced:
        nodes[id(sliced)] = _Sliced(sliced)
    if not leaves:  # tables the export computed for a static sequence (positions 0..S-1)
        return list(nodes.values()), None, ""
    if len(leaves) != 1:
        names = ", ".join(sorted(t.name for t in leaves.values()))
        return [], None, f"they are computed from {names}, not from one position tensor"
    (pos,) = leaves.values()
    dt = dtype_of(pos)
    if dt is None or dt.kind not in "iu" or pos.shape is None or len(pos.shape) != 2:
        return [], None, f"'{pos.name}' is not an integer (batch, sequence) tensor"
    return list(nodes.values()), pos, ""


class _Sliced:
    """Stands among a subgraph's nodes for the leading rows of tables ``table[:n]`` (``n``
    computed at run time): ``names`` maps each slice's output to its whole table."""

    op = "Slice"

    def __init__(self, names: dict[str, Constant]):
        self.names = names


def _sliced_table(node: Node) -> Constant | None:
    """The constant table of ``Slice(table, 0, n, axes=0)``: the first rows of a 2-D table, any
    ``n``, step 1 (older exports: ``cos_cached[:seq_len]`` gathered by position); else None.
    Where the original gathers a row ``p < n`` it is the table's row ``p``."""
    if node.op != "Slice" or not is_default(node.domain):
        return None
    ins = inputs(node)
    if len(ins) < 4 or not isinstance(ins[0], Constant) or len(ins[0].shape) != 2:
        return None
    fixed = [ins[1], ins[3]] + ([ins[4]] if len(ins) > 4 and ins[4] is not None else [])
    values = [constant_value(t) for t in fixed]
    if any(v is None or np.asarray(v).size != 1 for v in values):
        return None
    start, axis, *step = (int(np.asarray(v).reshape(-1)[0]) for v in values)
    return ins[0] if start == 0 and axis in (0, -2) and step in ([], [1]) else None


def _table_rows(nodes: list[Node]) -> int | None:
    """Rows of a constant table the subgraph gathers from (the original's own position limit)."""
    sliced = {k: v for n in nodes if isinstance(n, _Sliced) for k, v in n.names.items()}
    rows = []
    for n in nodes:
        if n.op != "Gather" or isinstance(n, _Sliced) or int(n.attrs.get("axis", 0)) != 0:
            continue
        table = inputs(n)[0]
        table = sliced.get(table.name, table)
        if isinstance(table, Constant) and len(table.shape) == 2:
            rows.append(int(table.shape[0]))
    return min(rows) if rows else None


def _run(ir, nodes: list[Node], pos: Tensor | None, values, outs: list[Tensor]):
    """``outs`` computed by ``nodes`` with ``pos`` set to ``values`` (no positions: from
    constants alone)."""
    order = {id(n): i for i, n in enumerate(ir.graph.nodes)}
    known = {} if pos is None else {pos.name: values.astype(dtype_of(pos))}
    for n in nodes:
        if isinstance(n, _Sliced):
            known.update({k: np.asarray(constant_value(v)) for k, v in n.names.items()})
    nodes = [n for n in nodes if not isinstance(n, _Sliced)]
    ordered = sorted(nodes, key=lambda n: order.get(id(n), -1))
    for t in outs:
        if isinstance(t, Constant):
            known[t.name] = np.asarray(constant_value(t))
    for n in ordered:
        for t in inputs(n):
            if isinstance(t, Constant):
                known[t.name] = np.asarray(constant_value(t))
    if all(t.name in known for t in outs):
        return [known[t.name] for t in outs]
    try:
        got = evaluate(ir, ordered, known, [t.name for t in outs])
    except EvaluationError as e:
        require(False, "evaluation-failed", f"onnxruntime could not compute cos/sin: {e}")
    return [got[t.name] for t in outs]


#: the last tables read: every layer of a decoder shares one cos/sin, so one evaluation serves
#: all of them.  A tensor object's producers never change (rewrites make new tensors), and the
#: entry refers to the tensors weakly (a live identity match is the same computation; the old
#: graph is not kept alive).
_LAST_TABLES: list = []


def _tables(m: Match, cx, width: int, interleaved: bool) -> tuple:
    """(half-width cos cache, sin cache, the number of positions they cover, x's sequence
    axis, the position tensor or None for constant tables, where the rows come from: "table"
    gathered, "static" constants, "computed" on the fly) (memoized)."""
    key = (width, interleaved, max_positions())
    if _LAST_TABLES and _LAST_TABLES[0]() is m.cos and _LAST_TABLES[1]() is m.sin:
        if _LAST_TABLES[2] == key:
            return _LAST_TABLES[3]
    result = _read_tables(m, cx, width, interleaved)
    _LAST_TABLES[:] = [weakref.ref(m.cos), weakref.ref(m.sin), key, result]
    return result


def _read_tables(m: Match, cx, width: int, interleaved: bool) -> tuple:
    nodes, pos, problem = _position_subgraph([m.cos, m.sin])
    require(not problem, "position-source", f"cos/sin are not per-position tables: {problem}")
    if pos is None:
        cos, sin, rows = _constant_tables(m, cx, nodes)
        source = "static"
    else:
        rows = _table_rows(nodes)
        source = "table" if rows else "computed"
        rows = rows or max_positions()
        cos, sin = _run(cx.ir, nodes, pos, np.arange(rows).reshape(1, rows), [m.cos, m.sin])
    for name, v in (("cos", cos), ("sin", sin)):
        require(
            v.ndim == 4 and v.shape[-1] == width and v.size == rows * width,
            "shape-mismatch",
            f"{name} for {rows} positions has shape {list(v.shape)}; expected "
            f"[1, 1, {rows}, {width}]",
        )
        require(
            list(v.shape[:3]) in ([1, 1, rows], [1, rows, 1]),
            "layout",
            f"{name} for {rows} positions has shape {list(v.shape)}: x has its sequence on axis "
            f"{list(v.shape).index(rows)}; RotaryEmbedding takes (batch, heads, sequence, "
            "head_dim) or (batch, sequence, heads·head_dim)",
        )
    seq_axis = 2 if cos.shape[2] == rows and cos.shape[1] == 1 else 1
    cos, sin = cos.reshape(rows, width), sin.reshape(rows, width)
    if pos is not None:
        _check_per_position(cx, nodes, pos, m, cos, sin, seq_axis)
    halves = (
        (slice(0, None, 2), slice(1, None, 2))
        if interleaved
        else (
            slice(0, width // 2),
            slice(width // 2, width),
        )
    )
    for name, v in (("cos", cos), ("sin", sin)):
        a, b = v[:, halves[0]], v[:, halves[1]]
        require(
            np.allclose(a, b, rtol=1e-6, atol=1e-7),
            "constant-mismatch",
            f"the {'even and odd columns' if interleaved else 'two halves'} of the {name} "
            f"table differ (max {float(np.abs(a - b).max()):.3g}); RotaryEmbedding repeats one "
            "half-width table",
        )
    half_cos, half_sin = cos[:, halves[0]], sin[:, halves[0]]
    half_cos, half_sin = np.ascontiguousarray(half_cos), np.ascontiguousarray(half_sin)
    return half_cos, half_sin, rows, seq_axis, pos, source


def _constant_tables(m: Match, cx, nodes: list[Node]) -> tuple[np.ndarray, np.ndarray, int]:
    """cos/sin the export computed from constants: the rows of positions 0..S-1 of a static
    sequence of S, x's own (the caches need no more rows than the model can address)."""
    cos, sin = _run(cx.ir, nodes, None, None, [m.cos, m.sin])
    x = m.x
    require(
        cos.ndim == 4 and cos.shape == sin.shape,
        "shape-mismatch",
        f"constant cos/sin have shapes {list(cos.shape)}/{list(sin.shape)}; expected "
        "[1, 1, S, head_dim] or [1, S, 1, head_dim]",
    )
    axes = [a for a in (1, 2) if cos.shape[a] != 1] or [2]
    seq = x.shape[axes[0]] if len(axes) == 1 else None
    require(
        len(axes) == 1
        and isinstance(seq, (int, np.integer))
        and int(seq) == cos.shape[axes[0]]
        and cos.shape[0] == 1,
        "layout",
        f"constant cos/sin of shape {list(cos.shape)} are not one row per position of the "
        f"static sequence of '{x.name}' {x.shape}",
    )
    return cos, sin, int(seq)


def _check_per_position(cx, nodes, pos, m, cos, sin, seq_axis: int) -> None:
    """Two rows of shuffled positions must give the rows of the tables at those positions."""
    rows = cos.shape[0] - cos.shape[0] % 2
    shuffled = np.random.default_rng(0).permutation(rows).reshape(2, rows // 2)
    c2, s2 = _run(cx.ir, nodes, pos, shuffled, [m.cos, m.sin])
    want = [2, 1, 1, cos.shape[1]]
    want[seq_axis] = rows // 2
    ok = list(c2.shape) == want and list(s2.shape) == want
    if ok:
        c2, s2 = c2.reshape(2, rows // 2, -1), s2.reshape(2, rows // 2, -1)
        ok = np.allclose(c2, cos[shuffled], rtol=1e-6, atol=1e-7)
        ok = ok and np.allclose(s2, sin[shuffled], rtol=1e-6, atol=1e-7)
    require(
        ok,
        "position-source",
        f"cos/sin computed from '{pos.name}' do not depend on each position alone (a batch of "
        "shuffled positions gives other rows)",
    )


def _note_growth(rule: str, m: Match, cx, cos: np.ndarray, sin: np.ndarray) -> None:
    """An analysis remark for caches of cos/sin the original computes on the fly: the model
    grows by their bytes (once for every layer whose tables are equal)."""
    grown = int(cos.nbytes + sin.nbytes)
    cx.remark(
        "analysis",
        "rules",
        rule,
        "rotary-cache-growth",
        [m.root.name],
        f"RotaryEmbedding at '{m.root.name}' takes cos/sin caches of {cos.shape[0]} positions x "
        f"{cos.shape[1]} {cos.dtype} ({grown} bytes, read by every layer whose tables are "
        "equal); the original computes them on the fly, so the model grows by that much "
        f"(positions: GRAPHOPT_ROTARY_POSITIONS, default {DEFAULT_POSITIONS})",
        bytes=grown,
        rows=int(cos.shape[0]),
        dtype=str(cos.dtype),
    )


# ---------------------------------------------------------------------------- rule
@register_rule
class FuseRotaryEmbedding(Rule):
    name = "fuse-rotary-embedding"
    root = "Add"
    #: checked in ``check``: a Split may have more outputs than the two halves (Phi-3's
    #: partial-rotary spelling splits off an empty pass-through part), which may feed others
    exclusive = False
    summary = "x·cos + rotate_half(x)·sin → RotaryEmbedding"

    def match(self, node, cx):
        if len(inputs(node)) != 2:
            raise no_match()
        for a, b in _pairs(node):
            mul_c, mul_s = producer(a, "Mul"), producer(b, "Mul")
            if mul_c is None or mul_s is None or len(inputs(mul_c)) != 2:
                continue
            for x, cos in _pairs(mul_c):
                for rot, sin in _pairs(mul_s):
                    for layout, find in (("half", _rotated_half), ("pairs", _rotated_pairs)):
                        parts = find(rot) if isinstance(rot, Variable) else None
                        if parts is not None and parts["x"] is x:
                            return Match(
                                node,
                                {
                                    "add": node,
                                    "mul_cos": mul_c,
                                    "mul_sin": mul_s,
                                    **parts,
                                    "cos": cos,
                                    "sin": sin,
                                    "layout": layout,
                                },
                            )
        raise no_match()

    def check(self, m, cx):
        _check_exclusive(m, cx)
        x = m.x
        rank = len(x.shape) if x.shape is not None else None
        width = x.shape[-1] if rank else None
        require(
            rank == 4 and isinstance(width, (int, np.integer)) and width > 0 and width % 2 == 0,
            "unknown-shape",
            f"'{x.name}' has shape {x.shape}; the rotation needs a 4-D input with a static, "
            "even head dimension",
        )
        width = int(width)
        interleaved = m.layout == "pairs"
        if interleaved:
            _check_slice(m.slice_odd, cx, (1, width, 2), rank, width)
            _check_slice(m.slice_even, cx, (0, width, 2), rank, width)
            self._check_pairs(m, width)
        else:
            if "split" in m.bindings:
                _check_split(m.split, cx, rank, width)
            else:
                _check_slice(m.slice_hi, cx, (width // 2, width, 1), rank, width)
                _check_slice(m.slice_lo, cx, (0, width // 2, 1), rank, width)
            axis = int(m.concat.attrs.get("axis", 0))
            require(
                axis in (-1, rank - 1),
                "axes-not-last",
                f"'{m.concat.name}' joins the halves on axis {axis}, not the head dimension",
            )
        tname = float_type(x)
        require(
            dtype_of(m.cos) == dtype_of(x) and dtype_of(m.sin) == dtype_of(x),
            "dtype-mismatch",
            f"cos/sin are {dtype_of(m.cos)}/{dtype_of(m.sin)}, x is {dtype_of(x)}",
        )
        op, domain, _ = lowering(
            cx,
            [("RotaryEmbedding", "", 23, {}), ("RotaryEmbedding", MS, None, {})],
            tname,
            "RotaryEmbedding",
        )
        cos, sin, rows, seq_axis, pos, source = _tables(m, cx, width, interleaved)
        if source == "computed" and not cx.ir.has_shared_constant(cos):
            _note_growth(self.name, m, cx, cos, sin)
        heads = x.shape[2] if seq_axis == 1 else None
        if seq_axis == 1:  # (batch, sequence, heads, head_dim): the op's 3-D form
            require(
                isinstance(heads, (int, np.integer)) and heads > 0,
                "unknown-shape",
                f"'{x.name}' is (batch, sequence, heads, head_dim) with heads {heads}; the "
                "fused op's 3-D form needs a static head count",
            )
        if pos is None:  # constant tables of a static sequence: positions 0..S-1 of each row
            positions = np.arange(rows, dtype=np.int64).reshape(1, rows)
            expand = x.shape[0] != 1
        else:
            positions = None
            # positions of another (batch, sequence) shape broadcast in the original's Mul:
            # expand them to x's at run time unless the dims are provably x's already
            expand = not (same_dim(pos, 0, x, 0) and same_dim(pos, 1, x, seq_axis))
        m.stash(
            op=op,
            op_domain=domain,
            cos_cache=cos,
            sin_cache=sin,
            rows=rows,
            pos=pos,
            positions=positions,
            expand=expand,
            seq_axis=seq_axis,
            heads=None if heads is None else int(heads),
            interleaved=int(interleaved),
        )

    def _check_pairs(self, m, width: int) -> None:
        for u in (m.unsq_odd, m.unsq_even):
            axes = constant_value(inputs(u)[1]) if len(inputs(u)) > 1 else u.attrs.get("axes")
            axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
            require(
                axes in ([-1], [4]),
                "axes-not-last",
                f"'{u.name}' adds axis {axes}; the interleaved rotation stacks on a new last axis",
            )
        axis = int(m.concat.attrs.get("axis", 0))
        require(
            axis in (-1, 4),
            "axes-not-last",
            f"'{m.concat.name}' stacks the pairs on axis {axis}, not a new last axis",
        )
        out = m.reshape.outputs[0]
        require(
            out.shape is not None
            and len(out.shape) == 4
            and out.shape[-1] == width
            and all(same_dim(out, i, m.x, i) for i in range(3)),
            "shape-mismatch",
            f"'{m.reshape.name}' gives shape {out.shape}, not the shape of '{m.x.name}' "
            f"{m.x.shape}",
        )

    def rewrite(self, m, b):
        # one cos and one sin table for every layer (and q and k) whose tables are equal
        cos = b.const(m.cos_cache, "rotary/cos_cache", shared=True)
        sin = b.const(m.sin_cache, "rotary/sin_cache", shared=True)
        pos = m.pos
        if pos is None:
            pos = b.const(m.positions, "rotary/positions", shared=True)
        elif dtype_of(pos) != np.dtype(np.int64):
            pos = b.op("Cast", [pos], {"to": 7}, name=f"{m.root.name}/positions_int64")
            pos.dtype, pos.shape = np.dtype(np.int64), m.pos.shape
        if m.expand:
            pos = self._expanded(m, b, pos)
        x, attrs = m.x, {"interleaved": m.interleaved}
        if m.seq_axis == 1:  # (B, S, N, H) → (B, S, N·H) with num_heads, and back
            flat = b.const(np.array([0, 0, -1], dtype=np.int64), "flat_heads")
            x = b.op("Reshape", [m.x, flat], name=f"{m.root.name}/merge_heads")
            x.dtype, x.shape = m.x.dtype, self._merged_shape(m.x)
            attrs["num_heads"] = m.heads
        ins = [x, cos, sin, pos] if m.op_domain == "" else [x, pos, cos, sin]
        out = b.op(
            m.op,
            ins,
            attrs,
            domain=m.op_domain,
            like=None if m.seq_axis == 1 else m.root.outputs[0],
            name=f"{m.root.name}/{m.op}",
        )
        if m.seq_axis == 1:
            out.dtype, out.shape = m.x.dtype, x.shape
            split = b.const(np.array([0, 0, m.heads, -1], dtype=np.int64), "split_heads")
            out = b.op(
                "Reshape",
                [out, split],
                like=m.root.outputs[0],
                name=f"{m.root.name}/split_heads",
            )
        return [out]

    @staticmethod
    def _merged_shape(x: Tensor) -> list:
        """(B, S, N·H) of a (B, S, N, H) tensor: the product where both are known."""
        heads, width = x.shape[2], x.shape[3]
        both = isinstance(heads, int) and isinstance(width, int)
        return [x.shape[0], x.shape[1], heads * width if both else None]

    def _expanded(self, m, b, pos):
        """Positions broadcast to x's (batch, sequence) at run time."""
        shape = b.op("Shape", [m.x], name=f"{m.root.name}/x_shape")
        pick = b.const(np.array([0, m.seq_axis], dtype=np.int64), "batch_sequence")
        dims = b.op("Gather", [shape, pick], {"axis": 0}, name=f"{m.root.name}/x_dims")
        out = b.op("Expand", [pos, dims], name=f"{m.root.name}/positions")
        shape.dtype, shape.shape = np.dtype(np.int64), [4]
        dims.dtype, dims.shape = np.dtype(np.int64), [2]
        out.dtype, out.shape = np.dtype(np.int64), [m.x.shape[0], m.x.shape[m.seq_axis]]
        return out


__all__ = ["DEFAULT_POSITIONS", "POSITION_OPS", "max_positions"]

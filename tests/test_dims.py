"""opt/dims: dims and shape values followed through Pad, Slice, Concat and integer arithmetic,
and a shifted-window attention whose window count is computed from a padded, rolled input."""

import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, const, model, vi
from graphopt.opt.graph.dims import Dims, arith, shape_elements
from graphopt.opt.graph.ir import op_histogram

WIN, N, H = 2, 2, 4
C = N * H
I64_MAX = np.iinfo(np.int64).max


def tensors(m: onnx.ModelProto) -> dict:
    """The graphsurgeon tensors of ``m`` after onnx shape inference (as the passes see them)."""
    return gs.import_onnx(onnx.shape_inference.infer_shapes(m)).tensors()


def pad_to_windows(x: str, axis: int, p: str) -> list[onnx.NodeProto]:
    """``(WIN - dim % WIN) % WIN`` of ``x``'s ``axis``, as a [1] tensor named ``p``."""
    return [
        helper.make_node("Shape", [x], [f"{p}_s"], start=axis, end=axis + 1),
        helper.make_node("Mod", [f"{p}_s", "win"], [f"{p}_r"]),
        helper.make_node("Sub", ["win", f"{p}_r"], [f"{p}_d"]),
        helper.make_node("Mod", [f"{p}_d", "win"], [p]),
    ]


def padded_input(x: str = "x") -> tuple[list, list]:
    """torch's ``F.pad(x, (0, 0, 0, pad_r, 0, pad_b))`` on [B, Hs, Ws, C], pads computed at run
    time and written as the TorchScript exporter does (pairs reversed, then transposed)."""
    inits = [
        const("win", [WIN], np.int64),
        const("zero1", [0], np.int64),
        const("zeros2", [0, 0], np.int64),
        const("pairs", [-1, 2], np.int64),
        const("rev_s", [-1], np.int64),
        const("rev_e", [-I64_MAX], np.int64),
        const("ax0", [0], np.int64),
        const("flat", [-1], np.int64),
    ]
    nodes = pad_to_windows(x, 1, "pad_b") + pad_to_windows(x, 2, "pad_r")
    nodes += [
        helper.make_node(
            "Concat", ["zero1", "zero1", "zero1", "pad_r", "zero1", "pad_b"], ["torch_pads"], axis=0
        ),
        helper.make_node("Concat", ["torch_pads", "zeros2"], ["pads8"], axis=0),
        helper.make_node("Reshape", ["pads8", "pairs"], ["pads42"]),
        helper.make_node("Slice", ["pads42", "rev_s", "rev_e", "ax0", "rev_s"], ["pads_rev"]),
        helper.make_node("Transpose", ["pads_rev"], ["pads24"], perm=[1, 0]),
        helper.make_node("Reshape", ["pads24", "flat"], ["pads"]),
        helper.make_node("Cast", ["pads"], ["pads_i"], to=TensorProto.INT64),
        helper.make_node("Pad", [x, "pads_i"], ["xp"], mode="constant"),
    ]
    return nodes, inits


def rolled(x: str, shift: int) -> tuple[list, list]:
    """torch.roll(x, (-shift, -shift), (1, 2)) as the TorchScript exporter writes it."""
    inits = [
        const("sh", [shift], np.int64),
        const("zero_s", [0], np.int64),
        const("end", [I64_MAX], np.int64),
    ]
    nodes = []
    src = x
    for axis in (1, 2):
        ax = f"axis{axis}"
        inits.append(const(ax, [axis], np.int64))
        nodes += [
            helper.make_node("Slice", [src, "sh", "end", ax], [f"tail{axis}"]),
            helper.make_node("Slice", [src, "zero_s", "sh", ax], [f"head{axis}"]),
            helper.make_node("Concat", [f"tail{axis}", f"head{axis}"], [f"roll{axis}"], axis=axis),
        ]
        src = f"roll{axis}"
    return nodes, inits


def window_count() -> tuple[list, list]:
    """``nW = (pH // WIN) · (pW // WIN)`` and ``[B·nW // nW, nW, N, S, S]`` from the rolled
    input's shape, as the window regroup of torchvision's Swin reads it."""
    inits = [
        const("i1", 1, np.int64),
        const("i2", 2, np.int64),
        const("win0", WIN, np.int64),
        const("ax0s", [0], np.int64),
        const("tail", [N, WIN * WIN, WIN * WIN], np.int64),
    ]
    nodes = [
        helper.make_node("Shape", ["roll2"], ["rs"]),
        helper.make_node("Gather", ["rs", "i1"], ["ph"], axis=0),
        helper.make_node("Gather", ["rs", "i2"], ["pw"], axis=0),
        helper.make_node("Div", ["ph", "win0"], ["nh"]),
        helper.make_node("Div", ["pw", "win0"], ["nw"]),
        helper.make_node("Mul", ["nh", "nw"], ["n_win"]),
        helper.make_node("Shape", ["win_tokens"], ["ts"], start=0, end=1),
        helper.make_node("Squeeze", ["ts", "ax0s"], ["bw"]),
        helper.make_node("Div", ["bw", "n_win"], ["images"]),
        helper.make_node("Unsqueeze", ["images", "ax0s"], ["images1"]),
        helper.make_node("Unsqueeze", ["n_win", "ax0s"], ["n_win1"]),
        helper.make_node("Concat", ["images1", "n_win1", "tail"], ["win5"], axis=0),
    ]
    return nodes, inits


def shifted_window_block(hs: int = 3, ws: int = 4) -> onnx.ModelProto:
    """torchvision's shifted_window_attention on [B, hs, ws, C]: pad to whole windows, roll,
    partition, packed QKV, relative bias, the per-window mask through a 5-D regroup whose
    window count is computed from the padded input's shape."""
    rng = np.random.default_rng(0)
    s = WIN * WIN
    ph, pw = -(-hs // WIN) * WIN, -(-ws // WIN) * WIN
    n_win = (ph // WIN) * (pw // WIN)
    nodes, inits = padded_input()
    more, more_inits = rolled("xp", 1)
    nodes, inits = nodes + more, inits + more_inits
    inits += [
        const("part_tail", [WIN, C], np.int64),
        const("part_win", [WIN], np.int64),
        const("tokens", [-1, s, C], np.int64),
        const("Wpk", rng.standard_normal((C, 3 * C)) * 0.3),
        const("bpk", rng.standard_normal(3 * C)),
        const("five", [0, 0, 3, N, H], np.int64),
        const("g0", 0, np.int64),
        const("scale", 1 / math.sqrt(H)),
        const("relpos", rng.standard_normal((1, N, s, s))),
        const("wmask", np.where(rng.random((1, n_win, 1, s, s)) < 0.3, -100.0, 0.0)),
        const("win4", [-1, N, s, s], np.int64),
        const("merge", [0, 0, C], np.int64),
        const("Wo", rng.standard_normal((C, C)) * 0.3),
    ]
    nodes += [  # partition: [B, pH/W, W, pW/W, W, C] from the rolled shape, then windows
        helper.make_node("Shape", ["roll2"], ["shp"]),
        helper.make_node("Slice", ["shp", "zero_s", "axis1"], ["bdim"]),
        helper.make_node("Slice", ["shp", "axis1", "axis2"], ["hdim"]),
        helper.make_node("Slice", ["shp", "axis2", "sh_end"], ["wdim"]),
        helper.make_node("Div", ["hdim", "part_win"], ["hwin"]),
        helper.make_node("Div", ["wdim", "part_win"], ["wwin"]),
        helper.make_node(
            "Concat", ["bdim", "hwin", "part_win", "wwin", "part_tail"], ["part6"], axis=0
        ),
        helper.make_node("Reshape", ["roll2", "part6"], ["x6"]),
        helper.make_node("Transpose", ["x6"], ["x6t"], perm=[0, 1, 3, 2, 4, 5]),
        helper.make_node("Reshape", ["x6t", "tokens"], ["win_tokens"]),
    ]
    inits.append(const("sh_end", [3], np.int64))
    more, more_inits = window_count()
    nodes, inits = nodes + more, inits + more_inits
    nodes += [
        helper.make_node("MatMul", ["win_tokens", "Wpk"], ["pk0"]),
        helper.make_node("Add", ["pk0", "bpk"], ["pk"]),
        helper.make_node("Reshape", ["pk", "five"], ["pk5"]),
        helper.make_node("Transpose", ["pk5"], ["pkT"], perm=[2, 0, 3, 1, 4]),
        helper.make_node("Gather", ["pkT", "g0"], ["Q"], axis=0),
        helper.make_node("Gather", ["pkT", "i1"], ["K"], axis=0),
        helper.make_node("Gather", ["pkT", "i2"], ["V"], axis=0),
        helper.make_node("Mul", ["Q", "scale"], ["Qs"]),
        helper.make_node("Transpose", ["K"], ["KT"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["Qs", "KT"], ["qk"]),
        helper.make_node("Add", ["qk", "relpos"], ["zr"]),
        helper.make_node("Reshape", ["zr", "win5"], ["z5"]),
        helper.make_node("Add", ["z5", "wmask"], ["z5m"]),
        helper.make_node("Reshape", ["z5m", "win4"], ["z"]),
        helper.make_node("Softmax", ["z"], ["P"], axis=-1),
        helper.make_node("MatMul", ["P", "V"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctxT"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctxT", "merge"], ["attn"]),
        helper.make_node("MatMul", ["attn", "Wo"], ["y"]),
    ]
    for i, nd in enumerate(nodes):
        nd.name = f"n{i}_{nd.op_type}"
    return model(nodes, [vi("x", ["batch", hs, ws, C])], [vi("y", None)], inits)


# ------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    "op,a,b,want",
    [
        ("Add", 3, 4, 7),
        ("Sub", 3, 4, -1),
        ("Mul", 3, 4, 12),
        ("Div", 7, 2, 3),
        ("Div", -7, 2, -3),  # int64 Div truncates
        ("Mod", -7, 2, 1),  # Mod takes the divisor's sign
        ("Max", 3, 4, 4),
        ("Min", 3, 4, 3),
    ],
)
def test_arith_on_static_sizes(op, a, b, want):
    assert arith(op, ("int", a), ("int", b)) == ("int", want)


def test_arith_identities_and_expressions():
    b = ("param", "batch")
    assert arith("Add", b, ("int", 0)) == b
    assert arith("Mul", ("int", 1), b) == b
    assert arith("Div", arith("Mul", b, ("int", 16)), ("int", 16)) == b
    assert arith("Mul", b, ("int", 2)) == arith("Mul", ("int", 2), b)  # one key for both
    assert arith("Div", b, ("int", 2)) != b
    assert arith("Div", ("int", 1), ("int", 0))[0] == "expr"  # never evaluated
    assert arith("Mod", ("int", -7), ("int", 2), fmod=True) == ("int", -1)


def test_arith_folds_nested_offsets():
    s = ("param", "seq")
    assert arith("Add", arith("Sub", s, ("int", 1)), ("int", 1)) == s
    assert arith("Sub", arith("Add", ("int", 2), s), ("int", 5)) == arith("Sub", s, ("int", 3))
    assert arith("Add", arith("Mul", s, ("int", 2)), ("int", 1))[1] == "Add"  # no offset: kept


def test_the_last_cache_position_plus_one_is_the_sequence():
    """Bloom's kv length ``cache_position[-1] + 1``, the positions ``Range(0, S, 1)``; the
    first position is the start, another Range step is not followed."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
        helper.make_node("Gather", ["positions", "last"], ["final"], axis=0),
        helper.make_node("Add", ["final", "one"], ["kv_len"]),
        helper.make_node("Gather", ["positions", "zero"], ["first"], axis=0),
        helper.make_node("Range", ["zero", "seq", "two"], ["evens"]),
        helper.make_node("Gather", ["evens", "last"], ["even_last"], axis=0),
    ]
    inits = [const(n, v, np.int64) for n, v in (("zero", 0), ("one", 1), ("two", 2), ("last", -1))]
    outs = [vi(n, None, TensorProto.INT64) for n in ("kv_len", "first", "even_last")]
    t = tensors(model(nodes, [vi("x", ["batch", "seq"])], outs, inits))
    assert shape_elements(t["kv_len"]) == [("param", "seq")]
    assert shape_elements(t["first"]) == [("int", 0)]
    assert shape_elements(t["even_last"]) is None


# ------------------------------------------------------------------------- dims
def test_dims_through_a_computed_pad():
    """The padded dims of torch's F.pad with pads computed from the input's shape."""
    nodes, inits = padded_input()
    m = model(nodes, [vi("x", ["batch", 3, 4, C])], [vi("xp", None)], inits)
    t = tensors(m)
    assert t["xp"].shape is None or not isinstance(t["xp"].shape[1], int)  # inference: unknown
    d = Dims()
    assert shape_elements(t["pads_i"], d) == [("int", v) for v in (0, 0, 0, 0, 0, 1, 0, 0)]
    assert [d.key(t["xp"], i) for i in range(4)] == [
        ("param", "batch"),
        ("int", 4),
        ("int", 4),
        ("int", C),
    ]


def test_dims_through_roll_slices_and_concat():
    nodes, inits = padded_input()
    more, more_inits = rolled("xp", 1)
    m = model(nodes + more, [vi("x", ["batch", 3, 5, C])], [vi("roll2", None)], inits + more_inits)
    t = tensors(m)
    d = Dims()
    assert d.key(t["tail1"], 1) == ("int", 3) and d.key(t["head1"], 1) == ("int", 1)
    assert d.key(t["tail1"], 0) == ("param", "batch")
    assert [d.key(t["roll2"], i) for i in range(4)] == [
        ("param", "batch"),
        ("int", 4),
        ("int", 6),
        ("int", C),
    ]


def test_dims_of_a_symbolic_pad_and_unsqueeze():
    """A symbolic dim padded by zero keeps its key; by a computed amount it gets an expression
    (equal only to the same expression); Unsqueeze/Squeeze map the dims."""
    inits = [const("p0", [0, 0, 0, 0], np.int64), const("ax", [0], np.int64)]
    nodes = [
        helper.make_node("Pad", ["x", "p0"], ["same"]),
        helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
        helper.make_node("Concat", ["ax", "ax", "ax", "s"], ["p1"], axis=0),
        helper.make_node("Pad", ["x", "p1"], ["grown"]),
        helper.make_node("Unsqueeze", ["x", "ax"], ["u"]),
        helper.make_node("Squeeze", ["u", "ax"], ["sq"]),
    ]
    outs = [vi(n, None) for n in ("same", "grown", "u", "sq")]
    t = tensors(model(nodes, [vi("x", ["b", "n"])], outs, inits))
    d = Dims()
    assert d.key(t["same"], 1) == ("param", "n")
    assert d.key(t["grown"], 1) == ("expr", "Add", ("param", "n"), ("param", "n"))
    assert d.key(t["grown"], 0) == ("param", "b")
    assert [d.key(t["u"], i) for i in range(3)] == [("int", 1), ("param", "b"), ("param", "n")]
    assert [d.key(t["sq"], i) for i in range(2)] == [("param", "b"), ("param", "n")]


def test_reshape_minus_one_is_inferred_when_static():
    inits = [const("t", [-1, 4], np.int64)]
    nodes = [helper.make_node("Reshape", ["x", "t"], ["y"])]
    t = tensors(model(nodes, [vi("x", [3, 8])], [vi("y", [6, 4])], inits))
    t["y"].shape = None  # as after a rewrite: no inferred shape
    assert Dims().key(t["y"], 0) == ("int", 6)


def test_reshape_minus_one_cancels_a_computed_symbolic_element():
    """fairseq's query view [S,B,E] → [-1, B·N, H]: the -1 is S (the B of the computed B·N
    cancels the input's own, N·H = E); an element that is not a factor of the input keeps
    the dim unknown."""
    inits = [const("i1", [1], np.int64), const("nh", [N], np.int64), const("rest", [H], np.int64)]
    inits += [const("lead", [-1], np.int64)]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "i1"], ["b"]),
        helper.make_node("Mul", ["b", "nh"], ["bn"]),
        helper.make_node("Concat", ["lead", "bn", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("Shape", ["z"], ["zs"], start=0, end=1),
        helper.make_node("Concat", ["lead", "zs", "rest"], ["other"], axis=0),
        helper.make_node("Reshape", ["x", "other"], ["w"]),
    ]
    inputs = [vi("x", ["s", "b", C]), vi("z", ["m"])]
    t = tensors(model(nodes, inputs, [vi("y", None), vi("w", None)], inits))
    t["y"].shape = t["w"].shape = None  # as after a rewrite: no inferred shape
    d = Dims()
    assert d.key(t["y"], 0) == ("param", "s")
    assert d.key(t["w"], 0) == ("dim", "w", 0)


def test_a_slice_with_computed_bounds_keeps_the_axes_it_does_not_slice():
    """ProphetNet's chunked streams: heads [B,N,L,H] sliced on L at bounds read from a shape;
    B, N and H keep their keys (computed axes: nothing is known)."""
    inits = [const("ax2", [2], np.int64), const("i2", [2], np.int64), const("z", [0], np.int64)]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "i2"], ["end"]),
        helper.make_node("Slice", ["x", "z", "end", "ax2"], ["part"]),
        helper.make_node("Slice", ["x", "z", "end", "end"], ["anywhere"]),
    ]
    t = tensors(
        model(nodes, [vi("x", ["b", 4, "l", 8])], [vi("part", None), vi("anywhere", None)], inits)
    )
    t["part"].shape = t["anywhere"].shape = [None] * 4  # rank alone known
    d = Dims()
    assert [d.key(t["part"], i) for i in (0, 1, 3)] == [("param", "b"), ("int", 4), ("int", 8)]
    assert d.key(t["part"], 2) == ("dim", "part", 2)
    assert d.key(t["anywhere"], 0) == ("dim", "anywhere", 0)


def test_dims_through_reductions_keep_or_drop_the_reduced_axes():
    """Hiera's pooled query: ReduceMax over a stride axis, kept as 1 or dropped."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["kept"], axes=[1], keepdims=1),
        helper.make_node("ReduceMax", ["x"], ["dropped"], axes=[-2], keepdims=0),
        helper.make_node("ReduceMean", ["x"], ["all"], keepdims=0),
    ]
    outs = [vi(n, None) for n in ("kept", "dropped", "all")]
    t = tensors(model(nodes, [vi("x", ["b", 3, "s", 8])], outs, []))
    for name in ("kept", "dropped", "all"):
        t[name].shape = [None] * {"kept": 4, "dropped": 3, "all": 0}[name]  # rank alone known
    d = Dims()
    assert [d.key(t["kept"], i) for i in range(4)] == [
        ("param", "b"),
        ("int", 1),
        ("param", "s"),
        ("int", 8),
    ]
    assert [d.key(t["dropped"], i) for i in range(3)] == [("param", "b"), ("int", 3), ("int", 8)]


def test_dims_through_tile_a_kept_symbolic_dim_and_a_computed_slice():
    """TorchScript's nn.MultiheadAttention: a learned query tiled over a symbolic batch, the
    packed k/v unflattened by [L, 0, 2, -1] (the batch copied cancels the input's own), and the
    in-projection's rows sliced at E read from a shape."""
    inits = [
        const("probe", np.zeros((1, 1, 8)), np.float32),
        const("ones2", [1, 1], np.int64),
        const("unflat", [3, 0, 2, -1], np.int64),
        const("w", np.zeros((24, 8)), np.float32),
        const("last", [-1], np.int64),
        const("big", [I64_MAX], np.int64),
        const("ax0", [0], np.int64),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["b"], start=0, end=1),
        helper.make_node("Concat", ["b", "ones2"], ["reps"], axis=0),
        helper.make_node("Tile", ["probe", "reps"], ["tiled"]),
        helper.make_node("Reshape", ["kv"], ["kv4"], name="unflatten"),
        helper.make_node("Shape", ["x"], ["e"], start=-1),
        helper.make_node("Slice", ["w", "e", "big", "ax0"], ["w_kv"]),
    ]
    nodes[3].input.append("unflat")
    inputs = [vi("x", ["b", 5, 8]), vi("kv", [3, "b", 16])]
    t = tensors(model(nodes, inputs, [vi("tiled", None), vi("kv4", None), vi("w_kv", None)], inits))
    for name in ("tiled", "kv4", "w_kv"):
        t[name].shape = None  # as after a rewrite: no inferred shape
    d = Dims()
    assert [d.key(t["tiled"], i) for i in range(3)] == [("param", "b"), ("int", 1), ("int", 8)]
    assert d.key(t["kv4"], 3) == ("int", 8)
    assert d.key(t["w_kv"], 0) == ("int", 16)


def test_dims_through_a_scatter_are_the_data_s():
    """TorchScript's ``k[..., :n] = k_nope``: a ScatterND into the key keeps its dims."""
    nodes = [helper.make_node("ScatterND", ["data", "idx", "upd"], ["y"])]
    inputs = [
        vi("data", ["b", 8, "t", 48]),
        vi("idx", ["b", 8, "t", 32, 4], TensorProto.INT64),
        vi("upd", ["b", 8, "t", 32]),
    ]
    t = tensors(model(nodes, inputs, [vi("y", None)]))
    t["y"].shape = None  # as after a rewrite: no inferred shape
    d = Dims()
    assert [d.key(t["y"], i) for i in range(4)] == [
        ("param", "b"), ("int", 8), ("param", "t"), ("int", 48)
    ]  # fmt: skip


def test_window_regroup_target_is_proven():
    """The 5-D regroup target [B·nW // nW, nW, N, S, S] of a padded, rolled input: nW static,
    the images the batch itself."""
    t = tensors(shifted_window_block())
    elems = shape_elements(t["win5"], Dims())
    s = WIN * WIN
    assert elems == [("param", "batch"), ("int", 4), ("int", N), ("int", s), ("int", s)]


# ------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_shifted_window_attention_through_pad_fuses(target):
    """The window count is computed at run time (folding refused: no budget): the mask shape is
    proven through Pad and the roll, so the block fuses (cpu: short windows are refused as
    slower there, by measurement, not for the mask)."""
    rng = np.random.default_rng(1)
    feed = {"x": rng.standard_normal((3, 3, 4, C)).astype(np.float32)}
    out, report = assert_optimized(
        shifted_window_block(),
        target=target,
        inputs=feed,
        options={"fold_size_limit": 0},
    )
    h = op_histogram(out.graph.node)
    missed = [r.code for r in report.remarks if r.rule == "fuse-attention" and r.kind == "missed"]
    assert "mask-shape" not in missed
    if target == "cuda":
        assert h["com.microsoft.MultiHeadAttention"] == 1 and "Softmax" not in h
        assert "Pad" in h  # the window count was not folded away
    else:
        assert missed == ["slower-on-target"]


def test_shape_values_through_casts_to_integers_only():
    inits = [const("t", [2, 0], np.int64)]
    nodes = [
        helper.make_node("Add", ["t", "t"], ["tt"]),
        helper.make_node("Cast", ["tt"], ["tt32"], to=TensorProto.INT32),
        helper.make_node("Cast", ["tt"], ["ttb"], to=TensorProto.BOOL),
    ]
    outs = [vi(n, None, e) for n, e in (("tt32", TensorProto.INT32), ("ttb", TensorProto.BOOL))]
    t = tensors(model(nodes, [vi("x", [1])], outs, inits))
    assert shape_elements(t["tt32"]) == [("int", 4), ("int", 0)]
    assert shape_elements(t["ttb"]) is None


def test_rules_share_one_dims_between_rewrites():
    """The rule engine opens one Dims per graph state: every question between two rewrites shares
    its memo; a rewrite (and the rewrite being built) gets a fresh one; outside, always fresh."""
    from graphopt.opt.graph import dims

    assert dims.current() is not dims.current()
    with dims.sharing():
        first = dims.current()
        assert dims.current() is first
        with dims.unshared():
            assert dims.current() is not dims.current() and dims.current() is not first
        assert dims.current() is first
        dims.changed()
        assert dims.current() is not first
    assert dims.current() is not dims.current()


def test_the_engine_renews_the_shared_dims_after_each_rewrite(monkeypatch):
    """Two SkipLayerNormalization fusions in one pass: their checks' questions are answered by
    a Dims that no rewrite has happened under (the second check's is not the first's)."""
    from graphopt.opt.graph import dims
    from graphopt.rules import norm

    seen = []
    real = norm.same_dim

    def spy(a, i, b, j):
        seen.append(dims.current())
        return real(a, i, b, j)

    monkeypatch.setattr(norm, "same_dim", spy)
    nodes, inits = [], []
    for k in range(2):
        x = "x" if k == 0 else "n0"
        nodes += [
            helper.make_node("Add", [x, f"r{k}"], [f"a{k}"]),
            helper.make_node("LayerNormalization", [f"a{k}", f"g{k}", f"b{k}"], [f"n{k}"], axis=-1),
        ]
        inits += [const(f"g{k}", np.ones(C, np.float32)), const(f"b{k}", np.zeros(C, np.float32))]
    ins = [vi("x", ["B", "S", C]), vi("r0", ["B", "S", C]), vi("r1", ["B", "S", C])]
    m = model(nodes, ins, [vi("n1", ["B", "S", C])], inits)
    out, _ = assert_optimized(m, level=2, target="cuda")  # (slower on cpu: not fused there)
    h = op_histogram(out.graph.node)
    assert h.get("com.microsoft.SkipLayerNormalization") == 2, h
    first = seen[:2]  # the first check's two questions (batch, sequence) share one
    assert len(seen) >= 4 and first[0] is first[1] and seen[2] is not first[0]


@pytest.mark.parametrize("factor, trusted", [("heads", True), ("seq", False)])
def test_a_computed_reshape_element_that_scales_the_copied_dim_is_trusted(factor, trusted):
    """``Reshape(x [B,N,S,H], [B·N, -1, H])``: the computed B·N is never -1, and 0 only where
    B is 0, which a copy gives too, so it is the output's dim; B·S (another dim's factor)
    could be 0 with B not 0, and stays the output's own unknown dim."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i2"], ["seq"], axis=0),
        helper.make_node("Mul", ["b", factor], ["bn"]),
        helper.make_node("Concat", ["bn", "minus_one", "h"], ["fold"], axis=0),
        helper.make_node("Reshape", ["x", "fold"], ["y"]),
    ]
    inits = [
        const("i0", [0], np.int64),
        const("i2", [2], np.int64),
        const("heads", [N], np.int64),
        const("minus_one", [-1], np.int64),
        const("h", [H], np.int64),
    ]
    m = model(nodes, [vi("x", ["batch", N, "seq", H])], [vi("y", None)], inits)
    t = tensors(m)
    key = Dims().key(t["y"], 0)
    if trusted:
        assert key == arith("Mul", ("param", "batch"), ("int", N))
    else:
        assert key[0] == "dim", key


def test_dims_of_detr_spellings_conv_resize_cumsum_a_last_row_and_an_expand_of_minus_ones():
    """DETR's sine position embedding keeps the batch: a mask resized to computed sizes, a
    CumSum over it divided by its last row (``x[:, -1:]`` is min(d, 1) rows, which broadcast
    against d as d), and queries expanded by torch's ``expand(B, -1, -1)`` (a Where on
    ``Equal(target, −1)``); a causal Conv's stride-1 length is ``T + pads − span``."""
    inits = [
        const("w", np.ones((8, 1, 4)), np.float32),
        const("two", [2], np.int64),
        const("hw", [3, 3], np.int64),
        const("ax0", [0], np.int64),
        const("i0", [0], np.int64),
        const("m1s", [-1, -1], np.int64),
        const("ones3", [1, 1, 1], np.int64),
        const("minus1", [-1], np.int64),
        const("big", [I64_MAX], np.int64),
        const("ax1", [1], np.int64),
        const("query", np.zeros((1, 4, 8)), np.float32),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["conv"], group=8, pads=[3, 3], kernel_shape=[4]),
        helper.make_node("Shape", ["m"], ["m_lead"], end=2),
        helper.make_node("Concat", ["m_lead", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["m", "", "", "sizes"], ["small"], mode="nearest"),
        helper.make_node("CumSum", ["small", "two"], ["cum"]),
        helper.make_node("Slice", ["cum", "minus1", "big", "ax1"], ["last"]),
        helper.make_node("Div", ["cum", "last"], ["normed"]),
        helper.make_node("Sin", ["normed"], ["emb"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "i0"], ["b"]),
        helper.make_node("Concat", ["b", "m1s"], ["target"], axis=0),
        helper.make_node("Equal", ["target", "minus1"], ["is_m1"]),
        helper.make_node("Where", ["is_m1", "ones3", "target"], ["expand_to"]),
        helper.make_node("Expand", ["query", "expand_to"], ["queries"]),
    ]
    outs = [vi(n, None) for n in ("conv", "emb", "queries")]
    t = tensors(model(nodes, [vi("x", ["b", 8, "t"]), vi("m", [1, "b", 6, 6])], outs, inits))
    for name in ("conv", "emb", "queries"):
        t[name].shape = [None] * len(t[name].shape)  # rank alone known
    d = Dims()
    b, t_len = ("param", "b"), ("param", "t")
    assert [d.key(t["conv"], i) for i in range(3)] == [
        b,
        ("int", 8),
        arith("Add", t_len, ("int", 3)),
    ]
    assert [d.key(t["emb"], i) for i in range(4)] == [("int", 1), b, ("int", 3), ("int", 3)]
    assert [d.key(t["queries"], i) for i in range(3)] == [b, ("int", 4), ("int", 8)]


def test_a_reshape_trusts_the_length_of_a_last_row_slice_as_a_dim():
    """FSMT's decoder: a query of the sequence's last row, ``x[:, -1:]``, is min(T, 1) long;
    a Reshape whose target copies that length back (a fold of its heads) keeps it: never
    -1, and 0 only where T is, as for a dim's own key."""
    inits = [
        const("minus1", [-1], np.int64),
        const("big", [I64_MAX], np.int64),
        const("ax1", [1], np.int64),
        const("lead", [-1], np.int64),
    ]
    nodes = [
        helper.make_node("Slice", ["x", "minus1", "big", "ax1"], ["last"]),
        helper.make_node("Shape", ["last"], ["tail"], start=1),
        helper.make_node("Concat", ["lead", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["last", "target"], ["folded"]),
    ]
    t = tensors(model(nodes, [vi("x", ["b", "t", 8])], [vi("folded", None)], inits))
    t["folded"].shape = [None] * 3
    d = Dims()
    row = arith("Min", ("param", "t"), ("int", 1))
    assert d.key(t["last"], 1) == row
    assert [d.key(t["folded"], i) for i in (1, 2)] == [row, ("int", 8)]

"""fuse-attention through three more ways of doing per-head math, each checked by onnxruntime
parity:

- interleaved partial rotary before the heads' Transpose (GPT-J, CodeGen): ``x[..., ::2]`` and
  ``x[..., 1::2]`` stacked on a new last axis and flattened back, with cos/sin repeated
  pairwise by Unsqueeze → Expand → Reshape;
- one LayerNorm per head with its own weights (StableLM): Split on the heads axis, a norm for
  each part, Concat back in order;
- q, k and v interleaved per head in one projection (Persimmon, Bloom): ``[B,S,N,3,H]`` read by
  a Gather on axis 3, a LayerNorm on q and k."""

import numpy as np
import pytest
from onnx import helper
from test_rules_attention_per_head import rotary_unfused  # noqa: F401 - a fixture

from conftest import assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

N, H, R = 4, 16, 8  # heads, head size, rotated dims
D = N * H
RULE = "fuse-attention"
MHA = "com.microsoft.MultiHeadAttention"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def _shape_of(x: str, tag: str, tail: list[str]) -> list:
    """``{tag}`` = Concat(Shape(x)[0:1], Shape(x)[1:2], *tail): a target computed at run time,
    as the dynamo exporter writes ``view(B, S, ...)``."""
    return [
        mk("Shape", [x], [f"{tag}_b"], start=0, end=1),
        mk("Shape", [x], [f"{tag}_s"], start=1, end=2),
        mk("Concat", [f"{tag}_b", f"{tag}_s", *tail], [tag], axis=0),
    ]


def _interleaved_rotary(r: str) -> tuple[list, list]:
    """``{r}_roped`` [B,S,N,H] = GPT-J's rotary of the first R dims of ``{r}_4`` [B,S,N,H]."""
    n = [
        mk("Slice", [f"{r}_4", "z", "rdim", "last"], [f"{r}_rot"]),
        mk("Slice", [f"{r}_4", "rdim", "big", "last"], [f"{r}_pass"]),
        mk("Slice", [f"{r}_rot", "z", "big", "last", "two"], [f"{r}_even"]),
        mk("Slice", [f"{r}_rot", "one", "big", "last", "two"], [f"{r}_odd"]),
        mk("Neg", [f"{r}_odd"], [f"{r}_nodd"]),
        mk("Unsqueeze", [f"{r}_nodd", "last"], [f"{r}_a"]),
        mk("Unsqueeze", [f"{r}_even", "last"], [f"{r}_b"]),
        mk("Concat", [f"{r}_a", f"{r}_b"], [f"{r}_pairs"], axis=-1),
        *_shape_of(f"{r}_pairs", f"{r}_flat", ["nh", "rdim"]),
        mk("Reshape", [f"{r}_pairs", f"{r}_flat"], [f"{r}_swapped"]),
        mk("Mul", [f"{r}_rot", "cos_rep"], [f"{r}_c"]),
        mk("Mul", [f"{r}_swapped", "sin_rep"], [f"{r}_s"]),
        mk("Add", [f"{r}_c", f"{r}_s"], [f"{r}_rotated"]),
        mk("Concat", [f"{r}_rotated", f"{r}_pass"], [f"{r}_roped"], axis=-1),
    ]
    return n, []


def _sincos() -> tuple[list, list]:
    """cos_rep/sin_rep [B,S,1,R]: each frequency of ``position_ids`` repeated pairwise."""
    inv = (1.0 / 10000 ** (np.arange(0, R, 2) / R)).astype(np.float32)
    nodes = [
        mk("Unsqueeze", ["position_ids", "last"], ["pos3"]),
        mk("Cast", ["pos3"], ["posf"], to=1),
        mk("Mul", ["posf", "inv_freq"], ["freqs"]),  # [B,S,R/2]
        mk("Unsqueeze", ["freqs", "ax2"], ["freqs4"]),  # [B,S,1,R/2]
    ]
    for f in ("cos", "sin"):
        nodes += [
            mk(f.capitalize(), ["freqs4"], [f"{f}4"]),
            mk("Unsqueeze", [f"{f}4", "last"], [f"{f}5"]),
            mk("Expand", [f"{f}5", "pair"], [f"{f}_x"]),
            *_shape_of(f"{f}4", f"{f}_flat", ["one", "rdim"]),
            mk("Reshape", [f"{f}_x", f"{f}_flat"], [f"{f}_rep"]),
        ]
    return nodes, [const("inv_freq", inv), const("pair", [1, 1, 1, 1, 2], np.int64)]


def _per_head_norms(rng, r: str, inits: list) -> list:
    """``{r}_normed`` [B,N,S,H]: ``{r}_heads`` split per head, a LayerNorm with its own weights
    on each, concatenated back in order."""
    parts = [f"{r}_h{i}" for i in range(N)]
    nodes = [mk("Split", [f"{r}_heads", "ones_n"], parts, axis=1)]
    for p in parts:
        inits += [
            const(f"{p}_g", 1 + 0.1 * rng.standard_normal(H)),
            const(f"{p}_b", 0.1 * rng.standard_normal(H)),
        ]
        nodes.append(mk("LayerNormalization", [p, f"{p}_g", f"{p}_b"], [f"{p}_n"], axis=-1))
    nodes.append(mk("Concat", [f"{p}_n" for p in parts], [f"{r}_normed"], axis=1))
    return nodes


def encoder(spelling: str):
    """A self-attention over ``x`` [B,S,D] with a padding mask, q and k computed per head in
    ``spelling``: "interleaved", "per-head-norms" or "packed-per-head"."""
    rng = np.random.default_rng(11)
    inits = [
        const("z", [0], np.int64),
        const("one", [1], np.int64),
        const("two", [2], np.int64),
        const("big", [1 << 30], np.int64),
        const("last", [-1], np.int64),
        const("ax2", [2], np.int64),
        const("rdim", [R], np.int64),
        const("nh", [N], np.int64),
        const("h", [H], np.int64),
        const("ones_n", [1] * N, np.int64),
        const("split4", [0, 0, N, H], np.int64),
        const("scale", H**-0.5),
        const("merge", [0, 0, D], np.int64),
        const("fone", 1.0),
        const("fill", -1e4),
        const("ax12", [1, 2], np.int64),
    ]
    nodes = []
    if spelling == "packed-per-head":
        inits += [
            const("Wqkv", rng.standard_normal((D, 3 * D)) * 0.2),
            const("split5", [0, 0, N, 3, H], np.int64),
        ]
        nodes += [
            mk("MatMul", ["x", "Wqkv"], ["qkv"]),
            mk("Reshape", ["qkv", "split5"], ["qkv5"]),
        ]
        for i, r in enumerate("qkv"):
            inits.append(const(f"{r}_i", i, np.int64))
            nodes.append(mk("Gather", ["qkv5", f"{r}_i"], [f"{r}_4"], axis=3))
            src = f"{r}_4"
            if r != "v":
                inits += [
                    const(f"{r}_g", 1 + 0.1 * rng.standard_normal(H)),
                    const(f"{r}_b", 0.0 * np.ones(H)),
                ]
                nodes.append(
                    mk("LayerNormalization", [src, f"{r}_g", f"{r}_b"], [f"{r}_ln"], axis=-1)
                )
                src = f"{r}_ln"
            nodes.append(mk("Transpose", [src], [f"{r}_heads"], perm=[0, 2, 1, 3]))
        q, k = "q_heads", "k_heads"
    else:
        for r in "qkv":
            inits.append(const(f"W{r}", rng.standard_normal((D, D)) * 0.2))
            nodes += [
                mk("MatMul", ["x", f"W{r}"], [f"{r}_p"]),
                mk("Reshape", [f"{r}_p", "split4"], [f"{r}_4"]),
            ]
        if spelling == "interleaved":
            n, i = _sincos()
            nodes, inits = nodes + n, inits + i
            for r in "qk":
                n, i = _interleaved_rotary(r)
                nodes += n + [mk("Transpose", [f"{r}_roped"], [f"{r}_heads"], perm=[0, 2, 1, 3])]
            q, k = "q_heads", "k_heads"
        else:
            for r in "qk":
                nodes.append(mk("Transpose", [f"{r}_4"], [f"{r}_heads"], perm=[0, 2, 1, 3]))
                nodes += _per_head_norms(rng, r, inits)
            q, k = "q_normed", "k_normed"
        nodes.append(mk("Transpose", ["v_4"], ["v_heads"], perm=[0, 2, 1, 3]))
    nodes += [
        mk("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
        mk("MatMul", [q, "kt"], ["qk"]),
        mk("Mul", ["qk", "scale"], ["scores"]),
        mk("Unsqueeze", ["attention_mask", "ax12"], ["am4"]),
        mk("Cast", ["am4"], ["amf"], to=1),
        mk("Sub", ["fone", "amf"], ["inv"]),
        mk("Mul", ["inv", "fill"], ["pad"]),
        mk("Add", ["scores", "pad"], ["masked"]),
        mk("Softmax", ["masked"], ["P"], axis=-1),
        mk("MatMul", ["P", "v_heads"], ["ctx"]),
        mk("Transpose", ["ctx"], ["ctxT"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["ctxT", "merge"], ["y"]),
    ]
    inputs = [
        vi("x", ["batch", "seq", D]),
        vi("attention_mask", ["batch", "seq"], 7),
        vi("position_ids", ["batch", "seq"], 7),
    ]
    used = {i for nd in nodes for i in nd.input}
    inputs = [i for i in inputs if i.name in used]
    for i, nd in enumerate(nodes):
        nd.name = f"n{i}_{nd.op_type}"
    inits = [t for t in inits if t.name in used]
    return model(nodes, inputs, [vi("y", ["batch", "seq", D])], inits)


def feeds(m, batch=2, seq=6, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    am = np.ones((batch, seq), np.int64)
    am[0, seq - 2 :] = 0
    f = {
        "x": rng.standard_normal((batch, seq, D)).astype(np.float32),
        "attention_mask": am,
        "position_ids": np.ascontiguousarray(
            np.broadcast_to(np.arange(3, 3 + seq), (batch, seq)).astype(np.int64)
        ),
    }
    return {k: v for k, v in f.items() if k in {i.name for i in m.graph.input}}


@pytest.mark.parametrize(
    "spelling,order",
    [
        ("interleaved", "rotary-first"),
        ("interleaved", "attention-first"),
        ("per-head-norms", ""),
        ("packed-per-head", ""),
    ],
)
def test_per_head_math_of_more_families_fuses(spelling, order, request):
    """Fused, with the key kept per head as [B,T,N,H] under one (0,2,3,1) Transpose; the
    interleaved rotation either fused first (a RotaryEmbedding over the merged heads) or left
    as the exporter wrote it."""
    if order == "attention-first":
        request.getfixturevalue("rotary_unfused")
    m = encoder(spelling)
    out, report = assert_optimized(m, inputs=feeds(m))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1, h
    assert "Softmax" not in h, h
    assert codes(report, RULE) == []
    assert h.get("com.microsoft.RotaryEmbedding", 0) == (2 if order == "rotary-first" else 0)
    assert run(out, inputs=feeds(m, batch=3, seq=9, seed=1))[1].parity.ok

"""fuse-attention's lowering where the kernel is stricter than the graph, each checked by
onnxruntime parity:

- a learned bias table [N, S, T] added to the scores [B, N, S, T] by broadcasting (LeViT's
  ``attention_biases[:, idxs]``): attention_bias goes in 4-D, [1, N, S, T];
- per-head key and value [B, N, T, H] of different head sizes (DeepSeek's latent attention:
  the key is nope + rope dims, the value nope dims only): MultiHeadAttention takes them merged
  to [B, T, N·H], the layout in which the value may be of another width;
- a bias added before the mask's Where (MPT's ALiBi [N, 1, T], then
  ``masked_fill(mask, finfo.min)``): both go into attention_bias;
- a causal mask multiplied in (OpenAI GPT's ``w · b + −1e4 · (1 − b)``, ``b`` a constant or a
  constant buffer sliced to a dynamic sequence): the fill term is the bias and the Mul goes; a
  0/1 factor with no such fill is missed, not fused;
- a scaled query also read by a bias term (DeBERTa's content-to-position term of ``q / √3H``):
  the scale stays in front of the kernel, which takes the scaled query with scale 1."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, const, model, vi
from graphopt.opt.graph.ir import op_histogram

N, S = 4, 16
MHA = "com.microsoft.MultiHeadAttention"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def _heads(r: str, h: int, perm: list[int]) -> list:
    """``{r}_h``: the projection ``x @ W{r}`` [B,S,N·h] split into heads with ``perm``."""
    return [
        mk("MatMul", ["x", f"W{r}"], [f"{r}_p"]),
        mk("Reshape", [f"{r}_p", f"split{h}"], [f"{r}_4"]),
        mk("Transpose", [f"{r}_4"], [f"{r}_h"], perm=perm),
    ]


def _attend(k_t: str, v: str, hv: int, bias: str | None) -> list:
    """Softmax(q·kᵀ·scale (+ bias)) · v, merged to [B,S,N·hv] as ``y``."""
    nodes = [mk("MatMul", ["q_h", k_t], ["qk"]), mk("Mul", ["qk", "scale"], ["scaled"])]
    if bias is not None:
        nodes.append(mk("Add", ["scaled", bias], ["biased"]))
    nodes += [
        mk("Softmax", ["biased" if bias is not None else "scaled"], ["p"], axis=-1),
        mk("MatMul", ["p", v], ["o"]),
        mk("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["o_t", f"merge{hv}"], ["y"]),
    ]
    return nodes


def _shapes(*sizes: int) -> list:
    out = []
    for h in sizes:
        out += [
            const(f"split{h}", [0, 0, N, h], np.int64),
            const(f"merge{h}", [0, 0, N * h], np.int64),
        ]
    return out


def learned_table(rng):
    """LeViT: q, k, v from one input; a constant table [N, S, S] biases every batch (128
    tokens: on cpu, a bias over fewer keys is refused as slower-on-target)."""
    h, d, s = 8, 32, 128
    nodes = [*_heads("q", h, [0, 2, 1, 3]), *_heads("k", h, [0, 2, 3, 1])]
    nodes += [*_heads("v", h, [0, 2, 1, 3]), *_attend("k_h", "v_h", h, "table")]
    inits = [const(f"W{r}", rng.standard_normal((d, N * h)) * 0.3) for r in "qkv"]
    inits += [const("scale", np.float32(h**-0.5)), const("table", rng.standard_normal((N, s, s)))]
    return model(nodes, [vi("x", ["B", s, d])], [vi("y", None)], inits + _shapes(h))


def unequal_heads(rng):
    """Latent attention: the per-head key [B,N,T,48] and value [B,N,T,32] are given as a
    cache's are; the query is a projection of 48 per head."""
    hk, hv, d = 48, 32, 64
    nodes = [*_heads("q", hk, [0, 2, 1, 3]), mk("Transpose", ["key"], ["k_t"], perm=[0, 1, 3, 2])]
    nodes += _attend("k_t", "value", hv, "mask")
    inits = [const("Wq", rng.standard_normal((d, N * hk)) * 0.2)]
    inits += [const("scale", np.float32(hk**-0.5)), const("mask", np.zeros((1, 1, 1, S)))]
    inputs = [vi("x", ["B", 3, d]), vi("key", ["B", N, S, hk]), vi("value", ["B", N, S, hv])]
    return model(nodes, inputs, [vi("y", None)], inits + _shapes(hk, hv))


def alibi_under_the_mask(rng):
    """MPT: per-head ALiBi slopes × key positions [N, 1, T] added to the scaled scores, then
    ``Where(causal, finfo.min, scores + alibi)``."""
    h, d = 8, 32
    nodes = [*_heads("q", h, [0, 2, 1, 3]), *_heads("k", h, [0, 2, 3, 1])]
    nodes += [*_heads("v", h, [0, 2, 1, 3]), *_attend("k_h", "v_h", h, "alibi")]
    at = next(i for i, n in enumerate(nodes) if n.op_type == "Softmax")
    nodes[at].input[0] = "masked"
    nodes.insert(at, mk("Where", ["future", "lowest", "biased"], ["masked"]))
    slopes = 2.0 ** -np.arange(1, N + 1)
    alibi = (slopes[:, None, None] * np.arange(S)[None, None, :]).astype(np.float32)
    inits = [const(f"W{r}", rng.standard_normal((d, N * h)) * 0.3) for r in "qkv"]
    inits += [const("scale", np.float32(h**-0.5)), const("alibi", alibi)]
    inits += [const("lowest", np.float32(np.finfo(np.float32).min))]
    inputs = [vi("x", ["B", S, d]), vi("future", [1, 1, S, S], TensorProto.BOOL)]
    return model(nodes, inputs, [vi("y", None)], inits + _shapes(h))


@pytest.mark.parametrize("build", [learned_table, unequal_heads])
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_kernel_gets_the_layout_it_takes(build, target, rng):
    m = build(rng)
    out, report = assert_optimized(m, target=target, measure=False)
    ops = op_histogram(out.graph.node)
    assert ops.get(MHA) == 1 and "Softmax" not in ops, (ops, report.remarks)


def test_a_bias_under_the_mask_goes_into_the_attention_bias(rng):
    """cuda (on cpu 16 keys with a bias are below the measured bound); the causal mask an
    input, as models build it from theirs."""
    x = rng.standard_normal((2, S, 32)).astype(np.float32)
    feeds = {"x": x, "future": np.triu(np.ones((1, 1, S, S), bool), 1)}
    out, report = assert_optimized(alibi_under_the_mask(rng), target="cuda", inputs=feeds)
    ops = op_histogram(out.graph.node)
    assert ops.get(MHA) == 1 and "Softmax" not in ops and "Expand" not in ops, ops


def multiplied_mask(rng, fill: float = -1e4):
    """OpenAI GPT: scores times a causal 0/1 constant, plus ``fill · (1 − b)`` (folded)."""
    h, d = 8, 32
    nodes = [*_heads("q", h, [0, 2, 1, 3]), *_heads("k", h, [0, 2, 3, 1])]
    nodes += [*_heads("v", h, [0, 2, 1, 3]), *_attend("k_h", "v_h", h, "fill")]
    at = next(i for i, n in enumerate(nodes) if n.op_type == "Add")
    nodes[at].input[0] = "kept"
    nodes.insert(at, mk("Mul", ["scaled", "causal"], ["kept"]))
    b = np.tril(np.ones((S, S), np.float32))[None, None]
    inits = [const(f"W{r}", rng.standard_normal((d, N * h)) * 0.3) for r in "qkv"]
    inits += [const("scale", np.float32(h**-0.5)), const("causal", b)]
    inits += [const("fill", (fill * (1 - b)).astype(np.float32))]
    return model(nodes, [vi("x", ["B", S, d])], [vi("y", None)], inits + _shapes(h))


def test_a_multiplied_causal_mask_with_its_fill_fuses(rng):
    out, report = assert_optimized(multiplied_mask(rng), target="cuda")
    ops = op_histogram(out.graph.node)
    assert ops.get(MHA) == 1 and "Softmax" not in ops and "Mul" not in ops, ops


def test_a_zero_one_factor_without_a_fill_is_missed(rng):
    """A fill of −10 does not drown the kept score: no bias stands for the product."""
    out, report = assert_optimized(multiplied_mask(rng, fill=-10.0), target="cuda")
    assert MHA not in op_histogram(out.graph.node)
    miss = [r for r in report.remarks if r.rule == "fuse-attention" and r.kind == "missed"]
    assert [r.code for r in miss] == ["unrecognized-layout"], miss
    assert "0/1 mask" in miss[0].message


def sliced_multiplied_mask(rng, fill: float = -1e4):
    """OpenAI GPT exported with a dynamic sequence: ``b`` the [1,1,64,64] causal buffer sliced
    to the scores' sequence, the fill computed as ``(1 − b) · fill``."""
    h, d = 8, 32
    nodes = [*_heads("q", h, [0, 2, 1, 3]), *_heads("k", h, [0, 2, 3, 1])]
    nodes += [*_heads("v", h, [0, 2, 1, 3]), *_attend("k_h", "v_h", h, "fill")]
    at = next(i for i, n in enumerate(nodes) if n.op_type == "Add")
    nodes[at].input[0] = "kept"
    nodes[at:at] = [
        mk("Shape", ["scaled"], ["dims"]),
        mk("Slice", ["dims", "two", "four"], ["seqs"]),
        mk("Slice", ["buffer", "zeros", "seqs", "axes"], ["b"]),
        mk("Mul", ["scaled", "b"], ["kept"]),
        mk("Sub", ["one", "b"], ["masked"]),
        mk("Mul", ["masked", "lowest"], ["fill"]),
    ]
    buffer = np.tril(np.ones((64, 64), np.float32))[None, None]
    inits = [const(f"W{r}", rng.standard_normal((d, N * h)) * 0.3) for r in "qkv"]
    inits += [const("scale", np.float32(h**-0.5)), const("buffer", buffer)]
    inits += [const(n, v, np.int64) for n, v in [("two", [2]), ("four", [4]), ("zeros", [0, 0])]]
    inits += [const("axes", [2, 3], np.int64), const("one", np.float32(1))]
    inits += [const("lowest", np.float32(fill))]
    return model(nodes, [vi("x", ["B", "S", d])], [vi("y", None)], inits + _shapes(h))


@pytest.mark.parametrize("fill,fused", [(-1e4, True), (-10.0, False)])
def test_a_sliced_causal_buffer_multiplied_in_fuses_with_its_fill(rng, fill, fused):
    x = rng.standard_normal((2, 11, 32)).astype(np.float32)
    m = sliced_multiplied_mask(rng, fill)
    out, report = assert_optimized(m, target="cuda", inputs={"x": x})
    ops = op_histogram(out.graph.node)
    assert (ops.get(MHA) == 1 and "Softmax" not in ops) == fused, ops
    if not fused:
        miss = [r for r in report.remarks if r.rule == "fuse-attention" and r.kind == "missed"]
        assert "0/1 mask 'b'" in miss[0].message, miss


def shared_scaled_query(rng):
    """DeBERTa: ``q / c`` feeds the scores and a content-to-position term ``(q / c) · Pᵀ``."""
    h, d = 8, 32
    nodes = [*_heads("q", h, [0, 2, 1, 3]), *_heads("k", h, [0, 2, 3, 1])]
    nodes += [*_heads("v", h, [0, 2, 1, 3])]
    nodes += [
        mk("Div", ["q_h", "c"], ["q_s"]),
        mk("MatMul", ["q_s", "pos_t"], ["c2p"]),
        mk("MatMul", ["q_s", "k_h"], ["qk"]),
        mk("Add", ["qk", "c2p"], ["z"]),
        mk("Softmax", ["z"], ["p"], axis=-1),
        mk("MatMul", ["p", "v_h"], ["o"]),
        mk("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["o_t", f"merge{h}"], ["y"]),
    ]
    inits = [const(f"W{r}", rng.standard_normal((d, N * h)) * 0.3) for r in "qkv"]
    inits += [
        const("c", np.float32(np.sqrt(3 * h))),
        const("pos_t", rng.standard_normal((1, N, h, S))),
    ]
    return model(nodes, [vi("x", ["B", S, d])], [vi("y", None)], inits + _shapes(h))


def test_a_scaled_query_a_bias_term_reads_too_keeps_its_scale_in_front(rng):
    out, report = assert_optimized(shared_scaled_query(rng), target="cuda")
    ops = op_histogram(out.graph.node)
    assert ops.get(MHA) == 1 and "Softmax" not in ops and ops.get("Div") == 1, ops
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    assert {a.name: a.f for a in mha.attribute}.get("scale") == 1.0

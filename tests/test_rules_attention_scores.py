"""fuse-attention on transformed scores, one class of spelling per test: logit soft-capping,
additive terms of any provenance broadcast to [B,N,S,T] (position slopes, terms computed from
the query heads), batch and heads folded into one axis around the Softmax, masked_fill's
Where(cond, fill, scores), cosine attention with a per-head logit scale and K and V in
different layouts.  Every graph is checked against onnxruntime by graphopt's parity run."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram
from graphopt.rules.attention.masks import is_zero

B, S, N, H = 2, 6, 2, 8
D = N * H
RULE = "fuse-attention"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


class Graph:
    """A small attention graph: x [B,S,D] projected to q, k, v and split into heads."""

    def __init__(self, seed: int = 0, static: bool = False):
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits = [
            const("heads", [0, 0, N, H], np.int64),
            const("merge", [0, 0, D], np.int64),
        ]
        self.batch, self.seq = (B, S) if static else ("batch", "seq")
        self.inputs = [vi("x", [self.batch, self.seq, D])]

    def add(self, op, ins, out, **attrs) -> str:
        self.nodes.append(mk(op, ins, [out], **attrs))
        return out

    def const(self, name, value, dtype=np.float32) -> str:
        if name not in {i.name for i in self.inits}:  # shared by the layers' nodes
            self.inits.append(const(name, value, dtype))
        return name

    def heads(self, r: str) -> str:
        """``r`` = Transpose(Reshape(x·W, [B,S,N,H]), (0,2,1,3)) [B,N,S,H]."""
        w = self.const(f"W{r}", self.rng.standard_normal((D, D)) * 0.5)
        p = self.add("MatMul", ["x", w], f"{r}_proj")
        s = self.add("Reshape", [p, "heads"], f"{r}_bsnh")
        return self.add("Transpose", [s], f"{r}_h", perm=[0, 2, 1, 3])

    def finish(self, probs: str, v: str, folded: bool = False):
        """P·V merged back to [B,S,D] and projected out."""
        if folded:
            v3 = self.add("Reshape", [v, self.const("fold3", [-1, S, H], np.int64)], "v3")
            ctx3 = self.add("MatMul", [probs, v3], "ctx3")
            unfold = self.const("unfold_ctx", [-1, N, S, H], np.int64)
            ctx = self.add("Reshape", [ctx3, unfold], "ctx")
        else:
            ctx = self.add("MatMul", [probs, v], "ctx")
        t = self.add("Transpose", [ctx], "ctxT", perm=[0, 2, 1, 3])
        m = self.add("Reshape", [t, "merge"], "attn")
        self.add("MatMul", [m, self.const("Wo", self.rng.standard_normal((D, D)))], "y")
        for i, nd in enumerate(self.nodes):
            nd.name = f"n{i}_{nd.op_type}"
        return model(self.nodes, self.inputs, [vi("y", [self.batch, self.seq, D])], self.inits)


def feed(seed: int = 1, **extra) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, S, D)).astype(np.float32), **extra}


def padding_bias() -> np.ndarray:
    """[B,1,1,T] additive padding: row 0's last two keys masked with finfo.min."""
    bias = np.zeros((B, 1, 1, S), np.float32)
    bias[0, ..., -2:] = np.finfo(np.float32).min
    return bias


def attention_ops(m) -> dict:
    hist = op_histogram(m.graph.node)
    names = ("MultiHeadAttention", "GroupQueryAttention", "Attention")
    return {k.split(".")[-1]: v for k, v in hist.items() if k.split(".")[-1] in names}


def attrs_of(m, op: str) -> dict:
    node = next(n for n in m.graph.node if n.op_type == op)
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# ------------------------------------------------------------------ soft-capped scores
def soft_capped(cap: float = 2.0, capped_after_mask: bool = False, cached: bool = False):
    """Softmax(tanh(q·kᵀ·c / cap)·cap + mask)·v, the mask added after the cap (Gemma 2), or
    before it (then the cap also bounds the mask: no kernel computes that). ``cached``: a
    decoder step, k and v per head after Concat(past, new) (Gemma 2 with its KV cache)."""
    g = Graph()
    g.inputs.append(vi("mask_bias", ["batch", 1, 1, "total" if cached else "seq"]))
    q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    if cached:
        for r in ("key", "value"):
            g.inputs.append(vi(f"past_{r}", ["batch", N, "past", H]))
        k = g.add("Concat", ["past_key", k], "present_key", axis=2)
        v = g.add("Concat", ["past_value", v], "present_value", axis=2)
    kt = g.add("Transpose", [k], "kt", perm=[0, 1, 3, 2])
    s = g.add("MatMul", [q, kt], "qk")
    s = g.add("Mul", [s, g.const("scale", 0.3)], "qk_scaled")
    if capped_after_mask:
        s = g.add("Add", [s, "mask_bias"], "masked")
    s = g.add("Div", [s, g.const("cap_in", cap)], "capped_in")
    s = g.add("Tanh", [s], "capped_tanh")
    s = g.add("Mul", [s, g.const("cap_out", cap)], "capped")
    if not capped_after_mask:
        s = g.add("Add", [s, "mask_bias"], "masked")
    p = g.add("Softmax", [s], "P", axis=-1)
    return g.finish(p, v)


def test_soft_capped_scores_lower_to_group_query_attention_with_softcap():
    """GroupQueryAttention caps the scaled scores before it adds attention_bias: the one
    kernel of onnxruntime's CPU provider that computes the capped attention exactly (here
    over the new keys alone, at batch 2 with a padded row)."""
    out, report = run(soft_capped(), inputs=feed(mask_bias=padding_bias()))
    assert report.parity.ran and report.parity.ok, report.parity
    assert attention_ops(out) == {"GroupQueryAttention": 1}
    got = attrs_of(out, "GroupQueryAttention")
    assert got["softcap"] == pytest.approx(2.0) and got["scale"] == pytest.approx(0.3)
    assert got["causal"] == 0 and codes(report, RULE) == []


def test_soft_capped_scores_without_a_kernel_are_a_precise_miss():
    """On cuda GroupQueryAttention is taken only with causal=1 and MultiHeadAttention has no
    softcap: the miss names the cap and what each kernel lacks."""
    out, report = run(soft_capped(), target="cuda", inputs=feed(mask_bias=padding_bias()))
    assert codes(report, RULE) == ["no-kernel"]
    miss = next(r for r in report.remarks if r.rule == RULE and r.kind == "missed")
    assert "soft-capped (tanh(s/2)·2)" in miss.message and "causal=1" in miss.message
    assert miss.args["stage"] == "3 (lower)" and miss.args["softcap"] == 2.0
    assert "Softmax" in op_histogram(out.graph.node) and report.parity.ok


def cached_feed() -> dict:
    rng = np.random.default_rng(5)
    pasts = {
        f"past_{r}": rng.standard_normal((B, N, 4, H)).astype(np.float32) for r in ("key", "value")
    }
    bias = np.zeros((B, 1, 1, 4 + S), np.float32)
    bias[0, ..., :2] = np.finfo(np.float32).min  # row 0's first two cached keys are padding
    return feed(mask_bias=bias, **pasts)


def test_soft_capped_scores_over_a_cache_lower_to_4d_onnx_attention():
    """A decoder step (keys per head from Concat(past, new), the batch not provably 1): no
    GroupQueryAttention plan; below opset 23 the miss says that an upgrade helps, at 23 the
    ONNX Attention op takes the cache's [B,N,T,H] keys as they are, with the softcap."""
    m, feeds = soft_capped(cached=True), cached_feed()
    _, report = run(m, inputs=feeds)
    assert codes(report, RULE) == ["opset-too-old"]
    out, report = run(m, inputs=feeds, opset=23)
    assert report.parity.ran and report.parity.ok, report.parity
    assert attention_ops(out) == {"Attention": 1} and codes(report, RULE) == []
    got = attrs_of(out, "Attention")
    assert got["softcap"] == pytest.approx(2.0) and got["scale"] == pytest.approx(0.3)
    node = next(n for n in out.graph.node if n.op_type == "Attention")
    assert list(node.input[1:3]) == ["present_key", "present_value"]


@pytest.mark.parametrize("target", ["cuda", "tensorrt"])
def test_a_target_whose_attention_takes_no_softcap_keeps_capped_scores(target):
    """onnxruntime CUDA's Attention-23 and TensorRT's parser take no softcap: a miss that
    says so, the capped scores computed as the model computes them."""
    out, report = run(soft_capped(cached=True), target=target, inputs=cached_feed(), opset=23)
    assert codes(report, RULE) == ["no-kernel"] and report.parity.ok
    miss = next(r for r in report.remarks if r.rule == RULE and r.kind == "missed")
    assert f"target {target}'s ONNX Attention takes no softcap" in miss.message
    assert "Softmax" in op_histogram(out.graph.node)


def test_a_cap_over_the_masked_scores_is_not_read_as_softcap():
    out, report = run(soft_capped(capped_after_mask=True), inputs=feed(mask_bias=padding_bias()))
    assert attention_ops(out) == {} and "Softmax" in op_histogram(out.graph.node)
    assert codes(report, RULE) == ["unrecognized-layout"] and report.parity.ok


# ----------------------------------------------------------------- additive score terms
def position_slopes(g: Graph) -> str:
    """ALiBi's term: a slope per head times the key position, [1,N,1,T] built at run time
    from the key length."""
    shape = g.add("Shape", ["x"], "x_shape")
    t = g.add("Gather", [shape, g.const("one", 1, np.int64)], "t_len", axis=0)
    pos = g.add("Range", [g.const("zero_i", 0, np.int64), t, g.const("step", 1, np.int64)], "pos")
    posf = g.add("Cast", [pos], "posf", to=TensorProto.FLOAT)
    slopes = g.const("slopes", np.array([0.5, 0.25]).reshape(1, N, 1, 1))
    return g.add("Mul", [slopes, posf], "alibi")


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_additive_terms_of_any_provenance_sum_into_attention_bias(target):
    """A run-time position term [1,N,1,T] and the padding [B,1,1,T]: both broadcast to
    [B,N,S,T], so both go into the kernel's attention_bias."""
    g = Graph(2)
    g.inputs.append(vi("mask_bias", ["batch", 1, 1, "seq"]))
    q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    kt = g.add("Transpose", [k], "kt", perm=[0, 1, 3, 2])
    s = g.add("Div", [g.add("MatMul", [q, kt], "qk"), g.const("sqrt_h", np.sqrt(H))], "z0")
    s = g.add("Add", [s, position_slopes(g)], "z1")
    s = g.add("Add", [s, "mask_bias"], "z2")
    out, report = run(
        g.finish(g.add("Softmax", [s], "P", axis=-1), v),
        target=target,
        inputs=feed(mask_bias=padding_bias()),
    )
    assert report.parity.ran and report.parity.ok, report.parity
    assert attention_ops(out) == {"MultiHeadAttention": 1} and codes(report, RULE) == []


def interleaved_heads(g: Graph) -> tuple[str, str, str]:
    """Bloom's fused projection, q/k/v interleaved per head: Gather(Reshape(x·W, [B,S,N,3,H]),
    i, axis=3) transposed to [B,N,S,H]."""
    w = g.const("Wqkv", g.rng.standard_normal((D, 3 * D)) * 0.5)
    p = g.add("MatMul", ["x", w], "qkv_proj")
    r = g.add("Reshape", [p, g.const("qkv5", [0, 0, N, 3, H], np.int64)], "qkv5d")
    out = []
    for i, name in enumerate("qkv"):
        t = g.add("Gather", [r, g.const(f"i{i}", i, np.int64)], f"{name}_bsnh", axis=3)
        out.append(g.add("Transpose", [t], f"{name}_h", perm=[0, 2, 1, 3]))
    return out[0], out[1], out[2]


def folded(term: str, qkv: str = "separate", pv_folded: bool = True):
    """bmm-style scores: Q3 [B·N,S,H] = Reshape(Q), Kᵀ3 = Transpose(Reshape(K)), the scores
    [B·N,S,T] plus a folded term, unfolded to [B,N,S,T] for the mask and the Softmax, then
    folded back for P·V (Bloom's baddbmm with ALiBi, DeBERTa's c2p) or not (``pv_folded``
    False: GPT-NeoX's ``baddbmm`` of zeros times beta, P·V per head)."""
    g = Graph(3, static=True)
    g.inputs.append(vi("mask_bias", [B, 1, 1, S]))
    fold = g.const("fold3", [-1, S, H], np.int64)
    if qkv == "interleaved":
        q, k, v = interleaved_heads(g)
    else:
        q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    q3 = g.add("Reshape", [q, fold], "q3")
    k3 = g.add("Reshape", [k, fold], "k3")
    kt3 = g.add("Transpose", [k3], "kt3", perm=[0, 2, 1])
    s = g.add("Mul", [g.add("MatMul", [q3, kt3], "qk3"), g.const("c", 0.5)], "s3")
    if term == "slopes":  # [B·N, 1, T]: one slope per (image, head) times the key position
        a4 = g.const("a4_shape", [1, N, 1, -1], np.int64)
        alibi = g.add("Reshape", [position_slopes(g), a4], "a4")
        tiled = g.add("Tile", [alibi, g.const("tile", [B, 1, 1, 1], np.int64)], "a_tiled")
        term_t = g.add("Reshape", [tiled, g.const("a3_shape", [-1, 1, S], np.int64)], "alibi3")
    elif term == "zeros":  # torch.baddbmm(torch.zeros(...), q, kᵀ, beta=1.0, alpha=c)
        zeros = g.add("ConstantOfShape", [g.add("Shape", [s], "s3_shape")], "zeros")
        term_t = g.add("Mul", [zeros, g.const("beta", 1.0)], "zeros_beta")
    else:  # [B·N, S, T] computed from the folded query heads (content-to-position)
        w = g.const("Wpos", g.rng.standard_normal((H, S)) * 0.5)
        term_t = g.add("MatMul", [q3, w], "c2p")
    s = g.add("Add", [s, term_t], "s3_biased")
    z = g.add("Reshape", [s, g.const("unfold", [-1, N, S, S], np.int64)], "z4")
    z = g.add("Add", [z, "mask_bias"], "z4_masked")
    p = g.add("Softmax", [z], "P", axis=-1)
    if not pv_folded:
        return g.finish(p, v)
    p3 = g.add("Reshape", [p, g.const("fold_p", [-1, S, S], np.int64)], "P3")
    return g.finish(p3, v, folded=True)


@pytest.mark.parametrize(
    "term, qkv, pv_folded",
    [
        ("slopes", "separate", True),
        ("query-position", "separate", True),
        ("slopes", "interleaved", True),
        ("zeros", "separate", False),
        ("slopes", "separate", False),
    ],
)
def test_batch_and_heads_folded_around_the_softmax_fuse(term, qkv, pv_folded):
    """Also with q, k and v interleaved per head in one projection: they reach the kernel per
    head ([B,S,N·H] for the query, [B,N,T,H] for key and value); and with the scores alone
    folded, P·V per head."""
    m = folded(term, qkv, pv_folded)
    out, report = run(m, target="cuda", inputs=feed(mask_bias=padding_bias()))
    assert report.parity.ran and report.parity.ok, report.parity
    assert attention_ops(out) == {"MultiHeadAttention": 1} and codes(report, RULE) == []
    assert "Softmax" not in op_histogram(out.graph.node)


def test_masked_fill_where_the_fill_comes_first_moves_into_the_bias():
    """masked_fill(mask == 0, min): Where(cond, fill, scores) becomes Where(cond, fill, 0)."""
    g = Graph(4)
    g.inputs.append(vi("pad", ["batch", 1, 1, "seq"], TensorProto.BOOL))
    q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    kt = g.add("Transpose", [k], "kt", perm=[0, 1, 3, 2])
    s = g.add("Div", [g.add("MatMul", [q, kt], "qk"), g.const("sqrt_h", np.sqrt(H))], "z0")
    fill = g.const("fill", np.finfo(np.float32).min)
    s = g.add("Where", ["pad", fill, s], "z1")
    pad = np.zeros((B, 1, 1, S), bool)
    pad[0, ..., -2:] = True
    out, report = run(g.finish(g.add("Softmax", [s], "P", axis=-1), v), inputs=feed(pad=pad))
    assert report.parity.ran and report.parity.ok, report.parity
    assert attention_ops(out) == {"MultiHeadAttention": 1} and codes(report, RULE) == []


# ----------------------------------------------------------------- cosine attention
def l2_normalized(g: Graph, t: str) -> str:
    """``t / max(‖t‖₂ over the head, eps)`` (F.normalize)."""
    norm = g.add("ReduceL2", [t], f"{t}_l2", axes=[-1], keepdims=1)
    norm = g.add("Clip", [norm, g.const("eps", 1e-12)], f"{t}_l2c")
    full = g.add("Expand", [norm, g.add("Shape", [t], f"{t}_shape")], f"{t}_l2e")
    return g.add("Div", [t, full], f"{t}_n")


@pytest.mark.parametrize("scale_side", ["scores", "query"])
def test_cosine_attention_with_a_per_head_scale_and_mixed_kv_layouts_fuses(scale_side):
    """Swin v2: normalized q and k (k is then per head [B,N,T,H], v still a plain split), a
    learned logit scale per head exp'd to [N,1,1]; the scale folds into the query."""
    g = Graph(5)
    q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    qn, kn = l2_normalized(g, q), l2_normalized(g, k)
    logit = g.const("logit", np.exp(np.array([2.0, 3.0])).reshape(N, 1, 1))
    if scale_side == "query":
        qn = g.add("Mul", [qn, logit], "qn_scaled")
    kt = g.add("Transpose", [kn], "kt", perm=[0, 1, 3, 2])
    s = g.add("MatMul", [qn, kt], "qk")
    if scale_side == "scores":
        s = g.add("Mul", [s, logit], "qk_scaled")
    s = g.add("Add", [s, g.const("rel_bias", g.rng.standard_normal((1, N, S, S)))], "z")
    out, report = run(
        g.finish(g.add("Softmax", [s], "P", axis=-1), v),
        target="cuda",
        inputs=feed(),
    )
    assert report.parity.ran and report.parity.ok, report.parity
    assert attention_ops(out) == {"MultiHeadAttention": 1} and codes(report, RULE) == []
    assert attrs_of(out, "MultiHeadAttention")["scale"] == 1.0


def test_a_scale_that_varies_within_a_head_is_missed():
    g = Graph(6)
    q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    kt = g.add("Transpose", [k], "kt", perm=[0, 1, 3, 2])
    per_key = g.const("per_key", np.linspace(0.5, 1.0, S).reshape(1, 1, 1, S))
    s = g.add("Mul", [g.add("MatMul", [q, kt], "qk"), per_key], "z")
    out, report = run(g.finish(g.add("Softmax", [s], "P", axis=-1), v), inputs=feed())
    assert codes(report, RULE) == ["scale-mismatch"]
    assert "Softmax" in op_histogram(out.graph.node) and report.parity.ok


def test_zeros_of_a_run_time_shape_times_beta_are_a_zero_term():
    """``baddbmm``'s zero input of the scores' run-time shape, times beta: no bias term; times
    a computed factor (perhaps inf), not provably zeros."""
    nodes = [
        mk("Shape", ["x"], ["shape"]),
        mk("ConstantOfShape", ["shape"], ["zeros"]),
        mk("Mul", ["zeros", "beta"], ["zb"]),
        mk("Mul", ["zeros", "x"], ["zx"]),
    ]
    outs = [vi("zb", None), vi("zx", None)]
    m = model(nodes, [vi("x", ["batch", S])], outs, [const("beta", 1.0)])
    t = gs.import_onnx(onnx.shape_inference.infer_shapes(m)).tensors()
    assert is_zero(t["zeros"]) and is_zero(t["zb"]) and not is_zero(t["zx"])


@pytest.mark.parametrize("op", ["Div", "Mul"])
def test_a_scale_after_the_causal_where_moves_inside_it(op):
    """GPT-J: ``Where(causal, Q·Kᵀ, finfo.min) / √H``: the scale goes onto both branches."""
    g = Graph(7)
    g.inputs.append(vi("causal", [1, 1, "seq", "seq"], TensorProto.BOOL))
    q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    kt = g.add("Transpose", [k], "kt", perm=[0, 1, 3, 2])
    s = g.add("MatMul", [q, kt], "qk")
    s = g.add("Where", ["causal", s, g.const("fill", np.finfo(np.float32).min)], "masked")
    c = np.sqrt(H) if op == "Div" else 1 / np.sqrt(H)
    s = g.add(op, [s, g.const("c", c)], "scaled")
    out, report = run(
        g.finish(g.add("Softmax", [s], "P", axis=-1), v),
        target="cuda",
        inputs=feed(causal=np.tril(np.ones((1, 1, S, S), bool))),
    )
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "scale-through-where", "passed") == ["fired"]
    assert attention_ops(out) == {"MultiHeadAttention": 1} and codes(report, RULE) == []


def test_per_head_scores_with_folded_probabilities_fuse():
    """DeBERTa-v2 (dynamo) once unfold-3d-scores made its scores per head: the probabilities
    still folded to [B·N,S,T] for a folded V."""
    g = Graph(8, static=True)
    g.inputs.append(vi("mask_bias", [B, 1, 1, S]))
    q, k, v = g.heads("q"), g.heads("k"), g.heads("v")
    kt = g.add("Transpose", [k], "kt", perm=[0, 1, 3, 2])
    s = g.add("Mul", [g.add("MatMul", [q, kt], "qk"), g.const("c", 0.5)], "s")
    s = g.add("Add", [s, "mask_bias"], "z")
    p = g.add("Softmax", [s], "P", axis=-1)
    p3 = g.add("Reshape", [p, g.const("fold_p", [-1, S, S], np.int64)], "P3")
    out, report = run(
        g.finish(p3, v, folded=True), target="cuda", inputs=feed(mask_bias=padding_bias())
    )
    assert report.parity.ran and report.parity.ok, report.parity
    assert attention_ops(out) == {"MultiHeadAttention": 1} and codes(report, RULE) == []

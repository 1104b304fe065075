"""No attention is missed in silence: spellings the rule does not fuse still get a
``fuse-attention`` missed remark (the census), a Softmax over a product with a weight (a
classifier, a router) gets none, and XGLM's clamped bmm attention fuses.  Parity holds on
each."""

import numpy as np
from onnx import helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

B, N, S, H = 2, 4, 8, 16
D = N * H


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, name=f"{op.lower()}_{outs[0]}", **attrs)


def _heads(rng) -> tuple[list, list]:
    """q_h, v_h [B,N,S,H] and k_t [B,N,H,S] from projections of ``x``."""
    nodes, inits = [], [const("split", [0, 0, N, H], np.int64)]
    for r, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [
            mk("MatMul", ["x", f"W{r}"], [f"{r}_p"]),
            mk("Reshape", [f"{r}_p", "split"], [f"{r}_4"]),
            mk("Transpose", [f"{r}_4"], [f"{r}_h" if r != "k" else "k_t"], perm=perm),
        ]
        inits.append(const(f"W{r}", rng.standard_normal((D, D)) * 0.2))
    return nodes, inits


def _folded_scores() -> list:
    """q, k and v heads folded to [B·N,·,H] by ``fold``, and the folded scores ``s3``."""
    return [
        mk("Reshape", ["q_h", "fold"], ["q3"]),
        mk("Transpose", ["k_t"], ["k_h"], perm=[0, 1, 3, 2]),
        mk("Reshape", ["k_h", "fold"], ["k3"]),
        mk("Transpose", ["k3"], ["k3_t"], perm=[0, 2, 1]),
        mk("Reshape", ["v_h", "fold"], ["v3"]),
        mk("MatMul", ["q3", "k3_t"], ["s3"]),
    ]


def _merged(p: str) -> list:
    return [
        mk("MatMul", [p, "v_h"], ["o"]),
        mk("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["o_t", "merge"], ["y"]),
    ]


def sinks(rng, merged: bool = True):
    """GPT-OSS: a learned sink logit per head joins each row of scores before the Softmax
    (the row maximum taken out first), and its column is sliced off the probabilities; the
    heads merged after P·V, or (``merged`` False) P·V [B,N,S,H] the output."""
    nodes, inits = _heads(rng)
    nodes += [
        mk("MatMul", ["q_h", "k_t"], ["qk"]),
        mk("Mul", ["qk", "scale"], ["s"]),
        mk("Shape", ["s"], ["s_shape"], end=3),
        mk("Concat", ["s_shape", "one"], ["sink_shape"], axis=0),
        mk("Expand", ["sink", "sink_shape"], ["sinks"]),
        mk("Concat", ["s", "sinks"], ["with_sink"], axis=-1),
        mk("ReduceMax", ["with_sink"], ["row_max"], axes=[-1], keepdims=1),
        mk("Sub", ["with_sink", "row_max"], ["stable"]),
        mk("Softmax", ["stable"], ["p_all"], axis=-1),
        mk("Slice", ["p_all", "zero", "minus_one", "last"], ["p"]),
        *(_merged("p") if merged else [mk("MatMul", ["p", "v_h"], ["y"])]),
    ]
    inits += [
        const("scale", np.float32(H**-0.5)),
        const("sink", rng.standard_normal((1, N, 1, 1))),
        const("one", [1], np.int64),
        const("last", [-1], np.int64),
        const("zero", [0], np.int64),
        const("minus_one", [-1], np.int64),
        const("merge", [0, 0, D], np.int64),
    ]
    return model(nodes, [vi("x", [B, S, D])], [vi("y", None)], inits)


def clamped(rng):
    """XGLM: scores folded to [B·N,S,T] around a mask Add and a clamp at the lowest float
    (``torch.max(s, finfo.min)``), the probabilities unfolded and folded again for P·V with
    the target that folded the scores."""
    nodes, inits = _heads(rng)
    nodes += [
        *_folded_scores(),
        mk("Reshape", ["s3", "unfold"], ["s4"]),
        mk("Add", ["s4", "mask"], ["masked"]),
        mk("Max", ["masked", "lowest"], ["clamped"]),
        mk("Shape", ["s3"], ["fold_scores"]),  # computed: the round trip is read by identity
        mk("Reshape", ["clamped", "fold_scores"], ["z3"]),
        mk("Softmax", ["z3"], ["p3"], axis=-1),
        mk("Reshape", ["p3", "unfold"], ["p4"]),
        mk("Reshape", ["p4", "fold_scores"], ["p3b"]),
        mk("MatMul", ["p3b", "v3"], ["o3"]),
        mk("Reshape", ["o3", "ctx4"], ["o4"]),
        mk("Transpose", ["o4"], ["o_t"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["o_t", "merge"], ["y"]),
    ]
    causal = np.triu(np.full((S, S), np.finfo(np.float32).min), 1)[None, None]
    inits += [
        const("fold", [-1, S, H], np.int64),
        const("unfold", [-1, N, S, S], np.int64),
        const("ctx4", [-1, N, S, H], np.int64),
        const("merge", [0, 0, D], np.int64),
        const("mask", causal),
        const("lowest", np.float32(np.finfo(np.float32).min)),
    ]
    return model(nodes, [vi("x", ["batch", S, D])], [vi("y", None)], inits)


def clip_bmm(rng):
    """CLIP-era bmm attention as GroupViT still spells it: q, k, v folded to [B·N,S,H] with
    targets computed from the input's shape, the probabilities unfolded to [B,N,S,T] for the
    attention weights and folded back with a second computed target before P·V."""
    nodes, inits = _heads(rng)
    nodes += [
        mk("Shape", ["x"], ["x_shape"]),
        mk("Gather", ["x_shape", "i0"], ["b"], axis=0),
        mk("Gather", ["x_shape", "i1"], ["t"], axis=0),
        mk("Mul", ["b", "heads"], ["bn"]),
        mk("Concat", ["bn", "minus_one", "head"], ["fold"], axis=0),
        *_folded_scores(),
        mk("Softmax", ["s3"], ["p3"], axis=-1),
        mk("Shape", ["k3"], ["k3_shape"]),
        mk("Gather", ["k3_shape", "i1"], ["src"], axis=0),
        mk("Concat", ["b", "heads", "t", "src"], ["unfold"], axis=0),
        mk("Reshape", ["p3", "unfold"], ["p4"]),
        mk("Concat", ["bn", "t", "src"], ["refold"], axis=0),
        mk("Reshape", ["p4", "refold"], ["p3b"]),
        mk("MatMul", ["p3b", "v3"], ["o3"]),
        mk("Concat", ["b", "heads", "t", "head"], ["ctx4"], axis=0),
        mk("Reshape", ["o3", "ctx4"], ["o4"]),
        mk("Transpose", ["o4"], ["o_t"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["o_t", "merge"], ["y"]),
    ]
    inits += [
        const("i0", [0], np.int64),
        const("i1", [1], np.int64),
        const("heads", [N], np.int64),
        const("head", [H], np.int64),
        const("minus_one", [-1], np.int64),
        const("merge", [0, 0, D], np.int64),
    ]
    return model(nodes, [vi("x", ["batch", "seq", D])], [vi("y", None)], inits)


def classifier(rng):
    """Softmax over logits of a weight, then a product with another weight: not attention."""
    nodes = [
        mk("MatMul", ["x", "W"], ["logits"]),
        mk("Softmax", ["logits"], ["p"], axis=-1),
        mk("MatMul", ["p", "E"], ["y"]),
    ]
    inits = [const("W", rng.standard_normal((D, 8))), const("E", rng.standard_normal((8, D)))]
    return model(nodes, [vi("x", [B, S, D])], [vi("y", None)], inits)


def test_an_attention_with_sinks_fuses(rng):
    out, report = run(sinks(rng), target="cuda")
    assert report.parity.ran and report.parity.ok, report.parity
    h = op_histogram(out.graph.node)
    assert h.get("com.microsoft.MultiHeadAttention") == 1 and "Softmax" not in h, h
    assert codes(report, "fuse-attention") == []


def test_an_attention_with_sinks_and_no_head_merge_is_missed_with_a_remark(rng):
    out, report = run(sinks(rng, merged=False), target="cuda")
    assert report.parity.ran and report.parity.ok, report.parity
    assert op_histogram(out.graph.node).get("Softmax") == 1
    assert codes(report, "fuse-attention") == ["unrecognized-layout"]
    [miss] = [r for r in report.remarks if r.rule == "fuse-attention" and r.kind == "missed"]
    assert "sink column" in miss.message and miss.args["softmax"]


def test_a_clamped_folded_attention_fuses(rng):
    """The clamp at the lowest float changes no finite score; the probabilities' unfold and
    fold back with the scores' own computed target is no Reshape at all."""
    out, report = run(clamped(rng), target="cuda")
    assert report.parity.ran and report.parity.ok, report.parity
    ops = op_histogram(out.graph.node)
    assert ops.get("com.microsoft.MultiHeadAttention") == 1 and "Max" not in ops, ops
    assert codes(report, "fuse-attention") == []
    assert report.rules["reshape-round-trip"]["fired"] == 1


def test_probabilities_unfolded_and_folded_back_by_computed_targets_fuse(rng):
    """The fold back's target is the folded probabilities' own shape, proven from the
    input's dims (B·N of a [B,N,S,H] split is N times its B): the round trip is no Reshape."""
    x = {"x": rng.standard_normal((B, S, D)).astype(np.float32)}
    out, report = run(clip_bmm(rng), target="cuda", inputs=x)
    assert report.parity.ran and report.parity.ok, report.parity
    ops = op_histogram(out.graph.node)
    assert ops.get("com.microsoft.MultiHeadAttention") == 1 and "Softmax" not in ops, ops
    assert codes(report, "fuse-attention") == []
    assert report.rules["reshape-round-trip"]["fired"] == 1


def test_a_softmax_over_a_weight_product_is_not_an_attention(rng):
    out, report = run(classifier(rng), target="cuda")
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "fuse-attention") == []


def test_an_attention_whose_fusion_was_withheld_gets_no_census_remark(rng):
    """A fusion the bisect limit (or a safety net's skip) withheld is not a spelling the rule
    missed: the net's own remark says why, so the census says nothing."""
    from test_rules_attention_bias_heads import learned_table

    m = learned_table(rng)
    _, fused = run(m, target="cuda")
    assert codes(fused, "fuse-attention", "passed")
    out, report = run(m, target="cuda", bisect_limit=0)
    assert "Softmax" in op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []

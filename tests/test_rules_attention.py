"""Scaled-dot-product attention → com.microsoft.MultiHeadAttention: BERT and GPT-2 spellings,
every guard's code, and the real example model."""

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import EXAMPLES, assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

N, H = 2, 4
D = N * H
RULE = "fuse-attention"


def hist(m):
    return op_histogram(m.graph.node)


def attr(m, op, name, default=None):
    node = next(n for n in m.graph.node if n.op_type == op)
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def attention(
    *,
    scale="div",
    k_form="direct",
    mask="padding",
    heads=(0, 0, N, H),
    packed=False,
    nan_guard=False,
    out_target=(0, 0, D),
    dtype=np.float32,
    softmax_out=False,
    mid_reshape=False,
    softmax_axis=-1,
    layout="bsd",
):
    """One self-attention block as the PyTorch exporters write it (see rules/attention/).

    ``layout="sbd"`` is torch.nn.MultiheadAttention's sequence-first spelling (x is [S,B,D]);
    ``layout="packed"`` timm/Swin's one projection reshaped to [B,S,3,N,H] and unbound;
    ``k_form="dynamo"`` the 3-D Kᵀ of the dynamo exporter."""
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    rng = np.random.default_rng(0)
    dims = ["seq", "batch"] if layout == "sbd" else ["batch", "seq"]
    inputs = [vi("x", [*dims, D], elem)]
    inits = [
        const("heads", heads, np.int64),
        const("merge", out_target, np.int64),
        const("Wo", rng.standard_normal((D, D)) * 0.3, dtype),
    ]
    nodes = []
    if packed:  # GPT-2: one QKV projection, then Split
        inits += [
            const("Wqkv", rng.standard_normal((D, 3 * D)) * 0.3, dtype),
            const("bqkv", rng.standard_normal(3 * D), dtype),
            const("split", [D, D, D], np.int64),
        ]
        nodes += [
            helper.make_node("MatMul", ["x", "Wqkv"], ["qkv0"]),
            helper.make_node("Add", ["qkv0", "bqkv"], ["qkv"]),
            helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2),
        ]
    else:  # BERT: three projections with bias
        for n in "qkv":
            inits += [
                const(f"W{n}", rng.standard_normal((D, D)) * 0.3, dtype),
                const(f"b{n}", rng.standard_normal(D), dtype),
            ]
            nodes += [
                helper.make_node("MatMul", ["x", f"W{n}"], [f"{n}0"]),
                helper.make_node("Add", [f"b{n}", f"{n}0"], [n]),
            ]
    if layout == "packed":  # Reshape [B,S,3,N,H] → Transpose(2,0,3,1,4) → Gather 0/1/2
        inits += [
            const("Wpk", rng.standard_normal((D, 3 * D)) * 0.3, dtype),
            const("bpk", rng.standard_normal(3 * D), dtype),
            const("five", [0, 0, 3, N, -1], np.int64),
            const("i0", 0, np.int64),
            const("i1", 1, np.int64),
            const("i2", 2, np.int64),
        ]
        nodes += [
            helper.make_node("MatMul", ["x", "Wpk"], ["pk0"]),
            helper.make_node("Add", ["pk0", "bpk"], ["pk"]),
            helper.make_node("Reshape", ["pk", "five"], ["pk5"]),
            helper.make_node("Transpose", ["pk5"], ["pkT"], perm=[2, 0, 3, 1, 4]),
            helper.make_node("Gather", ["pkT", "i0"], ["Q"], axis=0),
            helper.make_node("Gather", ["pkT", "i1"], ["K4"], axis=0),
            helper.make_node("Gather", ["pkT", "i2"], ["V"], axis=0),
            helper.make_node("Transpose", ["K4"], ["KT"], perm=[0, 1, 3, 2]),
        ]
    elif layout == "sbd":  # Reshape [S,-1,H] → Transpose(1,0,2) → Reshape [-1,N,S,H]
        inits += [const("m1", [-1], np.int64), const("nh", [N], np.int64)]
        inits.append(const("hsz", [H], np.int64))
        nodes += [
            helper.make_node("Shape", ["x"], ["slen"], start=0, end=1),
            helper.make_node("Concat", ["slen", "m1", "hsz"], ["fold"], axis=0),
            helper.make_node("Concat", ["m1", "nh", "slen", "hsz"], ["unfold"], axis=0),
        ]
        for n, out in (("q", "Q"), ("k", "K4"), ("v", "V")):
            nodes += [
                helper.make_node("Reshape", [n, "fold"], [f"{n}3"]),
                helper.make_node("Transpose", [f"{n}3"], [f"{n}3t"], perm=[1, 0, 2]),
                helper.make_node("Reshape", [f"{n}3t", "unfold"], [out]),
            ]
        nodes.append(helper.make_node("Transpose", ["K4"], ["KT"], perm=[0, 1, 3, 2]))
    else:
        for n in "qkv":
            nodes.append(helper.make_node("Reshape", [n, "heads"], [f"{n}4"]))
        nodes.append(helper.make_node("Transpose", ["q4"], ["Q"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Transpose", ["v4"], ["V"], perm=[0, 2, 1, 3]))
    if layout in ("sbd", "packed"):
        pass
    elif k_form == "dynamo":  # [B,N,S,H] → [-1,S,H] → (0,2,1) → [B,N,H,S], targets from Shape
        inits += [
            const("km1", [-1], np.int64),
            const("k_2", [-2], np.int64),
            const("kmin", [np.iinfo(np.int64).min], np.int64),
            const("kh", [H], np.int64),
        ]
        nodes += [
            helper.make_node("Transpose", ["k4"], ["K"], perm=[0, 2, 1, 3]),
            helper.make_node("Shape", ["K"], ["ks"], start=0),
            helper.make_node("Slice", ["ks", "k_2", "km1"], ["kslen"]),
            helper.make_node("Slice", ["ks", "kmin", "k_2"], ["kbn"]),
            helper.make_node("Concat", ["km1", "kslen", "kh"], ["k3"], axis=0),
            helper.make_node("Concat", ["kbn", "kh", "kslen"], ["k4t"], axis=0),
            helper.make_node("Reshape", ["K", "k3"], ["K3"], allowzero=1),
            helper.make_node("Transpose", ["K3"], ["K3T"], perm=[0, 2, 1]),
            helper.make_node("Reshape", ["K3T", "k4t"], ["KT"], allowzero=1),
        ]
    elif k_form == "direct":
        nodes.append(helper.make_node("Transpose", ["k4"], ["KT"], perm=[0, 2, 3, 1]))
    else:
        nodes += [
            helper.make_node("Transpose", ["k4"], ["K"], perm=[0, 2, 1, 3]),
            helper.make_node("Transpose", ["K"], ["KT"], perm=[0, 1, 3, 2]),
        ]
    q, kt = "Q", "KT"
    if scale == "split":  # SDPA exports: √scale on each side
        inits.append(const("sq", H**-0.25, dtype))
        nodes += [
            helper.make_node("Mul", ["Q", "sq"], ["Qs"]),
            helper.make_node("Mul", ["sq", "KT"], ["KTs"]),
        ]
        q, kt = "Qs", "KTs"
    nodes.append(helper.make_node("MatMul", [q, kt], ["qk"]))
    s = "qk"
    if scale == "div":
        inits.append(const("c", math.sqrt(H), dtype))
        nodes.append(helper.make_node("Div", ["qk", "c"], ["sc"]))
        s = "sc"
    elif scale in ("mul", "custom", "per-head", "zero"):
        value = {
            "mul": 1 / math.sqrt(H),
            "custom": 0.2,
            "per-head": np.array([0.5, 0.25]).reshape(1, N, 1, 1),
            "zero": 0.0,
        }[scale]
        inits.append(const("c", value, dtype))
        nodes.append(helper.make_node("Mul", ["c", "qk"], ["sc"]))
        s = "sc"
    elif scale == "input":
        inputs.append(vi("c_in", [], elem))
        nodes.append(helper.make_node("Div", ["qk", "c_in"], ["sc"]))
        s = "sc"
    if mask == "padding":  # transformers 4.x: (1 - mask)·min as [B,1,1,T]
        inputs.append(vi("mask_bias", ["batch", 1, 1, "seq"], elem))
        nodes.append(helper.make_node("Add", [s, "mask_bias"], ["z"]))
    elif mask == "full":
        inputs.append(vi("mask_bias", ["batch", 1, "seq", "seq"], elem))
        nodes.append(helper.make_node("Add", ["mask_bias", s], ["z"]))
    elif mask == "sdpa":  # transformers ≥ 4.48: Where(bool mask, 0, -inf)
        inputs.append(vi("attention_mask", ["batch", "seq"], TensorProto.BOOL))
        inits += [
            const("axes12", [1, 2], np.int64),
            const("zero", [0.0], dtype),
            const("ninf", [-np.inf], dtype),
        ]
        nodes += [
            helper.make_node("Unsqueeze", ["attention_mask", "axes12"], ["m4"]),
            helper.make_node("Where", ["m4", "zero", "ninf"], ["mb"]),
            helper.make_node("Add", [s, "mb"], ["z"]),
        ]
    elif mask == "all-true":  # dynamo ViT: Where(Expand(all-true, [B,1,1,1]), 0, min)
        inits += [
            const("all_true", np.ones((1, 1, 1, 1)), bool),
            const("ones3", [1, 1, 1], np.int64),
            const("zero", [0.0], dtype),
            const("lowest", [np.finfo(np.float32).min], dtype),
        ]
        nodes += [
            helper.make_node("Shape", ["x"], ["bdim"], start=0, end=1),
            helper.make_node("Concat", ["bdim", "ones3"], ["mshape"], axis=0),
            helper.make_node("Expand", ["all_true", "mshape"], ["keep"]),
            helper.make_node("Where", ["keep", "zero", "lowest"], ["mb"]),
            helper.make_node("Add", [s, "mb"], ["z"]),
        ]
    elif mask in ("xsoftmax", "xsoftmax-keys"):  # DeBERTa's XSoftmax, SEW-D
        # rmask = ~(mask[:,None,None,:] & mask[:,None,:,None]): padded queries mask every key
        inputs.append(vi("attention_mask", ["batch", "seq"], TensorProto.INT64))
        inits += [
            const("axes12", [1, 2], np.int64),
            const("axes13", [1, 3], np.int64),
            const("lowest", [np.finfo(np.float32).min], dtype),
        ]
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["keep", "axes12"], ["keys4"]),
            helper.make_node("Unsqueeze", ["keep", "axes13"], ["queries4"]),
            helper.make_node("And", ["keys4", "queries4"], ["pairs"]),
            helper.make_node("Not", ["pairs"], ["rmask"]),
            helper.make_node("Not", ["keys4"], ["kmask"]),
            helper.make_node("Where", ["rmask", "lowest", s], ["z"]),
        ]
    elif mask in ("causal", "causal-1e4", "causal-half", "causal-mild"):  # GPT-2 (4.x)
        fill = {  # tril buffer slice; -half: float16's lowest, a float16 export's finfo.min
            "causal": np.finfo(np.float32).min,
            "causal-1e4": -1e4,
            "causal-half": np.finfo(np.float16).min,
        }.get(mask, -100.0)
        inputs.append(vi("mask_bias", ["batch", 1, 1, "seq"], elem))
        inits += [
            const("buffer", np.tril(np.ones((1, 1, 32, 32))), bool),
            const("starts", [0, 0], np.int64),
            const("axes23", [2, 3], np.int64),
            const("fill", fill, dtype),
        ]
        nodes += [
            helper.make_node("Shape", ["x"], ["slen"], start=1, end=2),
            helper.make_node("Concat", ["slen", "slen"], ["ends"], axis=0),
            helper.make_node("Slice", ["buffer", "starts", "ends", "axes23"], ["causal"]),
            helper.make_node("Where", ["causal", s, "fill"], ["zc"]),
            helper.make_node("Add", ["zc", "mask_bias"], ["z"]),
        ]
    elif mask in ("window", "window-per-image"):  # Swin shifted windows: regroup by window
        n_win, seq = 2, 5
        per_image = mask == "window-per-image"
        inits += [
            const("relpos", rng.standard_normal((1, N, seq, seq)), dtype),
            const("win5", [-1, n_win, N, seq, seq], np.int64),
            const("win4", [-1, N, seq, seq], np.int64),
        ]
        if per_image:  # a mask that differs per image cannot be tiled
            inputs.append(vi("wmask", ["images", n_win, 1, seq, seq], elem))
        else:
            wm = np.where(rng.random((1, n_win, 1, seq, seq)) < 0.3, -100.0, 0.0)
            inits.append(const("wmask", wm, dtype))
        nodes += [
            helper.make_node("Add", [s, "relpos"], ["zr"]),
            helper.make_node("Reshape", ["zr", "win5"], ["z5"]),
            helper.make_node("Add", ["z5", "wmask"], ["z5m"]),
            helper.make_node("Reshape", ["z5m", "win4"], ["z"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", [s], ["z"]))
    nodes.append(helper.make_node("Softmax", ["z"], ["P"], axis=softmax_axis))
    p = "P"
    if mask in ("xsoftmax", "xsoftmax-keys"):  # masked_fill(rmask, 0): wholly masked rows → 0
        inits.append(const("pzero", [0.0], dtype))
        cond = "rmask" if mask == "xsoftmax" else "kmask"  # -keys: zeroes by another mask
        nodes.append(helper.make_node("Where", [cond, "pzero", "P"], ["P2"]))
        p = "P2"
    if nan_guard:
        inits.append(const("pzero", [0.0], dtype))
        nodes += [
            helper.make_node("IsNaN", ["P"], ["nan"]),
            helper.make_node("Where", ["nan", "pzero", "P"], ["P2"]),
        ]
        p = "P2"
    nodes.append(helper.make_node("MatMul", [p, "V"], ["ctx"]))
    ctx = "ctx"
    if mid_reshape:  # BERT (transformers 5): reshape to [B, -1, S, H] built from shapes
        inits += [
            const("i0", 0, np.int64),
            const("i2", 2, np.int64),
            const("ax0", [0], np.int64),
            const("m1", [-1], np.int64),
            const("hsz", [H], np.int64),
        ]
        nodes += [
            helper.make_node("Shape", ["ctx"], ["cs"]),
            helper.make_node("Gather", ["cs", "i0"], ["cb"], axis=0),
            helper.make_node("Unsqueeze", ["cb", "ax0"], ["cb1"]),
            helper.make_node("Shape", ["Q"], ["qs"]),
            helper.make_node("Gather", ["qs", "i2"], ["qsl"], axis=0),
            helper.make_node("Unsqueeze", ["qsl", "ax0"], ["qsl1"]),
            helper.make_node("Concat", ["cb1", "m1", "qsl1", "hsz"], ["mid"], axis=0),
            helper.make_node("Reshape", ["ctx", "mid"], ["ctx2"]),
        ]
        ctx = "ctx2"
    out_perm = [2, 0, 1, 3] if layout == "sbd" else [0, 2, 1, 3]
    nodes += [
        helper.make_node("Transpose", [ctx], ["ctxT"], perm=out_perm),
        helper.make_node("Reshape", ["ctxT", "merge"], ["attn"]),
        helper.make_node("MatMul", ["attn", "Wo"], ["y"]),
    ]
    for i, nd in enumerate(nodes):
        nd.name = f"n{i}_{nd.op_type}"
    outputs = [vi("y", None, elem)] + ([vi("P", None, elem)] if softmax_out else [])
    return model(nodes, inputs, outputs, inits)


def mha_node(m):
    return next(n for n in m.graph.node if n.op_type == "MultiHeadAttention")


# ----------------------------------------------------------------------- positives
@pytest.mark.parametrize("scale", ["div", "mul", "split"])
@pytest.mark.parametrize("k_form", ["direct", "two-transposes"])
def test_bert_attention_fuses(scale, k_form):
    out, report = assert_optimized(attention(scale=scale, k_form=k_form))
    # q/k/v projections stay; biases go into MHA; the [B,1,1,T] mask is expanded to [1,1,S,T]
    assert hist(out) == {
        "MatMul": 4,
        "com.microsoft.MultiHeadAttention": 1,
        "Shape": 2,
        "Concat": 1,
        "Expand": 1,
    }
    node = mha_node(out)
    assert attr(out, "MultiHeadAttention", "num_heads") == N
    assert attr(out, "MultiHeadAttention", "scale") is None  # 1/√H is the default
    assert len(node.input) == 6 and node.input[3] and not node.input[4]
    assert codes(report, RULE, "passed") == ["fired"]


def test_mask_of_zeros_is_dropped():
    """A mask that provably masks nothing (dynamo's ViT) is no attention_bias at all."""
    out, report = assert_optimized(attention(mask="all-true"))
    node = mha_node(out)
    assert len(node.input) < 6 or node.input[5] == ""
    assert not {"Where", "Expand"} & set(hist(out))


def test_full_mask_is_used_directly():
    """A [B,1,S,T] mask whose S and T are the inputs' named dims needs no Expand."""
    out, _ = assert_optimized(attention(mask="full"))
    assert hist(out) == {"MatMul": 4, "com.microsoft.MultiHeadAttention": 1}
    assert mha_node(out).input[5] == "mask_bias"


def test_no_mask_and_minus_one_heads():
    out, _ = assert_optimized(attention(mask=None, heads=(0, 0, -1, H), out_target=(0, 0, -1)))
    assert hist(out) == {"MatMul": 4, "com.microsoft.MultiHeadAttention": 1}
    assert len(mha_node(out).input) == 4


def test_custom_scale_becomes_attribute():
    out, _ = assert_optimized(attention(scale="custom"))
    assert attr(out, "MultiHeadAttention", "scale") == pytest.approx(0.2)


def test_sdpa_mask_with_nan_guard_and_shape_glue_reshape():
    """transformers ≥ 4.48 (what examples/bert_tiny.onnx contains): -inf Where mask, the
    IsNaN guard after Softmax, and a Reshape to itself between the MatMuls."""
    m = attention(mask="sdpa", nan_guard=True, mid_reshape=True, scale="split")
    out, report = assert_optimized(m)
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 1 and "Softmax" not in h
    assert h["IsNaN"] == 1 and "Transpose" not in h and "Reshape" not in h
    # a fully masked sequence: the original zeroes those rows (NaN guard); so does the rewrite
    rng = np.random.default_rng(1)
    mask = rng.integers(0, 2, (2, 5)).astype(bool)
    mask[1] = False
    x = rng.standard_normal((2, 5, D)).astype(np.float32)
    out2, report2 = run(m, inputs={"x": x, "attention_mask": mask})
    assert report2.parity.ok, report2.parity


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_xsoftmax_zeroing_wholly_masked_rows_fuses_and_keeps_them_zero(target):
    """DeBERTa (transformers < 4.46) and SEW-D: the Softmax of the Where-masked scores, then
    the probabilities zeroed where the same [B,1,S,T] mask holds; a padded query's row is 0,
    not the mean of V, and the fused output keeps it so."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((2, 5, D)).astype(np.float32)
    mask = np.ones((2, 5), np.int64)
    mask[1, 3:] = 0  # two padded queries: their rows are masked wholly
    out, report = run(
        attention(mask="xsoftmax"), target=target, inputs={"x": x, "attention_mask": mask}
    )
    assert report.parity.ran and report.parity.ok, report.parity
    h = hist(out)
    assert h.get("com.microsoft.MultiHeadAttention") == 1 and "Softmax" not in h, h
    assert codes(report, RULE) == []
    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": x, "attention_mask": mask})[0]
    assert np.all(y[1, 3:] == 0) and np.all(np.abs(y[1, :3]).sum(-1) > 0)  # Wo has no bias


def test_probabilities_zeroed_by_another_mask_are_missed_with_the_reason():
    """A guard whose condition is not the mask's (here: the keys' padding only) would change
    rows the mask does not mask wholly: no fusion, and the remark names the condition."""
    rng = np.random.default_rng(22)
    x = rng.standard_normal((2, 5, D)).astype(np.float32)
    mask = np.ones((2, 5), np.int64)
    mask[0, 4:] = 0
    out, report = run(
        attention(mask="xsoftmax-keys"), target="cuda", inputs={"x": x, "attention_mask": mask}
    )
    assert report.parity.ok and "Softmax" in hist(out)
    missed = [r for r in report.remarks if r.rule == RULE and r.kind == "missed"]
    assert [r.code for r in missed] == ["unrecognized-layout"]
    assert "kmask" in missed[0].message and "zeroed" in missed[0].message


def test_gpt2_packed_qkv_and_causal_mask():
    """GPT-2 (transformers 4.x): packed QKV + Split, Where(tril slice, s, finfo.min) + mask."""
    out, report = assert_optimized(attention(packed=True, mask="causal"))
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 1 and h["Split"] == 1
    assert "Softmax" not in h and "Transpose" not in h
    node = mha_node(out)
    assert list(node.input[:3]) == ["q", "k", "v"]


def test_dynamo_three_d_k_transpose_fuses():
    """torch.onnx dynamo (SDPA decomposed): Kᵀ through a [-1,S,H] reshape, targets from Shape."""
    out, report = assert_optimized(attention(k_form="dynamo", scale="split", mask=None))
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 1
    assert "Softmax" not in h and "Transpose" not in h and "Reshape" not in h


@pytest.mark.parametrize("mask", [None, "padding"])
def test_sequence_first_attention_fuses(mask):
    """torch.nn.MultiheadAttention (torchvision ViT): x is [S,B,D], heads folded into the batch."""
    m = attention(layout="sbd", scale="split", mask=mask)
    rng = np.random.default_rng(2)
    feed = {"x": rng.standard_normal((5, 3, D)).astype(np.float32)}  # S=5, B=3: no symmetry
    if mask:
        feed["mask_bias"] = rng.standard_normal((3, 1, 1, 5)).astype(np.float32)
    out, report = assert_optimized(m, inputs=feed)
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 1 and "Softmax" not in h
    assert h["Transpose"] == 4  # q, k, v to batch-first, the result back to sequence-first


@pytest.mark.parametrize("scale", ["div", "split"])
def test_packed_qkv_unbind_fuses(scale):
    """timm ViT / Swin: one projection → [B,S,3,N,H] → permute → unbind; its bias moves in."""
    rng = np.random.default_rng(3)
    feed = {"x": rng.standard_normal((2, 5, D)).astype(np.float32)}
    feed["mask_bias"] = rng.standard_normal((2, 1, 1, 5)).astype(np.float32)
    out, report = assert_optimized(attention(layout="packed", scale=scale), inputs=feed)
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 1 and h["Split"] == 1
    assert "Softmax" not in h and "Gather" not in h and "Transpose" not in h
    assert mha_node(out).input[3]  # the packed bias


def test_shifted_window_mask_is_tiled_over_the_images():
    """Swin's shifted blocks add a per-window mask through a 5-D regrouping of the scores."""
    rng = np.random.default_rng(4)
    feed = {"x": rng.standard_normal((6, 5, D)).astype(np.float32)}  # 3 images × 2 windows
    out, report = assert_optimized(attention(layout="packed", mask="window"), inputs=feed)
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 1 and "Softmax" not in h
    assert h["Expand"] == 1  # the [1, nW, N, S, T] bias repeated over the images
    assert len(mha_node(out).input) == 6 and mha_node(out).input[5]


def test_window_mask_that_varies_per_image_is_missed():
    rng = np.random.default_rng(5)
    feed = {
        "x": rng.standard_normal((4, 5, D)).astype(np.float32),
        "wmask": rng.standard_normal((2, 2, 1, 5, 5)).astype(np.float32),
    }
    out, report = run(attention(layout="packed", mask="window-per-image"), inputs=feed)
    assert codes(report, RULE) == ["mask-shape"]
    assert "Softmax" in hist(out) and report.parity.ok


def test_unknown_head_split_is_missed_with_its_reason():
    """Softmax between two MatMuls is attention: an unknown spelling is a remark, not silence."""
    m = attention(layout="sbd", mask=None)
    for node in m.graph.node:  # a merge that puts the head size before the heads
        if node.op_type == "Transpose" and list(node.attribute[0].ints) == [2, 0, 1, 3]:
            node.attribute[0].ints[:] = [2, 0, 3, 1]
    x = np.random.default_rng(0).standard_normal((4, 1, D)).astype(np.float32)
    out, report = run(m, inputs={"x": x})
    assert "unrecognized-layout" in codes(report, RULE)
    assert "Softmax" in hist(out) and report.parity.ok


# ------------------------------------------------------------------------- guards
def test_mild_where_mask_is_missed():
    """A fill of −100 leaves a masked key a weight beside visible ones: no bias stands for it."""
    out, report = run(attention(packed=True, mask="causal-mild"))
    assert codes(report, RULE) == ["mask-shape"]
    assert "Softmax" in hist(out) and report.parity.ok


def test_a_fill_that_drowns_the_score_fuses_with_a_note():
    """GPT-2's older ``masked_bias`` of −1e4: a masked key weighs nothing beside a visible one,
    so the fill becomes the bias; the analysis remark says which rows are not the model's."""
    out, report = run(attention(packed=True, mask="causal-1e4"))
    assert codes(report, RULE) == [] and "Softmax" not in hist(out) and report.parity.ok
    (note,) = [r for r in report.remarks if r.code == "mask-fill-not-absorbing"]
    assert note.kind == "analysis" and note.args["fill"] == -1e4


def test_per_head_scale_folds_into_the_query():
    """One factor per head [1,N,1,1] (cosine attention's logit scale) multiplies each head's
    query; the kernel's scale is then 1."""
    out, report = run(attention(scale="per-head"))
    assert codes(report, RULE) == [] and "Softmax" not in hist(out)
    mha = [n for n in out.graph.node if n.op_type == "MultiHeadAttention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in mha[0].attribute} if mha else {}
    assert len(mha) == 1 and attrs["scale"] == 1.0
    assert report.parity.ok


def test_zero_scale_is_missed():
    out, report = run(attention(scale="zero"))
    assert codes(report, RULE) == ["scale-mismatch"]
    assert report.parity.ok


def test_runtime_scale_is_missed():
    out, report = run(attention(scale="input"))
    assert codes(report, RULE) == ["non-constant-param"]


def test_runtime_heads_are_missed():
    m = attention()
    # make the head-splitting target a graph input
    m.graph.initializer.remove(next(t for t in m.graph.initializer if t.name == "heads"))
    m.graph.input.append(vi("heads", [4], TensorProto.INT64))
    x = np.random.default_rng(0).standard_normal((1, 3, D)).astype(np.float32)
    feed = {
        "x": x,
        "mask_bias": np.zeros((1, 1, 1, 3), np.float32),
        "heads": np.array([0, 0, N, H], np.int64),
    }
    out, report = run(m, inputs=feed)
    assert codes(report, RULE) == ["dynamic-heads"]
    assert report.parity.ok


def test_softmax_over_the_wrong_axis_is_missed():
    out, report = run(attention(softmax_axis=2))
    assert codes(report, RULE) == ["softmax-axis"]
    assert report.parity.ok


def test_unknown_rank_is_missed():
    """q, k, v from a Reshape whose target length is a run-time value: rank unknown."""
    m = attention(mask=None)
    m.graph.input[0].name = "x_in"
    m.graph.input.append(vi("xs", ["r"], TensorProto.INT64))
    m.graph.node.insert(0, helper.make_node("Reshape", ["x_in", "xs"], ["x"], name="dyn"))
    del m.graph.value_info[:]
    x = np.random.default_rng(0).standard_normal((1, 3, D)).astype(np.float32)
    out, report = run(m, inputs={"x_in": x, "xs": np.array([1, 3, D], np.int64)})
    assert codes(report, RULE) == ["unknown-shape"]
    assert report.parity.ok


def test_unprovable_reshape_between_the_matmuls_is_missed():
    m = attention(mid_reshape=True, mask=None)
    # the [B, -1, S, H] target now comes from a graph input: not provably a no-op
    for node in m.graph.node:
        if node.op_type == "Reshape" and node.input[1] == "mid":
            node.input[1] = "mid_in"
    m.graph.input.append(vi("mid_in", [4], TensorProto.INT64))
    x = np.random.default_rng(0).standard_normal((1, 3, D)).astype(np.float32)
    out, report = run(m, inputs={"x": x, "mid_in": np.array([1, N, 3, H], np.int64)})
    assert codes(report, RULE) == ["reshape-not-identity"]
    assert report.parity.ok


def test_fp16_on_cpu_runs_inside_the_casts_its_matmuls_had():
    """onnxruntime's cpu MultiHeadAttention is float32 only, like its MatMul: float16
    attention already runs inside casts to float, and the fused kernel takes its place."""
    out, report = run(attention(dtype=np.float16))
    assert hist(out)["com.microsoft.MultiHeadAttention"] == 1
    assert report.parity.ran and report.parity.ok


def test_fp16_without_casts_has_no_contrib_kernel(cpu_without_fp16_casts):
    """Without casts to float, the cpu MultiHeadAttention (float32 only) does not run float16;
    its ONNX Attention (opset 23) has a float16 kernel, so the remark names the upgrade."""
    out, report = run(attention(dtype=np.float16), target=cpu_without_fp16_casts, check=False)
    assert codes(report, RULE) == ["opset-too-old"]
    (r,) = [r for r in report.remarks if r.rule == RULE]
    assert "--opset 23" in r.message


def test_fp16_on_cuda_fuses():
    out, report = run(attention(dtype=np.float16), target="cuda", check=False)
    assert hist(out)["com.microsoft.MultiHeadAttention"] == 1


def test_a_float16_causal_where_of_float16s_lowest_fuses_on_cuda():
    """GPT-2 exported in float16 by transformers 4.x: ``Where(causal, s, -65504)``."""
    m = attention(packed=True, mask="causal-half", dtype=np.float16)
    out, report = run(m, target="cuda", check=False)
    assert hist(out)["com.microsoft.MultiHeadAttention"] == 1 and codes(report, RULE) == []
    (note,) = [r for r in report.remarks if r.code == "mask-fill-not-absorbing"]
    assert note.args["fill"] == -65504.0


def _static_keys(m, keys: int):
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = keys
    for i in m.graph.input[1:]:
        dims = i.type.tensor_type.shape.dim
        if len(dims) == 4 and dims[3].dim_param == "seq":
            dims[3].dim_value = keys
    del m.graph.value_info[:]
    return m


def test_short_static_sequence_with_a_bias_is_slower_on_cpu():
    """With an attention_bias, onnxruntime's CPU kernel pays from 128 keys on
    (examples/benchmark/attention_shapes.py); a static shorter one (Swin's 49-key windows)
    stays unfused there, with the numbers."""
    m = _static_keys(attention(mask="padding"), 49)
    out, report = run(m)
    assert codes(report, RULE) == ["slower-on-target"]
    (r,) = [r for r in report.remarks if r.rule == RULE]
    assert r.args["keys"] == 49 and r.args["bound"] == 128 and "Swin" in r.message
    assert "attention_bias" in r.message
    assert "Softmax" in hist(out) and report.parity.ok
    out, _ = run(m, target="cuda", check=False)  # no such measurement for the cuda kernel
    assert hist(out)["com.microsoft.MultiHeadAttention"] == 1


@pytest.mark.parametrize("keys", [16, 49])
def test_short_static_sequence_without_a_bias_fuses_on_cpu(keys):
    """Without a mask or bias the CPU kernel was measured faster at every length (Wav2Vec2's
    49 frames, MobileViT's 16 and 64 patches): no key-length bound applies."""
    out, report = assert_optimized(_static_keys(attention(mask=None), keys))
    assert hist(out)["com.microsoft.MultiHeadAttention"] == 1 and "Softmax" not in hist(out)
    assert "slower-on-target" not in codes(report, RULE)


@pytest.mark.parametrize("kw", [{}, {"layout": "packed"}, {"mask": "causal", "packed": True}])
def test_standard_attention_op_where_the_target_has_no_contrib_kernel(kw):
    """TensorRT's table has the ONNX Attention op (opset 23), not MultiHeadAttention: after an
    opset upgrade the pattern becomes that, on 4-D [B,N,S,H] q/k/v (TensorRT takes only those)."""
    m = attention(**kw)
    out, report = run(m, target="tensorrt")
    assert codes(report, RULE) == ["opset-too-old"]
    out, report = assert_optimized(m, target="tensorrt", opset=23)
    h = hist(out)
    assert h["Attention"] == 1 and "Softmax" not in h
    node = next(n for n in out.graph.node if n.op_type == "Attention")
    assert len(node.input) in (3, 4) and not node.attribute  # heads from the 4-D shapes
    made = {o: n for n in out.graph.node for o in n.output}
    for q_k_v in node.input[:3]:
        assert made[q_k_v].op_type == "Transpose"  # [B,S,N,H] → [B,N,S,H]


def test_attention_probabilities_as_output_are_missed():
    out, report = run(attention(softmax_out=True))
    assert codes(report, RULE) == ["shared-intermediate"]
    assert report.parity.ok


# --------------------------------------------------------------------- real model
def test_bert_tiny_every_layer_fuses():
    out, report = run(str(EXAMPLES / "bert_tiny.onnx"))
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 2  # 2 layers
    assert h["LayerNormalization"] == 5  # embeddings + 2 per layer (already fused by export)
    assert h["com.microsoft.BiasGelu"] == 2
    assert "Softmax" not in h and "Transpose" not in h
    assert h["Expand"] == 4  # 3 of the embeddings + one attention_bias shared by both layers
    assert report.parity.ran and report.parity.ok
    assert max(o.max_abs for o in report.parity.outputs) < 1e-5


def test_dynamo_vit_and_gpt2_targets_fuse():
    """dynamo writes the head split as [-1, S, N, H] (static S) and GPT-2's merge as [-1, D]:
    the -1 is forced to be the batch, and a 2-D merge stays after the kernel."""
    m = attention(heads=(-1, 128, N, H), out_target=(-1, D), mask=None)
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 128
    del m.graph.value_info[:]
    x = np.random.default_rng(4).standard_normal((3, 128, D)).astype(np.float32)
    out, report = assert_optimized(m, inputs={"x": x})
    h = hist(out)
    assert h["com.microsoft.MultiHeadAttention"] == 1 and h["Reshape"] == 1
    assert "Softmax" not in h and "Transpose" not in h


def _computed_sequence(m, heads):
    """The head split's target as [B, Min(S, 512), *heads] computed from Shape(x): a
    sequence the dims do not prove, as dynamo writes a sliding-window cache's length (with
    ``allowzero``, as dynamo's Reshapes have it)."""
    m.graph.initializer.remove(next(t for t in m.graph.initializer if t.name == "heads"))
    m.graph.initializer.extend([const("cap", [512], np.int64), const("tail", heads, np.int64)])
    glue = [
        helper.make_node("Shape", ["x"], ["x_b"], start=0, end=1),
        helper.make_node("Shape", ["x"], ["x_s"], start=1, end=2),
        helper.make_node("Min", ["x_s", "cap"], ["x_sc"]),
        helper.make_node("Concat", ["x_b", "x_sc", "tail"], ["heads"], axis=0),
    ]
    for i, n in enumerate(glue):
        m.graph.node.insert(i, n)
    for n in m.graph.node:
        if n.op_type == "Reshape" and n.input[1] == "heads":
            n.attribute.append(helper.make_attribute("allowzero", 1))
    return m


def test_a_computed_sequence_is_the_sequence_when_heads_fill_the_width():
    """[B, X, N, H] of a [B,S,N·H] projection: the element count makes X the sequence."""
    m = _computed_sequence(attention(), [N, H])
    out, report = assert_optimized(m)
    assert hist(out).get("com.microsoft.MultiHeadAttention") == 1
    assert codes(report, RULE) == []


def test_a_computed_sequence_beside_inferred_heads_is_missed():
    """[B, X, -1, H]: X·N' = S·N proves neither X nor N'."""
    m = _computed_sequence(attention(), [-1, H])
    out, report = run(m)
    assert codes(report, RULE) == ["dynamic-heads"]
    assert report.parity.ok

"""Packed q, k and v taken apart by ``unbind(0)`` as the dynamo exporter writes
``F.scaled_dot_product_attention`` over timm's ``qkv.reshape(B,S,3,N,H).permute(2,0,3,1,4)``:
``Split`` along the packing axis, a ``Squeeze`` per part, and the key transposed through 3-D
(``Reshape(k, [B·N,T,H])``, ``(0,2,1)``, back to [B,N,H,T]) with its Squeeze folded into that
Reshape (static sizes write B·N as a number).  The attention fuses, checked by onnxruntime
parity; without the unbind spelled in, every layer of such a model stayed unfused.  HF's
repeat_kv under the same exporter (grouped heads, ``sdpa`` attention) folds the repeated key
[B,Nkv,rep,T,H] straight to [B·N,T,H]: ``unfold-3d-key`` writes it as its 4-D transpose."""

import numpy as np
import pytest
from onnx import helper

from conftest import assert_optimized, const, model, vi
from graphopt.opt.graph.ir import op_histogram

B, S, N, H = 2, 16, 4, 8
D = N * H


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def packed_parts(rng) -> tuple[list, list]:
    """``p0``, ``p1``, ``p2`` [1,B,N,S,H]: the packed projection ``x @ Wqkv`` split along the
    packing axis of ``Transpose(Reshape(·, [B,S,3,N,H]), (2,0,3,1,4))``."""
    nodes = [
        mk("MatMul", ["x", "Wqkv"], ["qkv"]),
        mk("Reshape", ["qkv", "pack"], ["qkv5"]),
        mk("Transpose", ["qkv5"], ["parts"], perm=[2, 0, 3, 1, 4]),
        mk("Split", ["parts", "ones"], ["p0", "p1", "p2"], axis=0),
    ]
    inits = [
        const("Wqkv", rng.standard_normal((D, 3 * D)) * 0.3),
        const("pack", [B, S, 3, N, H], np.int64),
        const("ones", [1, 1, 1], np.int64),
        const("axis0", [0], np.int64),
    ]
    return nodes, inits


def attend(v: str) -> list:
    """Softmax of the scores ``z`` times ``v``, merged to [B,S,D] as ``y``."""
    return [
        mk("Softmax", ["z"], ["p"], axis=-1),
        mk("MatMul", ["p", v], ["o"]),
        mk("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["ot", "merge"], ["y"]),
    ]


def unbound_sdpa(rng, squeeze_folded: bool):
    nodes, inits = packed_parts(rng)
    nodes += [
        mk("Squeeze", ["p0", "axis0"], ["q"]),
        mk("Squeeze", ["p2", "axis0"], ["v"]),
    ]
    if squeeze_folded:
        nodes.append(mk("Reshape", ["p1", "fold"], ["k3"]))
    else:
        nodes += [mk("Squeeze", ["p1", "axis0"], ["k"]), mk("Reshape", ["k", "fold"], ["k3"])]
    nodes += [
        mk("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
        mk("Reshape", ["kt3", "unfold"], ["kt"]),
        mk("Mul", ["q", "c"], ["qs"]),
        mk("Mul", ["kt", "c"], ["kts"]),
        mk("MatMul", ["qs", "kts"], ["z"]),
        *attend("v"),
    ]
    inits += [
        const("fold", [B * N, S, H], np.int64),
        const("unfold", [B, N, H, S], np.int64),
        const("c", np.float32(H**-0.25)),
        const("merge", [B, S, D], np.int64),
    ]
    return model(nodes, [vi("x", [B, S, D])], [vi("y", [B, S, D])], inits)


@pytest.mark.parametrize("squeeze_folded", [True, False])
def test_qkv_unbound_by_split_and_squeeze_fuses(rng, squeeze_folded):
    out, _ = assert_optimized(unbound_sdpa(rng, squeeze_folded), target="cuda")
    ops = op_histogram(out.graph.node)
    assert ops.get("com.microsoft.MultiHeadAttention") == 1 and "Softmax" not in ops, ops


KV, REP = 2, 2  # grouped heads: N = KV · REP


def repeated_key_through_3d(rng):
    """HF's repeat_kv under the dynamo SDPA spelling: the key's [B,KV,REP,T,H] Expand read by
    the 3-D Reshape directly; the value repeated as the eager model writes it."""
    nodes = [mk("MatMul", ["x", "Wq"], ["qp"]), mk("Reshape", ["qp", "split_q"], ["q4"])]
    nodes.append(mk("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]))
    for r in "kv":
        nodes += [
            mk("MatMul", ["x", f"W{r}"], [f"{r}p"]),
            mk("Reshape", [f"{r}p", "split_kv"], [f"{r}4"]),
            mk("Transpose", [f"{r}4"], [f"{r}h"], perm=[0, 2, 1, 3]),
            mk("Unsqueeze", [f"{r}h", "axis2"], [f"{r}u"]),
            mk("Expand", [f"{r}u", "rep"], [f"{r}5"]),
        ]
    nodes += [
        mk("Reshape", ["k5", "fold"], ["k3"]),
        mk("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
        mk("Reshape", ["kt3", "unfold"], ["kt"]),
        mk("Reshape", ["v5", "heads"], ["v"]),
        mk("Mul", ["q", "c"], ["qs"]),
        mk("Mul", ["kt", "c"], ["kts"]),
        mk("MatMul", ["qs", "kts"], ["z"]),
        *attend("v"),
    ]
    inits = [const("Wq", rng.standard_normal((D, D)) * 0.3)]
    inits += [const(f"W{r}", rng.standard_normal((D, KV * H)) * 0.3) for r in "kv"]
    inits += [
        const("split_q", [B, S, N, H], np.int64),
        const("split_kv", [B, S, KV, H], np.int64),
        const("axis2", [2], np.int64),
        const("rep", [B, KV, REP, S, H], np.int64),
        const("fold", [B * N, S, H], np.int64),
        const("unfold", [B, N, H, S], np.int64),
        const("heads", [B, N, S, H], np.int64),
        const("c", np.float32(H**-0.25)),
        const("merge", [B, S, D], np.int64),
    ]
    return model(nodes, [vi("x", [B, S, D])], [vi("y", [B, S, D])], inits)


def test_a_repeated_key_folded_through_3d_fuses(rng):
    out, report = assert_optimized(repeated_key_through_3d(rng), target="cuda")
    ops = op_histogram(out.graph.node)
    assert "Softmax" not in ops, ops
    assert report.rules["unfold-3d-key"]["fired"] == 1


def unbound_with_qk_norm(rng):
    """timm's ``qk_norm=True``: a LayerNorm over each head of the unbound q and k, v the third
    part as it is (the parts are not all packed any more: q and k go per head, v with them)."""
    nodes, inits = packed_parts(rng)
    for i, r in enumerate("qkv"):
        nodes.append(mk("Squeeze", [f"p{i}", "axis0"], [f"{r}0"]))
    for r in "qk":
        nodes.append(mk("LayerNormalization", [f"{r}0", f"g{r}", f"b{r}"], [r], axis=-1))
    nodes += [
        mk("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        mk("MatMul", ["q", "kt"], ["z0"]),
        mk("Mul", ["z0", "c2"], ["z"]),
        *attend("v0"),
    ]
    inits += [
        const("c2", np.float32(H**-0.5)),
        const("merge", [B, S, D], np.int64),
    ]
    for r in "qk":
        inits += [
            const(f"g{r}", 1 + 0.1 * rng.standard_normal(H)),
            const(f"b{r}", 0.1 * rng.standard_normal(H)),
        ]
    return model(nodes, [vi("x", [B, S, D])], [vi("y", [B, S, D])], inits)


def test_qk_norm_over_unbound_parts_fuses(rng):
    out, _ = assert_optimized(unbound_with_qk_norm(rng), target="cuda")
    ops = op_histogram(out.graph.node)
    assert ops.get("com.microsoft.MultiHeadAttention") == 1 and "Softmax" not in ops, ops

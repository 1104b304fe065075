"""Packed q, k and v taken apart by ``unbind(0)`` as the dynamo exporter writes
``F.scaled_dot_product_attention`` over timm's ``qkv.reshape(B,S,3,N,H).permute(2,0,3,1,4)``:
``Split`` along the packing axis, a ``Squeeze`` per part, and the key transposed through 3-D
(``Reshape(k, [B·N,T,H])``, ``(0,2,1)``, back to [B,N,H,T]) with its Squeeze folded into that
Reshape (static sizes write B·N as a number).  The attention fuses, checked by onnxruntime
parity; without the unbind spelled in, every layer of such a model stayed unfused."""

import numpy as np
import pytest
from onnx import helper

from conftest import assert_optimized, const, model, vi
from graphopt.opt.graph.ir import op_histogram

B, S, N, H = 2, 16, 4, 8
D = N * H


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def unbound_sdpa(rng, squeeze_folded: bool):
    nodes = [
        mk("MatMul", ["x", "Wqkv"], ["qkv"]),
        mk("Reshape", ["qkv", "pack"], ["qkv5"]),
        mk("Transpose", ["qkv5"], ["parts"], perm=[2, 0, 3, 1, 4]),
        mk("Split", ["parts", "ones"], ["p0", "p1", "p2"], axis=0),
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
        mk("Softmax", ["z"], ["p"], axis=-1),
        mk("MatMul", ["p", "v"], ["o"]),
        mk("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["ot", "merge"], ["y"]),
    ]
    inits = [
        const("Wqkv", rng.standard_normal((D, 3 * D)) * 0.3),
        const("pack", [B, S, 3, N, H], np.int64),
        const("ones", [1, 1, 1], np.int64),
        const("axis0", [0], np.int64),
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

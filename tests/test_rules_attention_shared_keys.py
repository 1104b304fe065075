"""Two attentions reading the same scaled keys: a decoder whose layers are clones (PyTorch's
``nn.TransformerDecoder`` deep-copies one layer) computes the same memory keys and values in
every layer, and CSE merges them, so the key scaled by ``1/√√H`` feeds the Q·Kᵀ of both layers'
cross-attention.  Each attention strips the scale alone and leaves the shared split to the
other; both fuse, checked by onnxruntime parity."""

import numpy as np
from onnx import helper

from conftest import assert_optimized, const, model, vi
from graphopt.opt.graph.ir import op_histogram

N, H, S, T, D = 4, 8, 10, 16, 32
MHA = "com.microsoft.MultiHeadAttention"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def heads(src: str, w: str, out: str, perm: list[int]) -> list:
    return [
        mk("MatMul", [src, w], [f"{out}_p"]),
        mk("Reshape", [f"{out}_p", "split"], [f"{out}_4"]),
        mk("Transpose", [f"{out}_4"], [out], perm=perm),
    ]


def cross_attention_of_cloned_layers(rng):
    nodes = heads("mem", "Wk", "k_t", [0, 2, 3, 1]) + heads("mem", "Wv", "v_h", [0, 2, 1, 3])
    nodes.append(mk("Mul", ["k_t", "c"], ["k_s"]))  # the scaled keys both layers read
    x = "x"
    for i in range(2):
        nodes += heads(x, f"Wq{i}", f"q{i}", [0, 2, 1, 3])
        nodes += [
            mk("Mul", [f"q{i}", "c"], [f"q{i}_s"]),
            mk("MatMul", [f"q{i}_s", "k_s"], [f"z{i}"]),
            mk("Softmax", [f"z{i}"], [f"p{i}"], axis=-1),
            mk("MatMul", [f"p{i}", "v_h"], [f"o{i}"]),
            mk("Transpose", [f"o{i}"], [f"o{i}_t"], perm=[0, 2, 1, 3]),
            mk("Reshape", [f"o{i}_t", "merge"], [f"a{i}"]),
            mk("Add", [x, f"a{i}"], [f"y{i}"]),
        ]
        x = f"y{i}"
    inits = [const(w, rng.standard_normal((D, N * H)) * 0.3) for w in ("Wk", "Wv", "Wq0", "Wq1")]
    inits += [
        const("c", np.float32(H**-0.25)),
        const("split", [0, 0, N, H], np.int64),
        const("merge", [0, 0, N * H], np.int64),
    ]
    return model(nodes, [vi("x", [2, S, D]), vi("mem", [2, T, D])], [vi("y1", [2, S, D])], inits)


def test_cloned_layers_reading_the_same_scaled_keys_both_fuse(rng):
    out, report = assert_optimized(cross_attention_of_cloned_layers(rng), target="cuda")
    ops = op_histogram(out.graph.node)
    assert ops.get(MHA) == 2 and "Softmax" not in ops, ops
    for mha in (n for n in out.graph.node if n.op_type == "MultiHeadAttention"):
        scale = {a.name: a.f for a in mha.attribute}.get("scale", H**-0.5)  # the default
        assert abs(scale - H**-0.5) < 1e-6

"""fuse-attention on ``torch.nn.MultiheadAttention`` as the dynamo exporter writes it, checked by
onnxruntime parity:

- sequence-first [S,B,E] with one packed in-projection, unbound by Reshape [S,B,3,E] →
  Unsqueeze → Transpose (3,1,2,0,4) → Squeeze → Gather; each part split [S,B·N,H] →
  Transpose (1,0,2) → Reshape [B,N,S,H]; the key transposed in 3-D, (1,0,2) then (0,2,1) —
  which the level-1 rules compose to one (1,2,0) — and unfolded to [B,N,H,T];
- a pooling head's learned query folded to a constant [B,N,1,H] with a static batch; a constant
  query the MatMul broadcasts over the batch is not given to the kernel (a miss, not a fusion)."""

import numpy as np
import pytest
from onnx import helper

from conftest import assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

S, B, N, H = 6, 2, 4, 16
E = N * H
RULE = "fuse-attention"
MHA = "com.microsoft.MultiHeadAttention"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def _split(part: str, src: str, seq: int, key: bool) -> list:
    """``{part}`` [B,N,seq,H] (or Kᵀ [B,N,H,seq]) from a sequence-first [seq,B,E]."""
    nodes = [
        mk("Reshape", [src, f"sbh{seq}"], [f"{part}_sbh"], allowzero=1),
        mk("Transpose", [f"{part}_sbh"], [f"{part}_bsh"], perm=[1, 0, 2]),
    ]
    if key:
        return nodes + [
            mk("Transpose", [f"{part}_bsh"], [f"{part}_bhs"], perm=[0, 2, 1]),
            mk("Reshape", [f"{part}_bhs", f"bnhs{seq}"], [part]),
        ]
    return nodes + [mk("Reshape", [f"{part}_bsh", f"bnsh{seq}"], [part], allowzero=1)]


def torch_mha(query: str = "self"):
    """One ``nn.MultiheadAttention`` over a batch-first x [B,S,E]: self-attention, or a learned
    query ``[B|1,N,1,H]`` constant (``query`` "pool" or "broadcast")."""
    rng = np.random.default_rng(0)
    t = S if query == "self" else 1
    inits = [
        const("w_in", rng.standard_normal((E, 3 * E)) * 0.2),
        const("b_in", rng.standard_normal(3 * E) * 0.1),
        const("w_out", rng.standard_normal((E, E)) * 0.2),
        const("b_out", rng.standard_normal(E) * 0.1),
        const("packed", [S, B, 3, E], np.int64),
        const("zero", [0], np.int64),
        const("three", [3], np.int64),
        const("scale", [float(H) ** -0.25]),
        const("out_2d", [t * B, E], np.int64),
        const("out_3d", [t, B, E], np.int64),
    ]
    for seq in {S, t}:
        inits += [
            const(f"sbh{seq}", [seq, B * N, H], np.int64),
            const(f"bnsh{seq}", [B, N, seq, H], np.int64),
            const(f"bnhs{seq}", [B, N, H, seq], np.int64),
        ]
    inits += [const(f"i{i}", i, np.int64) for i in range(3)]
    nodes = [
        mk("Transpose", ["x"], ["x_sbe"], perm=[1, 0, 2]),
        mk("MatMul", ["x_sbe", "w_in"], ["proj"]),
        mk("Add", ["proj", "b_in"], ["proj_b"]),
        mk("Reshape", ["proj_b", "packed"], ["p4"], allowzero=1),
        mk("Unsqueeze", ["p4", "zero"], ["p5"]),
        mk("Transpose", ["p5"], ["p5t"], perm=[3, 1, 2, 0, 4]),
        mk("Squeeze", ["p5t", "three"], ["parts"]),
        *[mk("Gather", ["parts", f"i{i}"], [f"sel{i}"], axis=0) for i in range(3)],
        *_split("k", "sel1", S, key=True),
        *_split("v", "sel2", S, key=False),
        mk("Mul", ["k", "scale"], ["ks"]),
    ]
    if query == "self":
        nodes += [*_split("q", "sel0", S, key=False), mk("Mul", ["q", "scale"], ["qs"])]
    else:
        batch = B if query == "pool" else 1
        inits.append(const("qs", rng.standard_normal((batch, N, 1, H)) * 0.5))
    nodes += [
        mk("MatMul", ["qs", "ks"], ["scores"]),
        mk("Softmax", ["scores"], ["probs"], axis=-1),
        mk("MatMul", ["probs", "v"], ["ctx"]),
        mk("Transpose", ["ctx"], ["ctx_sbnh"], perm=[2, 0, 1, 3]),
        mk("Reshape", ["ctx_sbnh", "out_2d"], ["ctx_2d"], allowzero=1),
        mk("Gemm", ["ctx_2d", "w_out", "b_out"], ["o_2d"]),
        mk("Reshape", ["o_2d", "out_3d"], ["o_sbe"], allowzero=1),
        mk("Transpose", ["o_sbe"], ["y"], perm=[1, 0, 2]),
    ]
    for i, nd in enumerate(nodes):
        nd.name = f"n{i}_{nd.op_type}"
    return model(nodes, [vi("x", [B, S, E])], [vi("y", [B, t, E])], inits, opset=18)


def _feeds(seed=0) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((B, S, E)).astype(np.float32)}


@pytest.mark.parametrize("query", ["self", "pool"])
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_torch_multihead_attention_fuses(query, target):
    m = torch_mha(query)
    out, report = assert_optimized(m, target=target, inputs=_feeds(), measure=False)
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1, h
    assert "Softmax" not in h, h
    assert codes(report, RULE) == []
    assert run(out, target=target, inputs=_feeds(1), measure=False)[1].parity.ok


def test_a_query_broadcast_over_the_batch_is_missed():
    m = torch_mha("broadcast")
    out, report = assert_optimized(m, target="cuda", inputs=_feeds())
    assert MHA not in op_histogram(out.graph.node)
    assert codes(report, RULE) == ["unrecognized-layout"]

"""Sequence-first attention written with Einsums (XLNet's relative attention): projections
straight into heads by a constant weight [D,N,H] (``einsum-projection``), a per-head bias on
the query, Q·Kᵀ and P·V over [S,B,N,H] heads (``einsum-to-matmul``), a relative term added
before the scale (``distribute-score-scale``) and a mask subtracted (``subtract-score-term``).
The key reaches Q·Kᵀ as ``Transpose(k [T,B,N,H], (1,2,3,0))``, which the kernel takes back as
[B,T,N·H].  Every graph is checked against onnxruntime by graphopt's parity run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

S, B, N, H = 20, 2, 4, 8
D = N * H


class SeqFirst:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []

    def add(self, op, ins, out, **attrs) -> str:
        self.nodes.append(helper.make_node(op, ins, [out], name=f"n{len(self.nodes)}", **attrs))
        return out

    def c(self, name, value, dtype=np.float32) -> str:
        self.inits.append(const(name, value, dtype))
        return name

    def heads(self, r: str) -> str:
        w = self.c(f"W{r}", self.rng.standard_normal((D, N, H)) * 0.3)
        return self.add("Einsum", ["x", w], f"{r}_h", equation="ibh,hnd->ibnd")

    def graph(self, mask: str = "subtracted"):
        q, k, v = self.heads("q"), self.heads("k"), self.heads("v")
        qw = self.add("Add", [q, self.c("r_w", self.rng.standard_normal((N, H)) * 0.3)], "qw")
        ac = self.add("Einsum", [qw, k], "ac", equation="ibnd,jbnd->bnij")
        rel = self.c("R", self.rng.standard_normal((S, N, H)) * 0.3)
        qr = self.add("Add", [q, self.c("r_r", self.rng.standard_normal((N, H)) * 0.3)], "qr")
        bd = self.add("Einsum", [qr, rel], "bd", equation="ibnd,jnd->bnij")
        z = self.add("Mul", [self.add("Add", [ac, bd], "raw"), self.c("scale", H**-0.5)], "z")
        if mask == "subtracted":  # XLNet: scores − 1e30 · mask
            big = self.add("Mul", ["mask", self.c("big", np.float32(1e30))], "big_mask")
            z = self.add("Sub", [z, big], "masked")
        else:  # the 0/1 mask subtracted as it is: not a bias of −∞, still a term
            z = self.add("Sub", [z, "mask"], "masked")
        p = self.add("Softmax", [z], "P", axis=-1)
        ctx = self.add("Einsum", [p, v], "ctx", equation="bnij,jbnd->ibnd")
        wo = self.c("Wo", self.rng.standard_normal((D, N, H)) * 0.3)
        self.add("Einsum", [ctx, wo], "y", equation="ibnd,hnd->ibh")
        ins = [vi("x", [S, B, D]), vi("mask", [B, 1, S, S])]
        return model(self.nodes, ins, [vi("y", [S, B, D])], self.inits)


def feed() -> dict:
    rng = np.random.default_rng(1)
    mask = np.zeros((B, 1, S, S), np.float32)
    mask[1, ..., -3:] = 1.0
    return {"x": rng.standard_normal((S, B, D)).astype(np.float32), "mask": mask}


def fused(m) -> int:
    return sum(v for k, v in op_histogram(m.graph.node).items() if k.endswith("MultiHeadAttention"))


@pytest.mark.parametrize("mask", ["subtracted", "plain"])
def test_sequence_first_einsum_attention_with_a_relative_term_fuses(mask):
    out, report = run(SeqFirst().graph(mask), target="cuda", inputs=feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []
    for rule in ("einsum-projection", "subtract-score-term", "distribute-score-scale"):
        assert "fired" in codes(report, rule, "passed"), rule
    assert op_histogram(out.graph.node).get("Einsum") == 1  # the relative term, as it was


@pytest.mark.parametrize(
    "equation, shapes, lowered",
    [
        ("ibh,hnd->ibnd", [(3, 2, 6), (6, 2, 3)], True),  # into heads
        ("ibnd,hnd->ibh", [(3, 2, 2, 3), (6, 2, 3)], True),  # out of them
        ("ibh,hdn->ibnd", [(3, 2, 6), (6, 3, 2)], True),  # the weight's n letters reordered
        ("ibh,hnd->bind", [(3, 2, 6), (6, 2, 3)], False),  # the kept dims reordered
        ("ibh,hnd->ibn", [(3, 2, 6), (6, 2, 3)], False),  # d summed over in the weight alone
    ],
)
def test_projections_by_a_constant_weight_are_lowered(equation, shapes, lowered):
    rng = np.random.default_rng(2)
    w = const("w", rng.standard_normal(shapes[1]), np.float32)
    nodes = [helper.make_node("Einsum", ["a", "w"], ["y"], name="e", equation=equation)]
    m = model(nodes, [vi("a", list(shapes[0]))], [vi("y", None)], [w])
    feeds = {"a": rng.standard_normal(shapes[0]).astype(np.float32)}
    out, report = run(m, inputs=feeds)
    assert report.parity.ran and report.parity.ok, report.parity
    assert ("Einsum" not in op_histogram(out.graph.node)) == lowered

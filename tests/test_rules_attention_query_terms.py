"""Scores with terms computed from the query heads, and queries made per head some other
way: Wav2Vec2-BERT's relative-key term (the split query also read by an Einsum), BROS's term
added before the scale (``distribute-score-scale``), EXAONE-4's q/k RMSNorm spelled out on a
layer without rotary, Conditional DETR's q and k concatenated per head from two projections.
A split the term reads stays; the kernel takes the query as [B,S,N·H].  Every graph is
checked against onnxruntime by graphopt's parity run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

B, S, N, H = 2, 16, 4, 8
D = N * H


class Heads:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits = [const("split", [0, 0, N, H], np.int64), const("merge", [0, 0, D], np.int64)]

    def add(self, op, ins, out, **attrs) -> str:
        self.nodes.append(helper.make_node(op, ins, [out], name=f"n{len(self.nodes)}", **attrs))
        return out

    def c(self, name, value, dtype=np.float32) -> str:
        self.inits.append(const(name, value, dtype))
        return name

    def split(self, r: str, perm) -> str:
        w = self.c(f"W{r}", self.rng.standard_normal((D, D)) * 0.3)
        p = self.add("MatMul", ["x", w], f"{r}_p")
        p = self.add("Reshape", [p, "split"], f"{r}_4")
        return self.add("Transpose", [p], f"{r}_h", perm=perm)

    def rms(self, x: str, r: str) -> str:
        """x · 1/√(mean(x²) + ε) over the head axis, spelled out."""
        sq = self.add("Pow", [x, self.c(f"two_{r}", np.float32(2))], f"{r}_sq")
        mean = self.add("ReduceMean", [sq], f"{r}_mean", axes=[-1])
        eps = self.add("Add", [mean, self.c(f"eps_{r}", np.float32(1e-6))], f"{r}_eps")
        root = self.add("Sqrt", [eps], f"{r}_root")
        inv = self.add("Div", [self.c(f"one_{r}", np.float32(1)), root], f"{r}_inv")
        return self.add("Mul", [x, inv], f"{r}_normed")

    def concat_heads(self, r: str, perm) -> str:
        """Conditional DETR: content and position parts split per head, concatenated per
        head (head size 2H), then the heads' Transpose."""
        parts = []
        for part in ("content", "pos"):
            w = self.c(f"W{r}_{part}", self.rng.standard_normal((D, D)) * 0.3)
            p = self.add("MatMul", ["x", w], f"{r}_{part}")
            parts.append(self.add("Reshape", [p, "split"], f"{r}_{part}4"))
        cat = self.add("Concat", parts, f"{r}_cat", axis=-1)
        return self.add("Transpose", [cat], f"{r}_h", perm=perm)

    def graph(self, kind: str):
        v = self.split("v", [0, 2, 1, 3])
        if kind == "concat_heads":
            q = self.concat_heads("q", [0, 2, 1, 3])
        else:
            q = self.split("q", [0, 2, 1, 3])
        if kind == "concat_heads":
            kt = self.concat_heads("k", [0, 2, 3, 1])
        elif kind == "norm":  # q and k normalized per head after the split, no rotary
            q = self.rms(q, "q")
            k = self.rms(self.split("k", [0, 2, 1, 3]), "k")
            kt = self.add("Transpose", [k], "kt", perm=[0, 1, 3, 2])
        else:
            kt = self.split("k", [0, 2, 3, 1])
        s = self.add("MatMul", [q, kt], "qk")
        scale = self.c("scale", np.float32(H**-0.5))
        if kind == "concat_heads":
            scale = self.c("scale2", np.float32((2 * H) ** -0.5))
        if kind == "relative_key":  # Wav2Vec2-BERT: q·E per distance, scaled like the scores
            e = self.c("E", self.rng.standard_normal((S, S, H)) * 0.3)
            rel = self.add("Einsum", [q, e], "rel", equation="bhld,lrd->bhlr")
            s = self.add(
                "Add", [self.add("Mul", [s, scale], "s1"), self.add("Mul", [rel, scale], "r1")], "z"
            )
        elif kind == "before_scale":  # BROS: the term added to the raw product, then scaled
            p = self.c("box", self.rng.standard_normal((B, S, S, H)) * 0.3)
            rel = self.add("Einsum", [q, p], "rel", equation="bnid,bijd->bnij")
            s = self.add(
                "Div", [self.add("Add", [s, rel], "raw"), self.c("root", np.float32(H**0.5))], "z"
            )
        else:
            s = self.add("Mul", [s, scale], "z")
        s = self.add("Add", [s, "mask"], "masked")
        pr = self.add("Softmax", [s], "P", axis=-1)
        ctx = self.add("MatMul", [pr, v], "ctx")
        t = self.add("Transpose", [ctx], "ctx_t", perm=[0, 2, 1, 3])
        self.add("Reshape", [t, "merge"], "y")
        ins = [vi("x", [B, S, D]), vi("mask", [B, 1, 1, S])]
        return model(self.nodes, ins, [vi("y", [B, S, D])], self.inits)


def feed() -> dict:
    rng = np.random.default_rng(1)
    mask = np.zeros((B, 1, 1, S), np.float32)
    mask[1, ..., -3:] = -1e4
    return {"x": rng.standard_normal((B, S, D)).astype(np.float32), "mask": mask}


def fused(m) -> int:
    return sum(v for k, v in op_histogram(m.graph.node).items() if k.endswith("MultiHeadAttention"))


@pytest.mark.parametrize("kind", ["relative_key", "before_scale", "norm", "concat_heads"])
def test_query_terms_and_per_head_norms_fuse(kind):
    out, report = run(Heads().graph(kind), target="cuda", inputs=feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []


def test_a_term_before_the_scale_over_short_keys_is_said_slower_on_cpu():
    """16 keys with a bias on cpu: the attention is read (the scale distributed) and refused
    for its cost, with that reason, not as a spelling stage 1 cannot read."""
    out, report = run(Heads().graph("before_scale"), target="cpu", inputs=feed())
    assert report.parity.ok and fused(out) == 0
    assert codes(report, "fuse-attention") == ["slower-on-target"]

"""Folded attention over one packed projection with a spatial merge (SAM's and ViTDet's image
encoders): ``unpack-folded-heads`` and ``unsplit-spatial-merge`` make it the bmm spelling that
``unfold-3d-softmax`` and ``fuse-attention`` fuse, with the query-dependent decomposed relative
positions as a folded bias term.  One class of spelling per test; every graph is checked
against onnxruntime by graphopt's parity run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

N, H = 2, 16
E = N * H


class Sam:
    """x [B,h,w,E] → qkv → [B,S,3,N,H] → (2,0,3,1,4) → [3,B·N,S,H] → q, k, v [B·N,S,H];
    scores + rel [B·N,S,T] (from q); P·V → [B,N,h,w,H] → (0,2,3,1,4) → [B,h,w,E]."""

    def __init__(self, hw: int = 8, batch=2, seed: int = 0):
        self.hw, self.s, self.batch = hw, hw * hw, batch
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []

    def add(self, op, ins, out, **attrs) -> str:
        self.nodes.append(helper.make_node(op, ins, [out], name=f"n{len(self.nodes)}", **attrs))
        return out

    def c(self, name, value, dtype=np.int64) -> str:
        self.inits.append(const(name, value, dtype))
        return name

    def w(self, name, shape) -> str:
        return self.c(name, self.rng.standard_normal(shape) * 0.3, np.float32)

    def graph(self, unbind="split", dynamo=False, rel=True, merge=None, regroup=False):
        hw, s = self.hw, self.s
        p = self.add("MatMul", ["x", self.w("Wqkv", (E, 3 * E))], "qkv_mm")
        p = self.add("Add", [p, self.w("bqkv", (3 * E,))], "qkv")
        pack = [-1, s, 3, N, H] if dynamo else [0, s, 3, N, -1]
        r5 = self.add("Reshape", [p, self.c("pack", pack)], "qkv5")
        x5 = self.add("Transpose", [r5], "x5", perm=[2, 0, 3, 1, 4])
        folded = self.add("Reshape", [x5, self.c("fold", [3, -1, s, H])], "qkv_folded")
        if unbind == "split":
            self.add("Split", [folded, self.c("ones", [1, 1, 1])], "unused", axis=0)
            self.nodes[-1].output[:] = ["q1", "k1", "v1"]
            q, k, v = (self.add("Squeeze", [f"{r}1", self.c(f"a{r}", [0])], f"{r}3") for r in "qkv")
        else:
            q, k, v = (
                self.add("Gather", [folded, self.c(f"i{r}", i)], f"{r}3", axis=0)
                for i, r in enumerate("qkv")
            )
        qs = self.add("Mul", [q, self.c("scale", np.float32(H**-0.5), np.float32)], "q_scaled")
        kt = self.add("Transpose", [k], "kt", perm=[0, 2, 1])
        z = self.add("MatMul", [qs, kt], "scores")
        if rel:  # SAM's get_decomposed_rel_pos: einsums of the query with tables per row/col
            q4 = self.add("Reshape", [q, self.c("q4_shape", [-1, hw, hw, H])], "q4")
            rh, rw = (
                self.add("Einsum", [q4, self.w(f"R{a}", (hw, hw, H))], f"rel_{a}", equation=eq)
                for a, eq in (("h", "bhwc,hkc->bhwk"), ("w", "bhwc,wkc->bhwk"))
            )
            rh = self.add("Unsqueeze", [rh, self.c("a4", [4])], "rel_h5")
            rw = self.add("Unsqueeze", [rw, self.c("a3", [3])], "rel_w5")
            if regroup:  # ViTDet (and SAM before): the scores regrouped to [B·N,h,w,h,w]
                z5 = self.add("Reshape", [z, self.c("z5_shape", [-1, hw, hw, hw, hw])], "z5")
                z5 = self.add("Add", [z5, rh], "z5_h")
                z5 = self.add("Add", [z5, rw] if regroup == "full" else [z5, rh], "z5_hw")
                z = self.add("Reshape", [z5, self.c("z3_shape", [-1, s, s])], "biased")
            else:
                rel5 = self.add("Add", [rh, rw], "rel5")
                shape = self.add("Shape", [z], "scores_shape")
                rel3 = self.add("Reshape", [rel5, shape], "rel3")
                z = self.add("Add", [z, rel3], "biased")
        pr = self.add("Softmax", [z], "P", axis=-1)
        ctx = self.add("MatMul", [pr, v], "ctx")
        spatial = merge or ([-1, N, hw, hw, H] if dynamo else [self.batch, N, hw, hw, -1])
        attrs = {"allowzero": 1} if dynamo else {}
        c5 = self.add("Reshape", [ctx, self.c("spatial", spatial)], "ctx5", **attrs)
        t5 = self.add("Transpose", [c5], "ctx_t", perm=[0, 2, 3, 1, 4])
        y = self.add("Reshape", [t5, self.c("out", [self.batch, hw, hw, E])], "ctx_e")
        self.add("MatMul", [y, self.w("Wo", (E, E))], "y")
        batch = "batch" if dynamo else self.batch
        io = [vi("x", [batch, hw, hw, E])], [vi("y", [batch, hw, hw, E])]
        return model(self.nodes, *io, self.inits)

    def feed(self) -> dict:
        shape = (self.batch, self.hw, self.hw, E)
        return {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}


def fused(m) -> int:
    return sum(v for k, v in op_histogram(m.graph.node).items() if k.endswith("MultiHeadAttention"))


@pytest.mark.parametrize(
    "target, unbind, dynamo, hw",
    [
        ("cuda", "split", False, 8),
        ("cuda", "gather", False, 8),
        ("cuda", "split", True, 8),
        ("cpu", "split", False, 12),  # 144 keys: from 128 on it pays on cpu
    ],
)
def test_packed_folded_attention_with_spatial_merge_fuses(target, unbind, dynamo, hw):
    g = Sam(hw=hw)
    out, report = run(g.graph(unbind=unbind, dynamo=dynamo), target=target, inputs=g.feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []
    assert "Softmax" not in op_histogram(out.graph.node)


def test_without_relative_positions_fuses():
    g = Sam()
    out, report = run(g.graph(rel=False), target="cuda", inputs=g.feed())
    assert report.parity.ok and fused(out) == 1


def test_short_windows_on_cpu_are_refused_before_any_change():
    """16 keys with a bias: slower on cpu; said once, and neither rewrite is left behind."""
    g = Sam(hw=4)
    out, report = run(g.graph(), target="cpu", inputs=g.feed())
    assert report.parity.ok and fused(out) == 0
    assert codes(report, "unpack-folded-heads") == ["slower-on-target"]
    fired = {r.rule for r in report.remarks if r.kind == "passed"}
    assert not fired & {"unpack-folded-heads", "unsplit-spatial-merge"}, fired


def test_a_merge_that_does_not_split_the_sequence_is_left_and_said():
    """[B,N,h/2,2w,H]: not h·w = S row by row for the kernel's output: no rewrite of the
    merge, and the attention is missed with a remark, not in silence."""
    g = Sam()
    hw = g.hw
    out, report = run(g.graph(merge=[g.batch, N, hw // 2, hw, -1]), target="cuda", inputs=g.feed())
    assert report.parity.ok and fused(out) == 0
    assert codes(report, "fuse-attention") == ["unrecognized-layout"]
    assert "unsplit-spatial-merge" not in {r.rule for r in report.remarks if r.kind == "passed"}


@pytest.mark.parametrize("dynamo", [False, True])
def test_scores_regrouped_for_the_relative_positions_fuse(dynamo):
    """ViTDet: Reshape(Reshape(s, [B·N,h,w,h,w]) + rel_h + rel_w, [B·N,S,T]) is s plus the
    terms regrouped back (``unregroup-score-terms``), then the rest as above."""
    g = Sam()
    out, report = run(g.graph(dynamo=dynamo, regroup="full"), target="cuda", inputs=g.feed())
    assert report.parity.ok and fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []


def test_regrouped_terms_that_do_not_cover_every_score_are_left_and_said():
    """rel_h twice: broadcast over the key columns, its sum is not one bias per score; the
    rewrite keeps off and the attention is missed with a remark."""
    g = Sam()
    out, report = run(g.graph(regroup="rows"), target="cuda", inputs=g.feed())
    assert report.parity.ok and fused(out) == 0
    assert codes(report, "fuse-attention") == ["unrecognized-layout"]
    assert "unregroup-score-terms" not in {r.rule for r in report.remarks if r.kind == "passed"}


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_packed_projection_of_an_image_unbound_per_head_fuses(target):
    """SAM2's Hiera: x [B,h,w,E] → qkv → [B,S,3,N,H] → Split/Squeeze on axis 2 → each part
    transposed into heads (the key straight to Kᵀ by (0,2,3,1)); P·V merged back to
    [B,h,w,E]. No split of a [B,S,D] source: q, k and v go to the kernel merged per head."""
    hw, s, b = 8, 64, 2
    rng = np.random.default_rng(2)
    inits = [
        const("Wqkv", rng.standard_normal((E, 3 * E)) * 0.3, np.float32),
        const("pack", [0, s, 3, N, -1], np.int64),
        const("ones", [1, 1, 1], np.int64),
        const("two", [2], np.int64),
        const("scale", np.float32(H**-0.5), np.float32),
        const("image", [0, hw, hw, -1], np.int64),
    ]
    mk = helper.make_node
    nodes = [
        mk("MatMul", ["x", "Wqkv"], ["qkv"]),
        mk("Reshape", ["qkv", "pack"], ["qkv5"]),
        mk("Split", ["qkv5", "ones"], ["q5", "k5", "v5"], axis=2),
        *(mk("Squeeze", [f"{r}5", "two"], [f"{r}4"]) for r in "qkv"),
        mk("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
        mk("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        mk("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),
        mk("Mul", ["q", "scale"], ["qs"]),
        mk("MatMul", ["qs", "kt"], ["z"]),
        mk("Softmax", ["z"], ["P"], axis=-1),
        mk("MatMul", ["P", "v"], ["ctx"]),
        mk("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["ctx_t", "image"], ["y"]),
    ]
    m = model(nodes, [vi("x", [b, hw, hw, E])], [vi("y", [b, hw, hw, E])], inits)
    f = {"x": rng.standard_normal((b, hw, hw, E)).astype(np.float32)}
    out, report = run(m, target=target, inputs=f)
    assert report.parity.ran and report.parity.ok, report.parity
    assert fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []

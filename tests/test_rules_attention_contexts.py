"""Contexts P·V spelled so that fuse-attention reads them once rewritten: one Softmax times
two values, the merged contexts concatenated on the last axis (DiffLlama's differential
attention: ``concat-shared-contexts`` makes it one product of the concatenated values, fused
with a value head twice as wide), and a term added to the context before the heads merge
(Nyströmformer's convolution of the values: ``merge-context-term``).  Every graph is checked
against onnxruntime by graphopt's parity run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from conftest import codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

B, S, N, H = 2, 16, 4, 8
D = N * H


class Heads:
    """Nodes and initializers of a test graph over x [B,S,D] split into N heads of H."""

    def __init__(self, seed: int, merged: int, *inits):
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits = [
            const("split", [0, 0, N, H], np.int64),
            const("merge", [0, 0, merged], np.int64),
            const("scale", np.float32(H**-0.5)),
            *inits,
        ]

    def add(self, op, ins, out, **attrs) -> str:
        self.nodes.append(helper.make_node(op, ins, [out], name=f"n{len(self.nodes)}", **attrs))
        return out

    def heads(self, r: str, perm) -> str:
        """``Transpose(Reshape(x·W, [B,S,N,H]), perm)``."""
        self.inits.append(const(f"W{r}", self.rng.standard_normal((D, D)) * 0.3, np.float32))
        p = self.add("Reshape", [self.add("MatMul", ["x", f"W{r}"], f"{r}_p"), "split"], f"{r}_4")
        return self.add("Transpose", [p], f"{r}_h", perm=perm)


def graph(shared: bool = True, grouped: bool = False, guarded: bool = False):
    """q, k and two values split into heads; ``shared``: P·V₁ and P·V₂ of one Softmax (else
    a second Softmax for V₂); ``grouped``: the two values are the halves of one projection's
    heads, each repeated to N heads (DiffLlama's ``chunk`` and ``repeat``); ``guarded``: the
    probabilities behind the NaN guard of SDPA exports, ``Where(IsNaN(P), 0, P)``."""
    g = Heads(
        0, 2 * D, const("half", [N // 2, N // 2], np.int64), const("reps", [1, 2, 1, 1], np.int64)
    )
    add = g.add
    q, kt = g.heads("q", [0, 2, 1, 3]), g.heads("k", [0, 2, 3, 1])
    if grouped:
        v = g.heads("v", [0, 2, 1, 3])
        g.nodes.append(helper.make_node("Split", [v, "half"], ["v_a", "v_b"], axis=1))
        values = [add("Tile", [t, "reps"], f"{t}_rep") for t in ("v_a", "v_b")]
    else:
        values = [g.heads("v1", [0, 2, 1, 3]), g.heads("v2", [0, 2, 1, 3])]
    z = add("Add", [add("Mul", [add("MatMul", [q, kt], "qk"), "scale"], "s"), "mask"], "z")
    p = add("Softmax", [z], "P", axis=-1)
    if guarded:
        g.inits.append(const("zero", np.float32(0)))
        p = add("Where", [add("IsNaN", [p], "nan"), "zero", p], "P_safe")
    p2 = p if shared else add("Softmax", [add("Mul", [z, "scale"], "z2")], "P2", axis=-1)
    ctx = [
        add("Transpose", [add("MatMul", [pr, v], f"ctx{i}")], f"ctx{i}_t", perm=[0, 2, 1, 3])
        for i, (pr, v) in enumerate(zip((p, p2), values))
    ]
    add("Reshape", [add("Concat", ctx, "ctx", axis=-1), "merge"], "y")
    ins = [vi("x", [B, S, D]), vi("mask", [B, 1, 1, S])]
    return model(g.nodes, ins, [vi("y", [B, S, 2 * D])], g.inits)


def feed() -> dict:
    rng = np.random.default_rng(1)
    mask = np.zeros((B, 1, 1, S), np.float32)
    mask[1, ..., -3:] = -1e4
    return {"x": rng.standard_normal((B, S, D)).astype(np.float32), "mask": mask}


def fused(m) -> int:
    return sum(v for k, v in op_histogram(m.graph.node).items() if k.endswith("MultiHeadAttention"))


@pytest.mark.parametrize("grouped, guarded", [(False, False), (True, False), (True, True)])
def test_two_contexts_of_one_softmax_fuse_as_one_attention(grouped, guarded):
    out, report = run(graph(grouped=grouped, guarded=guarded), target="cuda", inputs=feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "concat-shared-contexts", "passed") == ["fired"]
    assert fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []


def test_contexts_of_two_softmaxes_stay_apart():
    out, report = run(graph(shared=False), target="cuda", inputs=feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert "fired" not in codes(report, "concat-shared-contexts", "passed")
    assert op_histogram(out.graph.node).get("Softmax", 0) + fused(out) == 2


def conv_term_graph(keys: int = S, masked: bool = True, of_probs: bool = False):
    """Nyströmformer: ``Transpose(P·V + Conv(V), (0,2,1,3))``, a depthwise convolution of each
    head's values along the sequence; ``of_probs``: NeZHa's value-side relative term P·Rᵥ
    instead."""
    g = Heads(2, D)
    g.inits.append(const("Wc", g.rng.standard_normal((N, 1, 5, 1)) * 0.3, np.float32))
    add = g.add
    q, kt = g.heads("q", [0, 2, 1, 3]), g.heads("k", [0, 2, 3, 1])
    v = g.heads("v", [0, 2, 1, 3])
    z = add("Mul", [add("MatMul", [q, kt], "qk"), "scale"], "s")
    if masked:
        z = add("Add", [z, "mask"], "z")
    p = add("Softmax", [z], "P", axis=-1)
    conv = add("Conv", [v, "Wc"], "conv", group=N, kernel_shape=[5, 1], pads=[2, 0, 2, 0])
    if of_probs:
        g.inits.append(const("Rv", g.rng.standard_normal((keys, H)) * 0.3, np.float32))
        conv = add("MatMul", [p, "Rv"], "rel_v")
    ctx = add("Add", [add("MatMul", [p, v], "pv"), conv], "ctx")
    add("Reshape", [add("Transpose", [ctx], "ctx_t", perm=[0, 2, 1, 3]), "merge"], "y")
    ins = [vi("x", [B, keys, D]), vi("mask", [B, 1, 1, keys])]
    return model(g.nodes, ins, [vi("y", [B, keys, D])], g.inits)


def conv_feed(keys: int = S) -> dict:
    rng = np.random.default_rng(3)
    mask = np.zeros((B, 1, 1, keys), np.float32)
    mask[1, ..., -3:] = -1e4
    return {"x": rng.standard_normal((B, keys, D)).astype(np.float32), "mask": mask}


def test_a_term_added_to_the_context_before_the_merge_fuses():
    out, report = run(conv_term_graph(), target="cuda", inputs=conv_feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "merge-context-term", "passed") == ["fired"]
    assert fused(out) == 1, op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []


def test_a_context_term_over_short_keys_is_said_slower_on_cpu():
    """16 masked keys on cpu: the context is left as it is, and the reason is the cost."""
    out, report = run(conv_term_graph(), target="cpu", inputs=conv_feed())
    assert report.parity.ok and fused(out) == 0
    assert "slower-on-target" in codes(report, "merge-context-term")
    assert codes(report, "fuse-attention") == []  # the census takes that refusal as said
    assert "Softmax" in op_histogram(out.graph.node)


def test_a_context_term_computed_from_the_probabilities_is_missed_precisely():
    out, report = run(conv_term_graph(of_probs=True), target="cuda", inputs=conv_feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert fused(out) == 0
    assert codes(report, "merge-context-term") == ["shared-intermediate"]
    assert codes(report, "fuse-attention") == []


def rotated_back_graph(split: bool = True):
    """DeepSeek-V4's context read per head before the merge: P·V [B,N,S,H] cut on the head's
    last axis (a Split, or with ``split=False`` two Slices), the second part changed per
    head (a stand-in for its inverse rotary: ``−part``), concatenated back, then merged."""
    g = Heads(3, D, const("parts", [H // 2, H // 2], np.int64))
    add = g.add
    q, kt, v = g.heads("q", [0, 2, 1, 3]), g.heads("k", [0, 2, 3, 1]), g.heads("v", [0, 2, 1, 3])
    z = add("Add", [add("Mul", [add("MatMul", [q, kt], "qk"), "scale"], "s"), "mask"], "z")
    ctx = add("MatMul", [add("Softmax", [z], "P", axis=-1), v], "ctx")
    if split:
        g.nodes.append(helper.make_node("Split", [ctx, "parts"], ["keep", "turn"], axis=3))
    else:
        g.inits += [const(n, [v], np.int64) for n, v in (("a0", 0), ("h2", H // 2), ("hh", H))]
        g.inits.append(const("ax3", [3], np.int64))
        add("Slice", [ctx, "a0", "h2", "ax3"], "keep")
        add("Slice", [ctx, "h2", "hh", "ax3"], "turn")
    back = add("Concat", ["keep", add("Neg", ["turn"], "turned")], "back", axis=-1)
    add("Reshape", [add("Transpose", [back], "back_t", perm=[0, 2, 1, 3]), "merge"], "y")
    ins = [vi("x", [B, S, D]), vi("mask", [B, 1, 1, S])]
    return model(g.nodes, ins, [vi("y", [B, S, D])], g.inits)


@pytest.mark.parametrize("split", [True, False], ids=["split", "slices"])
def test_a_context_read_per_head_before_the_merge_fuses(split):
    """The attention ends at P·V: the kernel's [B,S,N·H] is split back into [B,N,S,H] heads
    for the per-head readers, and the merge after them stays."""
    out, report = run(rotated_back_graph(split), target="cuda", inputs=feed())
    assert report.parity.ran and report.parity.ok, report.parity
    assert fused(out) == 1 and "Softmax" not in op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []


def window_graph():
    """Qwen2.5-VL's window attention: q, k and v heads split along the sequence into two
    windows, an attention in each, the contexts concatenated on the sequence, one merge."""
    g = Heads(4, D, const("windows", [S // 2, S // 2], np.int64))
    add = g.add
    heads = {r: g.heads(r, [0, 2, 1, 3]) for r in "qkv"}
    for r, t in heads.items():
        g.nodes.append(helper.make_node("Split", [t, "windows"], [f"{r}0", f"{r}1"], axis=2))
    ctx = []
    for w in "01":
        kt = add("Transpose", [f"k{w}"], f"kt{w}", perm=[0, 1, 3, 2])
        s = add("Mul", [add("MatMul", [f"q{w}", kt], f"qk{w}"), "scale"], f"s{w}")
        ctx.append(add("MatMul", [add("Softmax", [s], f"P{w}", axis=-1), f"v{w}"], f"ctx{w}"))
    joined = add("Concat", ctx, "ctx", axis=2)
    add("Reshape", [add("Transpose", [joined], "ctx_t", perm=[0, 2, 1, 3]), "merge"], "y")
    return model(g.nodes, [vi("x", [B, S, D])], [vi("y", [B, S, D])], g.inits)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_window_contexts_concatenated_before_one_merge_fuse_each(target):
    x = {"x": feed()["x"]}
    out, report = run(window_graph(), target=target, inputs=x)
    assert report.parity.ran and report.parity.ok, report.parity
    assert codes(report, "split-window-contexts", "passed") == ["fired"]
    assert fused(out) == 2 and "Softmax" not in op_histogram(out.graph.node)
    assert codes(report, "fuse-attention") == []

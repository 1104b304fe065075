"""Rotary caches: one cos and one sin table for every layer that needs the same one, no longer
than the positions the model can address, and no bigger a model because of them."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_rules_rotary import INV_FREQ, apply, run_model

from conftest import assert_optimized, const, model, vi
from graphopt.opt.graph.ir import op_histogram

B, H, S, D = 2, 4, 5, 16
LAYERS = 3


def initializer_bytes(m) -> int:
    return sum(len(i.raw_data) or i.ByteSize() for i in m.graph.initializer)


def caches(m) -> set[str]:
    """Names of the cos/sin caches the RotaryEmbedding nodes read."""
    names = set()
    for n in m.graph.node:
        if n.op_type == "RotaryEmbedding":
            names.update(n.input[2:4] if n.domain == "com.microsoft" else n.input[1:3])
    return names


def tables(rows: int):
    f = np.arange(rows)[:, None] * INV_FREQ[None, :]
    emb = np.concatenate([f, f], axis=1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def per_layer_tables(rows: int = 1024, layers: int = LAYERS):
    """Each layer gathers from its own cos/sin tables (older exports: one rotary module per
    attention layer, its buffers exported under that layer's names), q and k of a layer share
    them.  The tables are equal, and so are the half-width caches made from them, but both are
    over the size of constants cse compares (1024 x 8 elements)."""
    cos, sin = tables(rows)
    nodes, inits, ins, outs = [], [], [vi("position_ids", [B, S], TensorProto.INT64)], []
    inits.append(const("ax_1", [1], np.int64))
    for i in range(layers):
        p = f"l{i}_"
        nodes += [
            helper.make_node("Gather", [f"{p}cos_cached", "position_ids"], [f"{p}cos0"]),
            helper.make_node("Gather", [f"{p}sin_cached", "position_ids"], [f"{p}sin0"]),
            helper.make_node("Unsqueeze", [f"{p}cos0", "ax_1"], [f"{p}cos"]),
            helper.make_node("Unsqueeze", [f"{p}sin0", "ax_1"], [f"{p}sin"]),
        ]
        inits += [const(f"{p}cos_cached", cos), const(f"{p}sin_cached", sin)]
        for x in ("q", "k"):
            n, c = apply(f"{p}{x}", f"{p}cos", f"{p}sin", f"{p}{x}_rot", p=f"{p}{x}_")
            nodes += n
            inits += c
            ins.append(vi(f"{p}{x}", [B, H, S, D]))
            outs.append(vi(f"{p}{x}_rot", [B, H, S, D]))
    return model(nodes, ins, outs, inits)


def feeds(m, rng, first=0):
    f = {
        i.name: rng.standard_normal((B, H, S, D)).astype(np.float32)
        for i in m.graph.input
        if i.name != "position_ids"
    }
    f["position_ids"] = np.tile(np.arange(first, first + S), (B, 1)).astype(np.int64)
    return f


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_per_layer_tables_become_one_cos_and_one_sin(rng, target):
    m = per_layer_tables()
    out, _ = assert_optimized(m, target=target)
    assert op_histogram(out.graph.node).get("com.microsoft.RotaryEmbedding") == 2 * LAYERS
    names = caches(out)
    assert len(names) == 2, names  # one cos, one sin for q and k of every layer
    dims = {tuple(i.dims) for i in out.graph.initializer if i.name in names}
    assert dims == {(1024, D // 2)}  # the original's own rows: no more, no fewer
    assert initializer_bytes(out) <= initializer_bytes(m)
    f = feeds(m, rng, first=1024 - S)  # the last rows the original can address
    for want, got in zip(run_model(m, f), run_model(out, f)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_static_sequence_tables_cover_its_positions(rng, batch):
    """A static-shape export folds the positions 0..S-1: cos = Cos(emb) of a constant emb (1, S,
    D) per layer (ModernBERT at a fixed sequence length).  The caches have S rows, the
    positions are a constant (over a batch of more than one, expanded: folded to a constant)."""
    f = np.arange(S)[:, None] * INV_FREQ[None, :]
    emb = np.concatenate([f, f], axis=1)[None].astype(np.float32)
    nodes, inits, ins, outs = [], [const("ax_1", [1], np.int64)], [], []
    for i in range(LAYERS):
        p = f"l{i}_"
        nodes += [
            helper.make_node("Cos", [f"{p}emb"], [f"{p}cos0"]),
            helper.make_node("Sin", [f"{p}emb"], [f"{p}sin0"]),
            helper.make_node("Unsqueeze", [f"{p}cos0", "ax_1"], [f"{p}cos"]),
            helper.make_node("Unsqueeze", [f"{p}sin0", "ax_1"], [f"{p}sin"]),
        ]
        inits.append(const(f"{p}emb", emb))
        for x in ("q", "k"):
            n, c = apply(f"{p}{x}", f"{p}cos", f"{p}sin", f"{p}{x}_rot", p=f"{p}{x}_")
            nodes += n
            inits += c
            ins.append(vi(f"{p}{x}", [batch, H, S, D]))
            outs.append(vi(f"{p}{x}_rot", [batch, H, S, D]))
    m = model(nodes, ins, outs, inits)
    out, _ = assert_optimized(m)
    h = op_histogram(out.graph.node)
    assert h.get("com.microsoft.RotaryEmbedding") == 2 * LAYERS, h
    names = caches(out)
    assert len(names) == 2
    assert {tuple(i.dims) for i in out.graph.initializer if i.name in names} == {(S, D // 2)}
    assert initializer_bytes(out) <= initializer_bytes(m)
    feed = {i.name: rng.standard_normal((batch, H, S, D)).astype(np.float32) for i in m.graph.input}
    for want, got in zip(run_model(m, feed), run_model(out, feed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_caches_of_cos_sin_computed_on_the_fly_state_the_growth():
    """cos/sin computed from the positions (no table in the original): the one shared pair of
    caches is all the model grows by, and an analysis remark says how much."""
    from test_rules_rotary import decoder_rope, freqs_mul

    m = decoder_rope(freqs_mul())
    out, report = assert_optimized(m)
    names = caches(out)
    assert len(names) == 2
    grown = [r for r in report.remarks if r.code == "rotary-cache-growth"]
    assert len(grown) == 1 and grown[0].kind == "analysis", grown
    assert grown[0].args["bytes"] == 2 * 8192 * (D // 2) * 4
    assert initializer_bytes(out) - initializer_bytes(m) <= grown[0].args["bytes"]


def test_tables_from_the_original_state_no_growth():
    _, report = assert_optimized(per_layer_tables())
    assert not [r for r in report.remarks if r.code == "rotary-cache-growth"]


def test_tables_sliced_to_the_sequence_keep_the_original_rows(rng):
    """Older exports gather from ``cos_cached[:seq_len]`` (a Slice whose end is computed at
    run time): the caches have the original table's rows (every position the model can
    address), one cos and one sin for every layer."""
    rows, shape = 1024, [B, H, "seq", D]
    cos, sin = tables(rows)
    ins = [vi("position_ids", [B, "seq"], TensorProto.INT64)]
    nodes, outs = [], []
    inits = [
        const("ax_0", [0], np.int64),
        const("zero", [0], np.int64),
        const("ax_1", [1], np.int64),
    ]
    for i in range(LAYERS):
        p = f"l{i}_"
        nodes.append(helper.make_node("Shape", [f"{p}q"], [f"{p}seq"], start=2, end=3))
        for t, v in (("cos", cos), ("sin", sin)):
            nodes += [
                helper.make_node(
                    "Slice", [f"{p}{t}_cached", "zero", f"{p}seq", "ax_0"], [f"{p}{t}_s"]
                ),
                helper.make_node("Gather", [f"{p}{t}_s", "position_ids"], [f"{p}{t}0"]),
                helper.make_node("Unsqueeze", [f"{p}{t}0", "ax_1"], [f"{p}{t}"]),
            ]
            inits.append(const(f"{p}{t}_cached", v))
        for x in ("q", "k"):
            n, c = apply(f"{p}{x}", f"{p}cos", f"{p}sin", f"{p}{x}_rot", p=f"{p}{x}_")
            nodes += n
            inits += c
            ins.append(vi(f"{p}{x}", shape))
            outs.append(vi(f"{p}{x}_rot", shape))
    m = model(nodes, ins, outs, inits, opset=17)
    out, _ = assert_optimized(m)
    assert op_histogram(out.graph.node).get("com.microsoft.RotaryEmbedding") == 2 * LAYERS
    names = caches(out)
    assert len(names) == 2
    assert {tuple(i.dims) for i in out.graph.initializer if i.name in names} == {(rows, D // 2)}
    assert initializer_bytes(out) <= initializer_bytes(m)
    f = feeds(m, rng)
    for want, got in zip(run_model(m, f), run_model(out, f)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

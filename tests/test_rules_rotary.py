"""Rotary embedding fusion: exporter spellings → RotaryEmbedding, with onnxruntime parity."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

B, H, S, D = 2, 4, 5, 16
THETA = 10000.0
INV_FREQ = (1.0 / THETA ** (np.arange(0, D, 2) / D)).astype(np.float32)


def hist(m):
    return op_histogram(m.graph.node)


def rotate_half(x, out, p=""):
    """HF rotate_half: Concat(Neg(x[..., D/2:]), x[..., :D/2])."""
    nodes = [
        helper.make_node("Slice", [x, f"{p}h", f"{p}big", f"{p}ax"], [f"{p}hi"]),
        helper.make_node("Slice", [x, f"{p}zero", f"{p}h", f"{p}ax"], [f"{p}lo"]),
        helper.make_node("Neg", [f"{p}hi"], [f"{p}nhi"]),
        helper.make_node("Concat", [f"{p}nhi", f"{p}lo"], [out], axis=-1),
    ]
    inits = [
        const(f"{p}h", [D // 2], np.int64),
        const(f"{p}big", [2**63 - 1], np.int64),
        const(f"{p}ax", [3], np.int64),
        const(f"{p}zero", [0], np.int64),
    ]
    return nodes, inits


def rotate_pairs(x, out, p=""):
    """Interleaved: stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)."""
    nodes = [
        helper.make_node("Slice", [x, f"{p}one", f"{p}big", f"{p}ax", f"{p}two"], [f"{p}odd"]),
        helper.make_node("Slice", [x, f"{p}zero", f"{p}big", f"{p}ax", f"{p}two"], [f"{p}even"]),
        helper.make_node("Neg", [f"{p}odd"], [f"{p}nodd"]),
        helper.make_node("Unsqueeze", [f"{p}nodd", f"{p}last"], [f"{p}u1"]),
        helper.make_node("Unsqueeze", [f"{p}even", f"{p}last"], [f"{p}u2"]),
        helper.make_node("Concat", [f"{p}u1", f"{p}u2"], [f"{p}st"], axis=-1),
        helper.make_node("Reshape", [f"{p}st", f"{p}shape"], [out]),
    ]
    inits = [
        const(f"{p}one", [1], np.int64),
        const(f"{p}zero", [0], np.int64),
        const(f"{p}big", [2**63 - 1], np.int64),
        const(f"{p}ax", [3], np.int64),
        const(f"{p}two", [2], np.int64),
        const(f"{p}last", [-1], np.int64),
        const(f"{p}shape", [0, 0, 0, D], np.int64),
    ]
    return nodes, inits


def apply(x, cos, sin, out, rotate=rotate_half, p=""):
    """out = x·cos + rotate(x)·sin."""
    nodes, inits = rotate(x, f"{p}rotated", p)
    nodes += [
        helper.make_node("Mul", [x, cos], [f"{p}xc"]),
        helper.make_node("Mul", [f"{p}rotated", sin], [f"{p}rs"]),
        helper.make_node("Add", [f"{p}xc", f"{p}rs"], [out]),
    ]
    return nodes, inits


def freqs_mul(pos="position_ids", opset=17, scaling=None, head_axis=1):
    """transformers 5 on the fly: Unsqueeze(pos, -1)·inv_freq, Concat(f, f), Cos/Sin,
    [·scaling], Cast, Unsqueeze over the head axis."""
    nodes = [
        helper.make_node("Unsqueeze", [pos, "ax_m1"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["posf", "inv_freq"], ["freqs"]),
        helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos0"]),
        helper.make_node("Sin", ["emb"], ["sin0"]),
    ]
    inits = [const("ax_m1", [-1], np.int64), const("inv_freq", INV_FREQ)]
    c, s = "cos0", "sin0"
    if scaling is not None:
        nodes += [
            helper.make_node("Mul", ["cos0", "scaling"], ["cos1"]),
            helper.make_node("Mul", ["sin0", "scaling"], ["sin1"]),
        ]
        inits.append(const("scaling", scaling))
        c, s = "cos1", "sin1"
    nodes += [
        helper.make_node("Cast", [c], ["cosc"], to=TensorProto.FLOAT),
        helper.make_node("Cast", [s], ["sinc"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["cosc", "ax_head"], ["cos"]),
        helper.make_node("Unsqueeze", ["sinc", "ax_head"], ["sin"]),
    ]
    inits.append(const("ax_head", [head_axis], np.int64))
    return nodes, inits


def freqs_matmul(pos="position_ids"):
    """Older transformers: MatMul(inv_freq[None, :, None], pos[:, None, :]) → Transpose."""
    nodes = [
        helper.make_node("Unsqueeze", [pos, "ax_1"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["inv3", "posf"], ["fT"]),
        helper.make_node("Transpose", ["fT"], ["freqs"], perm=[0, 2, 1]),
        helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos0"]),
        helper.make_node("Sin", ["emb"], ["sin0"]),
        helper.make_node("Unsqueeze", ["cos0", "ax_1"], ["cos"]),
        helper.make_node("Unsqueeze", ["sin0", "ax_1"], ["sin"]),
    ]
    inits = [const("ax_1", [1], np.int64), const("inv3", INV_FREQ.reshape(1, -1, 1))]
    return nodes, inits


def freqs_table(rows=128, interleaved=False):
    """Cached tables gathered by position: Gather(cos_cached, pos) → Unsqueeze(1)."""
    f = np.arange(rows)[:, None] * INV_FREQ[None, :]
    emb = np.repeat(f, 2, axis=1) if interleaved else np.concatenate([f, f], axis=1)
    nodes = [
        helper.make_node("Gather", ["cos_cached", "position_ids"], ["cos0"]),
        helper.make_node("Gather", ["sin_cached", "position_ids"], ["sin0"]),
        helper.make_node("Unsqueeze", ["cos0", "ax_1"], ["cos"]),
        helper.make_node("Unsqueeze", ["sin0", "ax_1"], ["sin"]),
    ]
    inits = [
        const("cos_cached", np.cos(emb)),
        const("sin_cached", np.sin(emb)),
        const("ax_1", [1], np.int64),
    ]
    return nodes, inits


def decoder_rope(freqs, rotate=rotate_half, opset=17, x_shape=(B, H, S, D), two=True):
    """q and k of one attention layer rotated with one shared cos/sin."""
    nodes, inits = freqs
    outs = []
    for name in ("q", "k") if two else ("q",):
        n, i = apply(name, "cos", "sin", f"{name}_rot", rotate, p=f"{name}_")
        nodes += n
        inits += i
        outs.append(vi(f"{name}_rot", list(x_shape)))
    ins = [vi(name, list(x_shape)) for name in ("q", "k")[: len(outs)]]
    ins.append(vi("position_ids", [B, S], TensorProto.INT64))
    return model(nodes, ins, outs, inits, opset=opset)


def reference(x, pos, interleaved=False):
    f = pos[..., None].astype(np.float64) * INV_FREQ.astype(np.float64)
    cos, sin = np.cos(f)[:, None], np.sin(f)[:, None]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return out
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def run_model(m, feeds):
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def feeds(rng, first=0):
    return {
        "q": rng.standard_normal((B, H, S, D)).astype(np.float32),
        "k": rng.standard_normal((B, H, S, D)).astype(np.float32),
        "position_ids": np.tile(np.arange(first, first + S), (B, 1)).astype(np.int64),
    }


def rotary_node(m):
    return next(n for n in m.graph.node if n.op_type == "RotaryEmbedding")


def attr(node, name):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


# ------------------------------------------------------------------------------ fusions
@pytest.mark.parametrize(
    "freqs",
    [
        pytest.param(lambda: freqs_mul(scaling=None), id="torchscript-mul"),
        pytest.param(lambda: freqs_mul(scaling=0.9), id="attention-scaling"),
        pytest.param(freqs_matmul, id="matmul-transpose"),
        pytest.param(freqs_table, id="cached-table"),
    ],
)
def test_half_rotation_fuses(freqs, rng):
    m = decoder_rope(freqs())
    out, report = assert_optimized(m)
    h = hist(out)
    assert h.get("com.microsoft.RotaryEmbedding") == 2, h
    assert not {"Cos", "Sin", "Neg", "Slice", "Split"} & set(h), h
    node = rotary_node(out)
    assert node.domain == "com.microsoft" and attr(node, "interleaved") == 0
    assert list(node.input)[1] == "position_ids"  # contrib order: x, positions, cos, sin
    f = feeds(rng, first=40)
    want, got = run_model(m, f), run_model(out, f)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_matches_the_rope_formula_at_large_positions(rng):
    m = decoder_rope(freqs_mul())
    out, _ = run(m)
    f = feeds(rng, first=5000)
    got = run_model(out, f)
    np.testing.assert_allclose(got[0], reference(f["q"], f["position_ids"]), atol=5e-4)
    np.testing.assert_allclose(got[0], run_model(m, f)[0], atol=2e-5)


def test_cache_covers_the_gathered_table_rows():
    out, _ = run(decoder_rope(freqs_table(rows=128)))
    caches = [i for i in out.graph.initializer if i.dims and list(i.dims) == [128, D // 2]]
    assert len(caches) == 2  # cos and sin, shared by q and k


def test_cache_rows_from_environment(monkeypatch):
    monkeypatch.setenv("GRAPHOPT_ROTARY_POSITIONS", "300")
    out, _ = run(decoder_rope(freqs_mul()))
    assert any(list(i.dims) == [300, D // 2] for i in out.graph.initializer)


def test_split_halves_fuse():
    """slices-to-split rewrites the two halves as one Split; the rule reads that form too."""
    m = decoder_rope(freqs_mul())
    out, report = assert_optimized(m)
    assert "slices-to-split" in {r.rule for r in report.remarks if r.kind == "passed"}
    assert hist(out).get("com.microsoft.RotaryEmbedding") == 2


def test_interleaved_fuses(rng):
    m = decoder_rope(freqs_table(interleaved=True), rotate=rotate_pairs)
    out, _ = assert_optimized(m)
    node = rotary_node(out)
    assert attr(node, "interleaved") == 1
    f = feeds(rng, first=7)
    got = run_model(out, f)[0]
    np.testing.assert_allclose(got, reference(f["q"], f["position_ids"], True), atol=2e-5)


def test_opset_23_lowers_to_the_standard_op(rng):
    m = decoder_rope(freqs_mul(opset=23), opset=23)
    out, _ = assert_optimized(m)
    node = rotary_node(out)
    assert node.domain in ("", "ai.onnx")
    assert list(node.input)[3] == "position_ids"  # ONNX order: x, cos, sin, positions


def test_dynamic_batch_and_sequence():
    """Dims named alike on x and the positions prove one position per token."""
    shape = ["batch", H, "seq", D]
    nodes, inits = freqs_mul()
    n, i = apply("q", "cos", "sin", "q_rot", p="q_")
    m = model(
        nodes + n,
        [vi("q", shape), vi("position_ids", ["batch", "seq"], TensorProto.INT64)],
        [vi("q_rot", shape)],
        inits + i,
    )
    out, _ = assert_optimized(m)
    assert hist(out).get("com.microsoft.RotaryEmbedding") == 1
    assert "Expand" not in hist(out)  # the dims are provably x's: positions as they are


# ------------------------------------------------------------------------------ guards
def test_positions_broadcast_over_the_batch(rng):
    """Positions (1, S) for a batch of 2 broadcast in the original: expanded to (2, S)."""
    nodes, inits = freqs_mul()
    n, i = apply("q", "cos", "sin", "q_rot", p="q_")
    m = model(
        nodes + n,
        [vi("q", [B, H, S, D]), vi("position_ids", [1, S], TensorProto.INT64)],
        [vi("q_rot", [B, H, S, D])],
        inits + i,
    )
    out, _ = assert_optimized(m)
    h = hist(out)
    assert h.get("com.microsoft.RotaryEmbedding") == 1 and h.get("Expand") == 1, h
    f = {"q": feeds(rng)["q"], "position_ids": np.arange(9, 9 + S)[None].astype(np.int64)}
    np.testing.assert_allclose(run_model(out, f)[0], run_model(m, f)[0], atol=1e-5)


@pytest.mark.parametrize("rotate", [rotate_half, rotate_pairs], ids=["half", "interleaved"])
def test_bsnh_layout_fuses_as_3d(rng, rotate):
    """x as (batch, sequence, heads, head_dim), cos unsqueezed on axis 2 (GPT-J): the op's 3-D
    form between two Reshapes, num_heads set."""
    nodes, inits = freqs_table(interleaved=True) if rotate is rotate_pairs else freqs_mul()
    inits = [const(i.name, [2], np.int64) if i.name in ("ax_head", "ax_1") else i for i in inits]
    m = decoder_rope((nodes, inits), rotate=rotate, x_shape=(B, S, H, D), two=False)
    out, _ = assert_optimized(m)
    node = rotary_node(out)
    assert attr(node, "num_heads") == H
    assert attr(node, "interleaved") == (rotate is rotate_pairs)
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    f = {"q": q, "position_ids": feeds(rng, first=11)["position_ids"]}
    np.testing.assert_allclose(run_model(out, f)[0], run_model(m, f)[0], atol=2e-5)
    want = reference(q.transpose(0, 2, 1, 3), f["position_ids"], rotate is rotate_pairs)
    np.testing.assert_allclose(run_model(out, f)[0], want.transpose(0, 2, 1, 3), atol=2e-5)


def test_bsnh_layout_states_the_merged_shape():
    """The 3-D op's output keeps (batch, sequence, heads·head_dim): an attention lifted after it
    needs the rank, which onnx cannot infer for a contrib op (dynamo exports of vision rotary)."""
    nodes, inits = freqs_mul()
    inits = [const(i.name, [2], np.int64) if i.name in ("ax_head", "ax_1") else i for i in inits]
    m = decoder_rope((nodes, inits), rotate=rotate_half, x_shape=(B, S, H, D), two=False)
    out, _ = assert_optimized(m)
    name = rotary_node(out).output[0]
    (info,) = [v for v in out.graph.value_info if v.name == name]
    assert [d.dim_value for d in info.type.tensor_type.shape.dim] == [B, S, H * D]


def test_sequence_first_layout_refused():
    """(sequence, batch, heads, head_dim) as Megatron/ChatGLM write it: cos is (S, B, 1, D)."""
    nodes, inits = freqs_mul(head_axis=2)
    nodes = [n for n in nodes if n.output[0] not in ("cos", "sin")]
    for t in ("cos", "sin"):
        nodes += [
            helper.make_node("Transpose", [f"{t}c"], [f"{t}_sb"], perm=[1, 0, 2]),
            helper.make_node("Unsqueeze", [f"{t}_sb", "ax_head"], [t]),
        ]
    m = decoder_rope((nodes, inits), x_shape=(S, B, H, D), two=False)
    out, report = run(m)
    assert "com.microsoft.RotaryEmbedding" not in hist(out)
    assert "layout" in codes(report, "fuse-rotary-embedding")


def test_cos_from_two_sources_refused():
    """cos computed from the positions and another input is not a per-position table."""
    nodes, inits = freqs_mul()
    nodes = [n for n in nodes if n.output[0] != "posf"]
    nodes.insert(1, helper.make_node("Cast", ["pos3"], ["posf0"], to=TensorProto.FLOAT))
    nodes.insert(2, helper.make_node("Add", ["posf0", "offset"], ["posf"]))
    n, i = apply("q", "cos", "sin", "q_rot", p="q_")
    m = model(
        nodes + n,
        [
            vi("q", [B, H, S, D]),
            vi("position_ids", [B, S], TensorProto.INT64),
            vi("offset", [1]),
        ],
        [vi("q_rot", [B, H, S, D])],
        inits + i,
    )
    out, report = run(m)
    assert "com.microsoft.RotaryEmbedding" not in hist(out)
    assert "position-source" in codes(report, "fuse-rotary-embedding")


def test_unequal_halves_refused():
    """cos = Cos(Concat(f, 2f)): its halves differ, RotaryEmbedding repeats one."""
    nodes, inits = freqs_mul()
    nodes.insert(3, helper.make_node("Add", ["freqs", "freqs"], ["freqs2"]))
    nodes[4] = helper.make_node("Concat", ["freqs", "freqs2"], ["emb"], axis=-1)
    m = decoder_rope((nodes, inits), two=False)
    out, report = run(m)
    assert "com.microsoft.RotaryEmbedding" not in hist(out)
    assert "constant-mismatch" in codes(report, "fuse-rotary-embedding")


def test_wrong_half_slices_refused():
    """Slices at D/4 are not rotate_half."""
    nodes, inits = freqs_mul()
    n, i = apply("q", "cos", "sin", "q_rot", p="q_")
    i = [const("q_h", [D // 4], np.int64) if t.name == "q_h" else t for t in i]
    m = model(
        nodes + n,
        [vi("q", [B, H, S, D]), vi("position_ids", [B, S], TensorProto.INT64)],
        [vi("q_rot", [B, H, S, D])],
        inits + i,
    )
    out, report = run(m, pipeline="fold-constants,rules{level=2},dce")
    assert "com.microsoft.RotaryEmbedding" not in hist(out)
    assert "constant-mismatch" in codes(report, "fuse-rotary-embedding")


@pytest.mark.parametrize("target, code", [("npu", "no-kernel"), ("tensorrt", "opset-too-old")])
def test_targets_without_the_kernel(target, code):
    m = decoder_rope(freqs_mul(), two=False)
    out, report = run(m, target=target, check=False)
    assert "RotaryEmbedding" not in {n.op_type for n in out.graph.node}
    assert code in codes(report, "fuse-rotary-embedding")


def test_cuda_takes_the_contrib_op():
    out, _ = run(decoder_rope(freqs_mul(), two=False), target="cuda")
    assert rotary_node(out).domain == "com.microsoft"


@pytest.mark.parametrize("passed", [0, 8], ids=["whole-head", "partial"])
def test_phi3_partial_rotary_spelling_fuses(rng, passed):
    """Phi-3: q_rot = q[..., :rotary_dim], q_pass = q[..., rotary_dim:] (empty when the whole
    head rotates), Concat(rope(q_rot), q_pass); slices-to-split makes one Split of three parts.
    With a pass-through part (GPT-NeoX, Phi-2), q_rot is rotated whole and the Slice/Concat
    around it stay."""
    nodes, inits = freqs_mul()
    nodes += [
        helper.make_node("Slice", ["q", "p_zero", "p_d", "p_ax"], ["q_r"]),
        helper.make_node("Slice", ["q", "p_d", "p_big", "p_ax"], ["q_pass"]),
    ]
    inits += [
        const("p_zero", [0], np.int64),
        const("p_d", [D], np.int64),
        const("p_big", [2**63 - 1], np.int64),
        const("p_ax", [3], np.int64),
    ]
    n, i = apply("q_r", "cos", "sin", "q_emb", p="q_")
    nodes += n + [helper.make_node("Concat", ["q_emb", "q_pass"], ["q_out"], axis=-1)]
    shape = [B, H, S, D + passed]
    m = model(
        nodes,
        [vi("q", shape), vi("position_ids", [B, S], TensorProto.INT64)],
        [vi("q_out", shape)],
        inits + i,
    )
    out, _ = assert_optimized(m)
    assert hist(out).get("com.microsoft.RotaryEmbedding") == 1, hist(out)
    f = {
        "q": rng.standard_normal(shape).astype(np.float32),
        "position_ids": feeds(rng, first=3)["position_ids"],
    }
    np.testing.assert_allclose(run_model(out, f)[0], run_model(m, f)[0], atol=1e-5)


def test_fp16_fuses_with_fp16_caches(rng):
    """cos/sin computed in fp32 and cast to the model's fp16 (transformers' spelling): the
    caches are the fp16 values the model itself computes."""
    nodes, inits = freqs_mul()
    for node in nodes:
        if node.output[0] in ("cosc", "sinc"):
            node.attribute[0].i = TensorProto.FLOAT16
    n, i = apply("q", "cos", "sin", "q_rot", p="q_")
    f16 = TensorProto.FLOAT16
    m = model(
        nodes + n,
        [vi("q", [B, H, S, D], f16), vi("position_ids", [B, S], TensorProto.INT64)],
        [vi("q_rot", [B, H, S, D], f16)],
        inits + i,
    )
    out, _ = assert_optimized(m)
    assert hist(out).get("com.microsoft.RotaryEmbedding") == 1
    assert {i.data_type for i in out.graph.initializer if list(i.dims) == [8192, D // 2]} == {f16}
    f = {"q": feeds(rng)["q"].astype(np.float16), "position_ids": feeds(rng, 60)["position_ids"]}
    np.testing.assert_allclose(
        run_model(out, f)[0].astype(np.float32), run_model(m, f)[0].astype(np.float32), atol=2e-3
    )

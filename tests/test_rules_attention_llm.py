"""fuse-attention on decoder LLM self-attention: a per-layer KV cache (present = Concat(past,
new)), grouped-query repeat_kv (Unsqueeze → Expand → Reshape of the kv heads; MQA with one kv
head; MHA without a repeat), the causal + padding (+ sliding window) mask built from
``attention_mask``, and the query rotated by RotaryEmbedding after the head split; spelled like
the TorchScript and the dynamo exporters, checked with onnxruntime parity on padded masks."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_rules_rotary import D as H  # the rotary helpers rotate heads of this size
from test_rules_rotary import apply, freqs_mul

from conftest import assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram

NQ = 4
HIDDEN = NQ * H
RULE = "fuse-attention"
MHA = "com.microsoft.MultiHeadAttention"
ROT = "com.microsoft.RotaryEmbedding"


def mk(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def dim(t: str, start: int, end: int, out: str) -> helper.NodeProto:
    return mk("Shape", [t], [out], start=start, end=end)


def heads(rng, r: str, n: int, inits: list, dynamo: bool, hp: int = H, norm: bool = False) -> list:
    """``{r}_heads`` = Transpose(Reshape(x · W, [0|B, 0|S, n, hp]), (0,2,1,3)); with ``norm``
    an RMSNorm over each head between the Reshape and the Transpose (Qwen3's q/k norm)."""
    inits.append(const(f"W{r}", rng.standard_normal((HIDDEN, n * hp)) * 0.2))
    target = [-1, 0, n, hp] if dynamo else [0, 0, -1, hp]
    inits.append(const(f"{r}_split", target, np.int64))
    nodes = [
        mk("MatMul", ["x", f"W{r}"], [f"{r}_p"]),
        mk("Reshape", [f"{r}_p", f"{r}_split"], [f"{r}_4"]),
    ]
    if norm:
        nodes += rms_norm(rng, f"{r}_4", f"{r}_n", hp, inits, dynamo)
    return nodes + [
        mk("Transpose", [f"{r}_n" if norm else f"{r}_4"], [f"{r}_heads"], perm=[0, 2, 1, 3]),
    ]


def rms_norm(rng, x: str, out: str, width: int, inits: list, dynamo: bool) -> list:
    """``out`` = x / sqrt(mean(x², -1) + eps) · w, as the exporters write RMSNorm."""
    inits += [const(f"{x}_w", 1 + 0.1 * rng.standard_normal(width)), const(f"{x}_eps", 1e-6)]
    inits += [const(f"{x}_two", 2.0)]
    if dynamo:
        inits.append(const(f"{x}_axes", [-1], np.int64))
        mean = mk("ReduceMean", [f"{x}_sq", f"{x}_axes"], [f"{x}_ms"], keepdims=1)
    else:
        mean = mk("ReduceMean", [f"{x}_sq"], [f"{x}_ms"], axes=[-1], keepdims=1)
    return [
        mk("Pow", [x, f"{x}_two"], [f"{x}_sq"]),
        mean,
        mk("Add", [f"{x}_ms", f"{x}_eps"], [f"{x}_me"]),
        mk("Sqrt", [f"{x}_me"], [f"{x}_rms"]),
        mk("Div", [x, f"{x}_rms"], [f"{x}_nx"]),
        mk("Mul", [f"{x}_nx", f"{x}_w"], [out]),
    ]


def repeat_kv(t: str, nkv: int, out: str, dynamo: bool) -> list:
    """HF repeat_kv: Reshape(Expand(Unsqueeze(t, 2), [B, nkv, rep, T, H]), [B, NQ, T, H]), the
    targets from Shape(t) glue; none when every query head has its own kv head."""
    if nkv == NQ:
        return [mk("Identity", [t], [out])]
    lengths = [dim(t, 2, 4, f"{t}_th")]
    if dynamo:  # the total length as past + new, the way dynamo's sym sizes spell it
        lengths = [
            dim("past_key", 2, 3, f"{t}_past"),
            dim("x", 1, 2, f"{t}_new"),
            mk("Add", [f"{t}_past", f"{t}_new"], [f"{t}_total"]),
            mk("Concat", [f"{t}_total", "h"], [f"{t}_th"], axis=0),
        ]
    return lengths + [
        mk("Unsqueeze", [t, "ax2"], [f"{t}_u"]),
        dim(t, 0, 2, f"{t}_bn"),
        dim(t, 0, 1, f"{t}_b"),
        mk("Concat", [f"{t}_bn", "rep", f"{t}_th"], [f"{t}_es"], axis=0),
        mk("Expand", [f"{t}_u", f"{t}_es"], [f"{t}_e"]),
        mk("Concat", [f"{t}_b", "nq", f"{t}_th"], [f"{t}_rs"], axis=0),
        mk("Reshape", [f"{t}_e", f"{t}_rs"], [out], allowzero=int(dynamo)),
    ]


def k_transposed(k: str, dynamo: bool) -> list:
    """Kᵀ: one Transpose, or dynamo's Reshape(Transpose(Reshape(k, [-1,T,H]), (0,2,1)),
    [B,N,H,T])."""
    if not dynamo:
        return [mk("Transpose", [k], ["kt"], perm=[0, 1, 3, 2])]
    return [
        dim(k, 2, 3, "k_t"),
        dim(k, 0, 2, "k_bn"),
        mk("Concat", ["m1", "k_t", "h"], ["k3"], axis=0),
        mk("Concat", ["k_bn", "h", "k_t"], ["k4t"], axis=0),
        mk("Reshape", [k, "k3"], ["K3"]),
        mk("Transpose", ["K3"], ["K3T"], perm=[0, 2, 1]),
        mk("Reshape", ["K3T", "k4t"], ["kt"]),
    ]


def mask(window: int | None, fill: float) -> tuple[list, list]:
    """The exporters' 4-D additive mask [B,1,S,T]: Where(causal ∧ padding [∧ window], 0, fill)
    from index compares and ``attention_mask``."""
    nodes = [
        dim("past_key", 2, 3, "past_len"),
        dim("x", 1, 2, "q_len"),
        dim("attention_mask", 1, 2, "t_len"),
        mk("Squeeze", ["past_len"], ["p0"]),
        mk("Squeeze", ["q_len"], ["s0"]),
        mk("Squeeze", ["t_len"], ["t0"]),
        mk("Add", ["p0", "s0"], ["end"]),
        mk("Range", ["p0", "end", "one"], ["qpos"]),
        mk("Range", ["zero", "t0", "one"], ["kpos"]),
        mk("Unsqueeze", ["qpos", "ax1"], ["qcol"]),
        mk("Unsqueeze", ["kpos", "ax0"], ["krow"]),
        mk("LessOrEqual", ["krow", "qcol"], ["causal"]),
        mk("Unsqueeze", ["attention_mask", "ax12"], ["am4"]),
        mk("Cast", ["am4"], ["pad"], to=TensorProto.BOOL),
    ]
    allowed = "causal"
    if window is not None:
        nodes += [
            mk("Sub", ["qcol", "window"], ["lo"]),
            mk("Greater", ["krow", "lo"], ["inwin"]),
            mk("And", ["causal", "inwin"], ["local"]),
        ]
        allowed = "local"
    nodes += [
        mk("And", [allowed, "pad"], ["cond"]),
        mk("Where", ["cond", "fzero", "fill"], ["bias"]),
    ]
    inits = [
        const("one", 1, np.int64),
        const("zero", 0, np.int64),
        const("window", window or 0, np.int64),
        const("ax0", [0], np.int64),
        const("ax1", [1], np.int64),
        const("ax12", [1, 2], np.int64),
        const("fzero", 0.0),
        const("fill", fill),
    ]
    return nodes, inits


def rope(r: str, phi3: bool) -> tuple[list, list]:
    """``{r}_rot`` = the heads rotated; Phi-3 spells it Concat(rope(x[..., :H]), x[..., H:])
    (the pass-through part empty when the whole head rotates)."""
    if not phi3:
        return apply(f"{r}_heads", "cos", "sin", f"{r}_rot", p=f"{r}_")
    nodes, inits = apply(f"{r}_part", "cos", "sin", f"{r}_emb", p=f"{r}_")
    nodes += [
        mk("Slice", [f"{r}_heads", "zero1", "rot_w", "ax3"], [f"{r}_part"]),
        mk("Slice", [f"{r}_heads", "rot_w", "big", "ax3"], [f"{r}_pass"]),
        mk("Concat", [f"{r}_emb", f"{r}_pass"], [f"{r}_rot"], axis=-1),
    ]
    return nodes, inits


def decoder(
    nkv: int = 2,
    dynamo: bool = False,
    window: int | None = None,
    batch="batch",
    phi3=False,
    qk_norm=False,
    passed: int = 0,
    sinks: bool = False,
    sink_gate: bool = False,
    row_sinks: bool = False,
):
    """One decoder self-attention with a KV cache and RoPE, as the exporters write it; with
    ``qk_norm`` an RMSNorm over each q and k head before the rotation (Qwen3), with ``passed``
    (and ``phi3``) heads of H + ``passed`` of which the first H rotate (GPT-NeoX, Phi-2); with
    ``sinks`` GPT-OSS's learned sink logit per head concatenated to the scores, the row maximum
    subtracted, and the sink's column sliced off the probabilities; with ``sink_gate`` the same
    sinks as Granite's gate on the context, ``(P·V)·sigmoid(logsumexp(z) − sink)``; with
    ``row_sinks`` the sink logits are a projection of each token (Inkling 2: ``x·Wₛ`` [B,S,N]
    transposed to [B,N,S,1]) concatenated as the column."""
    rng = np.random.default_rng(7)
    sinks = sinks or row_sinks
    hp = H + passed
    nodes, inits = freqs_mul("position_ids")
    for r, n in (("q", NQ), ("k", nkv), ("v", nkv)):
        nodes += heads(rng, r, n, inits, dynamo, hp, qk_norm and r != "v")
    for r in "qk":
        n, i = rope(r, phi3)
        nodes, inits = nodes + n, inits + i
    nodes += [
        mk("Concat", ["past_key", "k_rot"], ["present_key"], axis=-2),
        mk("Concat", ["past_value", "v_heads"], ["present_value"], axis=-2),
    ]
    nodes += repeat_kv("present_key", nkv, "k_all", dynamo)
    nodes += repeat_kv("present_value", nkv, "v_all", dynamo) + k_transposed("k_all", dynamo)
    fill = float(np.finfo(np.float32).min) if dynamo else -np.inf
    mask_nodes, mask_inits = mask(window, fill)
    nodes += mask_nodes + [
        mk("Mul", ["q_rot", "qk_scale"], ["qs"]),
        mk("Mul", ["kt", "qk_scale"], ["kts"]),
        mk("MatMul", ["qs", "kts"], ["scores"]),
        mk("Add", ["scores", "bias"], ["z"]),
        *(_sink_softmax("z", "P", dynamo, row_sinks) if sinks else []),
        *(
            []
            if sinks or sink_gate
            else [
                mk("Softmax", ["z"], ["P0"], axis=-1),
                mk("IsNaN", ["P0"], ["nan"]),
                mk("Where", ["nan", "fzero", "P0"], ["P"]),
            ]
        ),
        *(_sink_gate("z", "P", "v_all", "ctx", dynamo) if sink_gate else []),
        *([] if sink_gate else [mk("MatMul", ["P", "v_all"], ["ctx"])]),
        mk("Transpose", ["ctx"], ["ctxT"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["ctxT", "merge"], ["y"]),
    ]
    inits += mask_inits + [
        const("qk_scale", H**-0.25),
        const("merge", [0, 0, NQ * hp], np.int64),
        const("ax2", [2], np.int64),
        const("rep", [NQ // nkv], np.int64),
        const("nq", [NQ], np.int64),
        const("m1", [-1], np.int64),
        const("h", [hp], np.int64),
        const("rot_w", [H], np.int64),
        const("zero1", [0], np.int64),
        const("big", [2**63 - 1], np.int64),
        const("ax3", [3], np.int64),
    ]
    if sinks:
        inits += [
            const("sinks", rng.standard_normal((1, NQ, 1, 1)) * 2),
            const("one1", [1], np.int64),
        ]
    if row_sinks:
        inits.append(const("sink_w", rng.standard_normal((HIDDEN, NQ)) * 0.5))
        nodes += [
            mk("MatMul", ["x", "sink_w"], ["row_logits"]),
            mk("Transpose", ["row_logits"], ["row_logits_t"], perm=[0, 2, 1]),
            mk("Unsqueeze", ["row_logits_t", "m1"], ["z_row_col"]),
        ]
    if sink_gate:
        inits.append(const("sinks3", rng.standard_normal((1, NQ, 1)) * 2))
    nodes = _topo(nodes, inputs_of(nkv, batch, hp), inits)
    for i, nd in enumerate(nodes):
        nd.name = f"n{i}_{nd.op_type}"
    inputs = inputs_of(nkv, batch, hp)
    outputs = [
        vi("y", [batch, "seq", NQ * hp]),
        vi("present_key", [batch, nkv, "total", hp]),
        vi("present_value", [batch, nkv, "total", hp]),
    ]
    return model(nodes, inputs, outputs, inits, opset=18 if dynamo else 17)


def _sink_softmax(z: str, p: str, dynamo: bool, rows: bool = False) -> list:
    """``{p}`` = Slice(Softmax(cat − max(cat)), 0, −1), cat = Concat([z, sinks expanded to
    [B,N,S,1]], −1) (ReduceMax's axes an input from opset 18); with ``rows`` the column is
    the computed ``{z}_row_col``."""
    axes = {} if dynamo else {"axes": [-1]}
    col = f"{z}_row_col" if rows else f"{z}_col"
    return [
        *(
            []
            if rows
            else [
                dim(z, 0, 3, f"{z}_lead"),
                mk("Concat", [f"{z}_lead", "one1"], [f"{z}_col_shape"], axis=0),
                mk("Expand", ["sinks", f"{z}_col_shape"], [f"{z}_col"]),
            ]
        ),
        mk("Concat", [z, col], [f"{z}_cat"], axis=-1),
        mk("ReduceMax", [f"{z}_cat"] + (["m1"] if dynamo else []), [f"{z}_max"], **axes),
        mk("Sub", [f"{z}_cat", f"{z}_max"], [f"{z}_sub"]),
        mk("Softmax", [f"{z}_sub"], [f"{z}_p"], axis=-1),
        mk("Slice", [f"{z}_p", "zero1", "m1", "ax3"], [p]),
    ]


def _sink_gate(z: str, p: str, v: str, ctx: str, dynamo: bool) -> list:
    """``{ctx}`` = (Softmax(z)·V) · Unsqueeze(Sigmoid(ReduceLogSumExp(z, −1) − sinks), −1),
    the Sub and Sigmoid in float32 between Casts (TorchScript) or not (dynamo)."""
    axes = {} if dynamo else {"axes": [-1]}
    sub = [mk("Sub", [f"{z}_lse", "sinks3"], [f"{z}_gap"])]
    if not dynamo:
        sub.append(mk("Cast", [f"{z}_gap"], [f"{z}_gap32"], to=TensorProto.FLOAT))
    gap = f"{z}_gap" if dynamo else f"{z}_gap32"
    return [
        mk("Softmax", [z], [p], axis=-1),
        mk("MatMul", [p, v], [f"{ctx}_pv"]),
        mk("ReduceLogSumExp", [z] + (["m1"] if dynamo else []), [f"{z}_lse"], keepdims=0, **axes),
        *sub,
        mk("Sigmoid", [gap], [f"{z}_gate"]),
        mk("Unsqueeze", [f"{z}_gate", "m1"], [f"{z}_gate4"]),
        mk("Mul", [f"{ctx}_pv", f"{z}_gate4"], [ctx]),
    ]


def inputs_of(nkv: int, batch, hp: int = H) -> list:
    return [
        vi("x", [batch, "seq", HIDDEN]),
        vi("attention_mask", [batch, "total"], TensorProto.INT64),
        vi("position_ids", [batch, "seq"], TensorProto.INT64),
        vi("past_key", [batch, nkv, "past", hp]),
        vi("past_value", [batch, nkv, "past", hp]),
    ]


def _topo(nodes: list, inputs: list, inits: list) -> list:
    """``nodes`` in topological order."""
    known = {v.name for v in inputs} | {i.name for i in inits}
    todo, done = list(nodes), []
    while todo:
        ready = [n for n in todo if all(i in known or i == "" for i in n.input)]
        assert ready, [n.op_type for n in todo]
        for n in ready:
            known.update(n.output)
            done.append(n)
            todo.remove(n)
    return done


def feeds(
    nkv: int,
    batch: int = 2,
    seq: int = 3,
    past: int = 5,
    seed: int = 0,
    left: bool = False,
    hp: int = H,
) -> dict:
    """A decode step with padding: the first row right-padded (left-padded with ``left``), the
    second left-padded."""
    rng = np.random.default_rng(seed)
    total = past + seq
    am = np.ones((batch, total), np.int64)
    if left:
        am[0, :2] = 0
    else:
        am[0, total - 2 :] = 0
    if batch > 1:
        am[1, :2] = 0
    pos = np.broadcast_to(np.arange(past, total), (batch, seq)).astype(np.int64)
    kv = (batch, nkv, past, hp)
    return {
        "x": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
        "attention_mask": am,
        "position_ids": np.ascontiguousarray(pos),
        "past_key": rng.standard_normal(kv).astype(np.float32),
        "past_value": rng.standard_normal(kv).astype(np.float32),
    }


def node(m, op: str):
    return next(n for n in m.graph.node if n.op_type == op)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("nkv", [2, 1, NQ], ids=["gqa-4-2", "mqa-4-1", "mha-4-4"])
def test_decoder_self_attention_fuses(nkv, dynamo):
    """Every kv grouping, both exporters: one MultiHeadAttention over the repeated kv heads
    [B,N,T,H], the query's rotary redone on [B,S,D], the present outputs kept."""
    m = decoder(nkv, dynamo)
    out, report = assert_optimized(m, inputs=feeds(nkv))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and h.get(ROT) == 2, h
    assert codes(report, RULE) == []
    mha = node(out, "MultiHeadAttention")
    q_rot = next(n for n in out.graph.node if n.output[0] == mha.input[0])
    assert q_rot.op_type == "RotaryEmbedding"
    assert {a.name: a.i for a in q_rot.attribute}["num_heads"] == NQ
    assert [o.name for o in out.graph.output] == ["y", "present_key", "present_value"]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_sliding_window_mask_moves_into_the_bias(dynamo):
    """Mistral: the window is part of the mask; with more keys than the window the result
    still matches."""
    m = decoder(2, dynamo, window=4)
    out, _ = assert_optimized(m, inputs=feeds(2, seq=3, past=6))
    assert op_histogram(out.graph.node).get(MHA) == 1


def test_prefill_batch_one_and_a_decode_step_match():
    """Empty cache with a longer prompt, then a one-token step: both match the original."""
    m = decoder(1)
    out, _ = assert_optimized(m, inputs=feeds(1, batch=1, seq=7, past=0))
    _, report = run(out, inputs=feeds(1, batch=2, seq=1, past=9, seed=3))
    assert report.parity.ok


def test_a_query_made_per_head_some_other_way_goes_to_the_kernel_merged():
    """A rotated query whose heads come from one Reshape to [B,N,S,H] (no Transpose: no
    split the rule knows) is still [B,N,S,H] heads with the key's batch and heads: the kernel
    takes it merged, [B,S,N·H], and computes what the model computes."""
    m = decoder(2)
    g = m.graph
    split = next(n for n in g.node if n.output[0] == "q_4")
    split.input[1] = "q_bnsh"
    g.initializer.append(const("q_bnsh", [0, NQ, -1, H], np.int64))
    tr = next(n for n in g.node if n.output[0] == "q_heads")
    tr.op_type = "Identity"
    del tr.attribute[:]
    out, report = run(m, inputs=feeds(2))
    assert report.parity.ran and report.parity.ok, report.parity
    assert [r.code for r in report.remarks if r.rule == RULE and r.kind == "missed"] == []
    assert "Softmax" not in {n.op_type for n in out.graph.node}


GQA = "com.microsoft.GroupQueryAttention"


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("nkv", [2, 1, NQ], ids=["gqa-4-2", "mqa-4-1", "mha-4-4"])
def test_batch_of_one_lowers_to_group_query_attention(nkv, dynamo):
    """A batch provably 1: GroupQueryAttention takes the new k/v (rotated on [B,S,D]) and the
    past, writes the present outputs, and matches on right- and left-padded masks, a prefill
    and a decode step."""
    m = decoder(nkv, dynamo, batch=1)
    out, report = assert_optimized(m, inputs=feeds(nkv, batch=1))
    h = op_histogram(out.graph.node)
    assert h.get(GQA) == 1 and MHA not in h, h
    readers = {n.op_type for n in out.graph.node if "past_key" in n.input}
    assert readers <= {"GroupQueryAttention", "Shape"}, readers  # the cache Concat is gone
    assert h.get(ROT) == 2, h
    gqa = node(out, "GroupQueryAttention")
    assert list(gqa.output[1:]) == ["present_key", "present_value"]
    attrs = {a.name: a.i for a in gqa.attribute}
    assert attrs["kv_num_heads"] == nkv and attrs["num_heads"] == NQ and attrs["causal"] == 0
    for f in (
        feeds(nkv, batch=1, left=True, seed=1),
        feeds(nkv, batch=1, seq=6, past=0, seed=2),
        feeds(nkv, batch=1, seq=1, past=9, left=True, seed=3),
    ):
        _, again = run(m, inputs=f)
        assert again.parity.ok
        assert run(out, inputs=f)[1].parity.ok


def test_group_query_attention_with_a_sliding_window_mask():
    """Mistral's window is in the mask, which the kernel takes whole (causal=0)."""
    m = decoder(2, window=4, batch=1)
    out, _ = assert_optimized(m, inputs=feeds(2, batch=1, seq=3, past=6))
    assert op_histogram(out.graph.node).get(GQA) == 1


@pytest.mark.parametrize("batch", ["batch", 1], ids=["mha", "gqa"])
def test_phi3_rotary_with_an_empty_pass_through(batch):
    """Phi-3's partial-rotary spelling rotating the whole head: the empty pass-through Concat
    (and the Split it comes from) belong to the fusion."""
    m = decoder(NQ, phi3=True, batch=batch)
    out, report = assert_optimized(m, inputs=feeds(NQ, batch=2 if batch == "batch" else 1))
    h = op_histogram(out.graph.node)
    assert h.get(MHA if batch == "batch" else GQA) == 1, h
    assert codes(report, RULE) == []


def _ort(m, f):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, f)


def test_declared_generation_steps_lower_a_dynamic_batch_to_group_query_attention():
    """decoder_steps=generate: batched prefill over an empty cache and batched one-token steps
    match; the fusion says it rests on the declaration; a batched chunk over a past fails loudly
    in the kernel (no other numbers)."""
    m = decoder(2)
    opts = {"options": {"decoder_steps": "generate"}}
    out, report = assert_optimized(m, inputs=feeds(2, batch=2, seq=1, past=9), **opts)
    assert op_histogram(out.graph.node).get(GQA) == 1
    notes = [r for r in report.remarks if r.code == "declared-decoder-steps"]
    assert len(notes) == 1 and notes[0].kind == "analysis"
    prefill = feeds(2, batch=3, seq=6, past=0, seed=4)
    for want, got in zip(_ort(m, prefill), _ort(out, prefill)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="batch_size must be 1"):
        _ort(out, feeds(2, batch=2, seq=3, past=5))
    plain, _ = run(m, inputs=feeds(2, batch=2, seq=1, past=9))
    assert op_histogram(plain.graph.node).get(MHA) == 1  # undeclared: MultiHeadAttention


def test_cuda_keeps_multiheadattention_for_a_batch_of_one():
    """On cuda the decoder lowers to MultiHeadAttention: its GroupQueryAttention has no fp32
    kernel, and the table restricts it to causal=1 (the exact lowering's causal=0 is not
    verified there), which keeps fp16 decoders off it too."""
    from graphopt.opt.rewrite.target import get_target

    assert get_target("cuda").kernel_attributes["GroupQueryAttention"]["causal"] == ("1",)
    out, _ = run(decoder(2, batch=1), target="cuda", inputs=feeds(2, batch=1))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and GQA not in h, h


def test_cli_declares_decoder_steps_into_the_report_and_the_manifest(tmp_path):
    """`--decoder-steps generate`: GroupQueryAttention on the symbolic batch, and the declaration
    is written where a deployment reads it (report.json and manifest.json)."""
    import json

    import onnx

    from cli_runner import CliRunner
    from graphopt.cli import app

    src, npz, out = tmp_path / "dec.onnx", tmp_path / "feeds.npz", tmp_path / "out"
    onnx.save(decoder(2), src)
    np.savez(npz, **feeds(2, batch=2, seq=1, past=9))
    args = ["optimize", str(src), "-o", str(out), "--inputs", str(npz), "--no-measure", "-q"]
    res = CliRunner().invoke(app, [*args, "--decoder-steps", "generate"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert report["ops_after"].get(GQA) == 1
    assert report["declared"] == manifest["declared"] == {"decoder_steps": "generate"}
    res = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "out2")])
    assert res.exit_code == 0, res.output
    plain = json.loads((tmp_path / "out2" / "report.json").read_text())
    assert plain["declared"] == {} and GQA not in plain["ops_after"]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("nkv", [2, NQ], ids=["gqa-4-2", "mha-4-4"])
def test_qk_norm_before_the_rotation_fuses(nkv, dynamo):
    """Qwen3: an RMSNorm over each q and k head between the split and the rotation. The
    query stays per head as the model computes it (norm, fused RotaryEmbedding) and the kernel
    takes it back as [B,S,D]; the key reaches the kernel through the cache."""
    m = decoder(nkv, dynamo, qk_norm=True)
    out, report = assert_optimized(m, inputs=feeds(nkv))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and h.get(ROT) == 2, h
    assert codes(report, RULE) == []
    assert [o.name for o in out.graph.output] == ["y", "present_key", "present_value"]
    _, again = run(out, inputs=feeds(nkv, batch=1, seq=1, past=7, seed=2))
    assert again.parity.ok


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "norm-and-rotary"])
def test_partial_rotary_with_a_pass_through_concat_fuses(qk_norm, dynamo):
    """GPT-NeoX / Phi-2: Concat(rope(x[..., :R]), x[..., R:]) along the head axis, the
    rotation fused first, then the attention over the concatenated heads."""
    passed = 8
    m = decoder(NQ, dynamo, phi3=True, qk_norm=qk_norm, passed=passed)
    f = feeds(NQ, hp=H + passed)
    out, report = assert_optimized(m, inputs=f)
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and h.get(ROT) == 2, h
    assert codes(report, RULE) == []
    mha = node(out, "MultiHeadAttention")
    assert {a.name: a.i for a in mha.attribute}["num_heads"] == NQ


def test_partial_rotary_fuses_with_the_rotation_left_unfused(monkeypatch):
    """Without the rotary fusion (its rule disabled) the walk goes through the exported
    rotate_half (Slice, Neg, Concat, Mul by cos/sin, Add): the order of the fusions does not
    matter."""
    import dataclasses

    from graphopt.opt.rewrite import target as targets

    cpu = targets.TARGETS["cpu"]
    off = cpu.disabled_rules | {"fuse-rotary-embedding"}
    monkeypatch.setitem(targets.TARGETS, "cpu", dataclasses.replace(cpu, disabled_rules=off))
    m = decoder(NQ, phi3=True, passed=8)
    out, report = assert_optimized(m, inputs=feeds(NQ, hp=H + 8))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and ROT not in h, h
    assert codes(report, RULE) == []

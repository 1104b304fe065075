"""fuse-attention on attention sinks (GPT-OSS): a learned logit per head concatenated to every
row of the scores, the row maximum subtracted, the sink's column sliced off the probabilities.
GroupQueryAttention takes them as ``head_sink`` where the decoder lowers to it; elsewhere
MultiHeadAttention goes over one more key, a zero key and value whose bias column is the sink
logit.  Spelled like both exporters, and as a gate on the context (Granite's sliding-window
decoders: ``(P·V)·sigmoid(logsumexp(z) − sink)``), checked with onnxruntime parity on padded
masks."""

import pytest
from test_rules_attention_llm import GQA, MHA, NQ, decoder, feeds, node

from conftest import assert_optimized, codes, run
from graphopt.opt.graph.ir import op_histogram

RULE = "fuse-attention"


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("nkv", [2, NQ], ids=["gqa-4-2", "mha-4-4"])
def test_sinks_lower_to_group_query_attention_head_sink(nkv, dynamo):
    m = decoder(nkv, dynamo, batch=1, sinks=True)
    out, report = assert_optimized(m, inputs=feeds(nkv, batch=1))
    h = op_histogram(out.graph.node)
    assert h.get(GQA) == 1 and "Softmax" not in h and "ReduceMax" not in h, h
    assert codes(report, RULE) == []
    gqa = node(out, "GroupQueryAttention")
    assert len(gqa.input) == 12 and gqa.input[11], list(gqa.input)  # head_sink
    for f in (feeds(nkv, batch=1, seq=6, past=0, seed=2), feeds(nkv, batch=1, seq=1, past=9)):
        assert run(out, inputs=f)[1].parity.ok


def test_sinks_of_a_declared_generation_loop():
    m = decoder(2, sinks=True)
    opts = {"options": {"decoder_steps": "generate"}}
    out, _ = assert_optimized(m, inputs=feeds(2, batch=2, seq=1, past=9), **opts)
    assert op_histogram(out.graph.node).get(GQA) == 1


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_sinks_elsewhere_go_to_multihead_attention_over_a_null_key(target):
    """A dynamic batch and no declaration (and cuda, whose GroupQueryAttention is causal=1
    only): MultiHeadAttention over the keys and one zero key and value, whose bias column is
    the sink logit — exact on padded masks, a prefill and a decode step."""
    m = decoder(2, sinks=True)
    out, report = assert_optimized(m, target=target, inputs=feeds(2))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and GQA not in h and "Softmax" not in h, h
    assert codes(report, RULE) == []
    for f in (
        feeds(2, batch=3, seq=6, past=0, seed=2),
        feeds(2, batch=2, seq=1, past=9, left=True),
    ):
        assert run(out, target=target, inputs=f)[1].parity.ok


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_sink_logit_per_query_row_goes_to_the_null_keys_bias_column(dynamo, target):
    """Inkling 2's sinks are a projection of each token: a computed column [B,N,S,1], not a
    constant per head, so never GroupQueryAttention's ``head_sink``; MultiHeadAttention takes
    it as its null key's bias column, broadcast with the mask's rows."""
    m = decoder(2, dynamo, batch=1, row_sinks=True)
    out, report = assert_optimized(m, target=target, inputs=feeds(2, batch=1))
    h = op_histogram(out.graph.node)
    assert h.get(MHA) == 1 and GQA not in h and "Softmax" not in h, h
    assert codes(report, RULE) == []
    for f in (feeds(2, batch=1, seq=6, past=0, seed=2), feeds(2, batch=1, seq=1, past=9)):
        assert run(out, target=target, inputs=f)[1].parity.ok


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_sinks_spelled_as_a_gate_on_the_context_fuse(dynamo, target):
    """``sigmoid(lse − c) = Σ eˢ / (Σ eˢ + eᶜ)``: the gate is the sink's share of the
    denominator, so the sinks go to the kernel as the concatenated spelling's do."""
    m = decoder(2, dynamo, batch=1, sink_gate=True)
    out, report = assert_optimized(m, target=target, inputs=feeds(2, batch=1))
    h = op_histogram(out.graph.node)
    fused = GQA if target == "cpu" else MHA
    assert h.get(fused) == 1 and "Softmax" not in h and "ReduceLogSumExp" not in h, h
    assert codes(report, RULE) == []
    for f in (feeds(2, batch=1, seq=6, past=0, seed=2), feeds(2, batch=1, seq=1, past=9)):
        assert run(out, target=target, inputs=f)[1].parity.ok

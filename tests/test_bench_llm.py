"""examples/llm/bench_llm.py: the decoder bench's non-timing logic on a tiny decoder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "llm" / "bench_llm.py"
VOCAB, HIDDEN, KV, HEAD = 10, 8, 2, 4


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_llm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_llm"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tiny_decoder(with_positions: bool = True) -> onnx.ModelProto:
    """One layer: embedding → key/value [B, 2, S, 4] appended to the cache; logits from the
    embedding plus (when ``with_positions``) the positions, else from the mask's length — the
    same numbers when positions are past … past + S − 1 (as a GQA graph derives them)."""
    rng = np.random.default_rng(0)
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "input_ids"], ["h"]),
        n("Reshape", ["h", "kv_shape"], ["h4"]),
        n("Transpose", ["h4"], ["kv"], perm=[0, 2, 1, 3]),
        n("Concat", ["past_key_values.0.key", "kv"], ["present.0.key"], axis=2),
        n("Concat", ["past_key_values.0.value", "kv"], ["present.0.value"], axis=2),
        n("MatMul", ["h", "head"], ["scores"]),
    ]
    if with_positions:
        nodes.append(n("Cast", ["position_ids"], ["pos"], to=TensorProto.FLOAT))
    else:  # positions = total − S + arange(S), from the mask and the tokens
        nodes += [
            n("Shape", ["attention_mask"], ["total"], start=1),
            n("Shape", ["input_ids"], ["seq"], start=1),
            n("Sub", ["total", "seq"], ["start"]),
            n("Squeeze", ["start"], ["start0"]),
            n("Squeeze", ["total"], ["total0"]),
            n("Range", ["start0", "total0", "one"], ["pos_i"]),
            n("Unsqueeze", ["pos_i", "zero"], ["pos_b"]),
            n("Cast", ["pos_b"], ["pos"], to=TensorProto.FLOAT),
        ]
    nodes += [
        n("Unsqueeze", ["pos", "minus1"], ["pos3"]),
        n("Mul", ["pos3", "pos_w"], ["bias"]),
        n("Add", ["scores", "bias"], ["logits"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "embed"),
        numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "head"),
        numpy_helper.from_array(rng.standard_normal(VOCAB).astype(np.float32), "pos_w"),
        numpy_helper.from_array(np.array([0, 0, KV, HEAD], np.int64), "kv_shape"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", i64, ["batch", "total"]),
    ]
    if with_positions:
        inputs.append(helper.make_tensor_value_info("position_ids", i64, ["batch", "seq"]))
    kv_dims = ["batch", KV, "past", HEAD]
    inputs += [
        helper.make_tensor_value_info(f"past_key_values.0.{x}", f32, kv_dims)
        for x in ("key", "value")
    ]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "seq", VOCAB])]
    # a builder's graph may list its presents in another order
    order = ("key", "value") if with_positions else ("value", "key")
    outputs += [
        helper.make_tensor_value_info(f"present.0.{x}", f32, ["batch", KV, "total", HEAD])
        for x in order
    ]
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, feeds: dict) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_read_decoder(bench):
    dec = bench.read_decoder(tiny_decoder())
    assert (dec.layers, dec.kv_heads, dec.head_dim, dec.vocab, dec.hidden) == (1, KV, HEAD, 10, 8)
    assert dec.past_names == ["past_key_values.0.key", "past_key_values.0.value"]
    assert bench.heads_hidden(dec, None)[:2] == (HIDDEN // HEAD, HIDDEN)


def test_read_decoder_refuses_a_model_without_a_cache(bench):
    model = tiny_decoder()
    del model.graph.input[3:]
    with pytest.raises(ValueError, match="not a decoder"):
        bench.read_decoder(model)


@pytest.mark.parametrize("new,past", [(5, 0), (1, 7)])
def test_feeds_prefill_and_decode(bench, new, past):
    dec = bench.read_decoder(tiny_decoder())
    feeds = bench.make_feeds(dec, new, past, seed=3)
    assert feeds["input_ids"].shape == (1, new) and feeds["input_ids"].max() < VOCAB
    assert feeds["attention_mask"].shape == (1, past + new) and feeds["attention_mask"].all()
    assert feeds["position_ids"].tolist() == [list(range(past, past + new))]
    assert feeds["past_key_values.0.key"].shape == (1, KV, past, HEAD)
    out = run(session(tiny_decoder()), feeds)  # the plain interface runs them as they are
    assert out["present.0.key"].shape == (1, KV, past + new, HEAD)


@pytest.mark.parametrize("new,past", [(5, 0), (1, 7)])
def test_adapter_feeds_a_graph_without_positions_the_same_computation(bench, new, past):
    dec = bench.read_decoder(tiny_decoder())
    feeds = bench.make_feeds(dec, new, past, seed=1)
    plain, builder = session(tiny_decoder()), session(tiny_decoder(with_positions=False))
    adapted = bench.adapt_feeds(builder.get_inputs(), feeds)
    assert "position_ids" not in adapted and set(adapted) == set(feeds) - {"position_ids"}
    parity = bench.compare(run(plain, feeds), run(builder, adapted))
    assert parity["ok"] and parity["tokens_same"]
    assert parity["logits_max_abs"] < 1e-5 and parity["present_max_abs"] == 0.0


def test_adapter_refuses_what_it_cannot_feed(bench):
    dec = bench.read_decoder(tiny_decoder())
    feeds = bench.make_feeds(dec, 2, 3)
    inputs = session(tiny_decoder()).get_inputs()
    with pytest.raises(ValueError, match="no such input"):
        bench.adapt_feeds(inputs, {k: v for k, v in feeds.items() if k != "attention_mask"})
    without_past = [a for a in inputs if a.name != "past_key_values.0.value"]
    with pytest.raises(ValueError, match="not the same computation"):
        bench.adapt_feeds(without_past, feeds)


def test_adapter_casts_to_the_inputs_type(bench):
    class Arg:
        name, type = "attention_mask", "tensor(int32)"

    out = bench.adapt_feeds([Arg()], {"attention_mask": np.ones((1, 3), np.int64)})
    assert out["attention_mask"].dtype == np.int32


def test_compare_sees_a_changed_token_and_a_wrong_present(bench):
    ref = run(session(tiny_decoder()), bench.make_feeds(bench.read_decoder(tiny_decoder()), 4, 2))
    same = bench.compare(ref, {k: v.copy() for k, v in ref.items()})
    assert same["ok"] and same["logits_max_abs"] == 0.0
    bad = {k: v.copy() for k, v in ref.items()}
    pos = ref["logits"][0, 0].argmin()
    bad["logits"][0, 0, pos] = ref["logits"].max() + 1.0
    worse = bench.compare(ref, bad)
    assert not worse["ok"] and not worse["tokens_same"]
    bad = {k: v.copy() for k, v in ref.items()}
    bad["present.0.value"] += 0.5
    assert bench.compare(ref, bad)["present_max_abs"] == pytest.approx(0.5)
    short = {**ref, "logits": ref["logits"][:, :1]}
    assert not bench.compare(ref, short)["ok"]


def test_paired_rounds_reports_every_variant_against_the_base(bench):
    calls = {"plain": 0, "other": 0}

    def make(name):
        def run_once():
            calls[name] += 1

        return run_once

    stats = bench.paired_rounds(
        {n: make(n) for n in calls},
        "plain",
        rounds=10,
        min_seconds=0.0,
        max_seconds=5.0,
        precision=10.0,
    )
    assert calls["plain"] == calls["other"] == stats["plain"]["rounds"] >= 10
    assert stats["plain"]["ratio"] == stats["plain"]["low"] == 1.0


def test_markdown_rows(bench):
    row = {
        "model": "m",
        "variants": {
            "plain": {"why": None, "key_ops": {}},
            "genai": {"why": "no DIR/m/model.onnx", "key_ops": {}},
        },
        "scenarios": {
            sc: {
                "variants": {
                    "plain": {"ms": 1.0, "ratio": 1.0, "low": 1.0, "high": 1.0, "parity": None}
                }
            }
            for sc in ("prefill", "decode")
        },
    }
    text = bench.markdown([row])
    assert "| m | plain | - | 1.00 | 1.000 [1.000, 1.000] |" in text
    assert "n/a: no DIR/m/model.onnx" in text


def test_a_variant_made_in_a_child_process_reports_its_failure(bench, tmp_path):
    v = bench.isolated(
        "ort-transformers",
        str(tmp_path / "missing.onnx"),
        str(tmp_path / "o.onnx"),
        "llama",
        8,
        256,
    )
    assert v.path is None and "model_type=gpt2 failed" in v.why
    crashed = bench.isolated("no-such-kind", "a", "b")
    assert crashed.path is None and crashed.why.startswith("crashed")

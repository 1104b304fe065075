"""The greedy generation check on a tiny KV-cache decoder built in the test."""

import json
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_rules_rotary import D, apply, freqs_mul

import graphopt
from conftest import const, vi
from graphopt.opt.verify.generation import check_generation, decoder_interface
from graphopt.targets.bundle import write_bundle

V, E = 50, D  # vocab, hidden = head_dim (one kv head)


def tiny_decoder(
    present_scale: float = 1.0, opset: int = 17, rope: bool = False
) -> onnx.ModelProto:
    """Embedding → one causal attention head over Concat(past, new) → vocab projection.
    ``present_scale`` ≠ 1 writes a wrong key cache (the attention itself reads the right one),
    so the step that computes it is still exact and only the next steps differ.  ``rope``
    rotates q and k as transformers exports it (else a learned position term is added)."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "input_ids"], ["x0"]),
        n("Cast", ["position_ids"], ["pe_posf"], to=TensorProto.FLOAT),
        n("Unsqueeze", ["pe_posf", "ax_m1"], ["pe_pos3"]),
        n("Mul", ["pe_pos3", "pos_w"], ["pe"]),
        n("Add", ["x0", "pe"], ["x"]),
        n("MatMul", ["x", "wq"], ["q3"]),
        n("MatMul", ["x", "wk"], ["k3"]),
        n("MatMul", ["x", "wv"], ["v3"]),
        n("Unsqueeze", ["q3", "ax_1"], ["q"] if not rope else ["q_in"]),
        n("Unsqueeze", ["k3", "ax_1"], ["k"] if not rope else ["k_in"]),
        n("Unsqueeze", ["v3", "ax_1"], ["v"]),
        n("Concat", ["past_key_values.0.key", "k"], ["keys"], axis=2),
        n("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=2),
        n("Mul", ["k", "present_scale"], ["k_written"]),
        n("Concat", ["past_key_values.0.key", "k_written"], ["present.0.key"], axis=2),
        n("Transpose", ["keys"], ["keysT"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "keysT"], ["scores"]),
        # causal: key position j is visible to the token at position p when j <= p
        n("Shape", ["keys"], ["kshape"]),
        n("Gather", ["kshape", "two"], ["total"]),
        n("Range", ["zero", "total", "one"], ["kpos"]),
        n("Unsqueeze", ["position_ids", "ax_m1"], ["qpos"]),
        n("LessOrEqual", ["kpos", "qpos"], ["visible3"]),
        n("Unsqueeze", ["visible3", "ax_1"], ["visible"]),
        n("Where", ["visible", "scores", "neg"], ["masked"]),
        n("Softmax", ["masked"], ["probs"], axis=-1),
        n("MatMul", ["probs", "present.0.value"], ["ctx4"]),
        n("Squeeze", ["ctx4", "ax_1"], ["ctx"]),
        n("Add", ["ctx", "x"], ["h"]),
        n("MatMul", ["h", "w_out"], ["logits"]),
    ]
    inits = [
        const("embed", f32(V, E)),
        const("pos_w", f32(E) * 0.1),
        const("wq", f32(E, E)),
        const("wk", f32(E, E)),
        const("wv", f32(E, E)),
        const("w_out", f32(E, V)),
        const("present_scale", present_scale),
        const("ax_m1", [-1], np.int64),
        const("ax_1", [1], np.int64),
        const("two", 2, np.int64),
        const("zero", 0, np.int64),
        const("one", 1, np.int64),
        const("neg", -1e9),
    ]
    if rope:
        freqs, tables = freqs_mul()
        q_rope, q_inits = apply("q_in", "cos", "sin", "q", p="q_")
        k_rope, k_inits = apply("k_in", "cos", "sin", "k", p="k_")
        nodes = nodes[:11] + freqs + q_rope + k_rope + nodes[11:]
        names = {i.name for i in inits}
        inits += [i for i in tables + q_inits + k_inits if i.name not in names]
    cache = ["batch", 1, "past", E]
    present = ["batch", 1, "total", E]
    g = helper.make_graph(
        nodes,
        "tiny-decoder",
        [
            vi("input_ids", ["batch", "seq"], TensorProto.INT64),
            vi("attention_mask", ["batch", "total"], TensorProto.INT64),
            vi("position_ids", ["batch", "seq"], TensorProto.INT64),
            vi("past_key_values.0.key", cache),
            vi("past_key_values.0.value", cache),
        ],
        [
            vi("logits", ["batch", "seq", V]),
            vi("present.0.key", present),
            vi("present.0.value", present),
        ],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def windowed_decoder(window: int) -> onnx.ModelProto:
    """A decoder whose cache keeps the last ``window`` rows (a sliding-window cache) and whose
    attention adds a bias from ``attention_mask``, which must cover the kept rows + new tokens."""
    rng = np.random.default_rng(1)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "input_ids"], ["x"]),
        n("MatMul", ["x", "wq"], ["q3"]),
        n("MatMul", ["x", "wk"], ["k3"]),
        n("MatMul", ["x", "wv"], ["v3"]),
        n("Unsqueeze", ["q3", "ax_1"], ["q"]),
        n("Unsqueeze", ["k3", "ax_1"], ["k"]),
        n("Unsqueeze", ["v3", "ax_1"], ["v"]),
        n("Concat", ["past_key_values.0.key", "k"], ["keys"], axis=2),
        n("Concat", ["past_key_values.0.value", "v"], ["values"], axis=2),
        n("Slice", ["keys", "last", "big", "ax_2"], ["present.0.key"]),
        n("Slice", ["values", "last", "big", "ax_2"], ["present.0.value"]),
        n("Transpose", ["keys"], ["keysT"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "keysT"], ["scores"]),
        n("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        n("Sub", ["maskf", "one_f"], ["off"]),
        n("Mul", ["off", "big_f"], ["bias2"]),
        n("Unsqueeze", ["bias2", "ax_12"], ["bias"]),
        n("Add", ["scores", "bias"], ["biased"]),
        n("Softmax", ["biased"], ["probs"], axis=-1),
        n("MatMul", ["probs", "values"], ["ctx4"]),
        n("Squeeze", ["ctx4", "ax_1"], ["ctx"]),
        n("MatMul", ["ctx", "w_out"], ["logits"]),
    ]
    inits = [
        const("embed", f32(V, E)),
        const("wq", f32(E, E)),
        const("wk", f32(E, E)),
        const("wv", f32(E, E)),
        const("w_out", f32(E, V)),
        const("ax_1", [1], np.int64),
        const("ax_2", [2], np.int64),
        const("ax_12", [1, 2], np.int64),
        const("last", [-window], np.int64),
        const("big", [2**62], np.int64),
        const("one_f", 1.0),
        const("big_f", 1e9),
    ]
    cache = ["batch", 1, "past", E]
    g = helper.make_graph(
        nodes,
        "windowed-decoder",
        [
            vi("input_ids", ["batch", "seq"], TensorProto.INT64),
            vi("attention_mask", ["batch", "total"], TensorProto.INT64),
            vi("past_key_values.0.key", cache),
            vi("past_key_values.0.value", cache),
        ],
        [
            vi("logits", ["batch", "seq", V]),
            vi("present.0.key", ["batch", 1, "kept", E]),
            vi("present.0.value", ["batch", 1, "kept", E]),
        ],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_mask_covers_the_rows_a_sliding_cache_keeps():
    """The cache keeps 4 rows of the 6 + 5 tokens and the model takes the mask over those rows
    and the new token (4 + 1, where a full cache's model takes 11 + 1)."""
    m = windowed_decoder(window=4)
    r = check_generation(m, m, prefill=6, steps=5)
    assert r.ran and r.ok, r.why


def test_interface_is_read_from_the_names():
    spec = decoder_interface(tiny_decoder())
    assert spec.cache["past_key_values.0.key"][0] == "present.0.key"
    assert spec.vocab == V and spec.attention_mask and spec.position_ids


def test_same_model_generates_the_same_tokens():
    m = tiny_decoder()
    r = check_generation(m, m, prefill=5, steps=4, batch=2)
    assert r.ran and r.ok and r.tokens_match and r.max_abs == 0.0
    assert [len(t) for t in r.tokens_original] == [5, 5]  # prefill's token + 4 decode steps
    assert [s["tokens"] for s in r.per_step] == [5, 1, 1, 1, 1]


def test_a_wrong_cache_shows_from_the_second_step():
    """The prefill's logits are exact; the cache it returns is not, so decode steps differ."""
    r = check_generation(tiny_decoder(), tiny_decoder(present_scale=1.5), prefill=4, steps=3)
    assert r.ran and not r.ok
    assert r.per_step[0]["ok"] and r.per_step[0]["max_abs"] == 0.0
    assert not all(s["ok"] for s in r.per_step[1:])
    assert r.max_abs > 1e-3


def test_not_a_decoder():
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", [2])], [vi("y", [2])]
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    r = check_generation(m, m)
    assert not r.ran and "input_ids" in r.why


def test_bundle_report_has_generation(tmp_path):
    m = tiny_decoder()
    out, report = graphopt.optimize(m, target="cpu", level=2)
    bundle = write_bundle(out, report, tmp_path / "b")
    doc = json.loads((bundle / "report.json").read_text())
    gen = doc["generation"]
    assert gen["ran"] and gen["ok"] and gen["tokens_match"], gen
    assert gen["steps"] == 8 and gen["prefill"] == 8


def test_rotary_fused_decoder_generates_the_same_tokens(tmp_path):
    """End to end: RoPE fused into RotaryEmbedding, then 8 decode steps at growing positions."""
    m = tiny_decoder(rope=True)
    out, report = graphopt.optimize(m, target="cpu", level=2)
    assert report.ops_after.get("com.microsoft.RotaryEmbedding") == 2, report.ops_after
    doc = json.loads((write_bundle(out, report, tmp_path / "b") / "report.json").read_text())
    gen = doc["generation"]
    assert gen["ok"] and gen["tokens_match"] and len(gen["per_step"]) == 9, gen
    assert gen["max_rel"] < 1e-4  # parity's fp32 rtol, relative to the largest logit


def test_bundle_report_of_another_model_has_none(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", [2])], [vi("y", [2])]
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    out, report = graphopt.optimize(m, target="cpu", level=2)
    doc = json.loads((write_bundle(out, report, tmp_path / "b") / "report.json").read_text())
    assert doc["generation"] is None


def gated_logits(m: onnx.ModelProto) -> onnx.ModelProto:
    """``tiny_decoder`` whose logits pass an element-wise gate (x·σ(x·s+t)): a region the
    generated-kernel pass fuses into a ``graphopt.fused`` node."""
    m = onnx.ModelProto.FromString(m.SerializeToString())
    producer = next(nd for nd in m.graph.node if "logits" in nd.output)
    producer.output[list(producer.output).index("logits")] = "raw"
    n = helper.make_node
    m.graph.node.extend(
        [
            n("Mul", ["raw", "gate_s"], ["gm"]),
            n("Add", ["gm", "gate_t"], ["ga"]),
            n("Sigmoid", ["ga"], ["gs"]),
            n("Mul", ["raw", "gs"], ["logits"]),
        ]
    )
    m.graph.initializer.extend([const("gate_s", 0.5), const("gate_t", 0.1)])
    return m


def test_generation_runs_a_model_with_generated_kernels(monkeypatch):
    """The check's sessions register the custom-op libraries of generated kernels, as every
    other session graphopt opens does (it said not-run: 'not a registered function/op')."""
    from graphopt.targets.codegen import NO_KERNELS_ENV, gates, kernel_pipeline

    monkeypatch.delenv(NO_KERNELS_ENV, raising=False)
    fast = gates.GateResult(True, numbers={"fused_us": 1.0, "unfused_us": 2.0, "speedup": 2.0})
    monkeypatch.setattr(gates, "benchmark", lambda *a, **kw: fast)
    m = gated_logits(tiny_decoder())
    pipeline = kernel_pipeline("cpu", 2, None, True)
    out, report = graphopt.optimize(m, target="cpu", level=2, pipeline=pipeline)
    fused = [nd for nd in out.graph.node if nd.domain.startswith("graphopt")]
    if not fused:
        pytest.skip(f"no generated kernel here: {report.ops_after}")
    result = check_generation(m, out).to_dict()
    assert result["verdict"] == "ok", result


def test_cli_checks_the_model_as_written(tmp_path, monkeypatch):
    """The command's check runs the bundle's model.onnx, its weights mapped from that file (the
    file the validity check wrote and moved into place), not a new serialization."""
    from cli_runner import CliRunner
    from graphopt.cli import app
    from graphopt.opt.verify import generation

    seen = []
    real = generation.check_generation

    def spy(original, optimized, **kw):
        mapped, folder = kw["written"]
        seen.append(
            {
                loc.value
                for t in mapped.graph.initializer
                for loc in t.external_data
                if loc.key == "location"
            }
        )
        assert (Path(folder) / "model.onnx").is_file()
        return real(original, optimized, **kw)

    monkeypatch.setattr(generation, "check_generation", spy)
    path = tmp_path / "decoder.onnx"
    onnx.save(tiny_decoder(), path)
    args = ["optimize", str(path), "-o", str(tmp_path / "b"), "--no-measure", "--no-kernels"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert seen == [{"model.onnx"}]
    gen = json.loads((tmp_path / "b" / "report.json").read_text())["generation"]
    assert gen["ok"] and gen["tokens_match"], gen


def test_the_original_steps_on_a_thread_beside_the_optimized_model(monkeypatch):
    """Both models' steps run at once (the original's on a thread): same values as one after
    the other, and a failure is still told of the model it happened in."""
    from graphopt.opt.verify import generation

    names = []
    real = generation._Decoder.step

    def step(self, ids):
        names.append(threading.current_thread().name.split("_")[0])
        return real(self, ids)

    monkeypatch.setattr(generation._Decoder, "step", step)
    m = tiny_decoder()
    r = check_generation(m, tiny_decoder(present_scale=1.5), prefill=4, steps=3)
    assert set(names) == {"graphopt-generation", threading.current_thread().name}
    assert r.ran and not r.ok and r.per_step[0]["max_abs"] == 0.0

    def failing(self, ids):
        if self.length:  # the second step of either model
            raise RuntimeError("boom")
        return real(self, ids)

    monkeypatch.setattr(generation._Decoder, "step", failing)
    r = check_generation(m, m, prefill=4, steps=3)
    assert not r.ran and "on the original" in r.why and not r.crashed

"""A failed generation check is a failed verification: the report says so in one line, the CLI
exits 3 with it, report.json keeps the numbers."""

import json

import numpy as np
import onnx
from test_generation import tiny_decoder

import graphopt
from cli_runner import CliRunner
from graphopt.cli import app
from graphopt.opt.errors import EXIT_PARITY
from graphopt.opt.verify import generation
from graphopt.opt.verify.generation import check_generation, failure_line
from graphopt.targets import bundle as bundle_module
from graphopt.targets.bundle import write_bundle


def test_same_tokens_are_no_failure():
    r = check_generation(tiny_decoder(), tiny_decoder(), prefill=4, steps=2).to_dict()
    assert r["verdict"] == "ok" and failure_line(r) is None
    assert failure_line(None) is None


def test_a_wrong_cache_is_one_line_with_the_numbers():
    r = check_generation(tiny_decoder(), tiny_decoder(present_scale=1.5), prefill=4, steps=3)
    d = r.to_dict()
    assert d["verdict"] == "failed"
    line = failure_line(d)
    assert line.startswith("generation check failed: ") and "\n" not in line
    assert f"{d['max_abs']:.3g}" in line and "tolerance" in line
    assert "from decode step " in line and " of 3" in line  # the prefill is exact


def test_a_model_that_fails_where_the_original_runs_is_a_failure():
    broken = tiny_decoder()  # the embeddings reshaped to 2 tokens: a decode step of 1 fails
    gather = broken.graph.node[0]
    gather.output[0] = "x0_flat"
    shape = onnx.numpy_helper.from_array(np.array([1, 2, -1], np.int64), "two_tokens")
    broken.graph.initializer.append(shape)
    reshape = onnx.helper.make_node("Reshape", ["x0_flat", "two_tokens"], ["x0"])
    broken.graph.node.insert(1, reshape)
    r = check_generation(tiny_decoder(), broken, prefill=2, steps=2)
    assert not r.ran and r.verdict == "failed" and "the original ran" in r.why
    assert failure_line(r.to_dict()).startswith("generation check failed: step ")


def test_not_a_decoder_is_not_a_failure():
    m = tiny_decoder()
    m.graph.input[0].name = "tokens"  # no input_ids: not a decoder the loop can drive
    r = check_generation(m, m).to_dict()
    assert r["verdict"] == "not-run" and failure_line(r) is None


def _tampered(real):
    """report_generation run against a decoder whose cache is written wrong."""

    def report_generation(report, context, optimized, written=None):
        return real(report, context, tiny_decoder(present_scale=1.5))  # not the file written

    return report_generation


def test_report_says_the_failure(tmp_path, monkeypatch):
    out, report = graphopt.optimize(tiny_decoder(), target="cpu", level=2)
    monkeypatch.setattr(bundle_module, "report_generation", _tampered(generation.report_generation))
    write_bundle(out, report, tmp_path / "b")
    assert report.generation["verdict"] == "failed"
    assert report.generation_failure == failure_line(report.generation)


def test_cli_exits_3_and_report_keeps_the_numbers(tmp_path, monkeypatch):
    path = tmp_path / "decoder.onnx"
    onnx.save(tiny_decoder(), path)
    args = ["optimize", str(path), "-o", str(tmp_path / "b"), "--no-measure", "--no-kernels"]
    ok = CliRunner().invoke(app, args)
    assert ok.exit_code == 0, ok.output
    monkeypatch.setattr(bundle_module, "report_generation", _tampered(generation.report_generation))
    res = CliRunner().invoke(app, args)
    assert res.exit_code == EXIT_PARITY == 3, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "generation check failed" in errors[0]
    doc = json.loads((tmp_path / "b" / "report.json").read_text())
    assert doc["generation"]["verdict"] == "failed" and doc["generation"]["max_abs"] > 1e-3
    assert doc["parity"]["ok"]  # parity alone passed


def fp16_weights(m: onnx.ModelProto, scale_out: float = 1.0) -> onnx.ModelProto:
    """float32 interface and compute, float16 weights cast up where read (as keep_io_types
    leaves an fp16 model's float32 outputs carrying fp16 error); ``w_out`` times ``scale_out``."""
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    g = m2.graph
    casts = []
    for i, t in enumerate(g.initializer):
        v = onnx.numpy_helper.to_array(t)
        if v.dtype != np.float32 or v.ndim < 2:
            continue
        if t.name == "w_out":
            v = v * scale_out
        g.initializer[i].CopyFrom(onnx.numpy_helper.from_array(v.astype(np.float16), t.name))
        casts.append(onnx.helper.make_node("Cast", [t.name], [f"{t.name}_f32"], to=1))
        for node in g.node:
            node.input[:] = [f"{t.name}_f32" if x == t.name else x for x in node.input]
    nodes = casts + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return m2


def test_fp16_weights_hold_float32_logits_to_fp16_tolerance():
    """Parity holds float32 outputs of an fp16-weight model to fp16's tolerance; so does the
    generation check (a 3e-4 relative change of the head is within it, not within fp32's)."""
    ref = fp16_weights(tiny_decoder())
    r = check_generation(ref, fp16_weights(tiny_decoder(), 1.0003), prefill=4, steps=2)
    assert r.ran and r.ok and r.tolerance == (1e-2, 1e-3) and r.max_rel > 1e-4, r.per_step

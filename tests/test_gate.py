"""CI gate: --expect op-count assertions (exit 4), JUnit XML, bench baselines (exit 5), and
`graphopt gate` (paired latency interval against a baseline, refusing noisy baselines)."""

import json
import time
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from cli_runner import CliRunner
from conftest import EXAMPLES, const, model, vi
from graphopt.cli import app
from graphopt.opt import optimizer as optimizer_module
from graphopt.opt.errors import UsageError
from graphopt.opt.verify.gate import (
    IntervalTooWide,
    PairedLatency,
    compare_baseline,
    evaluate_expectations,
    gate_baseline,
    paired_rounds,
    parse_expectations,
)
from graphopt.opt.verify.perf import median_interval

runner = CliRunner()
MODEL = str(EXAMPLES / "mobilenet_bn.onnx")


def test_parse_and_evaluate():
    exp = parse_expectations(["Conv>=27, Gemm==2", "BatchNormalization<1"])
    res = evaluate_expectations(exp, {"Conv": 27, "Gemm": 2})
    assert [e.ok for e in res] == [True, True, True]
    assert not evaluate_expectations(parse_expectations(["Conv>30"]), {"Conv": 27})[0].ok
    with pytest.raises(UsageError):
        parse_expectations(["Conv=>3"])


def test_optimize_expectations_and_junit(tmp_path):
    junit = tmp_path / "junit.xml"
    res = runner.invoke(
        app,
        [
            "optimize",
            MODEL,
            "-o",
            str(tmp_path / "o"),
            "--expect",
            "com.microsoft.FusedConv>=10,BatchNormalization==0",
            "--junit",
            str(junit),
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    suite = ET.parse(junit).getroot()
    names = [c.get("name") for c in suite.iter("testcase")]
    assert "expect.com.microsoft.FusedConv>=10" in names
    assert any(n.startswith("parity[original].") for n in names)
    assert suite.get("failures") == "0"
    # A deliberately failing expectation: exit 4, recorded as a JUnit failure.
    res = runner.invoke(
        app,
        [
            "optimize",
            MODEL,
            "-o",
            str(tmp_path / "o"),
            "--expect",
            "MultiHeadAttention>=12",
            "--junit",
            str(junit),
            "--format",
            "json",
        ],
    )
    assert res.exit_code == 4
    data = json.loads(res.stdout)
    assert data["expectations"][0] == {  # the short name resolved to the one op it names
        "op": "com.microsoft.MultiHeadAttention",
        "cmp": ">=",
        "count": 12,
        "actual": 0,
        "ok": False,
        "text": "com.microsoft.MultiHeadAttention>=12",
    }
    assert ET.parse(junit).getroot().get("failures") == "1"


def _baseline(tmp_path, ratio):
    p = tmp_path / f"base{ratio}.json"
    p.write_text(json.dumps({"schema": "graphopt.baseline/1", "ratio_p95": ratio}))
    return str(p)


def test_bench_baseline_gate(tmp_path):
    base = tmp_path / "b.json"
    res = runner.invoke(
        app,
        [
            "bench",
            MODEL,
            "--runs",
            "5",
            "--min-seconds",
            "0",
            "--warmup",
            "1",
            "--save-baseline",
            str(base),
            "--format",
            "json",
        ],
    )
    assert res.exit_code == 0, res.output
    saved = json.loads(base.read_text())
    assert saved["schema"] == "graphopt.baseline/1" and saved["ratio_p95"] > 0
    data = json.loads(res.stdout)
    assert data["original"]["p95_ms"] > 0 and data["optimized"]["runs"] == 5
    # A baseline 1000x better than anything possible: a regression, exit 5 (and 1000x worse:
    # fine), so machine noise cannot flip the outcome.
    res = runner.invoke(
        app,
        [
            "bench",
            MODEL,
            "--runs",
            "5",
            "--min-seconds",
            "0",
            "--warmup",
            "1",
            "--baseline",
            _baseline(tmp_path, 0.001),
            "--junit",
            str(tmp_path / "j.xml"),
        ],
    )
    assert res.exit_code == 5, res.output
    assert ET.parse(tmp_path / "j.xml").getroot().get("failures") == "1"
    res = runner.invoke(
        app,
        [
            "bench",
            MODEL,
            "--runs",
            "5",
            "--min-seconds",
            "0",
            "--warmup",
            "1",
            "--min-seconds",
            "0",
            "--baseline",
            _baseline(tmp_path, 1000.0),
        ],
    )
    assert res.exit_code == 0, res.output


def test_bench_bad_baseline_is_usage_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = runner.invoke(
        app, ["bench", MODEL, "--runs", "2", "--min-seconds", "0", "--baseline", str(bad)]
    )
    assert res.exit_code == 2
    res = runner.invoke(app, ["bench", MODEL, "--max-regression", "lots"])
    assert res.exit_code == 2


# ------------------------------------------------------------------ graphopt gate
def _slowed(real):
    """run_optimize whose optimized model also computes large MatMuls of the input that add 0
    to ``y`` (same outputs, parity holds, many times slower)."""

    def run(*a, **k):
        opt, report = real(*a, **k)
        m = onnx.ModelProto()
        m.CopyFrom(opt)
        g = m.graph
        big = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)
        g.initializer.extend(
            [numpy_helper.from_array(big, "big"), numpy_helper.from_array(np.float32(0), "zero")]
        )
        y = g.output[0].name
        g.node.extend(
            [
                # depends on the input, so onnxruntime cannot fold it away at load time
                helper.make_node("ReduceSum", [g.input[0].name], ["xs"], keepdims=0),
                helper.make_node("Mul", ["big", "xs"], ["bx"]),
                helper.make_node("MatMul", ["bx", "big"], ["bb"]),
                helper.make_node("MatMul", ["bb", "big"], ["bbb"]),
                helper.make_node("ReduceSum", ["bbb"], ["s"], keepdims=0),
                helper.make_node("Mul", ["s", "zero"], ["s0"]),
            ]
        )
        for n in g.node:
            n.output[:] = [o if o != y else "y_pre" for o in n.output]
        g.node.append(helper.make_node("Add", ["y_pre", "s0"], [y]))
        return m, report

    return run


def _small_model(tmp_path):

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    p = tmp_path / "small.onnx"
    m = model(
        nodes, [vi("x", [1, 3, 16, 16])], [vi("y", None)], [const("W", rng.random((8, 3, 3, 3)))]
    )
    onnx.save(m, p)
    return p


def test_gate_baseline_then_pass_then_catch_a_slowed_model(tmp_path, monkeypatch):
    p, base, junit = _small_model(tmp_path), tmp_path / "base.json", tmp_path / "j.xml"
    args = ["gate", str(p), "--max-seconds", "20"]
    res = runner.invoke(app, [*args, "--save-baseline", str(base)])
    assert res.exit_code == 0, res.output
    saved = json.loads(base.read_text())
    assert saved["schema"] == "graphopt.gate-baseline/1" and saved["width"] <= 0.05
    res = runner.invoke(app, [*args, "--baseline", str(base), "--junit", str(junit)])
    assert res.exit_code == 0, res.output
    assert "gate passed" in res.stdout
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert "latency" in cases and cases["latency"].find("failure") is None
    monkeypatch.setattr(optimizer_module, "optimize", _slowed(optimizer_module.optimize))
    res = runner.invoke(app, [*args, "--baseline", str(base), "--junit", str(junit)])
    assert res.exit_code == 5, res.output
    assert "latency regression" in res.stderr
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["latency"].find("failure") is not None
    assert sorted(f.name for f in tmp_path.iterdir()) == ["base.json", "j.xml", "small.onnx"]


def test_gate_refuses_a_baseline_from_a_wide_interval(tmp_path):
    p, base = _small_model(tmp_path), tmp_path / "base.json"
    res = runner.invoke(
        app,
        ["gate", str(p), "--max-seconds", "0", "--max-regression", "0.0001%",
         "--save-baseline", str(base)],
    )  # fmt: skip
    assert res.exit_code == 4, res.output
    assert "too wide to save as a baseline" in res.stderr and not base.exists()


def test_gate_parity_and_expectations_decide_first(tmp_path):
    p = _small_model(tmp_path)
    res = runner.invoke(app, ["gate", str(p), "--expect", "FusedConv>=5", "--format", "json"])
    assert res.exit_code == 4
    data = json.loads(res.stdout)
    assert data["latency"] is None and data["expectations"][0]["op"] == "com.microsoft.FusedConv"
    res = runner.invoke(app, ["gate", str(p), "--baseline", str(tmp_path / "none.json")])
    assert res.exit_code == 2
    bench_base = tmp_path / "bench.json"
    bench_base.write_text(json.dumps({"schema": "graphopt.baseline/1", "ratio_p95": 1.0}))
    res = runner.invoke(app, ["gate", str(p), "--baseline", str(bench_base)])
    assert res.exit_code == 2 and "not a graphopt gate baseline" in res.stderr


def test_paired_rounds_interval_and_rule():

    lat = paired_rounds(
        lambda: time.sleep(0.002), lambda: time.sleep(0.003), precision=0.2, min_seconds=0.1
    )
    assert lat.low <= lat.ratio <= lat.high and 1.2 < lat.ratio < 1.8 and lat.rounds >= 30
    med, lo, hi = median_interval(list(range(101)), 0.95)
    assert med == 50 and 38 <= lo < 50 < hi <= 62
    wide = PairedLatency(1.0, 0.9, 1.1, 0.95, 30, 1.0, 1.0, 1.0)
    with pytest.raises(IntervalTooWide):
        gate_baseline(wide, 0.05)
    base = gate_baseline(PairedLatency(1.0, 0.99, 1.01, 0.95, 30, 1.0, 1.0, 1.0), 0.05)
    assert base["schema"] == "graphopt.gate-baseline/1" and base["ratio"] == 1.0


def test_gate_regression_needs_the_whole_interval_past_the_limit(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"schema": "graphopt.gate-baseline/1", "ratio": 1.0}))
    straddles = PairedLatency(1.06, 1.02, 1.10, 0.95, 100, 1.0, 1.06, 1.0)
    assert not compare_baseline(straddles, path, 0.05)["regressed"]
    past = PairedLatency(1.10, 1.07, 1.13, 0.95, 100, 1.0, 1.1, 1.0)
    assert compare_baseline(past, path, 0.05)["regressed"]


def test_gate_regression_allows_for_the_baselines_own_interval(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(
        json.dumps({"schema": "graphopt.gate-baseline/1", "ratio": 1.0, "low": 0.98, "high": 1.03})
    )
    now = PairedLatency(1.10, 1.07, 1.13, 0.95, 100, 1.0, 1.1, 1.0)
    assert not compare_baseline(now, path, 0.05)["regressed"]  # 1.07 < 1.03 * 1.05
    assert compare_baseline(now, path, 0.03)["regressed"]

"""CI gate: --expect op-count assertions (exit 4), JUnit XML, bench baselines (exit 5)."""

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from conftest import EXAMPLES
from graphopt.cli import app
from graphopt.opt.errors import UsageError
from graphopt.opt.gate import evaluate_expectations, parse_expectations

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

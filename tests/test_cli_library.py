"""Library pieces the command line calls (it only parses, calls, renders and maps exit codes):
the gate's latency verdict, bench's JUnit, writing a bisect result, reading --inputs, node op
types for explain's filters, and the io helpers for side outputs and temporaries."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import const, model, vi
from graphopt.opt import errors
from graphopt.opt.bisect import BISECT_SCHEMA, BisectResult, write_bisect_result
from graphopt.opt.graph.io import atomic_write_text, discard
from graphopt.opt.report.explain import node_ops
from graphopt.opt.verify.bench import BenchResult, Latency
from graphopt.opt.verify.feeds import read_feeds
from graphopt.opt.verify.gate import (
    GATE_BASELINE,
    PairedLatency,
    bench_junit_xml,
    gate_latency,
    gate_verdict,
)


def latency(ratio: float, low: float, high: float) -> PairedLatency:
    return PairedLatency(ratio, low, high, 0.95, 60, 1.0, ratio, 2.0)


def baseline_file(tmp_path: Path, ratio: float = 1.0, high: float = 1.01) -> Path:
    path = tmp_path / "base.json"
    path.write_text(json.dumps({"schema": GATE_BASELINE, "ratio": ratio, "high": high}))
    return path


# ------------------------------------------------------------------ gate verdict
def test_gate_verdict_keeps_the_optimize_verdict_without_latency():
    v = gate_verdict(None, 3, "parity failed (outputs: y)", max_regression=0.05)
    assert (v.code, v.reason, v.line, v.failure, v.baseline) == (
        3,
        "parity failed (outputs: y)",
        "",
        None,
        None,
    )


def test_gate_verdict_regressed_only_when_the_whole_interval_is_past_the_limit(tmp_path):
    base = baseline_file(tmp_path)  # upper end 1.01; limit 5 %: regressed above 1.0605
    slower = gate_verdict(latency(1.2, 1.1, 1.3), 0, "", baseline=base, max_regression=0.05)
    assert slower.code == errors.EXIT_PERF and slower.reason.startswith("latency regression: ")
    assert slower.failure == slower.reason and slower.comparison["regressed"]
    assert "vs baseline 1.000: +20.0% [+10.0%, +30.0%] (limit 5.0%)" in slower.line
    straddles = gate_verdict(latency(1.1, 1.05, 1.3), 0, "", baseline=base, max_regression=0.05)
    assert straddles.code == 0 and straddles.failure is None
    assert straddles.junit_case() == {"text": straddles.line, "failure": None}


def test_gate_verdict_saves_a_baseline_only_from_a_narrow_interval():
    narrow = gate_verdict(
        latency(1.0, 0.99, 1.01), 0, "", save_baseline=True, max_regression=0.05, meta={"a": 1}
    )
    assert narrow.code == 0 and narrow.baseline["schema"] == GATE_BASELINE
    assert narrow.baseline["a"] == 1 and narrow.baseline["ratio"] == 1.0
    wide = gate_verdict(latency(1.0, 0.8, 1.2), 0, "", save_baseline=True, max_regression=0.05)
    assert wide.code == errors.EXIT_TARGET and wide.baseline is None
    assert wide.reason == wide.failure and "too wide" in wide.reason


def test_gate_latency_times_both_models_on_parity_sizes(tmp_path):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["n", 4])], [vi("y", ["n", 4])])
    onnx.save(m, tmp_path / "m.onnx")
    budget = dict(threads=1, precision=10.0, max_seconds=5.0)
    lat = gate_latency(tmp_path / "m.onnx", m, {"x": [2, 4]}, None, 0, **budget)
    assert lat.rounds >= 30 and lat.low <= lat.ratio <= lat.high


# ------------------------------------------------------------------ bench JUnit
def bench_result(regression, regressed: bool) -> BenchResult:
    lat = Latency(1.0, 1.2, 1.0, 5.0, 10)
    return BenchResult(lat, lat, 1.0, 1.1, 1, "all", {}, None, regression, 0.05, regressed)


def test_bench_junit_fails_only_on_a_regression():
    ok = bench_junit_xml("m", bench_result(None, False))
    assert 'failures="0"' in ok and "<failure" not in ok and 'name="m"' in ok
    bad = bench_junit_xml("m", bench_result(0.1, True))
    assert 'failures="1"' in bad and "normalized p95 1.100 is +10.0% vs baseline" in bad


# ------------------------------------------------------------------ bisect result
def tiny() -> onnx.ModelProto:
    return model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [2])], [vi("y", [2])])


def found(before=True) -> BisectResult:
    m = tiny()
    return BisectResult(True, "rewrite 1 of 1", 1, 2, {"index": 1}, None, m if before else None, m)


def test_write_bisect_result_writes_the_pair_and_marks_the_folder(tmp_path):
    dest = tmp_path / "b"
    payload = write_bisect_result(found(), dest)
    assert payload["files"] == str(dest) and payload["found"]
    assert sorted(p.name for p in dest.iterdir()) == ["after.onnx", "before.onnx", "report.json"]
    written = json.loads((dest / "report.json").read_text())
    assert written["schema"] == BISECT_SCHEMA and "files" not in written
    onnx.checker.check_model(onnx.load(dest / "before.onnx"))
    write_bisect_result(found(), dest)  # its own folder is replaced
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no staging folder survives


def test_write_bisect_result_writes_nothing_without_a_culprit(tmp_path):
    none = BisectResult(False, "parity holds", 3, 1)
    assert "files" not in write_bisect_result(none, tmp_path / "b")
    assert "files" not in write_bisect_result(found(before=False), tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_write_bisect_result_never_replaces_a_foreign_folder(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep")
    with pytest.raises(errors.UsageError):
        write_bisect_result(found(), dest)
    assert [p.name for p in dest.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


# ------------------------------------------------------------------ --inputs
def two_inputs() -> onnx.ModelProto:
    return model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [vi("a", [2]), vi("b", [2]), vi("w", [2])],
        [vi("y", [2])],
        [const("w", [1.0, 2.0])],  # an initializer listed as an input is not fed
    )


def test_read_feeds_npz_and_npy(tmp_path):
    x = np.arange(2, dtype=np.float32)
    np.savez(tmp_path / "in.npz", a=x, b=x)
    assert set(read_feeds(tmp_path / "in.npz", two_inputs())) == {"a", "b"}
    np.save(tmp_path / "x.npy", x)
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny(), path)
    feeds = read_feeds(tmp_path / "x.npy", path)  # the model as a path
    assert list(feeds) == ["x"] and np.array_equal(feeds["x"], x)


def test_read_feeds_refusals_are_usage_errors(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros(2, np.float32))
    with pytest.raises(errors.UsageError, match=r"the model has 2 inputs \(a, b\)"):
        read_feeds(tmp_path / "x.npy", two_inputs())
    with pytest.raises(errors.UsageError, match="cannot read"):
        read_feeds(tmp_path / "missing.npz", two_inputs())
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(errors.UsageError, match="cannot read as .npz"):
        read_feeds(tmp_path / "junk.npz", two_inputs())


# ------------------------------------------------------------------ explain's node ops
def test_node_ops_cover_subgraphs_and_domains():
    then = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["t"], name="inner")], "then", [], [vi("t", [2])]
    )
    other = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["e"], name="inner2")], "else", [], [vi("e", [2])]
    )
    g = helper.make_graph(
        [
            helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
            helper.make_node("FusedConv", ["y"], ["z"], name="fc", domain="com.microsoft"),
        ],
        "g",
        [vi("c", [], onnx.TensorProto.BOOL), vi("x", [2])],
        [vi("z", [2])],
    )
    m = helper.make_model(g)
    ops = node_ops(m)
    assert ops == {"if": "If", "fc": "com.microsoft.FusedConv", "inner": "Neg", "inner2": "Abs"}
    renamed = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["z"], name="fc")], "h", [], [])
    )
    assert node_ops(m, renamed)["fc"] == "Relu"  # a later model's name wins


# ------------------------------------------------------------------ io helpers
def test_side_output_write_failure_is_one_save_error(tmp_path):
    with pytest.raises(errors.ModelSaveError, match="cannot write .*missing"):
        atomic_write_text(tmp_path / "missing" / "r.jsonl", "{}\n")
    atomic_write_text(tmp_path / "r.jsonl", "{}\n")
    assert (tmp_path / "r.jsonl").read_text() == "{}\n"


def test_discard_removes_what_exists_and_ignores_the_rest(tmp_path):
    folder = tmp_path / "staging"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "f").write_text("x")
    discard(folder)
    discard(tmp_path / "never-there")
    assert list(tmp_path.iterdir()) == []

"""Bad flags on every command are usage errors (exit 2) or clean one-line errors, never internal
errors; and the exit-code bookkeeping of `optimize` (parity that could not run, verify failures)."""

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt import optimizer as optimizer_module
from graphopt.opt.remarks import Remark

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "internal error" not in res.stderr and "Traceback" not in res.output
    return lines[0]


def usage_error(res) -> str:
    assert res.exit_code == 2, res.output
    assert "internal error" not in res.output and "Traceback" not in res.output
    return res.stderr


@pytest.fixture
def relu(tmp_path):
    """One dynamic-batch input x → Relu → Add(c) → y."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["i"], name="id"),
        helper.make_node("Add", ["i", "c"], ["y"], name="add"),
    ]
    p = tmp_path / "m.onnx"
    onnx.save(model(nodes, [vi("x", ["N", 4])], [vi("y", None)], [const("c", np.ones(4))]), p)
    return p


@pytest.fixture
def two_inputs(tmp_path):
    nodes = [helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    p = tmp_path / "two.onnx"
    onnx.save(model(nodes, [vi("a", [1, 4]), vi("b", [1, 4])], [vi("y", None)]), p)
    return p


@pytest.fixture
def unrunnable(tmp_path):
    """Valid for onnx.checker, but onnxruntime fails at run time (Reshape of N elements to 3)."""
    shape = const("s", np.array([3]), np.int64)
    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"], name="reshape")]
    p = tmp_path / "bad.onnx"
    onnx.save(model(nodes, [vi("x", ["N"])], [vi("y", [3])], [shape]), p)
    return p


BAD_PIPELINES = [
    "fixpoint(dce){max-iterations=0}",
    "fixpoint(dce){max-iterations=-3}",
    "fixpoint(dce){max-iterations=3",
    "fixpoint(dce){max-iterations=}",
    "fixpoint(dce){max-iterations=2,max-iterations=3}",
    "fixpoint(" * 400 + "dce" + ")" * 400,
    "rules{level=9}",
    "rules(dce)",
    "(dce)",
    "dce,",
]


@pytest.mark.parametrize("text", BAD_PIPELINES, ids=range(len(BAD_PIPELINES)))
def test_bad_pipeline_text_is_a_usage_error(relu, tmp_path, text):
    for cmd in ("optimize", "explain", "bisect"):
        out = [] if cmd == "explain" else ["-o", tmp_path / "out"]
        res = invoke(cmd, relu, "--pipeline", text, *out)
        assert "pipeline text" in one_error_line(res) and res.exit_code == 2, (cmd, res.output)
    assert not (tmp_path / "out").exists()


def test_deep_but_legal_nesting_still_runs(relu, tmp_path):
    text = "fixpoint(" * 4 + "eliminate-identity,dce" + "){max-iterations=2}" * 4
    res = invoke("optimize", relu, "--pipeline", text, "-o", tmp_path / "out", "-q")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "args",
    [
        ["optimize", "{m}", "--seed", "-1"],
        ["check", "{m}", "{m}", "--seed", "-1"],
        ["bisect", "{m}", "--seed", "-1"],
        ["optimize", "{m}", "--bisect-limit", "-1"],
        ["optimize", "{m}", "--fold-size-limit", "nan"],
        ["optimize", "{m}", "--fold-size-limit", "inf"],
        ["optimize", "{m}", "--fold-size-limit", "-1"],
        ["bench", "{m}", "--min-seconds", "nan"],
        ["bench", "{m}", "--min-seconds", "-1"],
        ["bench", "{m}", "--max-regression", "nan%"],
        ["bench", "{m}", "--max-regression", "inf"],
        ["bench", "{m}", "--threads", "100000"],
        ["explain", "{m}", "--rule", "no-such-rule"],
        ["lint", "{m}", "--target", "no-such-target"],
        ["run", "{m}"],
    ],
    ids=lambda a: " ".join(a[:1] + a[2:] if a[1] == "{m}" else a),
)
def test_bad_numbers_and_names_are_usage_errors(relu, tmp_path, args):
    res = invoke(*[a.replace("{m}", str(relu)) for a in args])
    usage_error(res)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_npy_inputs_feed_the_single_input(relu, tmp_path):
    np.save(tmp_path / "x.npy", np.full((3, 4), -2.0, np.float32))
    out = tmp_path / "out"
    res = invoke("optimize", relu, "--inputs", tmp_path / "x.npy", "-o", out, "--format", "json")
    assert res.exit_code == 0, res.output
    assert '"x": [\n        3,\n        4\n      ]' in res.stdout  # parity ran on the .npy's shape
    for args in (
        ["check", relu, relu],
        ["explain", relu],
        ["bench", relu, "--runs", "1", "--min-seconds", "0"],
        ["run", out],
    ):
        res = invoke(*args, "--inputs", tmp_path / "x.npy")
        assert res.exit_code == 0, (args, res.output)


def test_npy_inputs_for_a_model_with_two_inputs_is_a_usage_error(two_inputs, tmp_path):
    np.save(tmp_path / "a.npy", np.ones((1, 4), np.float32))
    res = invoke("optimize", two_inputs, "--inputs", tmp_path / "a.npy", "-o", tmp_path / "o")
    line = one_error_line(res)
    assert res.exit_code == 2 and ".npy" in line and "a, b" in line
    assert not (tmp_path / "o").exists()


def test_corrupt_npy_is_a_usage_error(relu, tmp_path):
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY garbage")
    res = invoke("optimize", relu, "--inputs", tmp_path / "x.npy", "-o", tmp_path / "o")
    one_error_line(res)
    assert res.exit_code == 2


def test_output_under_a_regular_file_is_a_usage_error(relu, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for args in (
        ["optimize", relu, "-o", afile / "sub"],
        ["optimize", relu, "-o", tmp_path / "o", "--remarks", afile / "r.jsonl"],
        ["bisect", relu, "-o", afile / "sub"],
        ["lint", relu, "--freeze-initializers", "-o", afile / "f.onnx"],
        ["bench", relu, "--save-baseline", afile / "b.json"],
    ):
        res = invoke(*args)
        assert "not a directory" in one_error_line(res) and res.exit_code == 2, args
    assert afile.read_text() == "keep"


def test_run_output_under_a_regular_file(relu, tmp_path):
    assert invoke("optimize", relu, "-o", tmp_path / "b", "-q").exit_code == 0
    (tmp_path / "afile").write_text("keep")
    res = invoke("run", tmp_path / "b", "-o", tmp_path / "afile" / "out.npz")
    one_error_line(res)
    assert res.exit_code == 2


def test_output_under_an_unwritable_folder(relu, tmp_path, monkeypatch):
    """One line, exit 1, nothing written (simulated: the tests may run as root)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: Path(p) != locked and real_access(p, mode, **kw)
    )
    for args in (
        ["optimize", relu, "-o", locked / "a" / "b"],
        ["optimize", relu, "-o", tmp_path / "o", "--junit", locked / "j.xml"],
    ):
        res = invoke(*args)
        assert "permission denied" in one_error_line(res) and res.exit_code == 1, args
    assert list(locked.iterdir()) == [] and not (tmp_path / "o").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_under_a_read_only_folder(relu, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        res = invoke("optimize", relu, "-o", locked / "a" / "b")
        one_error_line(res)
        assert res.exit_code == 1
    finally:
        locked.chmod(0o755)


def test_bench_on_a_model_onnxruntime_cannot_run(unrunnable, relu):
    for args in (
        ["bench", unrunnable, "--runs", "1", "--min-seconds", "0"],
        ["bench", relu, "--optimized", unrunnable, "--runs", "1", "--min-seconds", "0"],
    ):
        res = invoke(*args)
        assert "onnxruntime cannot run" in one_error_line(res) and res.exit_code == 1, args


def test_parity_that_could_not_run_exits_3(unrunnable, tmp_path):
    out = tmp_path / "o"
    res = invoke("optimize", unrunnable, "-o", out, "-q")
    assert res.exit_code == 3, res.output
    line = one_error_line(res)
    assert line.startswith("error: parity could not run: ") and "--shape" in line
    assert (out / "manifest.json").exists()  # the bundle is still written
    res = invoke("optimize", unrunnable, "-o", out, "-q", "--no-check")
    assert res.exit_code == 0, res.output


def test_verify_failure_exits_1_with_its_reason(relu, tmp_path, monkeypatch):
    real = optimizer_module.optimize

    def with_verify_failure(*args, **kwargs):
        optimized, report = real(*args, **kwargs)
        report.remarks.append(
            Remark(
                "failure",
                "verify",
                "some-rule",
                "runtime-rejects",
                ("relu",),
                "onnxruntime refused the model",
            )
        )
        return optimized, report

    monkeypatch.setattr(optimizer_module, "optimize", with_verify_failure)
    res = invoke("optimize", relu, "-o", tmp_path / "o", "-q")
    assert res.exit_code == 1, res.output
    assert "runtime-rejects: onnxruntime refused the model" in one_error_line(res)


def test_deployed_parity_failure_exits_3(relu, tmp_path, monkeypatch):
    import graphopt.targets.bundle as bundle
    from graphopt.opt.verify.parity import ParityReport

    def disagree(*args, **_kwargs):
        report = args[-1]
        why = "the bundle and the original disagree"
        report.parity_deployed = ParityReport(False, True, [], {}, 0, "original", why)
        return {"ran": True}

    monkeypatch.setattr(bundle, "_deploy_parity", disagree)
    res = invoke("optimize", relu, "-o", tmp_path / "o", "-q")
    assert res.exit_code == 3, res.output
    assert "the bundle and the original disagree" in one_error_line(res)
    assert invoke("optimize", relu, "-o", tmp_path / "o", "-q", "--no-check").exit_code == 0


HOSTILE = [
    ["optimize", "{m}", "-o", "{t}/o", "--target", ""],
    ["optimize", "{m}", "-o", "{t}/o", "--shape", "x=a,b"],
    ["optimize", "{m}", "-o", "{t}/o", "--tolerance", "y=nan"],
    ["optimize", "{m}", "-o", "{t}/o", "--expect", "Relu>=x"],
    ["optimize", "{m}", "-o", "{t}/o", "--inputs", "{t}/missing.npz"],
    ["optimize", "{m}", "-o", "{t}/o", "--opset", "100000"],
    ["optimize", "{m}", "-o", "{t}/o", "--html", "{t}"],
    ["explain", "{m}", "--pipeline", "{{"],
    ["lint", "{m}", "--freeze-initializers", "-o", "{m}"],
    ["check", "{m}", "{t}/missing.onnx"],
    ["check", "{m}", "{m}", "--inputs", "{m}"],
    ["bisect", "{m}", "-o", "{m}"],
    ["bench", "{m}", "--baseline", "{m}"],
    ["bench", "{m}", "--ort-level", "fast"],
    ["run", "{t}/missing"],
    ["run", "{t}", "--inputs", "{m}"],
    ["targets", "show", "nowhere"],
    ["targets", "list"],
    ["rules", "--format", "xml"],
]


@pytest.mark.parametrize("args", HOSTILE, ids=lambda a: " ".join(a))
def test_hostile_flags_never_end_in_an_internal_error(relu, tmp_path, args):
    before = relu.read_bytes()
    res = invoke(*[a.format(m=relu, t=tmp_path) for a in args])
    assert res.exit_code in (1, 2), res.output
    assert "internal error" not in res.output and "Traceback" not in res.output
    assert relu.read_bytes() == before

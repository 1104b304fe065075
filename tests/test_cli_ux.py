"""The command line as a new user meets it: --version, --debug anywhere, one-line usage errors
with the nearest names, short op names, the grouped summary, progress on stderr."""

import json
import re
import time
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import helper

import graphopt.cli as cli
from cli_runner import CliRunner
from conftest import ROOT, const, model, vi
from graphopt import render
from graphopt.cli import app
from graphopt.opt import optimizer as optimizer_module
from graphopt.opt.errors import UsageError
from graphopt.opt.remarks import Remark
from graphopt.opt.report.explain import group_misses
from graphopt.opt.verify.gate import resolve_op
from graphopt.opt.verify.parity import ParityReport
from graphopt.opt.verify.verdict import parity_hint
from graphopt.progress import PhaseLines

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def conv_relu(tmp_path, rng, blocks: int = 1, bn_inputs: bool = False, tail: bool = False):
    """``blocks`` Conv+BN+Relu blocks; with ``bn_inputs`` the BN parameters are graph inputs
    (each block's fuse-conv-bn misses with non-constant-param); ``tail`` adds a Conv+Relu that
    fuses (so the fusion fixpoint runs a second round)."""
    c, nodes, inits, extra, x = 4, [], [], [], "x"
    for i in range(blocks):
        inits.append(const(f"W{i}", rng.standard_normal((c, c if i else 3, 3, 3)) * 0.3))
        bn = [const(f"{k}{i}", v) for k, v in zip("gbmv", _bn_params(rng, c))]
        if bn_inputs:
            extra += [vi(t.name, [c]) for t in bn]
        inits += bn
        nodes += [
            helper.make_node("Conv", [x, f"W{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
            helper.make_node(
                "BatchNormalization", [f"c{i}", *(t.name for t in bn)], [f"n{i}"], name=f"bn{i}"
            ),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        x = f"r{i}"
    if tail:
        inits.append(const("Wt", rng.standard_normal((c, c, 1, 1))))
        nodes += [
            helper.make_node("Conv", [x, "Wt"], ["ct"], name="conv_tail"),
            helper.make_node("Relu", ["ct"], ["rt"], name="relu_tail"),
        ]
        x = "rt"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    p = tmp_path / "net.onnx"
    onnx.save(model(nodes, [vi("x", [1, 3, 8, 8]), *extra], [vi("y", None)], inits), p)
    return p


def _bn_params(rng, c):
    return rng.random(c) + 0.5, rng.standard_normal(c), rng.standard_normal(c), rng.random(c) + 0.1


# ------------------------------------------------------------------ small things
def test_version():
    res = invoke("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"graphopt {cli.__version__}"


def test_debug_is_accepted_after_the_command(tmp_path, rng, monkeypatch):
    p = conv_relu(tmp_path, rng)

    def boom(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(optimizer_module, "optimize", boom)
    res = invoke("optimize", p, "-o", tmp_path / "o")
    assert res.exit_code == 1 and "rerun with --debug" in res.stderr
    for args in (("--debug", "optimize", p), ("optimize", p, "--debug")):
        res = invoke(*args, "-o", tmp_path / "o")
        assert isinstance(res.exception, RuntimeError), res.output  # the traceback, not a line
    assert invoke("optimize", p, "-o", tmp_path / "o").exit_code == 1  # off again


def test_run_on_a_model_file_is_a_usage_error(tmp_path, rng):
    p = conv_relu(tmp_path, rng)
    res = invoke("run", p)
    assert res.exit_code == 2
    assert len(res.stderr.strip().splitlines()) == 1
    assert "is a model file, not a bundle" in res.stderr and "graphopt optimize" in res.stderr


def test_explain_unknown_names_exit_2_with_the_nearest(tmp_path, rng):
    p = conv_relu(tmp_path, rng)
    res = invoke("explain", p, "--rule", "fuse-conv-bm")
    assert res.exit_code == 2 and "did you mean fuse-conv-bn" in res.stderr
    res = invoke("explain", p, "--node", "conv9")
    assert res.exit_code == 2 and "no node 'conv9'" in res.stderr and "conv0" in res.stderr
    res = invoke("explain", p, "--code", "no-kernl")
    assert res.exit_code == 2 and "did you mean no-kernel" in res.stderr
    res = invoke("explain", p, "--op", "Convv")
    assert res.exit_code == 2 and "Conv" in res.stderr
    assert invoke("explain", p, "--node", "relu0").exit_code == 0  # a node without remarks


def test_header_names_the_pipeline_that_replaced_the_preset(tmp_path, rng):
    p = conv_relu(tmp_path, rng)
    res = invoke("optimize", p, "-o", tmp_path / "o", "--pipeline", "fold-constants,dce")
    assert res.exit_code == 0, res.output
    header = res.stdout.splitlines()[0]
    assert "pipeline 'fold-constants,dce'" in header and "-O2" not in header
    res = invoke("optimize", p, "-o", tmp_path / "o")
    assert "-O2" in res.stdout.splitlines()[0] and "with the bundle" in res.stdout


@pytest.mark.parametrize("target", ["cuda", "tensorrt"])
def test_device_targets_say_parity_ran_on_this_cpu(tmp_path, rng, target):
    p = conv_relu(tmp_path, rng)
    res = invoke("optimize", p, "-o", tmp_path / "o", "-t", target)
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "parity ran on this machine's CPU" in text
    assert f"the {target} device was not run" in text
    cpu = invoke("optimize", p, "-o", tmp_path / "c")
    assert "device was" not in cpu.stdout


def test_run_of_a_cuda_bundle_suggests_the_flag(tmp_path, rng):
    p = conv_relu(tmp_path, rng)
    assert invoke("optimize", p, "-o", tmp_path / "b", "-t", "cuda", "-q").exit_code == 0
    res = invoke("run", tmp_path / "b")
    assert res.exit_code == 2
    assert "--provider CPUExecutionProvider" in res.stderr and "providers=[" not in res.stderr
    ok = invoke("run", tmp_path / "b", "--provider", "CPUExecutionProvider")
    assert ok.exit_code == 0, ok.output


def _hard_swish(tmp_path, opset: int):
    nodes = [
        helper.make_node("HardSigmoid", ["x"], ["g"], alpha=1 / 6, beta=0.5, name="hs"),
        helper.make_node("Mul", ["x", "g"], ["y"], name="mul"),
    ]
    p = tmp_path / f"hs{opset}.onnx"
    onnx.save(model(nodes, [vi("x", [1, 8])], [vi("y", None)], opset=opset), p)
    return p


def test_hard_swish_opset_hint_is_true(tmp_path):
    p = _hard_swish(tmp_path, 13)
    res = invoke("optimize", p, "-o", tmp_path / "a", "-t", "cuda", "--format", "json")
    miss = [r for r in json.loads(res.stdout)["remarks"] if r["rule"] == "fuse-hard-swish"]
    assert miss[0]["code"] == "opset-too-old" and "`--opset 14`" in miss[0]["message"]
    res = invoke("optimize", p, "-o", tmp_path / "b", "-t", "cuda", "--opset", "14", "--format",
                 "json")  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ops_after"].get("HardSwish") == 1 and report["parity"]["ok"]
    # a target with no HardSwish kernel at any opset says that --opset would not help
    res = invoke("optimize", p, "-o", tmp_path / "c", "-t", "cpu", "--format", "json")
    miss = [r for r in json.loads(res.stdout)["remarks"] if r["rule"] == "fuse-hard-swish"]
    assert miss[0]["code"] == "no-kernel" and "`--opset` would not help" in miss[0]["message"]


@pytest.mark.parametrize("command", ["check", "bisect", "explain"])
def test_shape_inputs_seed_have_help(command):
    res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    text = " ".join(res.stdout.split())
    assert "dynamic dims" in text  # --shape
    assert "one array per input name" in text  # --inputs
    if command != "explain":
        assert "Seed of random parity inputs" in text


def test_documented_report_keys_match_a_real_report(tmp_path, rng):
    page = (ROOT / "docs" / "report.md").read_text()
    section = page.split("## report.json", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            documented |= set(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
    p = conv_relu(tmp_path, rng)
    flags = ["--expect", "Relu>=0", "--profile", "--profile-runs", "2"]  # the keys they add
    res = invoke("optimize", p, "-o", tmp_path / "o", "--format", "json", *flags)
    assert res.exit_code == 0, res.output
    actual = set(json.loads(res.stdout))
    assert documented == actual
    on_disk = json.loads((tmp_path / "o" / "report.json").read_text())
    assert set(on_disk) <= documented
    rewrites = next(line for line in section.splitlines() if "`rewrites`" in line)
    assert "count" in rewrites and isinstance(on_disk["rewrites"], int)


def test_parity_hint_is_not_repeated():
    carried = ParityReport.not_run(
        "the original failed to run on every assignment; give real sizes with --shape NAME=..."
    )
    assert parity_hint(carried) == ""
    bare = ParityReport.not_run("the original failed to run: Reshape")
    assert "--shape" in parity_hint(bare)


def test_safety_net_reverts_are_loud(tmp_path, rng, monkeypatch):
    p = conv_relu(tmp_path, rng)
    real = optimizer_module.optimize

    def with_revert(*a, **k):
        out, report = real(*a, **k)
        report.remarks.append(
            Remark("failure", "safety-net", "fuse-conv-bn", "invalid-output", ("bn0",), "reverted")
        )
        return out, report

    monkeypatch.setattr(optimizer_module, "optimize", with_revert)
    res = invoke("optimize", p, "-o", tmp_path / "o", "--format", "json")
    assert res.exit_code == 0
    assert "warning: safety net: reverted" in res.stderr and res.stdout.startswith("{")


# ------------------------------------------------------------------ short op names
def test_expect_accepts_the_short_op_name(tmp_path, rng):
    p = conv_relu(tmp_path, rng)
    res = invoke("optimize", p, "-o", tmp_path / "o", "-t", "cuda", "--expect", "FusedConv>=1")
    assert res.exit_code == 0, res.output
    assert "expect com.microsoft.FusedConv>=1: ok (found 1)" in res.stdout
    res = invoke("optimize", p, "-o", tmp_path / "o", "-t", "cuda", "--expect", "FusdConv>=1")
    assert res.exit_code == 2 and "FusedConv" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_short_names_resolve_only_when_unambiguous():
    vocab = {"Conv", "com.microsoft.FusedConv", "a.Gelu", "b.Gelu"}
    assert resolve_op("FusedConv", vocab, "--expect") == "com.microsoft.FusedConv"
    assert resolve_op("Conv", vocab, "--expect") == "Conv"
    with pytest.raises(UsageError, match="ambiguous: a.Gelu, b.Gelu"):
        resolve_op("Gelu", vocab, "--expect")
    with pytest.raises(UsageError, match="did you mean com.microsoft.FusedConv"):
        resolve_op("FusedCnv", vocab, "--expect")


def test_explain_op_filter_takes_the_short_name(tmp_path, rng):
    p = conv_relu(tmp_path, rng, blocks=2, bn_inputs=True)
    res = invoke("explain", p, "--op", "BatchNormalization", "--format", "json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["missed"] and {m["node"] for m in data["missed"]} == {"bn0", "bn1"}
    res = invoke("explain", p, "--op", "Relu", "--format", "json")
    assert all(m["node"].startswith("relu") for m in json.loads(res.stdout)["missed"])


# ------------------------------------------------------------------ summary
def test_summary_groups_misses_and_counts_agree(tmp_path, rng):
    p = conv_relu(tmp_path, rng, blocks=12, bn_inputs=True, tail=True)
    res = invoke("optimize", p, "-o", tmp_path / "o", "-t", "cuda")
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stdout.splitlines() if "fuse-conv-bn non-constant-param" in line]
    assert len(lines) == 1 and "12×" in lines[0] and "e.g. 'bn0'" in lines[0]
    assert "to get more: graphopt lint --freeze-initializers (12 missed)" in " ".join(
        res.stdout.split()
    )
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    for rule, st in report["rules"].items():
        kept = sum(r["kind"] == "missed" and r["rule"] == rule for r in report["remarks"])
        assert st["missed"] == kept, rule
    bn = report["rules"]["fuse-conv-bn"]
    assert bn["missed"] == 12 and bn["missed_attempts"] == 24  # refused in two fixpoint rounds
    assert "fused: fuse-conv-relu ×1" in res.stdout
    data = json.loads(invoke("explain", p, "-t", "cuda", "--format", "json").stdout)
    assert data["rules"]["fuse-conv-bn"]["missed"] == 12


def test_summary_shows_at_most_ten_groups(capsys):
    remarks = [
        Remark("missed", "rules", f"rule-{i}", f"code-{i}", (f"n{i}",), "why") for i in range(14)
    ]
    remarks += [Remark("missed", "rules", "rule-0", "code-0", ("m",), "why")]
    render.render_misses(group_misses(SimpleNamespace(remarks=remarks)))
    text = capsys.readouterr().out
    assert text.count("×") == render.MAX_MISS_GROUPS
    assert "2× rule-0 code-0 (e.g. 'n0')" in text
    assert "4 more groups (4 remarks)" in text


# ------------------------------------------------------------------ progress
def test_progress_lines_on_stderr_never_on_stdout(tmp_path, rng):
    p = conv_relu(tmp_path, rng)
    env = {"GRAPHOPT_PROGRESS_AFTER": "0"}
    res = invoke("optimize", p, "-o", tmp_path / "o", "--format", "json", env=env)
    assert res.exit_code == 0, res.output
    json.loads(res.stdout)  # stdout is the JSON document alone
    lines = res.stderr.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d graphopt \+\d+\.\ds: ", line) for line in lines)
    said = " ".join(lines)
    for phase in ("loading", "running", "parity", "writing the bundle", "bundle: verifying"):
        assert phase in said, phase
    quiet = invoke("optimize", p, "-o", tmp_path / "o", "-q", env=env)
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == ""


@pytest.mark.parametrize(
    "args",
    [
        ("explain", "{p}"),
        ("lint", "{p}"),
        ("check", "{p}", "{p}"),
        ("bisect", "{p}", "-o", "{tmp}/b"),
        ("bench", "{p}", "--runs", "2", "--warmup", "0", "--min-seconds", "0"),
    ],
)
def test_every_long_command_reports_progress(tmp_path, rng, args):
    p = conv_relu(tmp_path, rng)
    argv = [a.format(p=p, tmp=tmp_path) for a in args]
    res = invoke(*argv, env={"GRAPHOPT_PROGRESS_AFTER": "0"})
    assert res.exit_code == 0, res.output
    assert "graphopt +" in res.stderr and "graphopt +" not in res.stdout
    quiet = invoke(*argv, "--quiet", env={"GRAPHOPT_PROGRESS_AFTER": "0"})
    assert "graphopt +" not in quiet.stderr


def test_phase_lines_print_only_phases_that_last(capsys):
    lines = PhaseLines(0.2)
    lines.say("quick")
    lines.say("slow")
    time.sleep(0.6)
    lines.say("last")
    lines.stop()
    time.sleep(0.3)
    err = capsys.readouterr().err
    assert "slow" in err and "quick" not in err and "last" not in err


def test_inputs_npy_unused_names_still_ok(tmp_path, rng):
    """--inputs keeps working on check (its help text changed, not its behaviour)."""
    p = conv_relu(tmp_path, rng)
    np.save(tmp_path / "x.npy", rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    res = invoke("check", p, p, "--inputs", tmp_path / "x.npy")
    assert res.exit_code == 0, res.output

"""The command line as typer parses it: one-line usage errors with exit 2 for every kind of bad
flag, help and version on stdout, no command at all is the help, and ``--help``/``--version``
import neither onnx nor onnxruntime."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli_runner import CliRunner
from graphopt.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["optimize", "m.onnx", "-O", "4"], "'-O' / '--level'"),
        (["optimize", "m.onnx", "-O", "two"], "'-O' / '--level'"),
        (["bench", "m.onnx", "--runs", "0"], "'--runs'"),
        (["bench", "m.onnx", "--runs", str(10**12)], "'--runs'"),
        (["optimize", "m.onnx", "--format", "yaml"], "'--format'"),
        (["optimize"], "Missing argument"),
        (["optimize", "m.onnx", "--bogus"], "--bogus"),
        (["optimize", "m.onnx", "--lev", "1"], "--lev"),  # no abbreviations
        (["nope"], "No such command 'nope'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, fragment):
    res = runner.invoke(app, args)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], res.stderr
    assert "--help" in lines[0]  # where to read more


def test_help_and_version_on_stdout():
    res = runner.invoke(app, ["--version"])
    assert (res.exit_code, res.stdout.strip(), res.stderr) == (0, "graphopt 0.1.0", "")
    res = runner.invoke(app, ["optimize", "--help"])
    assert res.exit_code == 0 and "--target" in res.stdout and "--level" in res.stdout
    assert "cpu" in res.stdout and "cuda" in res.stdout  # --target names the targets
    res = runner.invoke(app, [])
    assert res.exit_code == 0 and "optimize" in res.stdout and "profile" in res.stdout


def test_an_on_off_switch_and_a_repeatable_flag(tmp_path):
    """``--kernels/--no-kernels`` and ``--shape`` twice parse (the command then fails on the
    missing file: exit 1, a one-line error, not a usage error)."""
    res = runner.invoke(
        app,
        ["optimize", str(tmp_path / "no.onnx"), "--no-kernels", "--shape", "a=1", "--shape", "b=2"],
    )
    assert res.exit_code == 1 and res.stderr.startswith("error: ") and "no.onnx" in res.stderr


def test_the_target_names_in_help_are_the_registered_ones():
    from graphopt.flags import TARGET_NAMES
    from graphopt.opt.rewrite.target import TARGETS

    assert set(TARGET_NAMES) == set(TARGETS)


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_neither_onnx_nor_onnxruntime(flag):
    code = (
        "import sys\n"
        f"sys.argv = ['graphopt', '{flag}']\n"
        "from graphopt.cli import run_args\n"
        f"code = run_args(['{flag}'])\n"
        "heavy = sorted(m for m in ('onnx', 'onnxruntime', 'numpy', 'onnx_graphsurgeon')"
        " if m in sys.modules)\n"
        "print(code, heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "0 []", out


def test_a_model_path_is_read_by_graphopt_not_checked_by_the_parser(monkeypatch):
    """The parser does not test a model path for readability (typer's default, a usage error):
    graphopt reads the model itself, and an unreadable model is an error, exit 1."""
    import os

    from conftest import EXAMPLES

    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **k: False if mode == os.R_OK else real(p, mode, **k)
    )
    res = runner.invoke(app, ["lint", str(EXAMPLES / "mobilenet_bn.onnx"), "--format", "json"])
    assert res.exit_code == 0, res.output

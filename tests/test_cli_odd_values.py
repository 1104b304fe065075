"""Odd values on the command line and in the environment: one ``error:`` line and exit 2, not
an internal error — a size flag too large for bytes, an infinite or absurd memory cap, and an
argument the locale could not decode (a path onnx and onnxruntime cannot be given)."""

import pytest

from conftest import EXAMPLES
from graphopt import cli

MODEL = str(EXAMPLES / "mobilenet_bn.onnx")


def test_a_fold_size_limit_beyond_any_machine_is_a_usage_error(tmp_path, capsys):
    code = cli.run_args(
        ["optimize", MODEL, "-o", str(tmp_path / "b"), "--fold-size-limit", "1e308"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--fold-size-limit must be at most" in err and "internal error" not in err


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "99999999999999999999999", "-5", "0"])
def test_an_absurd_memory_cap_is_a_usage_error(monkeypatch, capsys, value):
    monkeypatch.setenv("GRAPHOPT_MEMORY_MB", value)
    with pytest.raises(SystemExit) as e:
        cli._cap_memory()
    assert e.value.code == 2
    assert "GRAPHOPT_MEMORY_MB must be a number of MiB" in capsys.readouterr().err


def test_an_argument_the_locale_could_not_decode_is_a_usage_error(capsys):
    undecodable = "bad\udcff.onnx"  # how Python holds the byte 0xff of a name it cannot decode
    assert cli.run_args(["optimize", undecodable]) == 2
    err = capsys.readouterr().err
    assert "is not text in this locale's encoding" in err and "bad\\xff.onnx" in err


@pytest.mark.parametrize(
    "args",
    [
        ["bench", MODEL, "--runs", "2", "--baseline"],
        ["gate", MODEL, "-q", "--baseline"],
        ["gate", MODEL, "-q", "--op-baseline"],
    ],
    ids=["bench", "gate", "gate-ops"],
)
def test_a_baseline_nested_too_deep_is_a_usage_error(tmp_path, capsys, args):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert cli.run_args([*args, str(deep)]) == 2
    err = capsys.readouterr().err
    assert "baseline" in err and "internal error" not in err, err

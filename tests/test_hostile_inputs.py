"""Hostile inputs and careless users: each case is refused with one line and its documented exit
code (never a traceback or "internal error"), and nothing that is not graphopt's is replaced."""

from __future__ import annotations

import os
import socket
import stat

import numpy as np
import onnx
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import vi
from graphopt import cli
from graphopt.cli import app
from graphopt.opt.errors import UsageError
from graphopt.opt.io import atomic_write_text

runner = CliRunner()


def one_line(res, code: int) -> str:
    """The one stderr line of a run that exited ``code``."""
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


@pytest.fixture
def relu(tmp_path):
    """A tiny model with one input ``x`` of shape [N, 64]."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu", [vi("x", ["N", 64])], [vi("y", ["N", 64])]
    )
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


# ------------------------------------------------------- side outputs: regular files only
def _special_files(tmp_path):
    """A FIFO, a socket, a folder and (as root) a character device, each at its own path."""
    made = {}
    os.mkfifo(tmp_path / "fifo")
    made["fifo"] = "a FIFO"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "sock"))
        made["sock"] = "a socket"
    except OSError:  # a file system without sockets
        pass
    finally:
        sock.close()
    (tmp_path / "folder").mkdir()
    made["folder"] = "a directory"
    if os.geteuid() == 0:  # a private copy of /dev/null: the test never aims at the real one
        os.mknod(tmp_path / "chardev", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made["chardev"] = "a character device"
    return made


def _kind(path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


@pytest.mark.parametrize(
    "argv",
    [
        ["optimize", "{model}", "-o", "{tmp}/out", "-q", "--remarks", "{target}"],
        ["optimize", "{model}", "-o", "{tmp}/out", "-q", "--junit", "{target}"],
        ["optimize", "{model}", "-o", "{tmp}/out", "-q", "--html", "{target}"],
        ["explain", "{model}", "-q", "--remarks", "{target}"],
        ["bench", "{model}", "--runs", "1", "--warmup", "0", "--save-baseline", "{target}"],
    ],
    ids=["optimize-remarks", "optimize-junit", "optimize-html", "explain-remarks", "bench"],
)
def test_side_outputs_never_replace_what_is_not_a_regular_file(argv, relu, tmp_path):
    special = _special_files(tmp_path)
    for name, kind in special.items():
        target = tmp_path / name
        before = _kind(target)
        args = [a.format(model=relu, tmp=tmp_path, target=target) for a in argv]
        line = one_line(runner.invoke(app, args), 2)
        assert str(target) in line and kind in line, line
        assert _kind(target) == before  # still what it was
        assert not (tmp_path / "out").exists()


def test_a_link_to_a_device_is_refused_and_named(relu, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    args = ["optimize", relu, "-o", tmp_path / "out", "-q", "--remarks", tmp_path / "link"]
    line = one_line(runner.invoke(app, args), 2)
    assert "a link to" in line and "a FIFO" in line
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)


def test_what_appears_at_a_side_output_after_the_check_is_not_replaced(relu, tmp_path, monkeypatch):
    """The check is made again when the file is written, not only up front."""
    target = tmp_path / "remarks.jsonl"
    real_check = cli.check_side_outputs

    def check_then_swap(*a, **k):
        real_check(*a, **k)
        os.mkfifo(target)  # appears after the up-front check

    monkeypatch.setattr(cli, "check_side_outputs", check_then_swap)
    args = ["optimize", relu, "-o", tmp_path / "out", "-q", "--remarks", target]
    assert "a FIFO" in one_line(runner.invoke(app, args), 2)
    assert stat.S_ISFIFO(os.stat(target).st_mode)
    assert [p.name for p in tmp_path.iterdir() if "graphopt-tmp" in p.name] == []


def test_atomic_write_refuses_a_non_regular_path_and_replaces_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="is a FIFO"):
        atomic_write_text(tmp_path / "fifo", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # no temporary left
    (tmp_path / "r.json").write_text("old")
    atomic_write_text(tmp_path / "r.json", "new")
    assert (tmp_path / "r.json").read_text() == "new"


# ------------------------------------------------------------------ vacuous checks
def test_a_zero_size_input_array_is_refused(relu, tmp_path):
    np.savez(tmp_path / "zero.npz", x=np.zeros((0, 64), np.float32))
    np.save(tmp_path / "zero.npy", np.zeros((0, 64), np.float32))
    for f in ("zero.npz", "zero.npy"):
        for argv in (
            ["optimize", relu, "-o", tmp_path / "out", "-q"],
            ["check", relu, relu, "-q"],
        ):
            line = one_line(runner.invoke(app, [*argv, "--inputs", tmp_path / f]), 2)
            assert "[0, 64]" in line and "no elements" in line, line
    assert not (tmp_path / "out").exists()


def test_an_npz_without_arrays_is_refused(relu, tmp_path):
    np.savez(tmp_path / "empty.npz")
    res = runner.invoke(app, ["check", relu, relu, "--inputs", tmp_path / "empty.npz"])
    assert "holds no arrays" in one_line(res, 2)


@pytest.mark.parametrize("damage", ["truncated", "bad-crc", "not-a-zip"])
def test_a_corrupt_npz_is_a_usage_error(damage, relu, tmp_path):
    np.savez(tmp_path / "good.npz", x=np.ones((2, 64), np.float32))
    data = (tmp_path / "good.npz").read_bytes()
    bad = {
        "truncated": data[: len(data) // 2],
        "bad-crc": data[:40] + b"\0" * 50 + data[90:],
        "not-a-zip": b"PK\x03\x04" + b"\xff" * 64,
    }[damage]
    (tmp_path / "bad.npz").write_bytes(bad)
    res = runner.invoke(app, ["check", relu, relu, "--inputs", tmp_path / "bad.npz"])
    assert "cannot read" in one_line(res, 2)

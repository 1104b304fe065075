"""Hostile inputs and careless users: each case is refused with one line and its documented exit
code (never a traceback or "internal error"), and nothing that is not graphopt's is replaced."""

from __future__ import annotations

import builtins
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import external_data_helper, helper, numpy_helper

from cli_runner import CliRunner
from conftest import vi
from graphopt.cli import app
from graphopt.opt.errors import UsageError
from graphopt.opt.graph import io as graph_io
from graphopt.opt.graph.io import atomic_write_text

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
    real_check = graph_io.check_side_outputs

    def check_then_swap(*a, **k):
        real_check(*a, **k)
        os.mkfifo(target)  # appears after the up-front check

    monkeypatch.setattr(graph_io, "check_side_outputs", check_then_swap)
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


# ------------------------------------------------------------------ broken files
def _matmul_model():
    w = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "W")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "mm", [vi("x", [1, 8])], [vi("y", [1, 8])]
    )
    g.initializer.append(w)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _external_model(folder, edit):
    """A model whose weight lies in ``w.bin``; ``edit(entries, folder)`` changes its external_data
    entries (a dict) or the files."""
    folder.mkdir()
    m = _matmul_model()
    external_data_helper.convert_model_to_external_data(
        m, all_tensors_to_one_file=True, location="w.bin", size_threshold=0
    )
    onnx.save(m, folder / "m.onnx")
    m = onnx.load(folder / "m.onnx", load_external_data=False)
    tensor = m.graph.initializer[0]
    entries = {e.key: e.value for e in tensor.external_data}
    edit(entries, folder)
    del tensor.external_data[:]
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)
    onnx.save(m, folder / "m.onnx")
    return folder / "m.onnx"


def _symlink_loop(entries, folder):
    (folder / "w.bin").unlink()
    (folder / "w.bin").symlink_to("w2.bin")
    (folder / "w2.bin").symlink_to("w.bin")


EXTERNAL_BREAKS = {
    "symlink-loop": (_symlink_loop, "symlink loop"),
    "file-too-short": (lambda e, f: os.truncate(f / "w.bin", 100), "has only 100 bytes"),
    "past-the-end": (lambda e, f: e.update(offset="1000"), "ends at byte"),
    "negative-length": (lambda e, f: e.update(length="-4"), "length '-4', not a byte count"),
    "negative-offset": (lambda e, f: e.update(offset="-4"), "offset '-4', not a byte count"),
    "text-offset": (lambda e, f: e.update(offset="abc"), "offset 'abc', not a byte count"),
    "fractional-offset": (lambda e, f: e.update(offset="1.5"), "offset '1.5', not a byte count"),
    "length-not-the-dims": (lambda e, f: e.update(length="8"), "need 256 bytes"),
}


@pytest.mark.parametrize("case", sorted(EXTERNAL_BREAKS))
def test_broken_external_data_is_one_line_and_exit_1(case, tmp_path):
    edit, said = EXTERNAL_BREAKS[case]
    p = _external_model(tmp_path / case, edit)
    for argv in (
        ["optimize", p, "-o", tmp_path / "out", "-q"],
        ["check", p, p, "-q"],
        ["lint", p],
        ["explain", p, "-q"],
    ):
        line = one_line(runner.invoke(app, argv), 1)
        assert said in line, (argv[0], line)
    assert not (tmp_path / "out").exists()


def test_a_declared_dim_of_two_to_the_62_is_refused_with_the_bound(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "big",
        [vi("x", [1, 2**62])],
        [vi("y", [1, 2**62])],
    )
    p = tmp_path / "big.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    line = one_line(runner.invoke(app, ["check", p, p, "-q"]), 1)
    assert "4611686018427387904" in line and "4 GiB" in line
    line = one_line(runner.invoke(app, ["optimize", p, "-o", tmp_path / "o", "-q"]), 3)
    assert line.startswith("error: parity could not run:") and "4 GiB" in line


def test_an_output_name_too_long_for_the_file_system_is_a_usage_error(relu, tmp_path):
    long = "a" * 300
    for argv in (
        ["optimize", relu, "-o", tmp_path / long, "-q"],
        ["optimize", relu, "-o", tmp_path / long / "b", "-q"],
        ["optimize", relu, "-o", tmp_path / "b", "-q", "--remarks", tmp_path / long],
        ["bisect", relu, "-o", tmp_path / long, "-q"],
    ):
        assert "300 bytes" in one_line(runner.invoke(app, argv), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relu.onnx"]


def test_an_unreadable_input_is_one_line_and_exit_1(relu, tmp_path, monkeypatch):
    if os.geteuid() == 0:  # root reads a mode-000 file anyway: refuse it the way the OS would
        real_open = builtins.open

        def refusing_open(file, *a, **k):
            if os.fspath(file) == os.fspath(relu):
                raise PermissionError(13, "Permission denied", os.fspath(file))
            return real_open(file, *a, **k)

        monkeypatch.setattr(builtins, "open", refusing_open)
    else:
        relu.chmod(0)
    try:
        for argv in (["optimize", relu, "-o", tmp_path / "o", "-q"], ["lint", relu]):
            assert "cannot read (Permission denied)" in one_line(runner.invoke(app, argv), 1)
    finally:
        relu.chmod(0o644)


def test_an_input_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "m.onnx")
    assert "is a FIFO" in one_line(runner.invoke(app, ["lint", tmp_path / "m.onnx"]), 1)


def _lint_breaks():
    x, y = vi("x", [2]), vi("y", [2])
    opsets = [helper.make_opsetid("", 17)]
    cycle = helper.make_graph(
        [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])],
        "cycle",
        [x],
        [vi("b", [2])],
    )
    local = [*opsets, helper.make_opsetid("local", 1)]
    f = helper.make_function(
        "local", "F", ["a"], ["b"], [helper.make_node("F", ["a"], ["b"], domain="local")], local
    )
    calls = helper.make_graph([helper.make_node("F", ["x"], ["y"], domain="local")], "r", [x], [y])
    raw = _matmul_model()
    raw.graph.initializer[0].raw_data = b"\0" * 12
    return {
        "cycle": (helper.make_model(cycle, opset_imports=opsets), "topologically sorted"),
        "recursive-function": (
            helper.make_model(calls, functions=[f], opset_imports=local),
            "must not be recursive",
        ),
        "raw-data-size": (raw, "holds 12 bytes of raw data"),
    }


@pytest.mark.parametrize("case", ["cycle", "recursive-function", "raw-data-size"])
def test_lint_on_a_model_too_broken_to_look_at_is_one_line_and_exit_1(case, tmp_path):
    m, said = _lint_breaks()[case]
    p = tmp_path / "m.onnx"
    p.write_bytes(m.SerializeToString())
    assert said in one_line(runner.invoke(app, ["lint", p]), 1)


@pytest.fixture
def bundle(relu, tmp_path):
    out = tmp_path / "b"
    res = runner.invoke(app, ["optimize", relu, "-o", out, "-q", "--no-measure"])
    assert res.exit_code == 0, res.output
    np.savez(tmp_path / "x.npz", x=np.ones((2, 64), np.float32))
    return out


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(edit(data)))


@pytest.mark.parametrize(
    "file,edit,said",
    [
        ("manifest.json", lambda d: [d], "manifest.json is a list, not an object"),
        ("session_config.json", lambda d: "ORT_ENABLE_ALL", "session_config.json is a string"),
        (
            "session_config.json",
            lambda d: d | {"graph_optimization_level": "banana"},
            "unknown graph_optimization_level 'banana'",
        ),
        (
            "session_config.json",
            lambda d: d | {"graph_optimization_level": 3},
            "'graph_optimization_level' is an integer, not a string",
        ),
        (
            "session_config.json",
            lambda d: d | {"graph_optimization_level": "__class__"},
            "unknown graph_optimization_level '__class__'",
        ),
        (
            "manifest.json",
            lambda d: d | {"integrity": {"files": {"model.onnx": []}}},
            "'integrity.files.model.onnx' is a list, not an object",
        ),
    ],
)
def test_run_on_a_bundle_with_broken_json_is_one_line_and_exit_1(file, edit, said, bundle):
    _edit_json(bundle / file, edit)
    res = runner.invoke(app, ["run", bundle, "--inputs", bundle.parent / "x.npz"])
    assert said in one_line(res, 1)


def test_run_inputs_that_are_a_corrupt_npz_is_a_usage_error(bundle):
    (bundle.parent / "bad.npz").write_bytes(b"PK\x03\x04" + b"\xff" * 64)
    res = runner.invoke(app, ["run", bundle, "--inputs", bundle.parent / "bad.npz"])
    assert "cannot read" in one_line(res, 2)


# ------------------------------------------------------------------ absurd counts
def test_absurd_run_counts_are_refused_with_the_bound(relu, bundle):
    huge = str(10**12)
    for argv in (
        ["bench", relu, "--runs", huge],
        ["bench", relu, "--warmup", huge],
        ["run", bundle, "--inputs", bundle.parent / "x.npz", "--repeat", huge],
    ):
        line = one_line(runner.invoke(app, argv), 2)
        assert "1000000" in line and huge in line, line


# ------------------------------------------------------------------ Ctrl-C
#: the console script as pip writes it, under the name it runs as (``graphopt``); ``{before}``
#: runs first
_SCRIPT = """import sys
{before}
from graphopt.cli import console
sys.exit(console())
"""

#: SIGINT delivered while graphopt's imports run (as onnx is imported, from the package's
#: own __init__): deterministic, however fast or loaded the machine
_SIGINT_DURING_IMPORTS = """import builtins, os, signal
_real = builtins.__import__
def _import(name, *args, **kw):
    if name == "onnx" and not getattr(builtins, "_sent", False):
        builtins._sent = True
        os.kill(os.getpid(), signal.SIGINT)
    return _real(name, *args, **kw)
builtins.__import__ = _import"""


def _console(tmp_path, before: str = ""):
    script = tmp_path / "bin" / "graphopt"
    script.parent.mkdir(exist_ok=True)
    script.write_text(_SCRIPT.format(before=before))
    return [sys.executable, str(script)]


def test_ctrl_c_while_the_imports_run_is_one_line_and_exit_130(relu, tmp_path):
    argv = [*_console(tmp_path, _SIGINT_DURING_IMPORTS), "lint", str(relu)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "error: interrupted\n" and done.stdout == ""


def test_ctrl_c_while_the_command_runs_is_one_line_and_exit_130(relu, tmp_path):
    argv = [*_console(tmp_path), "bench", str(relu), "--runs", "1000000", "--min-seconds", "600"]
    env = os.environ | {"GRAPHOPT_PROGRESS_AFTER": "0"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        seen = ""
        while "measuring latency" not in seen:  # the command is running: its progress says so
            line = proc.stderr.readline()
            assert line, f"exited early: {seen}"
            seen += line
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, seen + err
    assert err.strip().splitlines() == ["error: interrupted"] and "Traceback" not in err


# ------------------------------------------------ names from a model are shown, never obeyed
HOSTILE_NAME = "[bold red]x[/bold red][/oops]\x1b[2J\x1b[31mred\u202e"


@pytest.mark.parametrize("command", ["optimize", "lint"])
def test_markup_and_escapes_in_a_node_name_are_printed_as_written(command, tmp_path):
    g = helper.make_graph(
        [helper.make_node("FooBar", ["x"], ["y"], domain="my.dom", name=HOSTILE_NAME)],
        "g",
        [vi("x", [4])],
        [vi("y", [4])],
    )
    path = tmp_path / "named.onnx"
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("my.dom", 1)]
    onnx.save(helper.make_model(g, opset_imports=opsets), path)
    args = [command, str(path)] + (["-o", str(tmp_path / "out")] if command == "optimize" else [])
    res = runner.invoke(app, args)
    assert "internal error" not in res.output and "Traceback" not in res.output, res.output
    if command == "optimize":
        assert res.exit_code == 4, res.output  # the domain has no kernel: a documented refusal
    assert "\x1b" not in res.output and "\u202e" not in res.output
    assert "[bold red]x[/bold red][/oops]\\x1b[2J\\x1b[31mred\\u202e" in res.output.replace(
        "\n", ""
    )


def test_a_graph_without_outputs_is_refused_at_load(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", [4])], [])
    path = tmp_path / "no_outputs.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    line = one_line(runner.invoke(app, ["optimize", str(path), "-o", str(tmp_path / "o")]), 1)
    assert "the graph has no outputs" in line


def _npz_declaring(path, shape) -> None:
    """An .npz whose one array's header declares ``shape`` (float32) and holds no data: what a
    zip bomb's header says before its gigabytes of zeros."""
    import zipfile

    from numpy.lib import format as npy

    with (
        zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z,
        z.open("x.npy", "w") as f,
    ):
        npy.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})


def test_an_npz_that_declares_gigabytes_is_refused_before_it_is_unpacked(relu, tmp_path):
    _npz_declaring(tmp_path / "bomb.npz", (1 << 31, 64))
    args = [
        "optimize",
        str(relu),
        "-o",
        str(tmp_path / "o"),
        "--inputs",
        str(tmp_path / "bomb.npz"),
    ]
    line = one_line(runner.invoke(app, args), 2)
    assert "'x' declares 512.0 GiB, more than the 4 GiB an array may" in line


def test_golden_arrays_that_declare_gigabytes_are_a_corrupt_bundle(relu, tmp_path):
    out = tmp_path / "b"
    assert runner.invoke(app, ["optimize", str(relu), "-o", str(out), "-q"]).exit_code == 0
    _npz_declaring(out / "golden" / "inputs.npz", (1 << 31, 64))
    line = one_line(runner.invoke(app, ["run", str(out), "--verify", "none"]), 1)
    assert "declares 512.0 GiB" in line


@pytest.mark.parametrize(
    "dtype,expr,said",
    [
        ("float */ int x; /*", "relu(x0)", "is not one of float32, float16"),
        ("float32", "relu(x0); system(1)", "unexpected '; system'"),
    ],
)
def test_a_forged_generated_kernel_node_is_refused_not_compiled(dtype, expr, said, tmp_path):
    from graphopt.opt.graph.domains import GENERATED
    from graphopt.targets.codegen.expr import op_type, parse

    node = helper.make_node(
        op_type(parse("relu(x0)"), dtype, 0),
        ["x"],
        ["y"],
        domain=GENERATED,
        expr=expr,
        dtype=dtype,
        channel_axis=0,
    )
    g = helper.make_graph([node], "g", [vi("x", [1, 4, 8, 8])], [vi("y", [1, 4, 8, 8])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(GENERATED, 1)]
    path = tmp_path / "forged.onnx"
    onnx.save(helper.make_model(g, opset_imports=opsets), path)
    res = runner.invoke(app, ["optimize", str(path), "-o", str(tmp_path / "o"), "--kernels"])
    line = one_line(res, 1)
    assert "is no kernel graphopt can build" in line and said in line


@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_external_data_that_is_no_regular_file_is_named_for_what_it_is(kind, tmp_path):
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [vi("x", [1, 4])],
        [vi("y", [1, 4])],
        [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    external_data_helper.convert_model_to_external_data(m, location="w.bin", size_threshold=0)
    onnx.save(m, tmp_path / "m.onnx", save_as_external_data=False)
    (tmp_path / "w.bin").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "w.bin") if kind == "a FIFO" else (tmp_path / "w.bin").mkdir()
    res = runner.invoke(app, ["optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o")])
    assert f"'w.bin' for tensor 'W' is {kind}, not a regular file" in one_line(res, 1)


@pytest.mark.parametrize(
    "name,value,said",
    [
        ("GRAPHOPT_RUN_SECONDS", "abc", "must be seconds, from 0 (got 'abc')"),
        ("GRAPHOPT_TIME_BUDGET", "nan", "must be seconds, from 0 (got 'nan')"),
        ("GRAPHOPT_PIECE_MB", "inf", "must be a number of MiB, above 0 to 1048576"),
        ("GRAPHOPT_PIECE_NODES", "1", "must be a node count, from 2 (got '1')"),
        ("GRAPHOPT_PROGRESS_AFTER", "-5", "must be seconds, from 0 (got '-5')"),
        ("GRAPHOPT_ROTARY_POSITIONS", "0", "must be a position count, from 1 to 16777216"),
        ("GRAPHOPT_KERNEL_THREADS", "1e9", "must be a thread count"),
        ("GRAPHOPT_IN_PLACE_ABOVE", "x", "must be a number of bytes, from 0 (got 'x')"),
    ],
)
def test_a_bad_environment_number_is_refused_before_the_command(name, value, said, relu, tmp_path):
    res = runner.invoke(
        app, ["optimize", str(relu), "-o", str(tmp_path / "o"), "-q"], env={name: value}
    )
    assert f"{name} {said}" in one_line(res, 2)
    assert not (tmp_path / "o").exists()


def test_inputs_that_are_a_fifo_are_refused_without_blocking(relu, tmp_path):
    os.mkfifo(tmp_path / "in.npz")
    args = ["optimize", str(relu), "-o", str(tmp_path / "o"), "--inputs", str(tmp_path / "in.npz")]
    assert "is a FIFO, not a regular .npz or .npy file" in one_line(runner.invoke(app, args), 2)


def test_lint_says_a_graph_has_no_outputs(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", [4])], [])
    path = tmp_path / "no_outputs.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    res = runner.invoke(app, ["lint", str(path)])
    assert res.exit_code == 0 and "no-outputs: the graph declares no outputs" in res.stdout

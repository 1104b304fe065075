"""The command's process settings: glibc's allocator (one arena, fixed thresholds) and one
BLAS thread, unless the user chose."""

from __future__ import annotations

import ctypes
import os

import pytest

from graphopt import cli


class _Libc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch):
    fake = _Libc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    return fake


_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def test_one_arena_and_fixed_thresholds_on_glibc(monkeypatch, libc):
    for variable in _SETTINGS:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    cli._tune_malloc()
    assert libc.calls == [(-8, 1), (-3, 8 << 20), (-1, 32 << 20)]


def test_the_users_setting_and_other_c_libraries_are_left_alone(monkeypatch, libc):
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    for variable in _SETTINGS:
        monkeypatch.setenv(variable, "4")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    cli._tune_malloc()
    assert libc.calls == [(-3, 8 << 20)]  # only what the environment left to it
    libc.calls.clear()

    def not_glibc(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "confstr", not_glibc)
    cli._tune_malloc()
    assert libc.calls == []


def test_small_models_get_small_heap_thresholds(monkeypatch, libc):
    """A model file of 1 to 32 MiB maps blocks from 256 KiB (its weight-sized blocks would
    otherwise fragment the heap); a larger one, or one under 1 MiB (its weights may lie in
    other files), keeps the large thresholds; the user's variables still win."""
    for variable in _SETTINGS:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    cli._fit_malloc(21 << 20)
    assert libc.calls == [(-3, 256 << 10), (-1, 1 << 20)]
    libc.calls.clear()
    for size in (100 << 10, 32 << 20, 600 << 20):
        cli._fit_malloc(size)
    assert libc.calls == []
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4")
    cli._fit_malloc(21 << 20)
    assert libc.calls == [(-3, 256 << 10)]


_BLAS_PROBE = """
import ctypes, sys
import numpy
from graphopt import cli
print(cli._one_blas_thread())
maps = open('/proc/self/maps').read().splitlines()
path = next(line.split()[-1] for line in maps if 'openblas' in line.lower())
lib = ctypes.CDLL(path)
names = ('scipy_openblas_get_num_threads64_', 'openblas_get_num_threads64_',
         'openblas_get_num_threads')
get = next(getattr(lib, n) for n in names if hasattr(lib, n))
print(get())
"""


def _has_openblas() -> bool:
    import numpy  # noqa: F401

    try:
        with open("/proc/self/maps") as maps:
            return any("openblas" in line.lower() for line in maps)
    except OSError:
        return False


@pytest.mark.skipif(not _has_openblas(), reason="numpy is not built on OpenBLAS here")
@pytest.mark.parametrize("env", [{}, {"OPENBLAS_NUM_THREADS": "2"}])
def test_one_blas_thread_unless_the_user_chose(env):
    """In a fresh process (the setting is the process's): numpy's OpenBLAS on one thread,
    unless OPENBLAS_NUM_THREADS (or OMP_NUM_THREADS) is set."""
    import subprocess
    import sys

    clean = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    }
    out = subprocess.run(
        [sys.executable, "-c", _BLAS_PROBE], env=clean | env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    said, threads = out.stdout.split()
    if env:
        assert said == "None" and threads == env["OPENBLAS_NUM_THREADS"]
    else:
        assert said == "1" and threads == "1"


_QUIET_PROBE = """
import sys
from graphopt.cli import console
sys.argv = ["graphopt", "optimize", sys.argv[1], "-o", sys.argv[2], "--quiet", "--no-check"]
try:
    console()
except SystemExit as e:
    code = e.code
print(code, any(m == "rich" or m.startswith("rich.") for m in sys.modules))
"""


def test_a_quiet_run_does_not_import_rich(tmp_path):
    """Nothing is printed: the console library (about 30 ms of every start) is not loaded."""
    import subprocess
    import sys

    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        [w],
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    out = subprocess.run(
        [sys.executable, "-c", _QUIET_PROBE, str(src), str(tmp_path / "b")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False"]


_GATE_PROBE = """
import sys
from graphopt.cli import console
sys.argv = ["graphopt", "gate", sys.argv[1], "-q", "--save-baseline", sys.argv[2]]
try:
    console()
except SystemExit as e:
    print(e.code)
"""


def test_gate_saves_a_baseline_in_a_fresh_process(tmp_path):
    """`gate` writes no bundle, yet it times the model with a bundle's session settings: in a
    process that never imported the bundle writer, they are still found."""
    import subprocess
    import sys

    from conftest import EXAMPLES

    base = tmp_path / "base.json"
    env = {k: v for k, v in os.environ.items() if k != "GRAPHOPT_NO_MEASURE"}  # as users run
    out = subprocess.run(
        [sys.executable, "-c", _GATE_PROBE, str(EXAMPLES / "mobilenet_bn.onnx"), str(base)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.stdout.split()[-1:] == ["0"], out.stderr[-800:]
    assert base.exists()

"""The clock: report.json's seconds name every phase of a run and add up to the wall time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from onnx import helper

import graphopt
from conftest import const, model, vi
from graphopt.opt.clock import Clock, phase_summary, process_age

PHASES = {"load", "passes", "validity", "parity"}


def small():
    nodes = [
        helper.make_node("Add", ["x", "zero"], ["a"]),
        helper.make_node("MatMul", ["a", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["y"]),
    ]
    inits = [const("zero", np.zeros(8)), const("W", np.ones((8, 8))), const("b", np.ones(8))]
    return model(nodes, [vi("x", [2, 8])], [vi("y", [2, 8])], inits)


def _adds_up(seconds: dict[str, float]) -> None:
    parts = [v for k, v in seconds.items() if k != "total"]
    assert all(v >= 0 for v in parts)
    assert abs(sum(parts) - seconds["total"]) <= 1e-4 * len(parts) + 1e-9


def test_phases_are_exclusive_and_add_up():
    clock = Clock()
    with clock.phase("load"):
        time.sleep(0.02)
        with clock.phase("passes"):  # nested: charged to the open phase
            time.sleep(0.02)
    time.sleep(0.01)
    with clock.phase("parity"):
        time.sleep(0.01)
    s = clock.seconds()
    assert list(s) == ["load", "parity", "other", "total"]
    assert s["load"] >= 0.04 and s["other"] >= 0.01 and s["parity"] >= 0.01
    _adds_up(s)
    assert phase_summary(s).startswith(f"{s['total']:.2f}s (load ")
    assert phase_summary({"bundle": 1.0, "total": 1.0}) == "1.00s with the bundle (bundle 1.00)"


def test_process_age_counts_this_process(monkeypatch):
    age = process_age()
    if age is None:  # not Linux
        return
    assert 0 < age < time.perf_counter() + 3600
    assert "startup" not in Clock.since_process_start().seconds()  # a test runner's own age
    monkeypatch.setattr(sys, "argv", ["/usr/bin/graphopt", "optimize"])
    assert Clock.since_process_start().seconds()["startup"] > 0


def test_api_report_seconds_are_the_wall_time():
    t0 = time.perf_counter()
    _, report = graphopt.optimize(small(), check=True, measure=False)
    wall = time.perf_counter() - t0
    s = report.seconds
    assert PHASES <= set(s), s
    _adds_up(s)
    assert s["total"] <= wall + 1e-3
    assert wall - s["total"] < 0.05 + 0.05 * wall, (wall, s)


def test_cli_report_seconds_cover_the_whole_wait(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(small().SerializeToString())
    out = tmp_path / "b"
    code = "from graphopt.cli import app; app()"
    env = {**os.environ, "GRAPHOPT_NO_MEASURE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, "optimize", str(src), "-o", str(out), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "report.json").read_text())["seconds"]
    assert PHASES | {"write", "bundle"} <= set(s), s
    _adds_up(s)
    assert s["total"] <= wall
    if "startup" in s:  # the interpreter's start and imports are part of the wait
        # what is left: the interpreter's teardown after report.json was written
        assert wall - s["total"] < max(1.5, 0.35 * wall), (wall, s)

"""bench.py --speed: the commands it times and the table it writes (no tool is run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmark"))
speed = pytest.importorskip("speed")


def test_graphopt_runs_as_a_user_runs_it(tmp_path):
    side = {"inputs": {"input_ids": [1, 128], "mask": [1, 128]}}
    fast = speed._command(speed.NO_CHECK, tmp_path / "m.onnx", tmp_path / "o", side)
    full = speed._command(speed.DEFAULT, tmp_path / "m.onnx", tmp_path / "o", side)
    assert "--no-check" in fast and "--shape" not in fast
    assert "--no-check" not in full and "--no-kernels" not in full
    assert full[-4:] == ["--shape", "input_ids=1,128", "--shape", "mask=1,128"]
    ort = speed._command("onnxruntime offline", tmp_path / "m.onnx", tmp_path / "o", side)
    assert "_optimize" in ort and "ort-extended" in ort


def test_rows_take_the_median_and_the_largest_rss():
    recs = [
        {"rc": 0, "wall_s": w, "peak_rss_mb": m, "phases": None}
        for w, m in ((3.0, 100), (1.0, 300), (2.0, 200))
    ]
    row = speed._row(recs + [{"rc": 1, "error": "exit 1: boom"}])
    assert row["wall_s"] == 2.0 and row["peak_rss_mb"] == 300
    assert speed._row([{"rc": None, "error": "timeout after 5 s"}]) == {
        "ok": False,
        "error": "timeout after 5 s",
    }


def test_table_gives_ratios_to_graphopt_no_check():
    meta = {"command": "bench.py --speed", "date": "d", "machine": "m", "rounds": 1}
    phases = {"startup": 1.0, "passes": 2.0, "bundle": 0.5, "other": 0.5, "total": 4.0}
    rows = {
        speed.NO_CHECK: {"ok": True, "wall_s": 4.0, "peak_rss_mb": 200, "phases": phases},
        "onnxsim": {"ok": True, "wall_s": 2.0, "peak_rss_mb": 100},
        "onnxslim": {"ok": False, "error": "exit 1: boom"},
    }
    text = speed.render(meta, {"m": rows})
    assert "| onnxsim | 2.00 | 100 | 0.50 | 0.50 |" in text
    assert "| onnxslim | failed: exit 1: boom |" in text
    assert "startup 1.00, passes 2.00, bundle 0.50, other 0.50; total 4.0" in text

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
    assert "--no-check" in fast and "--shape" not in fast and "--no-kernels" not in fast
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
    assert row["phases"] is None and row["wall_without_measure_s"] == 2.0
    assert speed._row([{"rc": None, "error": "timeout after 5 s"}]) == {
        "ok": False,
        "error": "timeout after 5 s",
    }


def test_the_default_run_without_its_timing_is_taken_round_by_round():
    """One round whose safety net timed long (and bisected) does not lend its timing to
    another round's wall time: each round is reduced by its own, then the median."""
    walls_measures = ((1.13, 0.45), (4.05, 3.39), (1.12, 0.44))
    recs = [
        {"rc": 0, "wall_s": w, "peak_rss_mb": 1, "phases": {"measure": m}}
        for w, m in walls_measures
    ]
    row = speed._row(recs)
    assert row["wall_s"] == 1.13 and row["phases"] == {"measure": 0.45}
    assert abs(row["wall_without_measure_s"] - 0.68) < 1e-9


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


def test_summary_gives_ratios_to_onnxruntime_and_medians():
    meta = {"command": "bench.py --speed", "date": "d", "machine": "m", "rounds": 1}

    def rows(g, o, sim, default, measure, g_rss, o_rss):
        return {
            speed.NO_CHECK: {"ok": True, "wall_s": g, "peak_rss_mb": g_rss},
            speed.DEFAULT: {
                "ok": True,
                "wall_s": default,
                "peak_rss_mb": 1,
                "phases": {"measure": measure, "total": default},
            },
            "onnxruntime offline": {"ok": True, "wall_s": o, "peak_rss_mb": o_rss},
            "onnxsim": {"ok": True, "wall_s": sim, "peak_rss_mb": 1},
        }

    text = speed.render(
        meta,
        {
            "a": rows(2.0, 1.0, 3.0, 5.0, 1.0, 100, 200),  # 2x, below onnxsim, (5-1)/2 = 2
            "b": rows(4.0, 1.0, 3.0, 6.0, 0.0, 300, 200),  # 4x, above onnxsim, 1.5
            "c": rows(3.0, 1.0, 4.0, 3.0, 0.0, 100, 100),  # 3x, 1.0
        },
    )
    assert "| a | 2.00 | 1.00 | 2.00 | 3.00 | yes | 2.00 | 100 | 200 | 0.50 |" in text
    assert "| b | 4.00 | 1.00 | 4.00 | 3.00 | no | 1.50 | 300 | 200 | 1.50 |" in text
    assert (
        "3 models: --no-check ÷ onnxruntime median 3.00 (max 4.00, 1 above 3x); below onnxsim "
        "on 2/3; default (without measure) ÷ --no-check median 1.50 (max 2.00); peak RSS ÷ "
        "onnxruntime median 1.00 (max 1.50, at or below on 2/3)." in text
    )

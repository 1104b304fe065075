"""examples/scale/scaling.py: each size's own peak RSS, CPU time and phase times, per-1k-node
columns."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "scale"))
import scaling  # noqa: E402


def test_peak_rss_is_each_process_own():
    big = "import numpy as np; a = np.ones(40_000_000); print(a.sum())"  # ~300 MB
    code, _, rss_big, out, _ = scaling.timed([sys.executable, "-c", big])
    assert code == 0 and out.strip() == "40000000.0" and rss_big > 250
    ballast = np.ones(60_000_000)  # this process's own peak must not count either (~480 MB)
    code, _, rss_small, _, _ = scaling.timed([sys.executable, "-c", "pass"])
    assert code == 0 and rss_small < rss_big / 2  # not the largest child so far, nor ours
    del ballast


def test_row_gives_phases_and_per_1k_node_costs():
    seconds = {"startup": 1.0, "load": 0.5, "passes": 4.0, "validity": 1.0, "total": 8.0}
    r = {"nodes": 2000, "nodes_after": 500, "wall_s": 10.0, "cpu_s": 6.0, "peak_rss_mb": 300.0}
    text = scaling.line({**r, "seconds": seconds})
    assert text == (
        "| 2000 | 500 | 10.0 | 6.0 | 1.0 | 0.5 | 4.0 | 1.0 | 0.0 | 0.0 | 300 | 2.000 | 5.000 | "
        "3.000 |"
    )


def test_cpu_time_is_the_commands_own_not_its_waits():
    spin = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    code, wall, _, _, cpu = scaling.timed([sys.executable, "-c", spin])
    assert code == 0 and cpu >= 0.5
    code, wall, _, _, cpu = scaling.timed([sys.executable, "-c", "import time; time.sleep(1.0)"])
    assert code == 0 and wall >= 1.0 and cpu < 0.9
    assert scaling.line({"nodes": 5, "error": "exit 1"}) == "| 5 | exit 1 |"

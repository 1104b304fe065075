"""The HTML report: self-contained, escaped, and (slow) rendered by headless Chromium."""

import shutil
import subprocess

import onnx
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import EXAMPLES, model, vi
from graphopt.cli import app

runner = CliRunner()
HOSTILE = '<script>alert("x")</script>'


def hostile_model(tmp_path):
    nodes = [
        helper.make_node("Identity", ["x"], ["a"], name=HOSTILE),
        helper.make_node("Relu", ["a"], ["y"], name="relu</script><b>"),
    ]
    p = tmp_path / "hostile.onnx"
    onnx.save(model(nodes, [vi("x", [2])], [vi("y", [2])]), p)
    return p


def test_html_is_self_contained_and_escaped(tmp_path):
    out = tmp_path / "r.html"
    res = runner.invoke(
        app,
        [
            "optimize",
            str(hostile_model(tmp_path)),
            "-o",
            str(tmp_path / "o"),
            "--html",
            str(out),
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert HOSTILE not in page and "</script><b>" not in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
    for ident in ("op-histogram", "pass-table", "rule-table", "parity-table", "remarks-table"):
        assert f'id="{ident}"' in page


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_html_renders_in_headless_chromium(tmp_path):
    out = tmp_path / "r.html"
    res = runner.invoke(
        app,
        [
            "optimize",
            str(EXAMPLES / "bert_tiny.onnx"),
            "-o",
            str(tmp_path / "o"),
            "--html",
            str(out),
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    proc = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            out.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = proc.stdout
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert proc.returncode == 0 and dom, proc.stderr[-2000:]
    assert not console, console
    assert 'class="kind-' in dom, "remarks table was not filled by the page's script"
    assert " of " in dom.split('id="remarks-count"')[1][:40]
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile2'}",
            f"--screenshot={shot}",
            "--window-size=1280,1600",
            out.as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert shot.exists() and shot.stat().st_size > 10_000

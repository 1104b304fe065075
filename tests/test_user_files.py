"""graphopt never harms the user's files: an output folder is replaced only when it is a bundle
(or bisect folder) graphopt wrote and holds nothing else; no side output may land on the input
model, its external data, an input file or inside the bundle being written; and no temporary
folder survives a run, a failed one included."""

import json
import os
import subprocess

import numpy as np
import onnx
import pytest
from onnx import helper

import graphopt.targets.bundle as bundle_writer
from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt.graph.io import save_model, staging_dir
from graphopt.opt.rewrite.engine import Op, Rule
from graphopt.opt.rewrite.manager import RULES

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def refused(res) -> str:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


def snapshot(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def small(rng):
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "b"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    inits = [const("W", rng.standard_normal((64, 32))), const("b", rng.standard_normal(32))]
    return model(nodes, [vi("x", [2, 64])], [vi("y", None)], inits)


@pytest.fixture
def net(tmp_path, rng):
    p = tmp_path / "net.onnx"
    onnx.save(small(rng), p)
    return p


@pytest.fixture
def ext_net(tmp_path, rng):
    """A model whose weights live in an external-data file beside it."""
    p = tmp_path / "ext" / "net.onnx"
    save_model(small(rng), p, external=True)
    data = p.with_name("net.onnx.data")
    assert data.exists()
    return p, data


# ------------------------------------------------------------------ replacing output folders
def test_folder_with_a_report_json_is_not_replaced(net, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.json").write_text("{}")
    (mine / "thesis.tex").write_text("years of work")
    before = snapshot(mine)
    assert "not a graphopt bundle" in refused(invoke("optimize", net, "-o", mine))
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert "not a graphopt bundle" in refused(invoke("optimize", net, "-o", link))
    assert snapshot(mine) == before and link.is_symlink()


def test_a_bundle_is_replaced_and_a_bundle_with_user_files_is_not(net, tmp_path):
    out = tmp_path / "out"
    assert invoke("optimize", net, "-o", out, "-q").exit_code == 0
    assert invoke("optimize", net, "-o", out, "-q", "-O", "1").exit_code == 0
    assert json.loads((out / "report.json").read_text())["level"] == 1
    (out / "golden" / "notes.txt").write_text("mine")
    before = snapshot(out)
    line = refused(invoke("optimize", net, "-o", out, "-q"))
    assert "golden/notes.txt" in line
    assert snapshot(out) == before
    assert hidden(tmp_path) == []


def test_a_symlinked_bundle_replaces_its_target_only(net, tmp_path):
    real = tmp_path / "real"
    assert invoke("optimize", net, "-o", real, "-q").exit_code == 0
    link = tmp_path / "link"
    link.symlink_to(real)
    assert invoke("optimize", net, "-o", link, "-q", "-O", "1").exit_code == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert json.loads((real / "report.json").read_text())["level"] == 1
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "dangling" in refused(invoke("optimize", net, "-o", dangling))


def test_output_folder_holding_the_input_or_its_external_data(ext_net, tmp_path):
    p, data = ext_net
    before = data.read_bytes()
    refused(invoke("optimize", p, "-o", p.parent))
    refused(invoke("optimize", p, "-o", p))
    assert data.read_bytes() == before


class WrongReluToAbs(Rule):
    """Deliberately wrong (tests only): Relu(x) is not Abs(x)."""

    name = "test-files-wrong-relu"
    root = "Relu"
    level = 2
    summary = "deliberately wrong rewrite (tests only)"
    pattern = Op("Relu", "x")
    exclusive = False

    def rewrite(self, m, b):
        return [b.op("Abs", [m.x], like=m.root.outputs[0])]


def test_bisect_folder_has_its_own_marker(net, tmp_path, monkeypatch):
    monkeypatch.setitem(RULES, WrongReluToAbs.name, WrongReluToAbs())
    args = ["bisect", net, "--pipeline", f"{WrongReluToAbs.name},dce"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "report.json").write_text("{}")
    (foreign / "keep.txt").write_text("keep")
    assert "not a graphopt bisect folder" in refused(invoke(*args, "-o", foreign))
    assert (foreign / "keep.txt").read_text() == "keep"
    out = tmp_path / "bis"
    for _ in range(2):  # the second run replaces the first one's folder
        res = invoke(*args, "-o", out)
        assert res.exit_code == 3, res.output
        assert json.loads((out / "report.json").read_text())["schema"] == "graphopt.bisect/1"
        assert sorted(p.name for p in out.iterdir()) == ["after.onnx", "before.onnx", "report.json"]
    bundle = tmp_path / "bundle"
    assert invoke("optimize", net, "-o", bundle, "-q", "-O", "1").exit_code == 0
    refused(invoke(*args, "-o", bundle))  # a bundle is not a bisect folder
    assert hidden(tmp_path) == []


# ------------------------------------------------------------------ side outputs
SIDE_FLAGS = ["--remarks", "--junit", "--html"]


@pytest.mark.parametrize("flag", SIDE_FLAGS)
def test_side_outputs_never_overwrite_the_input_or_the_bundle(ext_net, tmp_path, flag):
    p, data = ext_net
    out = tmp_path / "out"
    assert invoke("optimize", p, "-o", out, "-q").exit_code == 0
    link = tmp_path / "link.onnx"
    link.symlink_to(p)
    files = [p, data, link]
    before = {f: f.read_bytes() for f in files}
    bundle = snapshot(out)
    for target in (p, data, link, out / "model.onnx", out / "golden" / "inputs.npz", out):
        refused(invoke("optimize", p, "-o", out, "-q", flag, target))
    assert {f: f.read_bytes() for f in files} == before and snapshot(out) == bundle


def test_explain_remarks_and_inputs_file_are_protected(net, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.ones((2, 64), np.float32))
    before = (tmp_path / "in.npz").read_bytes()
    refused(invoke("explain", net, "--remarks", net))
    refused(
        invoke("explain", net, "--inputs", tmp_path / "in.npz", "--remarks", tmp_path / "in.npz")
    )
    refused(
        invoke("optimize", net, "-o", tmp_path / "o", "--inputs", tmp_path / "in.npz",
               "--junit", tmp_path / "in.npz")
    )  # fmt: skip
    assert (tmp_path / "in.npz").read_bytes() == before


def test_bench_and_lint_outputs_are_protected(ext_net, tmp_path):
    p, data = ext_net
    before = (p.read_bytes(), data.read_bytes())
    quick = ["--runs", "1", "--min-seconds", "0"]
    refused(invoke("bench", p, *quick, "--save-baseline", p))
    refused(invoke("bench", p, *quick, "--save-baseline", data))
    refused(invoke("bench", p, *quick, "--junit", data))
    refused(invoke("lint", p, "--freeze-initializers", "-o", p))
    refused(invoke("lint", p, "--freeze-initializers", "-o", data))
    out = tmp_path / "b"
    assert invoke("optimize", p, "-o", out, "-q").exit_code == 0
    bundle = snapshot(out)
    refused(invoke("bench", p, *quick, "--optimized", out, "--save-baseline", out / "model.onnx"))
    refused(invoke("run", out, "-o", out / "golden" / "outputs.npz"))
    assert (p.read_bytes(), data.read_bytes()) == before and snapshot(out) == bundle


# ------------------------------------------------------------------ temporaries
def test_failed_write_leaves_no_temporary_folder(net, tmp_path, monkeypatch):
    import graphopt.targets.bundle as bundle

    def boom(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bundle, "write_bundle_files", boom)
    res = invoke("optimize", net, "-o", tmp_path / "out", "-q")
    assert res.exit_code == 1 and "No space left" in res.stderr
    assert hidden(tmp_path) == [] and not (tmp_path / "out").exists()


def test_interrupted_write_leaves_no_temporary_folder(net, tmp_path, monkeypatch):
    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    out = tmp_path / "out"
    assert invoke("optimize", net, "-o", out, "-q").exit_code == 0
    monkeypatch.setattr(bundle_writer, "replace_dir", interrupted)
    invoke("optimize", net, "-o", out, "-q")
    assert hidden(tmp_path) == [] and (out / "manifest.json").exists()


def test_read_only_folders_of_an_old_bundle_do_not_pile_up(net, tmp_path):
    out = tmp_path / "out"
    assert invoke("optimize", net, "-o", out, "-q").exit_code == 0
    (out / "golden").chmod(0o555)
    try:
        assert invoke("optimize", net, "-o", out, "-q").exit_code == 0
    finally:
        if (out / "golden").exists():
            (out / "golden").chmod(0o755)
    assert hidden(tmp_path) == []


def test_old_bundle_files_that_resist_deletion_once_do_not_pile_up(net, tmp_path, monkeypatch):
    """A file whose first unlink fails (a read-only folder for a non-root user) is retried
    after opening its folder; no hidden copy of the old bundle is left behind."""
    out = tmp_path / "out"
    assert invoke("optimize", net, "-o", out, "-q").exit_code == 0
    real_unlink, failed = os.unlink, []

    def unlink_once(path, *args, **kwargs):
        if str(path).endswith("outputs.npz") and not failed:
            failed.append(path)
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink_once)
    assert invoke("optimize", net, "-o", out, "-q").exit_code == 0
    assert failed and hidden(tmp_path) == []


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_a_killed_run_are_removed(net, tmp_path):
    dead, out = _dead_pid(), tmp_path / "out"
    stale = [
        tmp_path / f".out.graphopt-staging-{dead}-abc",
        tmp_path / f".out.graphopt-old-{dead}-def",
        tmp_path / f".report.json.graphopt-tmp-{dead}-ghi",
    ]
    for d in stale[:2]:
        d.mkdir()
        (d / "model.onnx").write_text("half")
    stale[2].write_text("half")
    kept = [
        tmp_path / f".out.graphopt-staging-{os.getpid()}-live",  # a live process's
        tmp_path / f".other.graphopt-staging-{dead}-x",  # another output's
        tmp_path / ".out.user-folder",  # not ours
    ]
    for d in kept:
        d.mkdir()
    res = invoke("optimize", net, "-o", out, "-q", "--remarks", tmp_path / "report.json")
    assert res.exit_code == 0, res.output
    assert not any(os.path.lexists(d) for d in stale)
    assert all(d.exists() for d in kept)


def test_staging_dir_name_says_whose_it_is(tmp_path):
    staging = staging_dir(tmp_path / "b")
    assert staging.name.startswith(f".b.graphopt-staging-{os.getpid()}-")

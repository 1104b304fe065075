"""The command line run in-process: outputs, JSON schema, exit codes, bad input."""

import json

import numpy as np
import onnx
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app

runner = CliRunner()


@pytest.fixture
def conv_model(tmp_path, rng):
    c = 4
    inits = [
        const("W", rng.standard_normal((c, 3, 3, 3))),
        const("g", rng.random(c) + 0.5),
        const("b", rng.standard_normal(c)),
        const("m", rng.standard_normal(c)),
        const("v", rng.random(c) + 0.1),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn"),
    ]
    p = tmp_path / "net.onnx"
    onnx.save(model(nodes, [vi("x", ["N", 3, 8, 8])], [vi("y", None)], inits), p)
    return p


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_optimize_writes_bundle_and_report(conv_model):
    before = conv_model.read_bytes()
    res = invoke("optimize", conv_model, "--target", "cpu")
    assert res.exit_code == 0, res.output
    out = conv_model.with_name("net.cpu.graphopt")
    report = json.loads((out / "report.json").read_text())
    assert report["nodes_before"] == 2 and report["nodes_after"] == 1
    assert report["ops_after"] == {"Conv": 1}
    assert report["parity"]["ok"] is True
    assert report["parity"]["outputs"][0]["name"] == "y"
    assert {"kind", "rule", "code", "nodes", "message"} <= set(report["remarks"][0])
    assert report["target"] == "cpu" and report["level"] == 2
    assert onnx.load(out / "model.onnx").graph.node[0].op_type == "Conv"
    assert conv_model.read_bytes() == before, "input model modified"


def test_json_format_and_shape_option(conv_model, tmp_path):
    res = invoke(
        "optimize",
        conv_model,
        "-o",
        tmp_path / "o",
        "--format",
        "json",
        "--shape",
        "x=2,3,8,8",
        "-O",
        "1",
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["level"] == 1 and data["parity"]["inputs"]["x"] == [2, 3, 8, 8]


def test_inputs_npz(conv_model, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.ones((1, 3, 8, 8), np.float32))
    res = invoke(
        "optimize",
        conv_model,
        "-o",
        tmp_path / "o",
        "--inputs",
        tmp_path / "in.npz",
        "--format",
        "json",
    )
    assert res.exit_code == 0, res.output


def test_remarks_jsonl(conv_model, tmp_path):
    res = invoke(
        "optimize", conv_model, "-o", tmp_path / "o", "--remarks", tmp_path / "r.jsonl", "-q"
    )
    assert res.exit_code == 0
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert any(r["rule"] == "fuse-conv-bn" and r["kind"] == "passed" for r in lines)


@pytest.mark.parametrize("content", [b"", b"not a model at all", bytes(range(256)) * 8])
def test_bad_model_one_line_error_nothing_written(tmp_path, content):
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    res = invoke("optimize", p)
    assert res.exit_code == 1
    assert len(res.stderr.strip().splitlines()) == 1 and "error" in res.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.onnx"]


def test_truncated_model(conv_model, tmp_path):
    data = conv_model.read_bytes()
    p = tmp_path / "trunc.onnx"
    p.write_bytes(data[: len(data) // 3])
    res = invoke("optimize", p, "-o", tmp_path / "out")
    assert res.exit_code == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--target", "tpu"],
        ["-O", "7"],
        ["--pipeline", "nope"],
        ["--shape", "x"],
        ["--shape", "q=1,2"],
        ["--bogus"],
        ["--opset", "13"],  # below the model's 17: never downgraded
        ["--opset", "99"],  # newer than onnx knows
    ],
)
def test_usage_errors_exit_2(conv_model, tmp_path, args):
    res = invoke("optimize", conv_model, "-o", tmp_path / "o", *args)
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "o").exists()


def test_output_dir_that_is_not_a_bundle_is_refused(conv_model, tmp_path):
    d = tmp_path / "precious"
    d.mkdir()
    (d / "thesis.txt").write_text("keep me")
    res = invoke("optimize", conv_model, "-o", d)
    assert res.exit_code == 2 and (d / "thesis.txt").read_text() == "keep me"
    res = invoke("optimize", conv_model, "-o", conv_model.parent)
    assert res.exit_code == 2 and conv_model.exists()


def test_rerun_replaces_previous_bundle(conv_model, tmp_path):
    assert invoke("optimize", conv_model, "-o", tmp_path / "o", "-q").exit_code == 0
    assert invoke("optimize", conv_model, "-o", tmp_path / "o", "-q", "-O", "1").exit_code == 0
    assert json.loads((tmp_path / "o" / "report.json").read_text())["level"] == 1


def test_check_command(conv_model, tmp_path):
    assert invoke("optimize", conv_model, "-o", tmp_path / "o", "-q").exit_code == 0
    res = invoke("check", conv_model, tmp_path / "o")
    assert res.exit_code == 0, res.output
    # A different model fails parity with exit code 3.
    m = onnx.load(tmp_path / "o" / "model.onnx")
    for t in m.graph.initializer:
        if t.dims and len(t.dims) == 4:
            arr = onnx.numpy_helper.to_array(t) * 1.5
            t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
    onnx.save(m, tmp_path / "broken.onnx")
    res = invoke("check", conv_model, tmp_path / "broken.onnx")
    assert res.exit_code == 3
    assert "error: parity failed (outputs: " in res.stderr


def test_rules_and_targets_lists():
    res = invoke("rules", "--format", "json")
    names = {r["name"] for r in json.loads(res.stdout)}
    assert {"fuse-conv-bn", "matmul-add-to-gemm", "fold-constants", "dce"} <= names
    res = invoke("targets", "--format", "json")
    assert {t["name"] for t in json.loads(res.stdout)} >= {"cpu", "cuda"}


def test_opset_upgrade_is_reported(conv_model, tmp_path):
    res = invoke("optimize", conv_model, "-o", tmp_path / "o", "--opset", "21", "--format", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert [r["code"] for r in report["remarks"] if r["rule"] == "upgrade-opset"] == [
        "opset-upgraded"
    ]
    out = onnx.load(tmp_path / "o" / "model.onnx")
    assert next(i.version for i in out.opset_import if i.domain == "") == 21
    assert report["parity"]["ok"]

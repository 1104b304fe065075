"""explain (why each rule fired or not, with hints) and lint (export pitfalls, with fixes)."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app

runner = CliRunner()


def conv_bn_kiai(rng, tmp_path, listed=slice(None)):
    """Conv+BN exported with keep_initializers_as_inputs=True (weights are graph inputs);
    ``listed``: which of W, g, b, m, v are inputs."""
    c = 4
    inits = [
        const("W", rng.standard_normal((c, 3, 3, 3))),
        const("g", rng.random(c) + 0.5),
        const("b", rng.standard_normal(c)),
        const("m", rng.standard_normal(c)),
        const("v", rng.random(c) + 0.1),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["cv"], name="conv"),
        helper.make_node("BatchNormalization", ["cv", "g", "b", "m", "v"], ["y"], name="bn"),
    ]
    m = model(
        nodes,
        [vi("x", [1, 3, 8, 8])] + [vi(t.name, list(t.dims)) for t in inits[listed]],
        [vi("y", None)],
        inits,
    )
    p = tmp_path / "kiai.onnx"
    onnx.save(m, p)
    return p


def test_explain_names_reason_and_hint(rng, tmp_path):
    p = conv_bn_kiai(rng, tmp_path, listed=slice(1, None))  # BN's: overridable defaults
    res = runner.invoke(app, ["explain", str(p), "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    missed = [m for m in data["missed"] if m["rule"] == "fuse-conv-bn"]
    assert missed and missed[0]["code"] == "non-constant-param" and missed[0]["node"] == "bn"
    assert "--freeze-initializers" in missed[0]["hint"]
    assert data["rules"]["fuse-conv-bn"]["missed_by_code"] == {"non-constant-param": 1}
    assert "matmul-add-to-gemm" in data["never_matched"]
    # Filters
    only = json.loads(
        runner.invoke(
            app, ["explain", str(p), "--format", "json", "--code", "non-constant-param"]
        ).stdout
    )
    assert {m["code"] for m in only["missed"]} == {"non-constant-param"}
    text = runner.invoke(app, ["explain", str(p), "--rule", "fuse-conv-bn"])
    assert "non-constant-param" in text.stdout and "hint" in text.stdout


def test_lint_proposes_freeze_and_freezing_lets_fusion_fire(rng, tmp_path):
    p = conv_bn_kiai(rng, tmp_path)
    res = runner.invoke(app, ["lint", str(p), "--format", "json"])
    findings = {f["code"]: f for f in json.loads(res.stdout)["findings"]}
    assert findings["initializer-as-input"]["fix"].startswith("graphopt optimize makes them")
    (tmp_path / "partial").mkdir()
    partial = conv_bn_kiai(rng, tmp_path / "partial", listed=slice(1, None))
    res = runner.invoke(app, ["lint", str(partial), "--format", "json"])
    findings = {f["code"]: f for f in json.loads(res.stdout)["findings"]}
    assert findings["initializer-as-input"]["fix"].startswith("graphopt lint MODEL")
    frozen = tmp_path / "frozen.onnx"
    res = runner.invoke(app, ["lint", str(p), "--freeze-initializers", "-o", str(frozen)])
    assert res.exit_code == 0, res.output
    assert [i.name for i in onnx.load(frozen).graph.input] == ["x"]
    res = runner.invoke(
        app, ["optimize", str(frozen), "-o", str(tmp_path / "o"), "--format", "json"]
    )
    report = json.loads(res.stdout)
    assert report["ops_after"] == {"Conv": 1} and report["parity"]["ok"]


def test_lint_findings(tmp_path):
    big = np.arange(1024, dtype=np.float32)
    f16 = np.array([1e-6, 1.0, 65504.0], dtype=np.float16)
    nodes = [
        helper.make_node("Add", ["x", "w1"], ["a"]),
        helper.make_node("Add", ["a", "w2"], ["b"]),
        helper.make_node("Cast", ["b"], ["c"], to=TensorProto.INT32),
        helper.make_node("Cast", ["c"], ["y"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["h"], ["y2"], to=TensorProto.FLOAT),
    ]
    m = model(
        nodes,
        [vi("x", [1024])],
        [vi("y", [1024]), vi("y2", [3])],
        [
            const("w1", big),
            const("w2", big),
            const("unused", [1.0, 2.0]),
            const("h", f16, np.float16),
        ],
        opset=13,
    )
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    data = json.loads(runner.invoke(app, ["lint", str(p), "--format", "json"]).stdout)
    codes = {f["code"] for f in data["findings"]}
    assert {
        "duplicate-weights",
        "unused-initializer",
        "fp16-subnormal",
        "fp16-saturated",
        "cast-ping-pong",
        "old-opset",
    } <= codes


def test_lint_custom_domain(tmp_path):
    nodes = [helper.make_node("MyOp", ["x"], ["y"], domain="acme.ops", name="mine")]
    g = helper.make_graph(nodes, "g", [vi("x", [2])], [vi("y", [2])])
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme.ops", 1)]
    )
    p = tmp_path / "custom.onnx"
    onnx.save(m, p)
    data = json.loads(runner.invoke(app, ["lint", str(p), "--format", "json"]).stdout)
    found = [f for f in data["findings"] if f["code"] == "unknown-domain"]
    assert found and found[0]["severity"] == "warning" and found[0]["where"] == ["mine"]


@pytest.mark.parametrize("cmd", ["explain", "lint"])
def test_bad_model(cmd, tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(b"garbage")
    res = runner.invoke(app, [cmd, str(p)])
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1


def test_optimize_freezes_exported_weight_inputs_and_says_so(rng, tmp_path):
    p = conv_bn_kiai(rng, tmp_path)
    out = tmp_path / "o"
    res = runner.invoke(app, ["optimize", str(p), "-o", str(out), "--no-measure"])
    assert res.exit_code == 0, res.output
    assert "interface: 5 initializers were also graph inputs" in " ".join(res.output.split())
    assert [i.name for i in onnx.load(out / "model.onnx").graph.input] == ["x"]
    kept = tmp_path / "k"
    args = ["optimize", str(p), "-o", str(kept), "--no-measure", "--keep-initializer-inputs"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "interface:" not in res.output
    inputs = [i.name for i in onnx.load(kept / "model.onnx").graph.input]
    assert inputs == ["x", "W", "g", "b", "m", "v"]

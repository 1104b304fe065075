"""examples/transformers/run_attention.py: the per-model attention table's own logic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "transformers" / "run_attention.py"


@pytest.fixture(scope="module")
def ra():
    spec = importlib.util.spec_from_file_location("run_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(remarks: list[dict]) -> dict:
    return {
        "ops_before": {"Softmax": 3, "MatMul": 12, "com.microsoft.Attention": 1},
        "ops_after": {
            "Softmax": 1,
            "com.microsoft.MultiHeadAttention": 2,
            "com.microsoft.Attention": 1,
            "MatMul": 4,
        },
        "remarks": remarks,
        "parity": {"ran": True, "ok": True},
        "nodes_before": 120,
        "nodes_after": 40,
        "seconds": {"total": 1.5},
    }


def test_fused_counts_only_attention_ops_the_run_added(ra):
    assert ra.fused_attention(_report([])) == {"MultiHeadAttention": 2}


def test_missed_by_code_first_names_stage_and_tensor(ra):
    remarks = [
        {"kind": "passed", "rule": "fuse-attention", "code": "ok", "nodes": ["a"]},
        {"kind": "missed", "rule": "fuse-gelu", "code": "x", "nodes": ["g"]},
        {
            "kind": "missed",
            "rule": "fuse-attention-x",
            "code": "mask-shape",
            "nodes": ["s1"],
            "message": "m",
            "args": {"stage": "mask", "tensor": "t7"},
        },
        {
            "kind": "missed",
            "rule": "fuse-attention",
            "code": "too-short",
            "nodes": ["s2"],
            "message": "fewer than 128 keys",
        },
        {"kind": "missed", "rule": "fuse-attention", "code": "mask-shape", "nodes": ["s3"]},
    ]
    codes, first = ra.missed_attention(_report(remarks))
    assert codes == {"mask-shape": 2, "too-short": 1}
    assert first == "mask-shape: stage mask, tensor t7"
    codes, first = ra.missed_attention(_report(remarks[3:4]))
    assert first == "too-short: at s2: fewer than 128 keys"


def test_row_and_markdown(ra):
    row = ra.row_from_report("m", "cpu", _report([]), 0, "")
    assert (row["layers"], row["parity"], row["nodes_before"], row["nodes_after"]) == (
        3,
        "ok",
        120,
        40,
    )
    failed = _report([])
    failed["parity"] = {"ran": True, "ok": False}
    assert ra.row_from_report("m", "cpu", failed, 3, "e")["parity"] == (
        "FAILED (exit 3: parity failed)"
    )
    missing = ra.row_from_report("m", "cuda", None, 1, "error: boom")
    assert missing["error"] == "error: boom"
    table = ra.render([row, missing], latency=False).splitlines()
    assert table[2] == "| m | cpu | 3 | MultiHeadAttention 2 | — |  | ok | 120 → 40 |"
    assert "error: boom" in table[3]


def _write_model(folder: Path, name: str) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / f"{name}.onnx"
    onnx.save(model, path)
    (folder / f"{name}.json").write_text(json.dumps({"inputs": {"x": [3, 4]}}))
    return path


def test_command_feeds_the_test_inputs_else_the_shapes(ra, tmp_path):
    path = _write_model(tmp_path, "m")
    cmd = ra.optimize_cmd(path, tmp_path / "out", "cuda", measure=False)
    assert cmd[cmd.index("--shape") + 1] == "x=3,4" and "--no-measure" in cmd
    np.savez(tmp_path / "m.npz", x=np.ones((3, 4), np.float32))
    cmd = ra.optimize_cmd(path, tmp_path / "out", "cpu", measure=True)
    assert cmd[cmd.index("--inputs") + 1] == str(tmp_path / "m.npz")
    assert "--shape" not in cmd and "--no-measure" not in cmd


def test_discover_needs_a_sidecar_and_known_names(ra, tmp_path):
    _write_model(tmp_path, "a")
    _write_model(tmp_path, "b")
    (tmp_path / "b.json").unlink()
    assert [p.stem for p in ra.discover(tmp_path, None)] == ["a"]
    with pytest.raises(SystemExit, match="b"):
        ra.discover(tmp_path, ["a", "b"])


def test_end_to_end_row_from_a_real_run(ra, tmp_path, capsys):
    models = tmp_path / "models"
    models.mkdir()
    _write_model(models, "soft")
    np.savez(models / "soft.npz", x=np.arange(12, dtype=np.float32).reshape(3, 4))
    out = tmp_path / "rows.json"
    assert (
        ra.main([str(models), "--no-measure", "--work", str(tmp_path / "w"), "--json", str(out)])
        == 0
    )
    (row,) = json.loads(out.read_text())
    assert (row["model"], row["target"], row["rc"], row["layers"], row["parity"]) == (
        "soft",
        "cpu",
        0,
        1,
        "ok",
    )
    assert row["fused"] == {} and row["nodes_after"] == 1
    assert "| soft | cpu | 1 | — | — |  | ok | 1 → 1 |" in capsys.readouterr().out
    assert not list((tmp_path / "w").iterdir())  # bundles removed without --keep


def tool(ratio, ok=True):
    """One benchmark tool's result: parity and its ENABLE_ALL ratio to the original."""
    return {"parity": {"ok": ok}, "ENABLE_ALL": {"ratio": ratio, "ratio_p10_p90": [0.8, 0.9]}}


def test_latency_cells_prefer_the_head_to_head(ra):
    result = {
        "tools": {
            "none": tool(1.0),
            "graphopt-O2": tool(0.9),
            "graphopt-O2-bundle": tool(0.85),
            "onnxslim": tool(0.95),
            "ort-transformers": tool(0.8, ok=False),
            "onnxscript": tool(0.97),
        }
    }
    vs_orig, vs_rival, detail = ra.latency_cells(result)
    assert vs_orig == "0.850 [0.80–0.90]" and detail["mine"] == "graphopt-O2-bundle"
    assert vs_rival == "0.895 vs onnxslim"
    result["duel"] = {"rival": "onnxslim", "ratio": 0.9, "ci95": [0.88, 0.92]}
    assert ra.latency_cells(result)[1] == "0.900 [0.880–0.920] vs onnxslim"


def test_render_merges_saved_rows_later_file_wins(ra, tmp_path, capsys):
    first = tmp_path / "a.json"
    second = tmp_path / "b.json"
    first.write_text(
        json.dumps(
            [
                ra.row_from_report("z", "cpu", _report([]), 0, ""),
                ra.row_from_report("m", "cpu", None, 1, "error: old"),
                ra.row_from_report("m", "cuda", _report([]), 0, ""),
            ]
        )
    )
    second.write_text(json.dumps([ra.row_from_report("m", "cpu", _report([]), 0, "")]))
    assert [(r["model"], r["target"]) for r in ra.merge_rows([first, second])] == [
        ("m", "cpu"),
        ("m", "cuda"),
        ("z", "cpu"),
    ]
    merged = tmp_path / "merged.json"
    assert ra.main(["--render", str(first), str(second), "--json", str(merged)]) == 0
    out = capsys.readouterr().out
    assert "error: old" not in out and out.count("MultiHeadAttention 2") == 3
    assert json.loads(merged.read_text()) == ra.merge_rows([first, second])


def test_latency_table_has_every_tool_and_why_not(ra):
    result = {
        "tools": {
            "none": tool(1.0),
            "graphopt-O2": tool(0.9),
            "graphopt-O2-bundle": tool(0.85),
            "onnxslim": tool(0.95),
            "onnxscript": tool(0.97, ok=False),
            "ort-transformers": {"na": True},
            "ort-extended": {"opt_error": "exit 1: boom"},
        },
        "duel": {"rival": "onnxslim", "ratio": 0.9, "ci95": [0.88, 0.92]},
    }
    vs_orig, vs_rival, detail = ra.latency_cells(result)
    row = {"model": "m", "target": "cpu", "latency_vs_original": vs_orig}
    row.update(latency_vs_rival=vs_rival, latency=detail)
    lines = ra.render_latency([row, {"model": "m", "target": "cuda"}]).splitlines()
    assert lines[0] == (
        "| model | graphopt -O2 | bundle | onnxslim | onnxscript | ort-transformers | "
        "ort-extended | bundle vs fastest rival |"
    )
    assert lines[2] == (
        "| m | 0.900 [0.80–0.90] | 0.850 [0.80–0.90] | 0.950 [0.80–0.90] | outputs differ | "
        "n/a | failed: exit 1: boom | 0.900 [0.880–0.920] vs onnxslim |"
    )
    assert len(lines) == 3


def test_each_extra_inputs_file_is_a_row_of_its_own(ra, tmp_path):
    path = _write_model(tmp_path, "m")
    assert ra.input_sets(path) == [("m", None)]
    np.savez(tmp_path / "m.npz", x=np.ones((3, 4), np.float32))
    np.savez(tmp_path / "m.first.npz", x=np.ones((1, 4), np.float32))
    assert ra.input_sets(path) == [
        ("m", tmp_path / "m.npz"),
        ("m.first", tmp_path / "m.first.npz"),
    ]
    cmd = ra.optimize_cmd(path, tmp_path / "out", "cpu", False, tmp_path / "m.first.npz")
    assert cmd[cmd.index("--inputs") + 1] == str(tmp_path / "m.first.npz")


def test_ops_are_counted_inside_if_branches(ra, tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])

    def body(name):
        out = helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [2])
        return helper.make_graph(
            [helper.make_node("Softmax", ["x"], [f"{name}_y"])], name, [], [out]
        )

    node = helper.make_node("If", ["c"], ["y"], then_branch=body("a"), else_branch=body("b"))
    graph = helper.make_graph([node], "g", [x, c], [y])
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert ra.all_ops(path) == {"If": 1, "Softmax": 2}
    row = ra.row_from_report("if", "cpu", _report([]), 0, "", (ra.all_ops(path), ra.all_ops(path)))
    assert row["layers"] == 2 and row["nodes_before"] == 3

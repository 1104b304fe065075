"""The bundle's JSON files: the content of an indented dump, one line per deep entry (the
C encoder writes each line; Python's indenting encoder is pure Python)."""

from __future__ import annotations

import json

import onnx
from onnx import helper

from cli_runner import CliRunner
from conftest import model, vi
from graphopt.cli import app
from graphopt.targets.bundle import dumps_json, write_json

VALUES = [
    {
        "b": [1, {"z": 2, "a": [3, 4]}],
        "a": {},
        "c": [],
        "d": (1, 2),
        "e": 1.5e300,
        "f": '\u00e9\n"',
        "g": {"k": {"m": [{"x": 1, "n": None}]}},
        "h": float("inf"),
        "t": True,
    },
    {1: "a", 2: "b"},
    {True: 1},
    [[1, [2, {"y": [3]}]]],
    [],
    {},
    3,
    "s",
]


def test_dumps_json_content_is_the_indented_dumps():
    for value in VALUES:
        text = dumps_json(value)
        assert json.loads(text) == json.loads(json.dumps(value, indent=2, sort_keys=True))
        for depth in (0, 1, 3, 99):
            assert json.loads(dumps_json(value, depth=depth)) == json.loads(text)


def test_dumps_json_deep_enough_is_the_indented_dumps():
    value = VALUES[0]
    assert dumps_json(value, depth=99) == json.dumps(value, indent=2, sort_keys=True)
    assert dumps_json(value, depth=0) == json.dumps(value, sort_keys=True)


def test_write_json_writes_the_dumped_text(tmp_path):
    for i, value in enumerate(VALUES):
        write_json(tmp_path / f"{i}.json", value)
        assert (tmp_path / f"{i}.json").read_text(encoding="utf-8") == dumps_json(value)


def test_bundle_files_have_one_line_per_node(tmp_path):
    """manifest.json's and memory_plan.json's per-node/per-tensor entries take a line each."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),
        helper.make_node("Sqrt", ["a"], ["b"], name="s1"),
        helper.make_node("Relu", ["b"], ["c"], name="r2"),
        helper.make_node("Sqrt", ["c"], ["y"], name="s2"),
    ]
    path = tmp_path / "m.onnx"
    onnx.save(model(nodes, [vi("x", [2, 3])], [vi("y", None)]), path)
    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["optimize", str(path), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    manifest_text = (out / "manifest.json").read_text()
    manifest = json.loads(manifest_text)
    assert len(manifest["nodes"]) == 4
    lines = manifest_text.splitlines()
    for entry in manifest["nodes"]:
        line = f"    {json.dumps(entry, sort_keys=True)}"
        assert line in lines or f"{line}," in lines
    assert manifest_text.startswith('{\n  "')
    for name in ("report.json", "session_config.json", "memory_plan.json"):
        text = (out / name).read_text()
        data = json.loads(text)
        assert json.loads(dumps_json(data)) == data and text == dumps_json(data)

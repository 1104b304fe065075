"""Models whose nodes are not topologically sorted (onnxruntime's float16 converter appends its
Casts at the end): onnxruntime loads them, so graphopt sorts them in memory, says so with a
``graph-sorted`` remark, writes a sorted output and leaves the input file as it was; a graph
with a cycle is still refused with one line (exit 1)."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from cli_runner import CliRunner
from conftest import vi
from graphopt.cli import app
from graphopt.opt.graph.compat import SORTED_KEY, sort_on_load, unsorted_graphs
from graphopt.opt.graph.io import is_in_place, load_model

runner = CliRunner()


def raw(nodes, inputs, outputs, inits=(), opset=17):
    """A model built without the checker (its nodes are out of order on purpose)."""
    g = helper.make_graph(nodes, "unsorted", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def plain_unsorted():
    nodes = [
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
        helper.make_node("Add", ["m", "x"], ["a"], name="add"),
        helper.make_node("Mul", ["x", "two"], ["m"], name="mul"),
    ]
    two = numpy_helper.from_array(np.float32(2), "two")
    return raw(nodes, [vi("x", ["n", 4])], [vi("y", ["n", 4])], [two])


def fp16_unsorted():
    """As onnxruntime's float16 converter writes them: fp16 weights and body, the Casts at the
    interface appended after the nodes that read them."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float16), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float16), "b")
    nodes = [
        helper.make_node("MatMul", ["x16", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "b"], ["h"], name="add"),
        helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
        helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16, name="graph_input_cast0"),
        helper.make_node("Cast", ["t"], ["y"], to=TensorProto.FLOAT, name="graph_output_cast0"),
    ]
    return raw(nodes, [vi("x", ["batch", "seq", 8])], [vi("y", ["batch", "seq", 8])], [w, b])


def if_body_unsorted():
    """An If on a graph input whose then-branch lists its nodes backwards and reads a value
    the main graph makes after the If."""
    then_body = helper.make_graph(
        [
            helper.make_node("Neg", ["t1"], ["t_out"], name="then_neg"),
            helper.make_node("Mul", ["s", "s"], ["t1"], name="then_mul"),
        ],
        "then",
        [],
        [vi("t_out", None)],
    )
    else_body = helper.make_graph(
        [helper.make_node("Identity", ["s"], ["e_out"], name="else_id")],
        "else",
        [],
        [vi("e_out", None)],
    )
    nodes = [
        helper.make_node(
            "If", ["c"], ["y"], then_branch=then_body, else_branch=else_body, name="if"
        ),
        helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"),
    ]
    return raw(nodes, [vi("x", [2, 3]), vi("c", [], TensorProto.BOOL)], [vi("y", [2, 3])])


def optimize(tmp_path, m, *extra, name="m.onnx", save=None):
    p = tmp_path / name
    if save is None:
        p.write_bytes(m.SerializeToString())
    else:
        save(m, p)
    before = p.read_bytes()
    out = tmp_path / "out"
    res = runner.invoke(app, ["optimize", str(p), "-o", str(out), "--format", "json", *extra])
    assert p.read_bytes() == before, "input model modified"
    return res, out


def assert_sorted_output(res, out):
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["parity"]["ran"] and report["parity"]["ok"], report["parity"]
    sorted_remarks = [r for r in report["remarks"] if r["code"] == "graph-sorted"]
    assert len(sorted_remarks) == 1 and sorted_remarks[0]["kind"] == "analysis"
    assert "not topologically sorted" in sorted_remarks[0]["message"]
    written = onnx.load(out / "model.onnx")
    onnx.checker.check_model(written)  # sorted, main graph and bodies
    assert not unsorted_graphs(written)
    assert SORTED_KEY not in {p.key for p in written.metadata_props}
    ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    return report, sorted_remarks[0]["message"]


def test_unsorted_model_is_sorted_and_optimized(tmp_path):
    res, out = optimize(tmp_path, plain_unsorted())
    _, message = assert_sorted_output(res, out)
    assert "main graph: 2 of 3 node(s) out of order" in message


def test_text_report_says_the_graph_was_sorted(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(plain_unsorted().SerializeToString())
    res = runner.invoke(app, ["optimize", str(p), "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "accepted: nodes not topologically sorted" in " ".join(res.stdout.split())


def test_fp16_model_with_casts_appended_is_sorted(tmp_path):
    m = fp16_unsorted()
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(m)
    res, out = optimize(tmp_path, m)
    assert_sorted_output(res, out)


def test_unsorted_if_body_is_sorted(tmp_path):
    res, out = optimize(tmp_path, if_body_unsorted(), "-O", "1")
    _, message = assert_sorted_output(res, out)
    assert "'then_branch' of If 'if'" in message and "main graph" in message


def test_unsorted_model_with_external_data_keeps_weights_on_disk(tmp_path):
    def save(m, p):
        onnx.save(m, p, save_as_external_data=True, location="m.data", size_threshold=0)

    data = tmp_path / "m.data"
    res, out = optimize(tmp_path, fp16_unsorted(), save=save)
    before = data.read_bytes()
    assert_sorted_output(res, out)
    assert data.read_bytes() == before
    # loaded lazily, the weights stay references into the data file
    loaded = load_model(tmp_path / "m.onnx", lazy_external=True)
    assert all(len(t.external_data) for t in loaded.graph.initializer)
    assert [n.name for n in loaded.graph.node][:1] == ["graph_input_cast0"]


def test_unsorted_model_read_without_its_large_weights(tmp_path, monkeypatch):
    """A large file is read with its weights left in it (``in_place``): sorted all the same."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((160, 160)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Relu", ["mm"], ["y"], name="relu"),
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
    ]
    m = raw(nodes, [vi("x", ["n", 160])], [vi("y", ["n", 160])], [w])
    p = tmp_path / "m.onnx"
    p.write_bytes(m.SerializeToString())
    monkeypatch.setenv("GRAPHOPT_IN_PLACE_ABOVE", "1")
    loaded = load_model(p, lazy_external=True, in_place=True)
    assert [n.name for n in loaded.graph.node] == ["matmul", "relu"]
    assert is_in_place(loaded.graph.initializer[0])  # the weight was not read
    res = runner.invoke(
        app,
        ["optimize", str(p), "-o", str(tmp_path / "out"), "--format", "json"],
    )
    assert_sorted_output(res, tmp_path / "out")


def test_sort_is_stable_and_in_place():
    m = plain_unsorted()
    assert sort_on_load(m)
    assert [n.name for n in m.graph.node] == ["mul", "add", "relu"]
    assert not sort_on_load(m)  # sorted already: nothing moves, nothing recorded again


@pytest.mark.parametrize("where", ["main", "body"])
def test_a_cycle_is_refused_with_one_line(tmp_path, where):
    cycle = [
        helper.make_node("Relu", ["b"], ["a"], name="r1"),
        helper.make_node("Relu", ["a"], ["b"], name="r2"),
        helper.make_node("Neg", ["b"], ["z"], name="after"),  # downstream, not on the cycle
    ]
    if where == "main":
        tail = [helper.make_node("Identity", ["z"], ["y"])]
        m = raw(cycle + tail, [vi("x", [2])], [vi("y", [2])])
    else:
        body = helper.make_graph(cycle, "then", [], [vi("z", [2])])
        other = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["e"])], "else", [], [vi("e", [2])]
        )
        m = raw(
            [helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=other)],
            [vi("x", [2]), vi("c", [], TensorProto.BOOL)],
            [vi("y", [2])],
        )
    res, out = optimize(tmp_path, m)
    assert res.exit_code == 1, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "has a cycle: 2 node(s) depend on each other (r1, r2)" in lines[0]
    assert "Traceback" not in res.output and not out.exists()


def test_unsorted_model_given_in_memory_is_reported_and_left_as_it_was():
    m = plain_unsorted()
    before = m.SerializeToString()
    out, report = graphopt.optimize(m, level=1)
    assert report.parity.ran and report.parity.ok
    assert [r.code for r in report.remarks if r.code == "graph-sorted"] == ["graph-sorted"]
    onnx.checker.check_model(out)
    assert m.SerializeToString() == before

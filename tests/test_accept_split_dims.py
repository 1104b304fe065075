"""Sample inputs that contradict a shared dim_param (optimum's merged decoders declare
``input_ids`` and ``attention_mask`` as ``[batch, sequence_length]``; a decoding step with a
cache feeds the mask the past and the new tokens): accepted with a ``dim-param-split`` remark,
the passes see the axes apart (a rewrite relying on their equality would break parity here),
parity runs on the user's inputs; a size that contradicts a static dim is still exit 2."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_runner import CliRunner
from conftest import model, vi
from graphopt.cli import app
from graphopt.opt.errors import UsageError
from graphopt.opt.graph.ir import ModelIR
from graphopt.opt.verify.feeds import split_dims, validate_args

runner = CliRunner()
INT = TensorProto.INT64
IDS = ["batch", "sequence_length"]


def ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def decoder():
    """Embeds the new tokens, appends them to the cache, masks with the attention mask (as long
    as both), and reshapes the mask by the ids' shape: ``[batch, ids length, -1]``, which a
    rewrite taking the two lengths for equal would turn into ``[batch, mask length, 1]``."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((100, 8)).astype(np.float32), "table")
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"]),
        helper.make_node("Concat", ["past", "emb"], ["present"], axis=1),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "ax2"], ["mask3"]),
        helper.make_node("Mul", ["present", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "ax1"], ["pooled"], keepdims=0),
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Slice", ["ids_shape", "zero", "two"], ["batch_and_len"]),
        helper.make_node("Concat", ["batch_and_len", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["maskf", "target"], ["mask_rows"]),
    ]
    inits = [table, ints("ax2", [2]), ints("ax1", [1]), ints("zero", [0]), ints("two", [2])]
    inits.append(ints("minus1", [-1]))
    inputs = [
        vi("input_ids", IDS, INT),
        vi("attention_mask", IDS, INT),
        vi("past", ["batch", "past_sequence_length", 8]),
    ]
    outputs = [
        vi("pooled", ["batch", 8]),
        vi("present", ["batch", "total_sequence_length", 8]),
        vi("mask_rows", ["batch", "rows", "cols"]),
    ]
    return model(nodes, inputs, outputs, inits)


def merged_decoder():
    """optimum's merged form: an If on ``use_cache_branch``; with the cache the mask covers the
    past and the new tokens, without it only the new tokens."""
    rng = np.random.default_rng(1)
    table = numpy_helper.from_array(rng.standard_normal((100, 8)).astype(np.float32), "table")
    with_cache = helper.make_graph(
        [
            helper.make_node("Concat", ["past", "emb"], ["kv"], axis=1),
            helper.make_node("Mul", ["kv", "mask3"], ["with_out"]),
        ],
        "with_past",
        [],
        [vi("with_out", None)],
    )
    without = helper.make_graph(
        [helper.make_node("Mul", ["emb", "mask3"], ["without_out"])],
        "without_past",
        [],
        [vi("without_out", None)],
    )
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "ax2"], ["mask3"]),
        helper.make_node("Squeeze", ["use_cache_branch"], ["cond"]),
        helper.make_node(
            "If", ["cond"], ["hidden"], then_branch=with_cache, else_branch=without, name="if"
        ),
        helper.make_node("ReduceSum", ["hidden", "ax1"], ["pooled"], keepdims=0),
    ]
    inputs = [
        vi("input_ids", IDS, INT),
        vi("attention_mask", IDS, INT),
        vi("past", ["batch", "past_sequence_length", 8]),
        vi("use_cache_branch", [1], TensorProto.BOOL),
    ]
    return model(
        nodes, inputs, [vi("pooled", ["batch", 8])], [table, ints("ax2", [2]), ints("ax1", [1])]
    )


def step(new=1, past=3, batch=1):
    """One decoding step: ``new`` tokens after ``past`` cached ones."""
    rng = np.random.default_rng(2)
    return {
        "input_ids": rng.integers(0, 100, (batch, new)).astype(np.int64),
        "attention_mask": np.ones((batch, past + new), np.int64),
        "past": rng.standard_normal((batch, past, 8)).astype(np.float32),
    }


def optimize(tmp_path, m, feeds, *extra):
    p = tmp_path / "decoder.onnx"
    onnx.save(m, p)
    np.savez(tmp_path / "step.npz", **feeds)
    out = tmp_path / "out"
    args = ["optimize", str(p), "-o", str(out), "--inputs", str(tmp_path / "step.npz")]
    return runner.invoke(app, args + ["--format", "json", *extra]), out


def assert_split_accepted(res, out, feeds):
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    parity = report["parity"]
    assert parity["ran"] and parity["ok"], parity
    assert parity["inputs"] == {k: list(v.shape) for k, v in feeds.items()}  # the user's
    split = [r for r in report["remarks"] if r["code"] == "dim-param-split"]
    assert len(split) == 1 and split[0]["kind"] == "analysis", report["remarks"]
    message = split[0]["message"]
    assert "'sequence_length'" in message
    ids, mask = feeds["input_ids"].shape[1], feeds["attention_mask"].shape[1]
    assert f"input_ids[1]={ids}" in message and f"attention_mask[1]={mask}" in message
    written = onnx.load(out / "model.onnx")
    declared = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in written.graph.input
    }
    assert declared["input_ids"] == IDS and declared["attention_mask"] == IDS
    return report


def test_decoding_step_with_a_longer_mask_is_accepted(tmp_path):
    feeds = step(new=1, past=3)
    res, out = optimize(tmp_path, decoder(), feeds)
    assert_split_accepted(res, out, feeds)


def test_merged_decoder_if_on_use_cache_branch_is_accepted(tmp_path):
    feeds = step(new=2, past=5) | {"use_cache_branch": np.array([True])}
    res, out = optimize(tmp_path, merged_decoder(), feeds, "-O", "2")
    assert_split_accepted(res, out, feeds)


def test_agreeing_inputs_keep_one_symbol_and_no_remark(tmp_path):
    feeds = step(new=4, past=0)  # a first step without a cache: the lengths agree
    res, _ = optimize(tmp_path, decoder(), feeds)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["parity"]["ok"]
    assert not [r for r in report["remarks"] if r["code"] == "dim-param-split"]


def test_a_static_dim_contradiction_is_still_a_usage_error(tmp_path):
    feeds = step() | {"past": np.zeros((1, 3, 7), np.float32)}  # the model fixes 8
    res, out = optimize(tmp_path, decoder(), feeds)
    assert res.exit_code == 2, res.output
    assert len(res.stderr.strip().splitlines()) == 1
    assert "fixes it to 8 ([batch, past_sequence_length, 8])" in res.stderr
    assert not out.exists()


def test_a_shape_contradicting_given_inputs_is_still_a_usage_error():
    m = decoder()
    feeds = step(new=1, past=3)
    del feeds["attention_mask"]
    with pytest.raises(UsageError, match="'sequence_length'"):
        validate_args(m, {"attention_mask": [1, 4]}, feeds)


def test_split_dims_names_every_axis_declaring_the_dim_param():
    m = decoder()
    assert split_dims(m, step(new=3, past=0)) == []
    (split,) = split_dims(m, step(new=1, past=3))
    assert split.param == "sequence_length"
    assert split.axes == (("input_ids", 1, 1), ("attention_mask", 1, 4))


def test_the_ir_gives_each_axis_its_own_symbol():
    m = decoder()
    ir = ModelIR(m, split_dims=split_dims(m, step(new=1, past=3)))
    shapes = {t.name: t.shape for t in ir.graph.inputs}
    assert shapes["input_ids"][0] == shapes["attention_mask"][0] == "batch"
    assert shapes["input_ids"][1] != shapes["attention_mask"][1]
    assert "sequence_length" not in {
        d for t in ir.graph.tensors().values() if t.shape for d in t.shape
    }
    assert [n.code for n in ir.notes] == ["dim-param-split"]
    # the export declares the interface as the model did
    exported = ir.to_onnx()
    for vi_ in exported.graph.input[:2]:
        assert [d.dim_param for d in vi_.type.tensor_type.shape.dim] == IDS

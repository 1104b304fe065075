"""Parity inputs the original accepts: shared dims, ladders, metadata sizes; arguments that
cannot apply to the model are usage errors; parity that cannot run is never a pass."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphopt
from conftest import const, model, vi
from graphopt.opt.errors import UsageError
from graphopt.opt.verify.feeds import candidate_shapes


def detector(h="height", w="width"):
    """Needs H and W multiples of 32 (a Reshape to 32x32 tiles), like a detection backbone."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "i2"], ["hh"], axis=0),
        helper.make_node("Gather", ["s", "i3"], ["ww"], axis=0),
        helper.make_node("Div", ["hh", "k32"], ["h32"]),
        helper.make_node("Div", ["ww", "k32"], ["w32"]),
        helper.make_node("Mul", ["h32", "k32"], ["hb"]),
        helper.make_node("Mul", ["w32", "k32"], ["wb"]),
        helper.make_node("Concat", ["one", "three", "hb1", "wb1"], ["target"], axis=0),
        helper.make_node("Unsqueeze", ["hb", "ax0"], ["hb1"]),
        helper.make_node("Unsqueeze", ["wb", "ax0"], ["wb1"]),
        helper.make_node("Reshape", ["r", "target"], ["y"]),
    ]
    nodes = nodes[:8] + nodes[9:11] + [nodes[8], nodes[11]]
    inits = [
        const("i2", 2, np.int64),
        const("i3", 3, np.int64),
        const("k32", 32, np.int64),
        const("one", [1], np.int64),
        const("three", [3], np.int64),
        const("ax0", [0], np.int64),
    ]
    return model(nodes, [vi("x", ["batch", 3, h, w])], [vi("y", None)], inits)


def test_spatial_dims_follow_a_ladder_until_the_original_runs():
    m = detector()
    _, report = graphopt.optimize(m, level=1)
    assert report.parity.ran and report.parity.ok, report.parity
    assert report.parity.inputs["x"] == [1, 3, 224, 224]


def test_a_dim_shared_by_two_inputs_gets_one_size():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    m = model(nodes, [vi("a", ["n", "seq"]), vi("b", [1, "seq"])], [vi("y", None)])
    for cand in candidate_shapes(m, {"a": [1, 40]}):
        assert cand["b"] == [1, 40]
    _, report = graphopt.optimize(m, level=1, shapes={"a": [1, 40]})
    assert report.parity.ok and report.parity.inputs["b"] == [1, 40]


def test_metadata_image_size_is_tried_first():
    m = detector()
    m.metadata_props.add(key="imgsz", value="[320, 320]")
    assert candidate_shapes(m)[0]["x"] == [1, 3, 320, 320]


def test_state_between_static_dims_is_batch_like():
    nodes = [helper.make_node("Add", ["s", "s"], ["y"])]
    m = model(nodes, [vi("s", [2, None, 128])], [vi("y", None)])
    assert candidate_shapes(m)[0]["s"] == [2, 1, 128]


def test_parity_that_cannot_run_is_not_run_never_ok():
    nodes = [helper.make_node("Reshape", ["x", "t"], ["y"])]
    m = model(nodes, [vi("x", ["n", "k"])], [vi("y", None)], [const("t", [7, 11, 13], np.int64)])
    _, report = graphopt.optimize(m, level=1)
    assert not report.parity.ran and not report.parity.ok
    assert "did not run on any derived input" in report.parity.error


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"shapes": {"x": []}}, "no dims"),
        ({"shapes": {"x": [1, 2, 3]}}, "rank 3"),
        ({"shapes": {"x": [0, 4]}}, "positive"),
        ({"shapes": {"x": [1, 5]}}, "fixes it to 4"),
        ({"shapes": {"x": [1 << 20, 1 << 20]}}, "GiB"),
        ({"inputs": {"x": np.zeros((1, 4), np.float64)}}, "float64"),
        ({"inputs": {"x": np.zeros((1, 3), np.float32)}}, "fixes it to 4"),
        ({"output_tolerances": {"nosuch": (1e-3, 1e-5)}}, "unknown output"),
        ({"output_tolerances": {"y": (float("nan"), float("nan"))}}, "finite"),
        ({"output_tolerances": {"y": (-1.0, 0.0)}}, "finite"),
    ],
)
def test_arguments_that_cannot_apply_are_usage_errors(kw, fragment):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["n", 4])], [vi("y", None)])
    with pytest.raises(UsageError, match=fragment):
        graphopt.optimize(m, level=1, **kw)


def test_two_inputs_disagreeing_on_a_shared_dim_are_a_usage_error():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    m = model(nodes, [vi("a", ["n", "seq"]), vi("b", ["n", "seq"])], [vi("y", None)])
    with pytest.raises(UsageError, match="'seq'"):
        graphopt.optimize(m, level=1, shapes={"a": [1, 8], "b": [1, 9]})


def test_zipmap_like_sequence_of_maps_outputs_compare_numerically():
    from graphopt.opt.verify.parity import compare_outputs

    ref = [{0: 0.25, 1: 0.75}, {0: 0.5, 1: 0.5}]
    same = [{0: 0.25, 1: 0.75}, {0: 0.5, 1: 0.5}]
    off = [{0: 0.25, 1: 0.75}, {0: 0.9, 1: 0.1}]
    assert compare_outputs(["p"], [ref], [same])[0].ok
    assert not compare_outputs(["p"], [ref], [off])[0].ok


def test_an_invalid_output_is_never_returned(monkeypatch):
    """If every rewrite is kept and the output still fails the checker, optimize raises."""
    from graphopt.opt import optimizer
    from graphopt.opt.errors import GraphoptError

    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [4])], [vi("y", None)])
    monkeypatch.setattr(
        optimizer,
        "_invalid",
        lambda model, base_dir=None, checker=True, runtime=True, keep=False, into=None: (
            None if model is m else "bad"
        ),
    )
    with pytest.raises(GraphoptError, match="invalid"):
        graphopt.optimize(m, level=1, check=False)


def test_output_validity_is_checked_with_no_check_too(monkeypatch):
    from graphopt.opt import optimizer

    calls = []
    real = optimizer._invalid
    monkeypatch.setattr(optimizer, "_invalid", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [4])], [vi("y", None)])
    graphopt.optimize(m, level=1, check=False)
    assert calls


def test_an_external_data_model_from_another_directory_writes_golden(tmp_path, monkeypatch):
    from cli_runner import CliRunner
    from graphopt.cli import app

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    m = model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [vi("x", ["n", 64])],
        [vi("y", None)],
        [const("w", w)],
    )
    src = tmp_path / "src"
    src.mkdir()
    onnx.save_model(
        m, src / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0
    )
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "bundle"
    res = CliRunner().invoke(app, ["optimize", str(src / "m.onnx"), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    assert (out / "golden" / "outputs.npz").exists()
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verified"]["bundle_session"]["golden_ok"]
    assert manifest["verified"]["deploy_parity"]["ok"]
    _ = TensorProto


def test_a_question_mark_dim_is_unknown_not_shared():
    """Paddle exports write "?" for every unknown dim: H and W may differ."""
    m = model(
        [helper.make_node("Relu", ["x"], ["y"])], [vi("x", [1, 3, "?", "?"])], [vi("y", None)]
    )
    x = np.zeros((1, 3, 48, 192), np.float32)
    _, report = graphopt.optimize(m, level=1, inputs={"x": x})
    assert report.parity.ok and report.parity.inputs["x"] == [1, 3, 48, 192]


@pytest.mark.parametrize("spec", ["x=", "x=-1,4", "x=0,4", "x=,", "=1,2", "x"])
def test_shape_specs_are_parsed_strictly(spec):
    from graphopt.opt.verify.parity import parse_shapes

    with pytest.raises(UsageError):
        parse_shapes([spec])


def test_string_inputs_get_random_words():
    """A model reading strings (a tokenizer front, an sklearn pipeline) still gets parity."""
    word = helper.make_tensor("w", TensorProto.STRING, [], [b"model"])
    nodes = [helper.make_node("Equal", ["s", "w"], ["y"])]
    m = model(
        nodes, [vi("s", ["n"], TensorProto.STRING)], [vi("y", ["n"], TensorProto.BOOL)], [word], 19
    )
    _, report = graphopt.optimize(m, level=1)
    assert report.parity.ran and report.parity.ok, report.parity


def test_attention_masks_are_padded_so_a_dropped_mask_shows():
    """Parity feeds a mask with padding (the first row's last quarter zero): a rewrite that
    ignored the mask would change the outputs instead of passing on an all-ones mask."""
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "m"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", ["b", "s"]), vi("attention_mask", ["b", "s"], TensorProto.INT64)],
        [vi("y", ["b", "s"])],
    )
    import onnxruntime as ort

    from graphopt.opt.verify.parity import make_inputs

    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    mask = make_inputs(sess, {"x": [2, 16], "attention_mask": [2, 16]}, seed=0)["attention_mask"]
    assert mask[0, :12].all() and not mask[0, 12:].any() and mask[1].all()
    _, report = graphopt.optimize(m, level=1)
    assert report.parity.ran and report.parity.ok


def cached_decoder(total: str):
    """A decoder step: the cache (past) and the new tokens are concatenated, and the attention
    mask must be as long as both (``total``: its length's dim_param)."""
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids", "axes13"], ["new"]),
        helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present"], axis=2),
        helper.make_node("ReduceSum", ["present", "axes13"], ["lengths"], keepdims=0),
        helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["lengths", "mask"], ["y"]),
    ]
    inputs = [
        vi("input_ids", ["batch", "seq"], TensorProto.INT64),
        vi("attention_mask", ["batch", total], TensorProto.INT64),
        vi("past_key_values.0.key", ["batch", 1, "past_seq", 1]),
    ]
    return model(nodes, inputs, [vi("y", None)], [const("axes13", [1, 3], np.int64)])


def test_a_total_length_is_the_cache_and_the_new_tokens():
    m = cached_decoder("total_seq")
    first = candidate_shapes(m)[0]
    assert first["input_ids"] == [1, 16] and first["past_key_values.0.key"] == [1, 1, 16, 1]
    assert first["attention_mask"] == [1, 32]
    _, report = graphopt.optimize(m, level=1, measure=False)
    assert report.parity.ran and report.parity.ok, report.parity.error
    assert report.parity.inputs["attention_mask"] == [1, 32]


def test_a_length_written_as_a_sum_is_that_sum_and_one_new_token_is_tried():
    m = cached_decoder("past_seq + 1")
    _, report = graphopt.optimize(m, level=1, measure=False)
    assert report.parity.ran and report.parity.ok, report.parity.error
    assert report.parity.inputs == {
        "input_ids": [1, 1],
        "attention_mask": [1, 17],
        "past_key_values.0.key": [1, 1, 16, 1],
    }


def test_a_size_written_as_a_sum_of_dims_is_that_sum_in_any_model():
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["padded"]),
        helper.make_node("Add", ["padded", "y"], ["z"]),
    ]
    inputs = [vi("x", [1, "len"]), vi("y", [1, "len + 1"])]
    m = model(nodes, inputs, [vi("z", None)], [const("pads", [0, 0, 0, 1], np.int64)])
    assert candidate_shapes(m)[0] == {"x": [1, 16], "y": [1, 17]}

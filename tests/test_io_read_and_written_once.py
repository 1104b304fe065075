"""The input is read once, the output serialized once, and onnx's checker reads models without
their weights (stand-ins) while refusing exactly what it refuses on the whole model."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from cli_runner import CliRunner
from conftest import const, model, vi
from graphopt.cli import app
from graphopt.opt import optimizer
from graphopt.opt.errors import ModelLoadError
from graphopt.opt.graph import io
from graphopt.opt.graph.spool import SpoolDir
from graphopt.opt.optimizer import run_of

W = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)  # 16 KiB


@pytest.fixture(autouse=True)
def stand_ins_always_pay(monkeypatch):
    """These models are tiny: make skeletons for them as for a model of large weights."""
    monkeypatch.setattr(io, "STANDIN_PAYS_PER_ELEMENT", 0)


def weighted(*, bad_op: bool = False) -> onnx.ModelProto:
    """x @ W + Constant, reshaped by a small shape constant (kept as it is by the skeleton)."""
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(W, "cv")),
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("NoSuchOp" if bad_op else "Add", ["m", "c"], ["a"]),
        helper.make_node("Reshape", ["a", "s"], ["y"]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [vi("x", [64, 64])],
        [vi("y", [4096])],
        [const("w", W), const("s", [4096], np.int64)],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def checker_says(m: onnx.ModelProto | bytes, full: bool = True) -> str | None:
    try:
        onnx.checker.check_model(m if isinstance(m, bytes) else m.SerializeToString(), full)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        return str(e)
    return None


def lean_says(m: onnx.ModelProto, full: bool = True, data: bytes | None = None) -> str | None:
    try:
        io.check_without_weights(m, full_check=full, data=data)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        return str(e)
    return None


# ------------------------------------------------------------------ the skeleton
def test_the_skeleton_keeps_everything_but_large_values():
    m = weighted()
    sk, replaced = io.skeleton(m, m.SerializeToString())
    assert replaced == 2  # w and the Constant's value; the shape constant s is kept
    w, s = sk.graph.initializer
    assert (w.name, w.data_type, list(w.dims)) == ("w", TensorProto.FLOAT, [64, 64])
    assert not w.raw_data and w.data_location == TensorProto.EXTERNAL
    assert w.external_data[0].value == io.STANDIN_LOCATION
    assert s == m.graph.initializer[1]
    assert sk.graph.node[0].attribute[0].t.data_location == TensorProto.EXTERNAL
    assert len(sk.SerializeToString()) < 2048 < len(m.SerializeToString()) // 10
    assert m == weighted()  # the model itself is not touched
    assert checker_says(sk) is None  # stand-ins are no false errors


def test_sizes_are_read_from_the_bytes_or_measured_alike():
    m = weighted()
    data = m.SerializeToString()
    assert io._raw_lengths(data) == [W.nbytes, 8]
    assert io.skeleton(m, data)[0] == io.skeleton(m)[0]


def _branches() -> tuple:
    """If branches holding weights: an initializer in one, a Constant's value in the other."""
    body = helper.make_graph(
        [helper.make_node("Add", ["x", "wb"], ["t"])],
        "then",
        [],
        [vi("t", [64, 64])],
        [const("wb", W)],
    )
    other = helper.make_graph(
        [helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(W, "ev"))],
        "else",
        [],
        [vi("e", [64, 64])],
    )
    return body, other


def test_stand_ins_in_subgraphs_and_functions_are_no_false_errors():
    body, other = _branches()
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=other)]
    m = helper.make_model(
        helper.make_graph(
            nodes, "g", [vi("cond", [], TensorProto.BOOL), vi("x", [64, 64])], [vi("y", [64, 64])]
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    assert checker_says(m) is None
    sk, replaced = io.skeleton(m)
    assert replaced == 2
    assert checker_says(sk) is None and lean_says(m) is None


def _too_short(m: onnx.ModelProto) -> None:
    m.graph.initializer[0].raw_data = W.tobytes()[:-4]


def _undefined(m: onnx.ModelProto) -> None:
    m.graph.initializer[0].data_type = TensorProto.UNDEFINED


def _two_value_fields(m: onnx.ModelProto) -> None:
    m.graph.initializer[0].float_data.extend([1.0])


def _wrong_matmul(m: onnx.ModelProto) -> None:
    t = m.graph.initializer[0]
    t.CopyFrom(const("w", np.zeros((32, 128), np.float32)))


def _bad_op(m: onnx.ModelProto) -> None:
    m.graph.node[2].op_type = "NoSuchOp"


def _duplicate_initializer(m: onnx.ModelProto) -> None:
    m.graph.initializer.append(m.graph.initializer[0])


def _external_without_location(m: onnx.ModelProto) -> None:
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL


def _shape_of_wrong_size(m: onnx.ModelProto) -> None:
    m.graph.initializer[1].CopyFrom(const("s", [4095], np.int64))


BREAKS = {
    "raw-too-short": _too_short,
    "undefined-type": _undefined,
    "two-value-fields": _two_value_fields,
    "shapes-disagree": _wrong_matmul,
    "unknown-op": _bad_op,
    "duplicate-initializer": _duplicate_initializer,
    "external-without-location": _external_without_location,
    "reshape-of-wrong-size": _shape_of_wrong_size,
}


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("case", sorted(BREAKS))
def test_a_bad_model_is_refused_with_the_checkers_own_message(case, full):
    m = weighted()
    BREAKS[case](m)
    expected = checker_says(m, full)
    if full or case not in ("shapes-disagree", "reshape-of-wrong-size"):  # shape inference's
        assert expected is not None, case
    assert lean_says(m, full) == expected
    assert lean_says(m, full, data=m.SerializeToString()) == expected


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_values_shape_inference_needs_are_settled_on_the_whole_model(case, monkeypatch):
    """With every tensor a stand-in (the shape constant too), Reshape's inference asks for the
    stand-in's values: the whole model decides, and the verdict is the checker's."""
    monkeypatch.setattr(io, "STANDIN_BYTES", 1)
    m = weighted()
    BREAKS[case](m)
    assert lean_says(m) == checker_says(m)
    assert lean_says(weighted()) is None


def test_the_checker_is_given_the_skeleton_not_the_weights(monkeypatch):
    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(
        onnx.checker, "check_model", lambda m, *a, **k: seen.append(len(m)) or real(m, *a, **k)
    )
    m = weighted()
    io.check_without_weights(m, full_check=True)
    assert seen and max(seen) < 2048


def test_a_graph_of_small_constants_is_checked_whole(monkeypatch):
    monkeypatch.setattr(io, "STANDIN_PAYS_PER_ELEMENT", 2048)
    made = []
    real = io.skeleton
    monkeypatch.setattr(io, "skeleton", lambda *a, **k: made.append(1) or real(*a, **k))
    m = weighted()  # 4 nodes, 2 initializers: 4097 elements, under 2048 per node and tensor
    BREAKS["unknown-op"](m)
    assert lean_says(m) == checker_says(m) is not None and not made
    m.graph.initializer[0].CopyFrom(const("w", np.zeros((64, 256), np.float32)))
    assert lean_says(m) is not None and made


# ------------------------------------------------------------------ load and validity
def test_load_refuses_a_bad_weighted_model_with_the_same_line(tmp_path):
    m = weighted(bad_op=True)
    p = tmp_path / "bad.onnx"
    p.write_bytes(m.SerializeToString())
    first = checker_says(m, full=False).strip().splitlines()[0]
    with pytest.raises(ModelLoadError) as e:
        io.load_model(p)
    assert str(e.value) == f"{p}: invalid ONNX model: {first}"


def test_the_validity_check_names_the_checkers_first_line():
    m = weighted()
    _wrong_matmul(m)
    first = checker_says(m).strip().splitlines()[0]
    assert optimizer._invalid(m) == "onnx.checker: " + first
    assert optimizer._invalid(weighted()) is None


def test_cli_refuses_a_bad_weighted_model(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(weighted(bad_op=True).SerializeToString())
    res = CliRunner().invoke(app, ["optimize", str(p), "-o", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert "invalid ONNX model" in res.stderr and "NoSuchOp" in res.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ serialized once
def small() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Identity", ["x"], ["i"]),
        helper.make_node("MatMul", ["i", "w"], ["y"]),
    ]
    return model(nodes, [vi("x", [4, 64])], [vi("y", [4, 64])], [const("w", W)])


def written_bytes(held) -> bytes:
    """What the validity check wrote of a model: its spooled file, or its bytes."""
    return held.spooled.path.read_bytes() if held.spooled is not None else held.data


@pytest.mark.parametrize("check", [False, True])
def test_the_bundle_writes_the_bytes_the_validity_check_loaded(tmp_path, monkeypatch, check):
    out, report = graphopt.optimize(small(), check=check)
    held = run_of(report).serialized
    assert held is not None and held.model is out and held.spooled is not None
    # the metadata is in them: nothing changed since
    assert written_bytes(held) == out.SerializeToString()
    keys = {p.key for p in onnx.load_model_from_string(written_bytes(held)).metadata_props}
    assert {"graphopt.pipeline", "graphopt.target"} <= keys
    calls = []
    real = io.serialize
    monkeypatch.setattr(io, "serialize", lambda m: calls.append(m) or real(m))
    bundle = graphopt.write_bundle(out, report, tmp_path / "b")
    assert out not in calls  # model.onnx was not serialized again
    written = (bundle / "model.onnx").read_bytes()
    assert written == out.SerializeToString()
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model_sha256"] == hashlib.sha256(written).hexdigest()
    assert run_of(report).serialized is None  # let go of once written
    assert not held.spooled.path.exists()  # moved into the bundle, not copied


def test_bytes_held_through_the_safety_net_are_the_models(tmp_path, monkeypatch):
    """The performance safety net may replace the output: bytes are kept only for the model
    returned, and whatever it is, model.onnx is its bytes."""
    from graphopt.opt.verify import perf

    monkeypatch.delenv("GRAPHOPT_NO_MEASURE", raising=False)
    monkeypatch.setattr(perf, "MIN_BUDGET_S", 1.0)
    out, report = graphopt.optimize(small())
    assert report.performance["measured"], report.performance
    if run_of(report).serialized is not None:
        assert run_of(report).serialized.model is out
        assert written_bytes(run_of(report).serialized) == out.SerializeToString()
    bundle = graphopt.write_bundle(out, report, tmp_path / "b")
    assert (bundle / "model.onnx").read_bytes() == out.SerializeToString()


def test_no_bytes_are_held_through_a_lean_parity(tmp_path, monkeypatch):
    # lean parity is for external weights over the budget; the rule is what is tested here
    monkeypatch.setattr(optimizer, "is_lean", lambda model, budget=None: True)
    out, report = graphopt.optimize(small())
    assert report.parity.ran and report.parity.ok
    assert run_of(report).serialized is None
    bundle = graphopt.write_bundle(out, report, tmp_path / "b")
    assert (bundle / "model.onnx").read_bytes() == out.SerializeToString()


def test_held_bytes_are_only_for_the_model_object_returned(tmp_path):
    out, report = graphopt.optimize(small(), check=False)
    other = onnx.ModelProto()
    other.CopyFrom(out)
    assert run_of(report).take_serialized(other) is None
    assert run_of(report).serialized is None
    bundle = graphopt.write_bundle(other, report, tmp_path / "b")  # serialized here instead
    assert (bundle / "model.onnx").read_bytes() == other.SerializeToString()


def test_held_bytes_are_not_written_for_a_model_with_external_data(tmp_path):
    """Its model.onnx is not those bytes: the weights move to model.onnx.data."""
    onnx.save_model(
        small(),
        tmp_path / "m.onnx",
        save_as_external_data=True,
        location="m.data",
        size_threshold=0,
    )
    lazy = io.load_model(tmp_path / "m.onnx", lazy_external=True)
    assert io.has_external_data(lazy)
    holder = optimizer.Serialized(SpoolDir())
    # (the checker looks for m.data beside the working directory: _keep_valid drops that clause)
    assert optimizer._invalid(lazy, tmp_path, checker=False, into=holder) is None
    assert holder.spooled is None  # its weights are elsewhere: not written whole, not spooled
    assert holder.model is lazy and holder.data == lazy.SerializeToString()
    for external in (True, False):
        out = tmp_path / f"out{external}"
        out.mkdir()
        io.write_model_files(
            lazy, out / "model.onnx", external=external, base_dir=tmp_path, serialized=holder.data
        )
        written = onnx.load(out / "model.onnx", load_external_data=False)
        assert io.has_external_data(written) == external == (out / "model.onnx.data").is_file()
        np.testing.assert_array_equal(
            numpy_helper.to_array(written.graph.initializer[0], str(out)), W
        )


# ------------------------------------------------------------------ input read once
def _external_everywhere(tmp_path) -> tuple:
    """A model whose initializer, Constant value and If-branch initializer are all external."""
    body, other = _branches()
    nodes = [
        helper.make_node("If", ["cond"], ["t2"], then_branch=body, else_branch=other),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(W, "cv")),
        helper.make_node("Add", ["t2", "c"], ["a"]),
        helper.make_node("MatMul", ["a", "w"], ["y"]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [vi("cond", [], TensorProto.BOOL), vi("x", [64, 64])],
        [vi("y", [64, 64])],
        [const("w", W)],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    for i, t in enumerate(io._all_tensors(m)):
        onnx.external_data_helper.set_external_data(t, f"d{i % 3}.bin")
        t.ClearField("raw_data")
    (tmp_path / "m.onnx").write_bytes(m.SerializeToString())
    for i in range(3):
        (tmp_path / f"d{i}.bin").write_bytes(b"")
    return tmp_path / "m.onnx", m


def test_a_scan_finds_what_a_parse_finds(tmp_path):
    path, m = _external_everywhere(tmp_path)
    parsed = io._referenced_files(m, path)
    assert [p.name for p in parsed] == ["d0.bin", "d1.bin", "d2.bin"]
    assert io._located(io.external_locations(path), path) == parsed
    plain = tmp_path / "plain.onnx"
    plain.write_bytes(weighted().SerializeToString())
    assert io.external_locations(plain) == []


def test_a_large_input_is_scanned_not_parsed(tmp_path, monkeypatch):
    path, _ = _external_everywhere(tmp_path)
    monkeypatch.setattr(io, "SCAN_ABOVE", 0)
    monkeypatch.setattr(onnx, "load_model", lambda *a, **k: pytest.fail("parsed"))
    files = io.external_data_files(path)
    assert [p.name for p in files] == ["d0.bin", "d1.bin", "d2.bin"]
    res = CliRunner().invoke(app, ["optimize", str(path), "-o", str(tmp_path / "d1.bin")])
    assert res.exit_code == 2 and "would contain or replace the input" in res.stderr, res.output


def test_a_fresh_output_does_not_list_the_inputs_data_files_before_reading_it(
    tmp_path, monkeypatch
):
    """Only an output that exists can be or hold the input's data files: for a new one they are
    listed once the input is read (from what the read found), never by a scan of the file."""
    src = tmp_path / "m.onnx"
    onnx.save(weighted(), src, save_as_external_data=True, location="w.bin", size_threshold=0)
    monkeypatch.setattr(io, "SCAN_ABOVE", 0)
    scans = []
    real = io.external_locations
    monkeypatch.setattr(io, "external_locations", lambda p: scans.append(p) or real(p))
    args = ["optimize", str(src), "--no-check", "--no-kernels", "-o"]
    res = CliRunner().invoke(app, [*args, str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    assert scans == []
    res = CliRunner().invoke(app, [*args, str(tmp_path)])  # exists: holds the input's w.bin
    assert res.exit_code == 2 and "would contain or replace the input" in res.stderr, res.output


def test_a_file_that_is_no_model_is_still_nothing_listed(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "SCAN_ABOVE", 0)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff" * 64)
    assert io.external_data_files(junk) == []
    with pytest.raises(io._Malformed):
        io.external_locations(junk)


def test_validity_of_an_external_data_output_does_not_depend_on_the_working_directory(
    tmp_path, monkeypatch
):
    """onnx's checker looks for external files in the working directory when given bytes: its
    'should be stored in ..., but it is not regular file' is no reason to call a model invalid."""
    from graphopt.opt.graph.io import load_model
    from graphopt.opt.optimizer import _invalid

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    m = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
            [onnx.numpy_helper.from_array(w, "w")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save(m, folder / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    lazy = load_model(folder / "m.onnx", lazy_external=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "m.data").mkdir()  # a folder of that name where the checker looks: not a file
    monkeypatch.chdir(elsewhere)
    assert _invalid(lazy, base_dir=folder) is None


def test_blocks_are_read_into_one_buffer_and_a_short_file_is_an_error(tmp_path, monkeypatch):
    """A file copied or hashed by hand is read a block at a time into one buffer (no
    allocation per read); a file shorter than its recorded length is a save error."""
    import io as pyio

    from graphopt.opt.errors import ModelSaveError
    from graphopt.opt.graph import io as gio

    monkeypatch.setattr(gio, "HASH_BLOCK", 1000)
    data = bytes(range(256)) * 20  # 5120 bytes: five full blocks and a partial one
    f = pyio.BytesIO(data)
    f.seek(7)
    seen, buffers = [], set()
    for block in gio._blocks(f, len(data) - 7, "x"):
        seen.append(bytes(block))
        buffers.add(id(block.obj))
    assert b"".join(seen) == data[7:] and [len(b) for b in seen] == [1000] * 5 + [113]
    assert len(buffers) == 1
    with pytest.raises(ModelSaveError, match="x is truncated"):
        list(gio._blocks(pyio.BytesIO(data), len(data) + 1, "x"))

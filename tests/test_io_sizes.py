"""Sizes from tensor metadata: deciding on external data reads no weight; a model is
serialized without asking its size first, and loading checks the bytes it read."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.opt.errors import ModelLoadError
from graphopt.opt.graph.io import (
    EXTERNAL_THRESHOLD,
    load_model,
    needs_external_data,
    serialize,
    tensor_nbytes,
    validate,
)


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, np.int64, np.int8, np.bool_, np.float64, np.uint16]
)
def test_nbytes_is_the_raw_size(dtype):
    t = numpy_helper.from_array(np.zeros((3, 5, 7), dtype), "w")
    assert tensor_nbytes(t) == len(t.raw_data) == 3 * 5 * 7 * np.dtype(dtype).itemsize


def test_nbytes_of_packed_string_and_external_tensors():
    int4 = helper.make_tensor("q", TensorProto.INT4, [5], [1, 2, 3, 4, 5])
    assert tensor_nbytes(int4) == 3
    text = helper.make_tensor("s", TensorProto.STRING, [2], [b"abc", b"de"])
    assert tensor_nbytes(text) == 5
    ext = TensorProto(name="e", data_type=TensorProto.FLOAT, dims=[1000])
    ext.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", "4000")):
        ext.external_data.add(key=k, value=v)
    assert tensor_nbytes(ext) == 4000


def test_external_data_decided_from_metadata():
    # a weight whose dims say 2 GB: the decision does not need (or read) its bytes
    big = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[EXTERNAL_THRESHOLD // 4 + 1])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["W"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [big],
    )
    m = helper.make_model(graph)
    assert needs_external_data(m)
    big.dims[0] = 10
    m.graph.initializer[0].CopyFrom(big)
    assert not needs_external_data(m)


def small_model(op: str = "Relu"):
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones(300, np.float32), "unused")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_serialize_is_the_model_bytes():
    m = small_model()
    assert serialize(m) == m.SerializeToString()


def test_validate_checks_the_bytes_it_is_given():
    good, bad = small_model(), small_model("NoSuchOp")
    validate(good)
    with pytest.raises(ModelLoadError, match="NoSuchOp"):
        validate(good, data=bad.SerializeToString())  # the checker read these bytes


def test_load_checks_the_file_bytes_and_old_ir_after_fixing(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(small_model().SerializeToString())
    assert load_model(p).graph.node[0].op_type == "Relu"
    old = small_model()
    old.ir_version = 3  # its initializer is not a graph input: listed on load, then checked
    p.write_bytes(old.SerializeToString())
    assert "unused" in [i.name for i in load_model(p).graph.input]

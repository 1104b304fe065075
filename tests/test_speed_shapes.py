"""Shape inference exports again only the nodes that changed since its last run: a node that
is the same object with the same op, names and plain attributes keeps its proto; any change
(an attribute list edited in place included) exports it again, and results do not change."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from conftest import const, model, vi
from graphopt.opt.graph import analysis
from graphopt.opt.graph.ir import ModelIR, unlink_all
from graphopt.opt.rewrite.context import PassContext
from graphopt.opt.rewrite.manager import run_pass
from graphopt.opt.rewrite.target import get_target
from graphopt.opt.verify.parity import check_parity
from graphopt.passes.fold_constants import FoldConstants


def _model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2], name="tr"),
        helper.make_node("Relu", ["t"], ["r"], name="relu"),
        helper.make_node("Shape", ["r"], ["s"], name="shape"),
        helper.make_node("Reshape", ["r", "s"], ["y0"], name="reshape"),
        helper.make_node("Add", ["y0", "c"], ["y"], name="add"),
    ]
    return model(nodes, [vi("x", [2, 3, 4])], [vi("y", None)], [const("c", np.ones(1))])


def _fresh(nodes) -> list[bytes]:
    return [onnx.NodeProto.SerializeToString(analysis.OnnxExporter.export_node(n)) for n in nodes]


def test_unchanged_nodes_keep_their_protos_and_changed_ones_are_exported_again():
    ir = ModelIR(_model())
    nodes = list(ir.graph.nodes)
    protos: dict = {}
    first = analysis._export_nodes(nodes, protos)
    tr, relu = nodes[0], nodes[1]
    tr.attrs["perm"][0:2] = [0, 1]  # edited in place
    relu.op = "Sigmoid"
    nodes[3].inputs[1].name = "renamed"
    again = analysis._export_nodes(nodes, protos)
    assert again == _fresh(nodes)
    reused = [a is b for a, b in zip(first, again)]
    assert reused == [False, False, False, False, True]  # Shape writes the renamed "s"
    assert set(protos) == {id(n) for n in nodes}
    analysis._export_nodes(nodes[:2], protos)
    assert set(protos) == {id(n) for n in nodes[:2]}  # removed nodes are let go


def test_shapes_after_passes_are_those_of_a_fresh_inference():
    m = _model()
    ir = ModelIR(m)
    cx = PassContext(target=get_target("cpu"), level=2)
    assert analysis.infer_shapes(ir)
    ir.graph.nodes[0].attrs["perm"] = [2, 1, 0]
    for n in ir.graph.nodes[:4]:  # as a pass that changes a node does: its outputs' shapes go
        n.outputs[0].shape = None
    ir.mutations += 1
    assert analysis.infer_shapes(ir)  # from the kept protos of the other nodes
    cached = {t.name: (t.dtype, t.shape) for n in ir.graph.nodes for t in n.outputs}
    fresh = ModelIR(ir.to_onnx())
    for n in fresh.graph.nodes:
        for t in n.outputs:
            if t.name not in {o.name for o in fresh.graph.outputs}:
                t.shape = None
    assert analysis.infer_shapes(fresh)
    assert cached["r"][1] == [4, 3, 2]
    for n in fresh.graph.nodes:
        for t in n.outputs:
            if t.name in cached and t.name != "y":
                assert (t.dtype, t.shape) == cached[t.name], t.name
    run_pass(FoldConstants(), ir, cx)  # Shape of a static shape folds
    optimized = ir.to_onnx()
    assert "Shape" not in {n.op_type for n in optimized.graph.node}
    m.graph.node[0].attribute[0].ints[:] = [2, 1, 0]
    parity = check_parity(m, optimized)
    assert parity.ran and parity.ok, parity


def _with_constant_of_shape() -> onnx.ModelProto:
    value = helper.make_tensor("v", onnx.TensorProto.FLOAT, [1], [2.0])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("ConstantOfShape", ["s"], ["f"], value=value, name="fill"),
        helper.make_node("Add", ["x", "f"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "c"], ["y"], name="mul"),
    ]
    return model(nodes, [vi("x", [2, 3])], [vi("y", None)], [const("c", np.ones(3))])


def test_a_constant_tensor_attribute_keeps_its_proto_until_replaced():
    ir = ModelIR(_with_constant_of_shape())
    nodes = list(ir.graph.nodes)
    protos: dict = {}
    first = analysis._export_nodes(nodes, protos)
    again = analysis._export_nodes(nodes, protos)
    assert again[1] is first[1]  # ConstantOfShape: its value attribute is the same tensor
    fill = nodes[1]
    fill.attrs["value"] = analysis.Constant("v", np.array([3.0], dtype=np.float32))
    third = analysis._export_nodes(nodes, protos)
    assert third[1] is not first[1]
    assert third == _fresh(nodes)


def test_small_constants_are_exported_once_until_replaced_or_renamed():
    ir = ModelIR(_with_constant_of_shape())
    c = ir.graph.nodes[3].inputs[1]
    last: dict = {}
    first = analysis._constant_proto(c, {}, last)
    now: dict = {}
    assert analysis._constant_proto(c, last, now) is first and set(now) == {id(c)}
    c.name = "c2"
    assert analysis._constant_proto(c, now, {}).name == "c2"
    c.values = np.zeros(3)
    assert onnx.numpy_helper.to_array(analysis._constant_proto(c, now, {})).tolist() == [0, 0, 0]


def test_nodes_a_pass_unlinked_are_left_out_of_inference(monkeypatch):
    """A folded node stays in the node list, without inputs or outputs, until the graph is
    swept; inference runs without it and learns the shapes of the others."""
    ir = ModelIR(_model())
    shape = ir.graph.nodes[2]
    value = np.array([3, 2, 4], dtype=np.int64)
    unlink_all(shape.outputs)  # as fold-constants does
    unlink_all(shape.inputs)
    ir.graph.nodes[3].inputs[1].to_constant(value)
    for n in ir.graph.nodes:
        for t in n.outputs:
            t.shape = None
    exported = []
    real = analysis._export_nodes

    def export(nodes, protos):
        exported.extend(nodes)
        return real(nodes, protos)

    monkeypatch.setattr(analysis, "_export_nodes", export)
    assert analysis.infer_shapes(ir)
    assert shape not in exported and len(exported) == 4
    assert ir.graph.nodes[3].outputs[0].shape == [3, 2, 4]

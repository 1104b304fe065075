"""Shape inference exports again only the nodes that changed since its last run: a node that
is the same object with the same op, names and plain attributes keeps its proto; any change
(an attribute list edited in place included) exports it again, and results do not change."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from conftest import const, model, vi
from graphopt.opt import analysis
from graphopt.opt.ir import ModelIR
from graphopt.opt.manager import PassContext, run_pass
from graphopt.opt.parity import check_parity
from graphopt.opt.target import get_target
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
    assert [p.SerializeToString() for p in again] == _fresh(nodes)
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

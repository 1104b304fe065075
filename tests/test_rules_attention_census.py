"""No attention is missed in silence: a Softmax between two MatMuls that fuse-attention never
looked at gets a fuse-attention missed remark naming its stage, tensor and Softmax."""

from __future__ import annotations

import numpy as np
from onnx import helper

from conftest import const, model, run, vi


def attention(merge: str):
    """q, k, v [1, 2, 8, 4] → softmax(q·kᵀ·s + bias)·v, then merged by ``merge``."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"], name="qk"),
        helper.make_node("Mul", ["qk", "scale"], ["s"]),
        helper.make_node("Add", ["s", "bias"], ["sb"]),  # e.g. an ALiBi bias built elsewhere
        helper.make_node("Softmax", ["sb"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "v"], ["ctx"], name="pv"),
    ]
    inits = [const("scale", np.float32(0.5))]
    if merge == "reshape":
        nodes.append(helper.make_node("Reshape", ["ctx", "shape"], ["y"], name="merge"))
        inits.append(const("shape", [1, 64], np.int64))
        out = vi("y", [1, 64])
    else:
        nodes.append(helper.make_node("Relu", ["ctx"], ["y"]))
        out = vi("y", [1, 2, 8, 4])
    ins = [vi(n, [1, 2, 8, 4]) for n in ("q", "k", "v")] + [vi("bias", [1, 2, 8, 8])]
    return model(nodes, ins, [out], inits)


def test_an_attention_fuse_attention_never_roots_at_is_a_missed_remark():
    for merge in ("reshape", "relu"):
        _, report = run(attention(merge), target="cuda")
        (miss,) = [r for r in report.remarks if r.rule == "fuse-attention"]
        assert miss.kind == "missed" and miss.code == "unrecognized-layout"
        assert miss.args["stage"] == "1 (core)" and miss.args["softmax"] == "softmax"
        assert miss.args["tensor"] == "sb" and "MatMul" in miss.message and "'pv'" in miss.message
        assert report.parity.ok


def test_a_softmax_that_is_no_attention_gets_no_remark():
    m = model(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)],
        [vi("x", [2, 8])],
        [vi("y", [2, 8])],
    )
    _, report = run(m)
    assert not [r for r in report.remarks if r.rule == "fuse-attention"]


def test_the_census_sees_through_generated_element_wise_kernels():
    """The scale and bias fused into a generated kernel (fuse-elementwise runs after the
    attention rules) still make an attention: its Softmax is found from the MatMul."""
    from graphopt.opt.graph.domains import GENERATED
    from graphopt.opt.graph.ir import ModelIR
    from graphopt.rules.attention.census import pv_matmul, scores_matmul

    m = attention("reshape")
    chain = [n for n in m.graph.node if n.op_type in ("Mul", "Add")]
    kernel = helper.make_node(
        "Elementwise_0", ["qk", "scale", "bias"], ["sb"], domain=GENERATED, name="kernel"
    )
    for n in chain:
        m.graph.node.remove(n)
    m.graph.node.insert(2, kernel)
    ir = ModelIR(m)
    (softmax,) = [n for n in ir.graph.nodes if n.op == "Softmax"]
    found = scores_matmul(softmax)
    assert found is not None and found[0].name == "qk" and found[1] == ["Elementwise_0"]
    assert pv_matmul(softmax).name == "pv"


def test_probabilities_split_between_two_value_products_are_an_attention():
    """PEGASUS-X: the probabilities of local and global keys split apart, each half times
    its own values: still an attention, missed with a remark, not in silence."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"], name="qk"),
        helper.make_node("Softmax", ["qk"], ["p"], axis=-1, name="softmax"),
        helper.make_node("Split", ["p", "halves"], ["p1", "p2"], axis=-1),
        helper.make_node("Split", ["v", "halves"], ["v1", "v2"], axis=2),
        helper.make_node("MatMul", ["p1", "v1"], ["c1"], name="pv1"),
        helper.make_node("MatMul", ["p2", "v2"], ["c2"], name="pv2"),
        helper.make_node("Add", ["c1", "c2"], ["y"]),
    ]
    ins = [vi(n, [1, 2, 8, 4]) for n in ("q", "k", "v")]
    m = model(nodes, ins, [vi("y", [1, 2, 8, 4])], [const("halves", [4, 4], np.int64)])
    _, report = run(m, target="cuda")
    (miss,) = [r for r in report.remarks if r.rule == "fuse-attention"]
    assert miss.code == "unrecognized-layout" and miss.args["softmax"] == "softmax"
    assert report.parity.ok

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

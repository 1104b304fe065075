"""Property test: random DAGs of element-wise, Conv(+BN), MatMul, Reshape, Transpose, reduction
and shape-glue ops with random constants.  The full pipeline (and each pass alone) must keep the
outputs equal within tolerance, keep the graph valid, and change nothing on a second run.

GRAPHOPT_FUZZ_EXAMPLES raises the number of graphs for a longer local run; GRAPHOPT_FUZZ_RANDOM=1
draws new graphs instead of the fixed CI set.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graphopt

EXAMPLES = int(os.environ.get("GRAPHOPT_FUZZ_EXAMPLES", "40"))
#: CI runs a fixed, reproducible set; GRAPHOPT_FUZZ_RANDOM=1 explores new graphs each run
DERANDOMIZE = os.environ.get("GRAPHOPT_FUZZ_RANDOM", "") != "1"


class Builder:
    def __init__(self, draw):
        self.draw = draw
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0
        self.rng = np.random.default_rng(draw(st.integers(0, 2**16)))

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def const(self, value, dtype=np.float32) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name("n"), **attrs))
        return out


def _step(b: Builder, pool: list[tuple[str, tuple[int, ...]]]) -> tuple[str, tuple[int, ...]]:
    d = b.draw
    x, shape = d(st.sampled_from(pool))
    choice = d(
        st.sampled_from(
            [
                "unary",
                "binary_const",
                "binary_pool",
                "conv",
                "conv_bn",
                "transpose2",
                "reshape_chain",
                "reduce",
                "matmul",
                "pad_conv",
                "cast_pair",
                "identity",
                "shape_glue",
            ]
        )
    )
    rank = len(shape)
    if choice == "unary":
        op = d(st.sampled_from(["Relu", "Neg", "Abs", "Sigmoid", "Tanh"]))
        return b.node(op, [x]), shape
    if choice == "binary_const":
        op = d(st.sampled_from(["Add", "Sub", "Mul"]))
        form = d(st.sampled_from(["scalar", "channel", "full", "neutral"]))
        if form == "scalar":
            c = b.const(b.rng.uniform(0.5, 1.5, 1))
        elif form == "channel" and rank == 4:
            c = b.const(b.rng.uniform(0.5, 1.5, (shape[1], 1, 1)))
        elif form == "neutral":
            c = b.const([1.0 if op == "Mul" else 0.0])
        else:
            c = b.const(b.rng.uniform(0.5, 1.5, shape))
        ins = [x, c] if d(st.booleans()) else [c, x]
        return b.node(op, ins if op != "Sub" else [x, c]), shape
    if choice == "binary_pool":
        same = [t for t, s in pool if s == shape]
        other = d(st.sampled_from(same))
        return b.node(d(st.sampled_from(["Add", "Mul", "Sub"])), [x, other]), shape
    if choice in ("conv", "conv_bn", "pad_conv") and rank == 4:
        c_out = d(st.integers(1, 6))
        k = d(st.sampled_from([1, 3]))
        pad = k // 2
        src = x
        pads = [pad] * 4
        if choice == "pad_conv":
            p = [0, 0, 1, 1, 0, 0, 1, 1]
            src = b.node("Pad", [x, b.const(p, np.int64)], mode="constant")
            pads = [pad - 1 if pad else 0] * 4 if pad else [0] * 4
            pads = [max(v, 0) for v in pads]
        w = b.const(b.rng.standard_normal((c_out, shape[1], k, k)) * 0.3)
        bias = b.const(b.rng.standard_normal(c_out) * 0.1)
        y = b.node("Conv", [src, w, bias], pads=pads)
        h = shape[2] + (2 if choice == "pad_conv" else 0) + 2 * pads[0] - k + 1
        wd = shape[3] + (2 if choice == "pad_conv" else 0) + 2 * pads[1] - k + 1
        out_shape = (shape[0], c_out, h, wd)
        if choice == "conv_bn":
            params = [
                b.const(b.rng.uniform(0.5, 1.5, c_out)),
                b.const(b.rng.standard_normal(c_out) * 0.1),
                b.const(b.rng.standard_normal(c_out) * 0.1),
                b.const(b.rng.uniform(0.5, 2.0, c_out)),
            ]
            y = b.node("BatchNormalization", [y, *params])
        return y, out_shape
    if choice == "transpose2":
        perm = list(d(st.permutations(range(rank))))
        t = b.node("Transpose", [x], perm=perm)
        inv = list(np.argsort(perm))
        return b.node("Transpose", [t], perm=[int(i) for i in inv]), shape
    if choice == "reshape_chain":
        flat = b.node("Reshape", [x, b.const([shape[0], -1], np.int64)])
        return b.node("Reshape", [flat, b.const(list(shape), np.int64)]), shape
    if choice == "reduce":
        axis = d(st.integers(0, rank - 1))
        op = d(st.sampled_from(["ReduceMean", "ReduceSum", "ReduceMax"]))
        y = b.node(op, [x, b.const([axis], np.int64)], keepdims=1)
        return y, tuple(1 if i == axis else s for i, s in enumerate(shape))
    if choice == "matmul":
        flat = b.node("Flatten", [x], axis=1)
        k = int(np.prod(shape[1:]))
        n = d(st.integers(1, 8))
        y = b.node("MatMul", [flat, b.const(b.rng.standard_normal((k, n)) * 0.2)])
        y = b.node("Add", [y, b.const(b.rng.standard_normal(n) * 0.1)])
        return y, (shape[0], n)
    if choice == "cast_pair":
        t = b.node("Cast", [x], to=TensorProto.DOUBLE)
        return b.node("Cast", [t], to=TensorProto.FLOAT), shape
    if choice == "shape_glue":
        s = b.node("Shape", [x])
        g = b.node("Gather", [s, b.const(0, np.int64)], axis=0)
        u = b.node("Unsqueeze", [g, b.const([0], np.int64)])
        target = b.node("Concat", [u, b.const([-1], np.int64)], axis=0)
        flat = b.node("Reshape", [x, target])
        return b.node("Reshape", [flat, b.const(list(shape), np.int64)]), shape
    return b.node("Identity", [x]), shape


@st.composite
def random_models(draw):
    b = Builder(draw)
    shape = (1, draw(st.integers(1, 4)), draw(st.integers(3, 6)), draw(st.integers(3, 6)))
    pool = [("x", shape)]
    for _ in range(draw(st.integers(1, 10))):
        pool.append(_step(b, pool))
    outputs = [pool[-1]]
    if len(pool) > 2 and draw(st.booleans()):
        extra = draw(st.sampled_from(pool[1:-1]))
        if extra[0] != outputs[0][0]:
            outputs.append(extra)
    g = helper.make_graph(
        b.nodes,
        "fuzz",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in outputs],
        b.inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _ops(m):
    return sorted(n.op_type for n in m.graph.node)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(random_models(), st.sampled_from([1, 2, 3]))
def test_pipeline_preserves_outputs_and_is_idempotent(m, level):
    out, report = graphopt.optimize(m, level=level)
    assert report.parity.ran and report.parity.ok, (report.parity, _ops(m), _ops(out))
    onnx.checker.check_model(out, full_check=True)
    assert [o.name for o in out.graph.output] == [o.name for o in m.graph.output]
    again, second = graphopt.optimize(out, level=level)
    assert _ops(again) == _ops(out)
    assert second.parity.ok


PASSES = [
    "fold-constants",
    "simplify-shapes",
    "dce",
    "rules{level=3}",
    "fuse-conv-bn,fuse-conv-add,fuse-conv-mul,fuse-pad-conv,matmul-add-to-gemm",
]


@settings(
    max_examples=max(EXAMPLES // 2, 5),
    deadline=None,
    derandomize=DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(random_models(), st.sampled_from(PASSES))
def test_each_pass_alone_preserves_outputs(m, pipeline):
    out, report = graphopt.optimize(m, pipeline=pipeline)
    assert report.parity.ran and report.parity.ok, (pipeline, report.parity, _ops(m))
    onnx.checker.check_model(out, full_check=True)

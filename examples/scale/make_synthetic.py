"""Synthetic transformer-style models of a chosen node count, for the optimizer's scaling table.

Each block is what exporters emit for one small layer: shape glue (Shape→Gather→Unsqueeze→
Concat→Reshape), MatMul+Add, a decomposed LayerNorm, erf-GELU, Transpose pairs, Identity and
Dropout — about 40 nodes with tiny weights, so node count, not weight size, drives the cost.

    python examples/scale/make_synthetic.py --nodes 10000 --out synth_10k.onnx
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

H = 8


def block(i: int, x: str, rng: np.random.Generator) -> tuple[list, list, str]:
    p = f"b{i}_"
    inits = [
        numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32) * 0.3, p + "W"),
        numpy_helper.from_array(rng.standard_normal(H).astype(np.float32) * 0.1, p + "B"),
        numpy_helper.from_array(np.ones(H, np.float32), p + "g"),
        numpy_helper.from_array(np.zeros(H, np.float32), p + "beta"),
        numpy_helper.from_array(np.array([-1], np.int64), p + "axes"),
        numpy_helper.from_array(np.array(1e-5, np.float32), p + "eps"),
        numpy_helper.from_array(np.array(2.0, np.float32), p + "two"),
        numpy_helper.from_array(np.array(1.4142135, np.float32), p + "sqrt2"),
        numpy_helper.from_array(np.array(1.0, np.float32), p + "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), p + "half"),
        numpy_helper.from_array(np.array(0, np.int64), p + "i0"),
        numpy_helper.from_array(np.array(1, np.int64), p + "i1"),
        numpy_helper.from_array(np.array([0], np.int64), p + "ax0"),
        numpy_helper.from_array(np.array([2, H // 2], np.int64), p + "heads"),
        numpy_helper.from_array(np.array([H], np.int64), p + "hid"),
    ]
    n = helper.make_node
    nodes = [
        n("MatMul", [x, p + "W"], [p + "mm"]),
        n("Add", [p + "mm", p + "B"], [p + "lin"]),
        # LayerNorm, decomposed
        n("ReduceMean", [p + "lin", p + "axes"], [p + "mu"]),
        n("Sub", [p + "lin", p + "mu"], [p + "d"]),
        n("Pow", [p + "d", p + "two"], [p + "sq"]),
        n("ReduceMean", [p + "sq", p + "axes"], [p + "var"]),
        n("Add", [p + "var", p + "eps"], [p + "ve"]),
        n("Sqrt", [p + "ve"], [p + "sd"]),
        n("Div", [p + "d", p + "sd"], [p + "nrm"]),
        n("Mul", [p + "nrm", p + "g"], [p + "sc"]),
        n("Add", [p + "sc", p + "beta"], [p + "ln"]),
        # GELU (erf)
        n("Div", [p + "ln", p + "sqrt2"], [p + "gd"]),
        n("Erf", [p + "gd"], [p + "ge"]),
        n("Add", [p + "ge", p + "one"], [p + "ga"]),
        n("Mul", [p + "ln", p + "ga"], [p + "gm"]),
        n("Mul", [p + "gm", p + "half"], [p + "gelu"]),
        # split heads with shape glue, transpose there and back, merge heads
        n("Shape", [p + "gelu"], [p + "s"]),
        n("Gather", [p + "s", p + "i0"], [p + "d0"], axis=0),
        n("Gather", [p + "s", p + "i1"], [p + "d1"], axis=0),
        n("Unsqueeze", [p + "d0", p + "ax0"], [p + "u0"]),
        n("Unsqueeze", [p + "d1", p + "ax0"], [p + "u1"]),
        n("Concat", [p + "u0", p + "u1", p + "heads"], [p + "t4"], axis=0),
        n("Reshape", [p + "gelu", p + "t4"], [p + "r4"]),
        n("Transpose", [p + "r4"], [p + "tr"], perm=[0, 2, 1, 3]),
        n("Transpose", [p + "tr"], [p + "tb"], perm=[0, 2, 1, 3]),
        n("Concat", [p + "u0", p + "u1", p + "hid"], [p + "t3"], axis=0),
        n("Reshape", [p + "tb", p + "t3"], [p + "r3"]),
        n("Identity", [p + "r3"], [p + "id"]),
        n("Dropout", [p + "id"], [p + "dr"]),
        n("Add", [p + "dr", x], [p + "out"]),
    ]
    return nodes, inits, p + "out"


def build(target_nodes: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    i = 0
    while len(nodes) < target_nodes:
        bn, bi, x = block(i, x, rng)
        nodes += bn
        inits += bi
        i += 1
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    g = helper.make_graph(
        nodes,
        "synthetic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", H])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    m = build(args.nodes)
    onnx.save(m, args.out)
    print(f"{args.out}: {len(m.graph.node)} nodes")


if __name__ == "__main__":
    main()

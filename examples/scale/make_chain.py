"""A chain of one input through N unary nodes (Sigmoid by default): the longest path a model of
N nodes can have, for the million-node scaling row.

    python examples/scale/make_chain.py --nodes 1000000 --out chain_1m.onnx [--op Sigmoid]

The graph is written straight as protobuf (no onnx.helper per node, no checker): building a
million NodeProtos through the helpers costs more than the optimizer's passes over them.
"""

from __future__ import annotations

import argparse

import onnx
from onnx import TensorProto, helper


def chain(n: int, op: str = "Sigmoid", shape: tuple[int, ...] = (1, 16)) -> onnx.ModelProto:
    graph = onnx.GraphProto(name=f"chain_{n}")
    graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)))
    prev = "x"
    for i in range(n):
        out = "y" if i == n - 1 else f"t{i}"
        node = graph.node.add()
        node.op_type = op
        node.name = f"n{i}"
        node.input.append(prev)
        node.output.append(out)
        prev = out
    graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape)))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", default="Sigmoid")
    args = ap.parse_args()
    onnx.save(chain(args.nodes, args.op), args.out)


if __name__ == "__main__":
    main()

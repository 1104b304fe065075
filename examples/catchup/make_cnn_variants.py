"""Export the CNN variants used to compare graphopt with other ONNX optimizers.

Run with an environment that has torch, torchvision, onnx and onnxconverter-common::

    python examples/catchup/make_cnn_variants.py --out DIR

writes into DIR (models are not committed; everything is seeded):

* ``resnet50_dynamo.onnx``: torchvision ResNet-50 exported by ``torch.onnx.export(dynamo=True)``,
  opset 18, without the exporter's own optimization (Conv biases are spelled
  ``Expand(CastLike(0, x), Shape(W)[0:1])``-style glue, BatchNormalization kept).
* ``resnet50_fp16.onnx``: the same network in float16 (BatchNormalization kept), from the
  TorchScript exporter in training-preserving mode then converted with onnxconverter-common.
* ``resnet50_zoo.onnx``: the TorchScript export with every Conv weight and BatchNormalization
  parameter built at run time from ``ConstantOfShape`` / ``Expand`` / ``Tile`` chains with
  ``Mul``/``Add``, as in the ONNX model zoo's generated models.

BatchNormalization statistics are randomized (seeded) so that folding them is not trivial.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _network(seed: int):
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None)
    gen = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            c = mod.num_features
            mod.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
            mod.running_var.copy_(torch.rand(c, generator=gen) * 0.5 + 0.5)
            mod.weight.data.copy_(torch.rand(c, generator=gen) * 0.5 + 0.75)
            mod.bias.data.copy_(torch.randn(c, generator=gen) * 0.1)
    return model.eval()


def export_dynamo(model, path: str) -> None:
    import torch

    x = torch.randn(1, 3, 224, 224)
    prog = torch.onnx.export(model, (x,), dynamo=True, opset_version=18, optimize=False)
    prog.save(path)


def export_torchscript(model, path: str) -> None:
    import torch

    x = torch.randn(1, 3, 224, 224)
    model.train(False)
    torch.onnx.export(
        model,
        (x,),
        path,
        dynamo=False,
        opset_version=18,
        training=torch.onnx.TrainingMode.PRESERVE,
        do_constant_folding=False,
        input_names=["input"],
        output_names=["logits"],
    )


def to_fp16(src: str, dst: str) -> None:
    from onnxconverter_common import float16

    model = float16.convert_float_to_float16(onnx.load(src), keep_io_types=False)
    onnx.save(model, dst)


def _runtime_built(name: str, w: np.ndarray, k: int) -> tuple[list, list]:
    """Nodes and initializers computing ``w`` at run time: a filled ConstantOfShape (or an
    Expand / Tile of a small constant) scaled by a Mul and shifted by an Add."""
    shape = numpy_helper.from_array(np.array(w.shape, dtype=np.int64), f"{name}_shape")
    fill = helper.make_tensor(f"{name}_one", TensorProto.FLOAT, [1], [1.0])
    base = f"{name}_base"
    inits = [shape]
    if k % 3 == 0:
        nodes = [helper.make_node("ConstantOfShape", [shape.name], [base], value=fill)]
    elif k % 3 == 1:
        one = numpy_helper.from_array(np.ones([1] * w.ndim, np.float32), f"{name}_unit")
        inits.append(one)
        nodes = [helper.make_node("Expand", [one.name, shape.name], [base])]
    else:
        one = numpy_helper.from_array(np.ones([1] * w.ndim, np.float32), f"{name}_unit")
        inits.append(one)
        nodes = [helper.make_node("Tile", [one.name, shape.name], [base])]
    delta = numpy_helper.from_array((w - 1.0).astype(np.float32), f"{name}_delta")
    half = numpy_helper.from_array(np.array(0.5, np.float32), f"{name}_half")
    inits += [delta, half]
    nodes += [
        helper.make_node("Mul", [base, half.name], [f"{name}_scaled"]),
        helper.make_node("Add", [f"{name}_scaled", f"{name}_scaled"], [f"{name}_sum"]),
        helper.make_node("Add", [f"{name}_sum", delta.name], [name]),
    ]
    return nodes, inits


def make_zoo(src: str, dst: str) -> None:
    model = onnx.load(src)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    targets: list[str] = []
    for node in g.node:
        if node.op_type == "Conv":
            targets.append(node.input[1])
        elif node.op_type == "BatchNormalization":
            targets += list(node.input[1:5])
    new_nodes, new_inits = [], []
    for k, name in enumerate(dict.fromkeys(targets)):
        if name not in inits:
            continue
        w = numpy_helper.to_array(inits.pop(name))
        nodes, extra = _runtime_built(name, w, k)
        new_nodes += nodes
        new_inits += extra
    del g.initializer[:]
    g.initializer.extend(list(inits.values()) + new_inits)
    rest = list(g.node)
    del g.node[:]
    g.node.extend(new_nodes + rest)
    onnx.checker.check_model(model)
    onnx.save(model, dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder to write the models into")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = _network(args.seed)
    export_dynamo(model, os.path.join(args.out, "resnet50_dynamo.onnx"))
    ts = os.path.join(args.out, "resnet50_ts.onnx")
    export_torchscript(model, ts)
    to_fp16(ts, os.path.join(args.out, "resnet50_fp16.onnx"))
    make_zoo(ts, os.path.join(args.out, "resnet50_zoo.onnx"))
    for f in sorted(os.listdir(args.out)):
        m = onnx.load(os.path.join(args.out, f), load_external_data=False)
        ops: dict[str, int] = {}
        for n in m.graph.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
        print(f, len(m.graph.node), dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8]))


if __name__ == "__main__":
    main()

"""Export the CNN variants used to compare graphopt with other ONNX optimizers.

Run with an environment that has torch, torchvision, onnx and onnxconverter-common::

    python examples/cnn_variants/make_cnn_variants.py --out DIR [--only NAME,...] [--list]

writes NAME.onnx and a NAME.json sidecar (``{"inputs": {"input": [1, 3, 224, 224]}}``, what
``examples/benchmark/bench.py`` reads) into DIR for each model (models are not committed;
random weights, everything seeded, nothing downloaded). A name is ``ARCH_VARIANT``, ARCH one of
the torchvision networks ``resnet50``, ``mobilenet_v3_large``, ``efficientnet_b0``,
``convnext_tiny``, VARIANT one of:

* ``dynamo``: ``torch.onnx.export(dynamo=True)``, opset 18, without the exporter's own
  optimization (Conv biases are spelled ``Expand(CastLike(0, x), Shape(W)[0:1])``-style glue,
  BatchNormalization kept).
* ``ts``: the TorchScript exporter in training-preserving mode (BatchNormalization kept), opset 18.
* ``fp16``: the ``ts`` export in float16 (BatchNormalization kept), converted with
  onnxconverter-common (float16 inputs and outputs).
* ``zoo``: the ``ts`` export with every Conv weight and BatchNormalization parameter built at run
  time from ``ConstantOfShape`` / ``Expand`` / ``Tile`` chains with ``Mul``/``Add``, as in the
  ONNX model zoo's generated models.

Default set: ``resnet50_dynamo``, ``resnet50_ts``, ``resnet50_fp16``, ``resnet50_zoo``,
``mobilenet_v3_large_dynamo``, ``mobilenet_v3_large_fp16``, ``efficientnet_b0_dynamo``,
``convnext_tiny_dynamo``. BatchNormalization statistics are randomized (seeded) so that folding
them is not trivial; parameters that random init leaves constant (ConvNeXt's 1e-6 layer scales,
zero biases) get seeded noise.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ARCHS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny")
VARIANTS = ("dynamo", "ts", "fp16", "zoo")
DEFAULT = (
    "resnet50_dynamo",
    "resnet50_ts",
    "resnet50_fp16",
    "resnet50_zoo",
    "mobilenet_v3_large_dynamo",
    "mobilenet_v3_large_fp16",
    "efficientnet_b0_dynamo",
    "convnext_tiny_dynamo",
)
SHAPE = [1, 3, 224, 224]


def _network(arch: str, seed: int):
    """torchvision ``arch`` with seeded random weights, non-trivial BatchNorm statistics and no
    parameter left constant by its initializer; in eval mode."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)(weights=None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                c = mod.num_features
                mod.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                mod.running_var.copy_(torch.rand(c, generator=gen) * 0.5 + 0.5)
                mod.weight.copy_(torch.rand(c, generator=gen) * 0.5 + 0.75)
                mod.bias.copy_(torch.randn(c, generator=gen) * 0.1)
        for p in model.parameters():
            flat = p.reshape(-1)
            if flat.numel() > 1 and bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def export_dynamo(model, path: str) -> None:
    import torch

    x = torch.randn(1, 3, 224, 224)
    prog = torch.onnx.export(
        model,
        (x,),
        dynamo=True,
        opset_version=18,
        optimize=False,
        input_names=["input"],
        output_names=["logits"],
    )
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


def _summary(path: str) -> str:
    import onnxruntime as ort

    m = onnx.load(path, load_external_data=False)
    ops: dict[str, int] = {}
    for n in m.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    dt = np.float16 if inp.type == "tensor(float16)" else np.float32
    out = sess.run(None, {inp.name: np.random.default_rng(0).standard_normal(SHAPE).astype(dt)})
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8])
    finite = bool(np.isfinite(out[0]).all())
    return f"{len(m.graph.node)} nodes, output {out[0].shape} finite={finite} {top}"


def produce(name: str, out: str, seed: int, made: dict[str, object]) -> str:
    """Write OUT/NAME.onnx and its sidecar; ``made`` caches networks and TorchScript exports."""
    arch, variant = _split(name)
    path = os.path.join(out, f"{name}.onnx")
    if arch not in made:
        made[arch] = _network(arch, seed)
    model = made[arch]
    ts = os.path.join(out, f"{arch}_ts.onnx")
    if variant in ("ts", "fp16", "zoo") and (arch, "ts") not in made:
        export_torchscript(model, ts)
        _sidecar(out, f"{arch}_ts")
        made[(arch, "ts")] = ts
    if variant == "dynamo":
        export_dynamo(model, path)
    elif variant == "fp16":
        to_fp16(ts, path)
    elif variant == "zoo":
        make_zoo(ts, path)
    _sidecar(out, name)
    return path


def _sidecar(out: str, name: str) -> None:
    """NAME.json: the input shape ``examples/benchmark/bench.py`` feeds."""
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"inputs": {"input": SHAPE}}, f)


def _split(name: str) -> tuple[str, str]:
    arch, _, variant = name.rpartition("_")
    if arch not in ARCHS or variant not in VARIANTS:
        raise SystemExit(
            f"unknown model '{name}': ARCH_VARIANT with ARCH in {', '.join(ARCHS)} "
            f"and VARIANT in {', '.join(VARIANTS)}"
        )
    return arch, variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder to write the models into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="comma-separated ARCH_VARIANT names (default: the default set)")
    ap.add_argument("--list", action="store_true", help="print the default set and exit")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(DEFAULT)
    if args.list:
        print("\n".join(DEFAULT))
        return
    for name in names:
        _split(name)
    os.makedirs(args.out, exist_ok=True)
    made: dict[object, object] = {}
    for name in names:
        path = produce(name, args.out, args.seed, made)
        print(name, _summary(path), flush=True)


if __name__ == "__main__":
    main()

"""An optimum-style merged decoder: one model, an If on ``use_cache_branch``, two full decoders.

    python examples/make_merged_decoder.py --out models/tf [--layers 4] [--dynamo]

Run in an environment with torch, transformers, onnx and onnxruntime. A GPT-2 decoder (random
weights from a config, nothing downloaded) is exported twice with the TorchScript exporter
(opset 17; ``--dynamo``: the dynamo exporter, opset 18): without a cache (``input_ids``,
``attention_mask`` -> ``logits``, ``present.I.key/value``) and with one (the same plus
``past_key_values.I.key/value`` in). :func:`merge_decoders` then merges the two graphs the way
optimum's merger does, so that graphopt meets what optimum ships:

* initializers equal in both exports (same dtype, dims and bytes) become one initializer of the
  outer graph under one name; the rest of the weights move to the outer graph too (renamed where
  the two exports gave different tensors one name); scalars and 1-D integer constants stay in
  their branch;
* the merged graph's inputs are the with-cache export's plus a boolean ``use_cache_branch``
  of shape [1]; the If's ``then_branch`` is the decoder with the cache, ``else_branch`` the one
  without; both branches read the outer inputs and weights by name;
* both branches' outputs are made compatible: same names, and dims on which the two exports
  disagree become one dim_param of the merged output (``present`` is ``past + seq`` long with the
  cache, ``seq`` without).

Writes OUT/NAME.onnx (NAME = gpt2_merged, or gpt2_merged_dynamo), NAME.json (test shapes and
the model type, as examples/make_models.py writes them), NAME.npz (a decoding step: one new token
after 16 cached ones, ``use_cache_branch`` true) and NAME.first.npz (the first step: 8 prompt
tokens, row 0 left-padded, an empty cache, ``use_cache_branch`` false), and checks both against
torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import helper

HERE = os.path.dirname(os.path.abspath(__file__))
USE_CACHE = "use_cache_branch"


# ------------------------------------------------------------------------------- the merger


def _key(init: onnx.TensorProto) -> tuple:
    """What makes two initializers the same tensor: dtype, dims and bytes."""
    array = onnx.numpy_helper.to_array(init)
    return (init.data_type, tuple(init.dims), hashlib.sha256(array.tobytes()).hexdigest())


def _stays_in_branch(init: onnx.TensorProto) -> bool:
    """optimum keeps scalars and 1-D integer constants (shape glue) inside the branches."""
    ints = (onnx.TensorProto.INT32, onnx.TensorProto.INT64)
    return len(init.dims) == 0 or (len(init.dims) == 1 and init.data_type in ints)


def _rename_inputs(graph: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Point every read of a renamed outer value at its new name, in nested bodies too."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for attr in node.attribute:
            for body in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                _rename_inputs(body, renames)


def _hoist(models: list[onnx.ModelProto]) -> tuple[list[onnx.TensorProto], list[list]]:
    """The outer graph's initializers (one per distinct tensor) and each branch's own."""
    outer: dict[tuple, onnx.TensorProto] = {}
    taken: set[str] = set()
    local: list[list] = []
    for index, m in enumerate(models):
        renames: dict[str, str] = {}
        mine = []
        for init in m.graph.initializer:
            if _stays_in_branch(init):
                mine.append(init)
                continue
            key = _key(init)
            if key in outer:
                renames[init.name] = outer[key].name
                continue
            name = init.name
            while name in taken:  # another tensor of the other export has this name
                name = f"{name}_merged{index}"
            hoisted = onnx.TensorProto()
            hoisted.CopyFrom(init)
            hoisted.name = name
            outer[key] = hoisted
            taken.add(name)
            if name != init.name:
                renames[init.name] = name
        _rename_inputs(m.graph, renames)
        local.append(mine)
    return list(outer.values()), local


def _unified_outputs(
    with_past: onnx.GraphProto, without: onnx.GraphProto
) -> list[onnx.ValueInfoProto]:
    """Output value infos both branches agree with: a dim the exports name or size differently
    becomes a dim_param of the merged output."""
    if [o.name for o in with_past.output] != [o.name for o in without.output]:
        raise ValueError("the two decoders do not have the same outputs in the same order")
    merged = []
    for a, b in zip(with_past.output, without.output):
        ta, tb = a.type.tensor_type, b.type.tensor_type
        if ta.elem_type != tb.elem_type or len(ta.shape.dim) != len(tb.shape.dim):
            raise ValueError(f"output {a.name!r} differs in dtype or rank between the decoders")
        dims = []
        for axis, (da, db) in enumerate(zip(ta.shape.dim, tb.shape.dim)):
            if da == db:
                dims.append(da.dim_value or da.dim_param or None)
            else:
                dims.append(f"{a.name}_dim_{axis}")
        merged.append(helper.make_tensor_value_info(a.name, ta.elem_type, dims))
    return merged


def merge_decoders(
    without: onnx.ModelProto, with_past: onnx.ModelProto, name: str = "merged_decoder"
) -> onnx.ModelProto:
    """One model running ``with_past`` when ``use_cache_branch`` is true, else ``without``."""
    without, with_past = (
        onnx.ModelProto.FromString(without.SerializeToString()),
        (onnx.ModelProto.FromString(with_past.SerializeToString())),
    )
    outer_inits, (no_past_inits, past_inits) = _hoist([without, with_past])
    outputs = _unified_outputs(with_past.graph, without.graph)
    declared = {i.name for i in with_past.graph.input}
    missing = [i.name for i in without.graph.input if i.name not in declared]
    if missing:
        raise ValueError(f"inputs of the decoder without a cache that the other lacks: {missing}")

    def branch(m: onnx.ModelProto, inits: list, graph_name: str) -> onnx.GraphProto:
        return helper.make_graph(list(m.graph.node), graph_name, [], outputs, inits)

    cond = helper.make_tensor_value_info(USE_CACHE, onnx.TensorProto.BOOL, [1])
    if_node = helper.make_node(
        "If",
        [USE_CACHE],
        [o.name for o in outputs],
        name="optimum::if",
        then_branch=branch(with_past, past_inits, "with_past"),
        else_branch=branch(without, no_past_inits, "no_past"),
    )
    graph = helper.make_graph(
        [if_node], name, list(with_past.graph.input) + [cond], outputs, outer_inits
    )
    opsets = {
        o.domain: o.version for o in list(without.opset_import) + list(with_past.opset_import)
    }
    merged = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())]
    )
    merged.ir_version = max(without.ir_version, with_past.ir_version)
    merged.producer_name = with_past.producer_name
    onnx.checker.check_model(merged)
    return merged


# ------------------------------------------------------------------------------- the exports


def build(layers: int):
    """A GPT-2 decoder with random weights (seeded) and its config."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    sys.path.insert(0, HERE)
    from export_utils import perturb_constant_params

    torch.manual_seed(39)
    config = GPT2Config(
        n_layer=layers,
        n_embd=256,
        n_head=4,
        vocab_size=8000,
        n_positions=512,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    perturb_constant_params(model)
    return model, config


def export_pair(model, config, tmp: str, dynamo: bool) -> tuple[str, str]:
    """The decoder without and with a cache, each as ONNX in ``tmp``."""
    import torch

    sys.path.insert(0, HERE)
    from export_utils import CacheWrapper, Net, cache_names, export_dynamo, export_torchscript

    layers, heads = config.n_layer, config.n_head
    head_dim = config.n_embd // heads
    present = cache_names(layers, "present")
    past = cache_names(layers, "past_key_values")

    class NoCache(torch.nn.Module):
        """The first step: no cache in, the present keys and values out."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
            flat = []
            for layer in out["cache"].layers:
                flat += [layer.keys, layer.values]
            return (out["logits"], *flat)

    def first(batch: int, seq: int) -> dict:
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, : max(1, seq // 4)] = 0
        return {
            "input_ids": torch.randint(0, config.vocab_size, (batch, seq)),
            "attention_mask": mask,
        }

    def step(batch: int, seq: int) -> dict:
        out = first(batch, seq + 4)
        out["input_ids"] = out["input_ids"][:, -4:]
        for n in past:
            out[n] = torch.randn(batch, heads, seq, head_dim)
        return out

    token_axes = {
        "input_ids": {0: "batch", 1: "sequence_length"},
        "logits": {0: "batch", 1: "sequence_length"},
    }
    no_cache = Net(
        module=NoCache(),
        inputs=first,
        output_names=["logits", *present],
        dynamic_axes=token_axes
        | {"attention_mask": {0: "batch", 1: "sequence_length"}}
        | {n: {0: "batch", 2: "sequence_length"} for n in present},
        export_shape=(2, 8),
    )
    cached = Net(
        module=CacheWrapper(model, ["input_ids", "attention_mask"], layers),
        inputs=step,
        output_names=["logits", *present],
        dynamic_axes=token_axes
        | {"attention_mask": {0: "batch", 1: "total_sequence_length"}}
        | {n: {0: "batch", 2: "past_sequence_length"} for n in past}
        | {n: {0: "batch", 2: "total_sequence_length"} for n in present},
        export_shape=(2, 8),
    )
    paths = (os.path.join(tmp, "no_past.onnx"), os.path.join(tmp, "with_past.onnx"))
    for net, path in zip((no_cache, cached), paths):
        if dynamo:
            export_dynamo(net, path, opset=18)
        else:
            export_torchscript(net, path, opset=17)
    return paths


def feeds(config, use_cache: bool, seed: int) -> dict[str, np.ndarray]:
    """A decoding step (1 new token after 16 cached) or the first step (8 prompt tokens, an
    empty cache); row 0 of the mask is left-padded."""
    rng = np.random.default_rng(seed)
    layers, heads = config.n_layer, config.n_head
    head_dim = config.n_embd // heads
    past, new = (16, 1) if use_cache else (0, 8)
    mask = np.ones((2, past + new), np.int64)
    mask[0, :3] = 0
    out = {"input_ids": rng.integers(0, config.vocab_size, (2, new)).astype(np.int64)}
    out["attention_mask"] = mask
    for i in range(layers):
        for kv in ("key", "value"):
            shape = (2, heads, past, head_dim)
            out[f"past_key_values.{i}.{kv}"] = rng.standard_normal(shape).astype(np.float32)
    out[USE_CACHE] = np.array([use_cache])
    return out


def check_against_torch(path: str, model, config, inputs: dict) -> float:
    """Relative L2 error of the merged model's logits against torch on ``inputs``, at the
    positions the mask keeps."""
    import onnxruntime as ort
    import torch
    from transformers.cache_utils import DynamicCache

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], inputs)[0]
    ids = torch.from_numpy(inputs["input_ids"])
    mask = torch.from_numpy(inputs["attention_mask"])
    kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
    if inputs[USE_CACHE][0]:
        kwargs["cache"] = DynamicCache(
            [
                tuple(
                    torch.from_numpy(inputs[f"past_key_values.{i}.{kv}"]) for kv in ("key", "value")
                )
                for i in range(config.n_layer)
            ]
        )
    with torch.no_grad():
        want = model(**kwargs)["logits"].numpy()
    # a padded position attends to nothing: what the exporters compute there is not defined
    real = inputs["attention_mask"][:, -got.shape[1] :].astype(bool)
    got, want = got[real], want[real]
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dynamo", action="store_true", help="the dynamo exporter, opset 18")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    name = "gpt2_merged_dynamo" if args.dynamo else "gpt2_merged"
    model, config = build(args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        no_past, with_past = export_pair(model, config, tmp, args.dynamo)
        merged = merge_decoders(onnx.load(no_past), onnx.load(with_past), name)
    path = os.path.join(args.out, name + ".onnx")
    onnx.save(merged, path)
    step, first = feeds(config, True, 1), feeds(config, False, 2)
    np.savez(os.path.join(args.out, name + ".npz"), **step)
    np.savez(os.path.join(args.out, name + ".first.npz"), **first)
    errors = {
        "use_cache_branch=1": check_against_torch(path, model, config, step),
        "use_cache_branch=0": check_against_torch(path, model, config, first),
    }
    softmax = sum(
        n.op_type == "Softmax"
        for node in merged.graph.node
        for a in node.attribute
        for n in a.g.node
    )
    sidecar = {
        "inputs": {k: list(v.shape) for k, v in step.items()},
        "exporter": "dynamo" if args.dynamo else "torchscript",
        "opset": 18 if args.dynamo else 17,
        "layers": softmax,
        "model_type": "gpt2",
        "num_heads": config.n_head,
        "hidden_size": config.n_embd,
        "relative_l2_vs_torch": errors,
    }
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(sidecar, f, indent=1)
    print(
        f"{path}: {len(merged.graph.initializer)} outer initializers, "
        f"{softmax} Softmax in the branches"
    )
    for k, v in errors.items():
        print(f"  {k}: relative L2 vs torch {v:.2e}")
    worst = max(errors.values())
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())

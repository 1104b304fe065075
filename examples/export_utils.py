"""Shared helpers for make_examples.py and make_models.py.

Runs in the export environment (torch, torchvision, transformers, onnx, onnxruntime,
onnxconverter-common). Every model is built from an architecture or config with seeded random
weights; nothing is downloaded.
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import re
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from torch import nn

TWO_GB = 2**31


# ---------------------------------------------------------------------------- determinism


def seed_for(name: str) -> int:
    """A stable per-model seed, so `--only NAME` reproduces the same weights as a full run."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def quiet_warnings() -> None:
    """The TorchScript exporter and transformers emit many tracer/deprecation warnings."""
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# ---------------------------------------------------------------------------- model wrapping


class Wrapper(nn.Module):
    """Calls `model` with named inputs (given positionally, in `input_names` order) and returns
    the selected outputs as a tuple, so the ONNX graph gets clean input and output names.
    `extra` holds fixed keyword arguments (e.g. use_cache=False)."""

    def __init__(
        self, model: nn.Module, input_names: list[str], output_keys: list[str] | None, **extra
    ):
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.output_keys = output_keys
        self.extra = extra

    def forward(self, *args):
        out = self.model(**dict(zip(self.input_names, args)), **self.extra)
        if self.output_keys is None:  # plain tensor output (torchvision models)
            return out
        return tuple(out[k] for k in self.output_keys)


class CacheWrapper(nn.Module):
    """A decoder step with a KV cache as plain tensors: forward(*named_inputs, *past) where past
    is key, value for each of `layers` layers ([batch, heads, past_seq, head_dim]); returns the
    logits, then the present key and value of every layer (past and new tokens).

    `cross=True` wraps the self-attention cache in an EncoderDecoderCache with an empty
    cross-attention cache, so cross-attention keys and values are computed in the graph from
    the encoder states. The input named by `encoder_input` is passed as `encoder_outputs`."""

    def __init__(
        self,
        model: nn.Module,
        input_names: list[str],
        layers: int,
        cross: bool = False,
        encoder_input: str | None = None,
    ):
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.layers = layers
        self.cross = cross
        self.encoder_input = encoder_input

    def forward(self, *args):
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        n = len(self.input_names)
        kwargs = dict(zip(self.input_names, args[:n]))
        if self.encoder_input:
            kwargs["encoder_outputs"] = (kwargs.pop(self.encoder_input),)
        past = args[n:]
        cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(self.layers)])
        if self.cross:
            cache = EncoderDecoderCache(cache, DynamicCache())
        out = self.model(**kwargs, cache=cache, use_cache=True)
        present = out["cache"].self_attention_cache if self.cross else out["cache"]
        flat = []
        for layer in present.layers:
            flat += [layer.keys, layer.values]
        return (out["logits"], *flat)


def cache_names(layers: int, prefix: str) -> list[str]:
    """PREFIX.I.key, PREFIX.I.value for each layer, in CacheWrapper's order."""
    return [f"{prefix}.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


@dataclass
class Net:
    """A model ready to export.

    `inputs(batch, seq)` returns the named example inputs in forward order (`seq` is ignored by
    models without a sequence axis). `dynamic_axes` uses the TorchScript exporter's format.
    """

    module: nn.Module
    inputs: Callable[[int, int], dict[str, torch.Tensor]]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    # (batch, seq) used to trace, to write NAME.json and to verify, and a second shape that
    # checks the dynamic axes really are dynamic.
    export_shape: tuple[int, int] = (2, 16)
    test_shape: tuple[int, int] = (1, 128)
    alt_shape: tuple[int, int] | None = (3, 37)
    # extra NAME.json keys, e.g. model_type/num_heads/hidden_size for onnxruntime's
    # transformer optimizer in the benchmark
    sidecar: dict = field(default_factory=dict)
    input_names: list[str] = field(init=False)

    def __post_init__(self):
        self.module.eval()  # a fresh wrapper is in train mode; the exporter restores that mode
        self.input_names = list(self.inputs(1, 8).keys())


def image_inputs(channels: int = 3, size: int = 224, name: str = "input"):
    def make(batch: int, _seq: int) -> dict[str, torch.Tensor]:
        return {name: torch.randn(batch, channels, size, size)}

    return make


def text_inputs(vocab_size: int, names: tuple[str, ...] = ("input_ids", "attention_mask")):
    """input_ids in [0, vocab), an attention mask with the second half of row 0 padded (at any
    batch size, so that neither the traced export nor the test inputs take an all-ones
    shortcut), token_type_ids with a second segment."""

    def make(batch: int, seq: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            if name == "input_ids":
                out[name] = torch.randint(0, vocab_size, (batch, seq))
            elif name == "attention_mask":
                mask = torch.ones(batch, seq, dtype=torch.int64)
                mask[0, max(1, seq // 2) :] = 0
                out[name] = mask
            elif name == "token_type_ids":
                tt = torch.zeros(batch, seq, dtype=torch.int64)
                tt[:, seq // 2 :] = 1
                out[name] = tt
            else:
                raise ValueError(name)
        return out

    return make


# ---------------------------------------------------------------------------- weights


@torch.no_grad()
def perturb_constant_params(model: nn.Module, std: float = 0.02) -> None:
    """Random init leaves many tensors constant (zero biases, unit LayerNorm scales, zero heads,
    1e-6 layer scales). Add small noise so no tensor is trivially constant: optimizer bugs that
    such values would hide (and the exporter's de-duplication of equal initializers) show up."""
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        if flat.numel() > 1 and bool((flat == flat[0]).all()):
            p.add_(torch.randn_like(p) * std)


@torch.no_grad()
def randomize_batchnorm(
    model: nn.Module, make_batch: Callable[[], torch.Tensor], passes: int = 2
) -> int:
    """Give BatchNorm layers non-trivial affine parameters and running statistics.

    Random gamma/beta; running stats from a few train-mode passes on random inputs (cumulative
    average, momentum=None); then a small perturbation of mean and var so they are not exactly
    the batch statistics. Returns the number of BN layers touched. Leaves `model` in eval mode.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        model.eval()
        return 0
    momenta = []
    for bn in bns:
        if bn.affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0.0, 0.1)
        bn.reset_running_stats()
        momenta.append(bn.momentum)
        bn.momentum = None
    model.train()
    for _ in range(passes):
        model(make_batch())
    model.eval()
    for bn, momentum in zip(bns, momenta):
        bn.momentum = momentum
        std = bn.running_var.clamp_min(0).sqrt()
        bn.running_mean.add_(torch.randn_like(bn.running_mean) * 0.1 * std)
        bn.running_var.mul_(torch.empty_like(bn.running_var).uniform_(0.8, 1.25))
    return len(bns)


# ---------------------------------------------------------------------------- export


def export_torchscript(
    net: Net,
    path: str,
    opset: int = 17,
    keep_bn: bool = False,
    keep_initializers_as_inputs: bool = False,
) -> None:
    """TorchScript exporter (dynamo=False). keep_bn keeps BatchNormalization nodes (PRESERVE
    training mode on an eval-mode module, no exporter constant folding)."""
    from torch.onnx import TrainingMode

    args = tuple(net.inputs(*net.export_shape).values())
    with torch.no_grad():
        torch.onnx.export(
            net.module,
            args,
            path,
            dynamo=False,
            opset_version=opset,
            input_names=net.input_names,
            output_names=net.output_names,
            dynamic_axes=net.dynamic_axes,
            training=TrainingMode.PRESERVE if keep_bn else TrainingMode.EVAL,
            do_constant_folding=not keep_bn,
            keep_initializers_as_inputs=keep_initializers_as_inputs,
        )
        ref = net.module(*args)
    net.module.eval()
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    fix_output_shapes(path, net, [tuple(t.shape) for t in ref])


def fix_output_shapes(path: str, net: Net, shapes: list[tuple[int, ...]]) -> None:
    """The TorchScript exporter names output dims it could not infer (e.g. 'Convoutput_dim_2')
    even when they are fixed by the static input dims. Give every output dim that is not a
    declared dynamic axis its concrete value from the traced run."""
    model = onnx.load(path)
    changed = False
    for out, shape in zip(model.graph.output, shapes):
        declared = net.dynamic_axes.get(out.name, {})
        dims = out.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            continue
        for ax, (dim, size) in enumerate(zip(dims, shape)):
            if ax not in declared and not dim.HasField("dim_value"):
                dim.dim_value = size
                changed = True
    if changed:
        save_model(model, path)


def export_dynamo(net: Net, path: str, opset: int = 18) -> None:
    """torch.export-based exporter (dynamo=True, default optimize=True), single file."""
    from torch.export import Dim

    # Dim.DYNAMIC lets torch.export work out which axes are equal and their ranges (a named
    # Dim would have to state model limits such as seq <= 512); names are restored afterwards.
    dynamic_shapes = tuple(
        {ax: Dim.DYNAMIC for ax in net.dynamic_axes.get(name, {})} for name in net.input_names
    )
    params = list(inspect.signature(net.module.forward).parameters.values())
    variadic = [i for i, p in enumerate(params) if p.kind is p.VAR_POSITIONAL]
    if variadic:  # forward(a, b, *rest): the tensors of *rest are one parameter, one tuple
        fixed = variadic[0]
        dynamic_shapes = (*dynamic_shapes[:fixed], tuple(dynamic_shapes[fixed:]))
    args = tuple(net.inputs(*net.export_shape).values())
    with torch.no_grad():
        program = torch.onnx.export(
            net.module,
            args,
            dynamo=True,
            opset_version=opset,
            input_names=net.input_names,
            output_names=net.output_names,
            dynamic_shapes=dynamic_shapes,
            verbose=False,
        )
    model = program.model_proto
    rename_dynamic_dims(model, net.dynamic_axes)
    save_model(model, path)
    net.module.eval()


def rename_dynamic_dims(model: onnx.ModelProto, dynamic_axes: dict[str, dict[int, str]]) -> None:
    """Replace torch.export's symbolic dim names (s0, s1, ...) by the readable axis names."""
    mapping: dict[str, str] = {}
    for vi in model.graph.input:
        for ax, label in dynamic_axes.get(vi.name, {}).items():
            dim = vi.type.tensor_type.shape.dim[ax]
            if dim.dim_param:
                mapping.setdefault(dim.dim_param, label)
    if not mapping:
        return
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param in mapping:
                dim.dim_param = mapping[dim.dim_param]


def save_model(model: onnx.ModelProto, path: str) -> None:
    """Save one file, or with one external-data file when the proto would exceed 2 GB."""
    if model.ByteSize() >= TWO_GB:
        data = os.path.basename(path) + ".data"
        if os.path.exists(path + ".data"):
            os.remove(path + ".data")
        onnx.save_model(
            model,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, path)


def model_size(path: str) -> int:
    """Bytes of the model file plus any external data files next to it that it references."""
    total = os.path.getsize(path)
    model = onnx.load(path, load_external_data=False)
    seen = set()
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location" and entry.value not in seen:
                seen.add(entry.value)
                total += os.path.getsize(os.path.join(os.path.dirname(path), entry.value))
    return total


# ---------------------------------------------------------------------------- fp16


def _cast_to(node: onnx.NodeProto) -> int | None:
    for attr in node.attribute:
        if attr.name == "to":
            return attr.i
    return None


def convert_fp16(src: str, dst: str) -> dict[str, int]:
    """fp32 -> fp16 with onnxconverter-common (keep_io_types=True), plus two repairs without
    which onnxruntime refuses some converted models:

    (a) exporter-emitted Cast(to=FLOAT) nodes are left casting to fp32 and break type
        consistency: retarget them to FLOAT16;
    (b) with keep_io_types, a graph output that is also read inside the graph (BERT's
        last_hidden_state feeding the pooler) leaves that reader on the fp32 copy: point it at
        the fp16 tensor instead.
    """
    from onnxconverter_common import float16

    FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    model = onnx.load(src)
    graph = model.graph
    for i, node in enumerate(graph.node):  # the repair below finds original Casts by name
        if not node.name:
            node.name = f"node_{i}"
    exporter_casts = {n.name for n in graph.node if n.op_type == "Cast" and _cast_to(n) == FLOAT}
    model = float16.convert_float_to_float16(model, keep_io_types=True)
    graph = model.graph

    retargeted = 0
    for node in graph.node:
        if node.name in exporter_casts and _cast_to(node) == FLOAT:
            for attr in node.attribute:
                if attr.name == "to":
                    attr.i = FLOAT16
            retargeted += 1

    # Output casts added by keep_io_types: fp16 tensor -> fp32 graph output.
    outputs = {o.name for o in graph.output}
    fp16_source = {}
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in outputs and _cast_to(node) == FLOAT:
            fp16_source[node.output[0]] = node.input[0]
    rewired = 0
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in fp16_source:
            continue
        for j, name in enumerate(node.input):
            if name in fp16_source:
                node.input[j] = fp16_source[name]
                rewired += 1

    # Drop stale fp32 value_info for retargeted Cast outputs; shape inference redoes it.
    del graph.value_info[:]
    model = onnx.shape_inference.infer_shapes(model)
    save_model(model, dst)
    return {"retargeted_casts": retargeted, "rewired_inputs": rewired}


# ---------------------------------------------------------------------------- checks


def rel_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / (denom if denom > 0 else 1.0))


def check_model(path: str) -> None:
    """onnx.checker with full shape inference; by path so models with external data work."""
    onnx.checker.check_model(path, full_check=True)


def verify(path: str, net: Net, tolerance: float) -> dict[str, float]:
    """Load in onnxruntime (CPU), run on the test shape and on the alternative shape, compare
    the first output with torch (relative L2). Raises on a mismatch or non-finite output."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # no per-initializer warnings for *_kiai models
    sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    declared = {o.name: o.shape for o in sess.get_outputs()}
    model_inputs = {i.name for i in sess.get_inputs()}
    result = {}
    shapes = [("test", net.test_shape)] + ([("alt", net.alt_shape)] if net.alt_shape else [])
    for label, shape in shapes:
        inputs = net.inputs(*shape)
        feeds = {k: v.numpy() for k, v in inputs.items() if k in model_inputs}
        outs = sess.run(None, feeds)
        with torch.no_grad():
            ref = net.module(*inputs.values())
        ref = ref if isinstance(ref, (tuple, list)) else (ref,)
        for name, got, want in zip(net.output_names, outs, ref):
            want = want.numpy()
            if got.shape != want.shape:
                raise AssertionError(f"{label} {name}: shape {got.shape} != torch {want.shape}")
            for dim, size in zip(declared[name], got.shape):
                if isinstance(dim, int) and dim != size:
                    raise AssertionError(
                        f"{label} {name}: shape {got.shape} != declared {declared[name]}"
                    )
            if not np.isfinite(got).all():
                raise AssertionError(f"{label} {name}: non-finite values")
        err = rel_l2(outs[0], ref[0].numpy())
        if not err <= tolerance:
            raise AssertionError(f"{label}: relative L2 {err:.3g} > {tolerance:g}")
        result[label] = err
    return result


def summarize(path: str) -> tuple[int, list[tuple[str, int]]]:
    """Top-level node count and the five most frequent op types."""
    model = onnx.load(path, load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    return len(model.graph.node), ops.most_common(5)


def write_shapes(path: str, net: Net, info: dict | None = None) -> None:
    """NAME.json next to NAME.onnx: concrete test shapes that resolve the dynamic dims
    ("inputs"), the Net's sidecar keys and `info` (exporter, opset, ...); and NAME.npz, the
    test inputs themselves (padded attention masks included: a tool's own random inputs
    usually use an all-ones mask, which would hide a fusion that drops the mask)."""
    inputs = net.inputs(*net.test_shape)
    lines = [f"    {json.dumps(k)}: {json.dumps(list(v.shape))}" for k, v in inputs.items()]
    extra = {**net.sidecar, **(info or {})}
    tail = "".join(f",\n  {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items())
    stem = os.path.splitext(path)[0]
    with open(stem + ".json", "w") as f:
        f.write('{\n  "inputs": {\n' + ",\n".join(lines) + "\n  }" + tail + "\n}\n")
    np.savez(stem + ".npz", **{k: v.numpy() for k, v in inputs.items()})


def model_info(path: str, exporter: str) -> dict:
    """What the corpus index shows: exporter, opset, attention layers (Softmax nodes, subgraphs
    included), main-graph nodes and bytes."""
    model = onnx.load(path, load_external_data=False)

    def softmaxes(graph: onnx.GraphProto) -> int:
        count = 0
        for node in graph.node:
            count += node.op_type == "Softmax"
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    count += softmaxes(attr.g)
        return count

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return {
        "exporter": exporter,
        "opset": opset,
        "layers": softmaxes(model.graph),
        "nodes": len(model.graph.node),
        "bytes": model_size(path),
    }


def _shapes_cell(inputs: dict[str, list[int]]) -> str:
    """'name [shape]' per input; per-layer inputs that differ only by their layer number and
    have one shape are shown once ('past_key_values.N.key x12 [1, 12, 128, 64]')."""
    groups: dict[tuple[str, str], int] = {}
    for name, shape in inputs.items():
        key = (re.sub(r"\.\d+\.", ".N.", name), str(shape))
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(
        f"{name}{f' x{n}' if n > 1 else ''} {shape}" for (name, shape), n in groups.items()
    )


def write_index(out_dir: str) -> str:
    """OUT_DIR/index.md: one row per NAME.onnx with a NAME.json (written by write_shapes),
    sorted by name. Returns the path."""
    rows = []
    for entry in sorted(os.listdir(out_dir)):
        stem, ext = os.path.splitext(entry)
        side = os.path.join(out_dir, stem + ".json")
        if ext != ".onnx" or not os.path.exists(side):
            continue
        with open(side) as f:
            meta = json.load(f)
        shapes = _shapes_cell(meta.get("inputs", {}))
        size = meta.get("bytes", os.path.getsize(os.path.join(out_dir, entry)))
        rows.append(
            f"| {stem} | {meta.get('exporter', '?')} | {meta.get('opset', '?')} | {shapes} "
            f"| {meta.get('layers', '?')} | {meta.get('nodes', '?')} | {size / 2**20:.1f} |"
        )
    path = os.path.join(out_dir, "index.md")
    head = [
        "# Models",
        "",
        "Written by examples/make_models.py (random weights from a config). layers: Softmax "
        "nodes in the export; inputs: the test shapes of NAME.json (NAME.npz holds the test "
        "inputs themselves).",
        "",
        "| name | exporter | opset | inputs (test shapes) | layers | nodes | MB |",
        "|---|---|---|---|---|---|---|",
    ]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(head + rows) + "\n")
    os.replace(tmp, path)
    return path

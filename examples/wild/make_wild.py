"""Build the "wild" corpus: ONNX models from exporters and packages graphopt was not tuned on.

    python examples/wild/make_wild.py --out DIR [--only NAME,NAME]

Runs in a separate export environment (a venv with torch, torchvision, ultralytics, transformers,
scikit-learn, skl2onnx, onnxconverter-common, onnxscript, paddlepaddle, paddle2onnx, silero-vad,
rapidocr-onnxruntime, magika, onnx, onnxruntime, numpy; see README.md). Each generator writes
DIR/<name>.onnx, a DIR/<name>.json sidecar (source, package and exporter versions, what the model
exercises) and, where random inputs would be meaningless (a sample rate, image sizes that must
be multiples of the stride), DIR/<name>.inputs.npz. A generator whose package is missing or
fails is skipped with a printed reason; the others go on. Nothing is downloaded: models are
built from configs with seeded random weights, or are the ONNX files shipped inside wheels.
The default output folder is $GRAPHOPT_WILD, else examples/wild/models.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
MAX_BYTES = 60 * 2**20


@dataclass
class Item:
    """One corpus model: a ModelProto built here or a file shipped by a package."""

    name: str
    exercises: str
    source: str
    packages: list[str]
    model: onnx.ModelProto | None = None
    path: Path | None = None
    feeds: dict[str, np.ndarray] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    tmp: Path


GENERATORS: dict[str, Callable[[Ctx], list[Item]]] = {}
MODELS: dict[str, tuple[str, ...]] = {}


def generator(name: str, *models: str) -> Callable:
    """Register a generator and the names of the models it writes (for --only NAME)."""

    def register(fn: Callable[[Ctx], list[Item]]) -> Callable[[Ctx], list[Item]]:
        GENERATORS[name] = fn
        MODELS[name] = models
        return fn

    return register


# ------------------------------------------------------------------------------- helpers


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def shipped(dist: str, rel: str) -> Path:
    """A file inside an installed distribution, found without importing the package."""
    if version(dist) is None:
        raise RuntimeError(f"package {dist} is not installed")
    path = Path(str(md.distribution(dist).locate_file(rel)))
    if not path.is_file():
        raise RuntimeError(f"{dist} {version(dist)} ships no {rel}")
    return path


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def seed_torch(name: str) -> None:
    import torch

    torch.manual_seed(zlib.crc32(name.encode()) & 0x7FFFFFFF)


@contextlib.contextmanager
def quiet() -> Any:
    """Exporters print pages of warnings; keep the corpus log readable."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def torchscript_export(module: Any, args: tuple, path: Path, names: tuple, axes: dict) -> None:
    import torch

    with quiet(), torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=list(names[0]),
            output_names=list(names[1]),
            dynamic_axes=axes,
        )


# --------------------------------------------------------------- 1. models shipped in wheels

SILERO = {
    "silero_vad": ("silero_vad.onnx", "spox-built: If on sr whose branches hold the net"),
    "silero_vad_op15": ("silero_vad_16k_op15.onnx", "TorchScript opset 15, 16 kHz, three Ifs"),
    "silero_vad_half": ("silero_vad_half.onnx", "the half variant: nested Ifs, Casts, no sr input"),
    "silero_vad_op18_ifless": ("silero_vad_op18_ifless.onnx", "opset 18, IR 10, If on sr"),
    "silero_vad_sequence": ("silero_vad_16k_sequence.onnx", "framed sequence input, LSTM"),
}


@generator("silero", *SILERO)
def gen_silero(ctx: Ctx) -> list[Item]:
    items = []
    for name, (fname, what) in SILERO.items():
        path = shipped("silero-vad", f"silero_vad/data/{fname}")
        feeds = silero_feeds(onnx.load(str(path), load_external_data=False))
        items.append(
            Item(
                name,
                f"Silero VAD as shipped: {what}; Identity-ending branches",
                f"silero-vad wheel: silero_vad/data/{fname}",
                ["silero-vad"],
                path=path,
                feeds=feeds,
            )
        )
    return items


def silero_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    names = [i.name for i in model.graph.input]
    feeds: dict[str, np.ndarray] = {}
    rng = rng_for("silero")
    if "sr" in names:
        feeds["sr"] = np.array(16000, dtype=np.int64)
    if "state" in names:
        feeds["state"] = np.zeros((2, 1, 128), np.float32)
    if "h" in names:
        feeds["h"] = np.zeros((1, 1, 128), np.float32)
        feeds["c"] = np.zeros((1, 1, 128), np.float32)
        feeds["input"] = rng.uniform(-0.5, 0.5, (4, 576)).astype(np.float32)
    else:
        feeds["input"] = rng.uniform(-0.5, 0.5, (1, 512)).astype(np.float32)
    return feeds


RAPIDOCR = {
    "ppocr_v4_det": (
        "ch_PP-OCRv4_det_infer.onnx",
        (1, 3, 96, 128),
        "text detection (DB), Resize, ConvTranspose",
    ),
    "ppocr_v4_rec": (
        "ch_PP-OCRv4_rec_infer.onnx",
        (1, 3, 48, 160),
        "text recognition (SVTR), MatMul attention, Softmax over 6625",
    ),
    "ppocr_v2_cls": (
        "ch_ppocr_mobile_v2.0_cls_infer.onnx",
        (1, 3, 48, 192),
        "direction classifier, BatchNormalization left unfolded",
    ),
}


@generator("rapidocr", *RAPIDOCR)
def gen_rapidocr(ctx: Ctx) -> list[Item]:
    items = []
    for name, (fname, shape, what) in RAPIDOCR.items():
        path = shipped("rapidocr-onnxruntime", f"rapidocr_onnxruntime/models/{fname}")
        x = rng_for(name).uniform(-1, 1, shape).astype(np.float32)
        items.append(
            Item(
                name,
                f"PaddleOCR via paddle2onnx, dims named p2o.DynamicDimension.*: {what}",
                f"rapidocr-onnxruntime wheel: rapidocr_onnxruntime/models/{fname}",
                ["rapidocr-onnxruntime"],
                path=path,
                feeds={"x": x},
            )
        )
    return items


@generator("magika", "magika_v3_3")
def gen_magika(ctx: Ctx) -> list[Item]:
    rel = "magika/models/standard_v3_3/model.onnx"
    path = shipped("magika", rel)
    data = rng_for("magika").integers(0, 257, (1, 2048)).astype(np.int32)
    return [
        Item(
            "magika_v3_3",
            "tf2onnx (Keras) export: int32 byte input, Expand/ReduceSum/Max, ai.onnx.ml opset "
            "import",
            f"magika wheel: {rel}",
            ["magika"],
            path=path,
            feeds={"bytes": data},
        )
    ]


# ------------------------------------------------------------------------------ 2. YOLO


@generator("yolo", "yolov8n_dynamic", "yolo11n_dynamic")
def gen_yolo(ctx: Ctx) -> list[Item]:
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_VERBOSE", "False")
    os.environ.setdefault("YOLO_CONFIG_DIR", str(ctx.tmp / "ultralytics"))
    from ultralytics import YOLO, settings

    settings.update({"sync": False})
    items = []
    for name, cfg in (("yolov8n_dynamic", "yolov8n.yaml"), ("yolo11n_dynamic", "yolo11n.yaml")):
        seed_torch(name)
        work = ctx.tmp / name
        work.mkdir()
        with chdir(work), quiet():
            out = YOLO(cfg).export(format="onnx", dynamic=True, simplify=False, imgsz=320, opset=17)
        x = rng_for(name).uniform(0, 1, (1, 3, 256, 320)).astype(np.float32)
        items.append(
            Item(
                name,
                f"ultralytics {cfg} (random weights) exported with dynamic=True: "
                "batch/height/width dims, DFL head, Split/Concat/Softmax; TorchScript exporter",
                f"ultralytics YOLO('{cfg}').export(format='onnx', dynamic=True, simplify=False)",
                ["ultralytics", "torch"],
                model=onnx.load(str(work / out)),
                feeds={"images": x},
            )
        )
    return items


@contextlib.contextmanager
def chdir(path: Path) -> Any:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


# ----------------------------------------------------------------------------- 3. paddle


@generator("paddle", "paddle_tiny_conv")
def gen_paddle(ctx: Ctx) -> list[Item]:
    """paddle2onnx aborts the whole process on a conversion error: export in a child process."""
    for dist in ("paddlepaddle", "paddle2onnx"):
        if version(dist) is None:
            raise RuntimeError(f"package {dist} is not installed")
    prefix = ctx.tmp / "paddle_tiny"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--paddle-export", str(prefix)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not Path(str(prefix) + ".onnx").exists():
        lines = [
            ln for ln in (proc.stdout + proc.stderr).splitlines() if "ERROR" in ln or "Error" in ln
        ]
        raise RuntimeError(
            f"paddle export exited {proc.returncode}: {(lines or ['no message'])[-1].strip()[:240]}"
        )
    x = rng_for("paddle").uniform(-1, 1, (1, 3, 64, 96)).astype(np.float32)
    return [
        Item(
            "paddle_tiny_conv",
            "paddle2onnx export of a conv/BN/Hardswish/depthwise/SE net with dynamic batch/H/W "
            "(no Upsample: paddle2onnx 2.1 with paddle 3.3 aborts on interpolate's scale "
            "attribute)",
            "paddle.onnx.export of a paddle.nn.Layer built here (random weights)",
            ["paddlepaddle", "paddle2onnx"],
            model=onnx.load(str(prefix) + ".onnx"),
            feeds={"x": x},
        )
    ]


def paddle_export(prefix: str) -> None:
    """Child-process side of gen_paddle: build the tiny net and write PREFIX.onnx."""
    import paddle
    from paddle import nn

    paddle.seed(zlib.crc32(b"paddle_tiny_conv") & 0x7FFFFFFF)

    class TinyNet(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2D(3, 16, 3, stride=2, padding=1), nn.BatchNorm2D(16), nn.Hardswish()
            )
            self.dw = nn.Sequential(
                nn.Conv2D(16, 16, 3, padding=1, groups=16), nn.BatchNorm2D(16), nn.ReLU()
            )
            self.pool = nn.AdaptiveAvgPool2D(1)
            self.se = nn.Sequential(
                nn.Conv2D(16, 8, 1), nn.ReLU(), nn.Conv2D(8, 16, 1), nn.Hardsigmoid()
            )
            self.head = nn.Conv2D(16, 2, 1)

        def forward(self, x):  # noqa: ANN001, ANN202
            y = self.dw(self.stem(x))
            y = y * self.se(self.pool(y))
            return nn.functional.sigmoid(self.head(y))

    net = TinyNet()
    net.eval()
    spec = [paddle.static.InputSpec(shape=[None, 3, None, None], dtype="float32", name="x")]
    with quiet():
        paddle.onnx.export(net, prefix, input_spec=spec, opset_version=13)


# --------------------------------------------------- 4./5. onnxruntime quantization, int4, fp8


class RandomReader:
    """A CalibrationDataReader over a few seeded random batches."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self.batches = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.batches, None)

    def rewind(self) -> None:  # the interface of onnxruntime's reader
        pass


def float_cnn(ctx: Ctx) -> Path:
    """torchvision mobilenet_v3_small, random weights, TorchScript exporter, opset 17."""
    path = ctx.tmp / "mnv3_small_fp32.onnx"
    if not path.exists():
        import torch
        import torchvision

        seed_torch("mnv3_small")
        m = torchvision.models.mobilenet_v3_small(weights=None).eval()
        x = torch.randn(1, 3, 224, 224)
        torchscript_export(
            m,
            (x,),
            path,
            (("input",), ("logits",)),
            {"input": {0: "batch"}, "logits": {0: "batch"}},
        )
    return path


def cnn_batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = rng_for("cnn_calibration")
    return [{"input": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(n)]


def float_bert(ctx: Ctx) -> Path:
    """transformers BertModel from a tiny config, random weights, TorchScript exporter."""
    path = ctx.tmp / "bert_hf_tiny_fp32.onnx"
    if not path.exists():
        import torch
        from transformers import BertConfig, BertModel

        seed_torch("bert_hf_tiny")
        cfg = BertConfig(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=128,
            attn_implementation="eager",
        )
        m = KwargsModule(
            BertModel(cfg).eval(),
            ("input_ids", "attention_mask", "token_type_ids"),
            ("last_hidden_state", "pooler_output"),
        )
        feeds = bert_feeds(1, 16)
        args = tuple(
            torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask", "token_type_ids")
        )
        dyn = {0: "batch", 1: "sequence"}
        names = (
            ("input_ids", "attention_mask", "token_type_ids"),
            ("last_hidden_state", "pooler_output"),
        )
        axes = {
            **dict.fromkeys(names[0], dyn),
            "last_hidden_state": dyn,
            "pooler_output": {0: "batch"},
        }
        torchscript_export(m, args, path, names, axes)
    return path


def KwargsModule(inner: Any, names: tuple, outs: tuple) -> Any:  # noqa: N802
    """Wrap a module whose forward takes keywords (transformers) for the tracing exporter."""
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args):  # noqa: ANN002, ANN202
            res = self.inner(**dict(zip(names, args, strict=True)))
            return tuple(getattr(res, k) for k in outs)

    return Wrapped().eval()


def bert_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }


def preprocessed(src: Path, ctx: Ctx) -> Path:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    dst = src.with_name(src.stem + ".pre.onnx")
    if not dst.exists():
        # onnxruntime's symbolic shape inference leaves temporary files in the working folder
        with quiet(), chdir(ctx.tmp):
            try:
                quant_pre_process(str(src), str(dst), skip_symbolic_shape=False)
            except Exception as exc:  # symbolic inference gives up on some exports (BERT's masks)
                print(
                    f"  {src.stem}: quant_pre_process without symbolic shapes ({exc})",
                    file=sys.stderr,
                )
                quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)
    return dst


QUANT_WHAT = {
    "qdq": "static int8 QDQ per-channel (QuantizeLinear/DequantizeLinear pairs around every op)",
    "qop": "static int8 QOperator (QLinearConv/QLinearMatMul/QLinearAdd..., contrib QLinear*)",
    "dyn": "dynamic int8 (DynamicQuantizeLinear + MatMulInteger/ConvInteger)",
}


def quantize_three(
    ctx: Ctx, base: Item, batches: list, qop_types: list[str] | None = None
) -> list[Item]:
    """QDQ per-channel, QOperator and dynamic int8 models of ``src``; ``qop_types`` limits the
    op types of the QOperator model (None: every op the quantizer knows)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    src = ctx.tmp / f"{base.name}.onnx"
    pre = preprocessed(src, ctx)
    stem = base.name.removesuffix("_fp32")
    items = []
    for kind in ("qdq", "qop", "dyn"):
        dst = ctx.tmp / f"{stem}_{kind}.onnx"
        with quiet():
            if kind == "dyn":
                quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8)
            else:
                fmt = QuantFormat.QDQ if kind == "qdq" else QuantFormat.QOperator
                types = qop_types if kind == "qop" else None
                quantize_static(
                    str(pre),
                    str(dst),
                    RandomReader(list(batches)),
                    quant_format=fmt,
                    per_channel=kind == "qdq",
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    op_types_to_quantize=types,
                )
        extra = {"op_types_to_quantize": qop_types} if kind == "qop" and qop_types else {}
        items.append(
            Item(
                f"{stem}_int8_{kind}",
                f"onnxruntime.quantization {QUANT_WHAT[kind]} of {base.name}",
                f"onnxruntime.quantization on {base.name} after quant_pre_process",
                ["onnxruntime", *base.packages],
                model=onnx.load(str(dst)),
                feeds=batches[0],
                extra=extra,
            )
        )
    return items


@generator("quant_cnn", "mnv3_small_fp32", *(f"mnv3_small_int8_{k}" for k in QUANT_WHAT))
def gen_quant_cnn(ctx: Ctx) -> list[Item]:
    src = float_cnn(ctx)
    batches = cnn_batches(4)
    base = Item(
        "mnv3_small_fp32",
        "torchvision mobilenet_v3_small (random weights), TorchScript exporter opset 17: "
        "Hardswish/Hardsigmoid, SE blocks, dynamic batch",
        "torch.onnx.export(dynamo=False) of torchvision.models.mobilenet_v3_small(weights=None)",
        ["torch", "torchvision"],
        model=onnx.load(str(src)),
        feeds=batches[0],
    )
    return [base, *quantize_three(ctx, base, batches)]


@generator("quant_bert", "bert_hf_tiny_fp32", *(f"bert_hf_tiny_int8_{k}" for k in QUANT_WHAT))
def gen_quant_bert(ctx: Ctx) -> list[Item]:
    src = float_bert(ctx)
    batches = [bert_feeds(1, 16, seed) for seed in range(4)]
    base = Item(
        "bert_hf_tiny_fp32",
        "transformers BertModel (tiny config, eager attention, random weights), TorchScript "
        "exporter opset 17, dynamic batch/sequence",
        "torch.onnx.export(dynamo=False) of transformers.BertModel(BertConfig(hidden 128, 2 "
        "layers))",
        ["transformers", "torch"],
        model=onnx.load(str(src)),
        feeds=batches[0],
    )
    # QOperator over every op gives LayerNormalization uint8 weights that onnxruntime refuses
    # to load (onnxruntime 1.32): quantize the linear layers only, as deployments do.
    return [base, *quantize_three(ctx, base, batches, qop_types=["MatMul", "Gemm"])]


@generator(
    "int4",
    "bert_hf_tiny_int4_matmulnbits",
    "bert_hf_tiny_int4_qdq",
    "int4_block_dq_helper",
    "fp8_dq_helper",
)
def gen_int4(ctx: Ctx) -> list[Item]:
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)

    src = float_bert(ctx)
    items = []
    for kind, fmt in (("matmulnbits", QuantFormat.QOperator), ("qdq", QuantFormat.QDQ)):
        with quiet():
            q = MatMulNBitsQuantizer(
                onnx.load(str(src)), block_size=32, is_symmetric=True, quant_format=fmt
            )
            q.process()
        what = (
            "com.microsoft.MatMulNBits (4-bit, block 32)"
            if kind == "matmulnbits"
            else "blocked int4 DequantizeLinear (block_size 32, opset 21) feeding MatMul"
        )
        items.append(
            Item(
                f"bert_hf_tiny_int4_{kind}",
                f"onnxruntime MatMulNBitsQuantizer on the tiny BERT: {what}",
                f"MatMulNBitsQuantizer(block_size=32, quant_format={fmt.name})",
                ["onnxruntime", "transformers", "torch"],
                model=q.model.model,
                feeds=bert_feeds(1, 16),
            )
        )
    items.append(int4_block_dq())
    items.append(fp8_dq())
    return items


def mlp_graph(name: str, weight_nodes: list, x_dim: int, inits: list) -> onnx.GraphProto:
    """X[batch, x_dim] -> MatMul(W1 from weight_nodes) -> Relu -> MatMul(W2 float) -> Y."""
    rng = rng_for(name)
    w2 = numpy_helper.from_array(rng.standard_normal((64, 10)).astype(np.float32) * 0.1, "w2")
    nodes = [
        *weight_nodes,
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", x_dim])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    return helper.make_graph(nodes, name, [x], [y], [*inits, w2])


def int4_block_dq() -> Item:
    """Blocked int4 weights (opset 21 DequantizeLinear with block_size) built with onnx.helper."""
    rng = rng_for("int4_block_dq")
    k, n, block = 128, 64, 32
    q = rng.integers(-8, 8, (k, n)).astype(np.int8)
    scale = rng.uniform(0.005, 0.02, (k // block, n)).astype(np.float32)
    wq = helper.make_tensor("w1_q", TensorProto.INT4, [k, n], q.flatten().tolist())
    dq = helper.make_node(
        "DequantizeLinear", ["w1_q", "w1_scale"], ["w1"], axis=0, block_size=block
    )
    graph = mlp_graph("int4_block_dq", [dq], k, [wq, numpy_helper.from_array(scale, "w1_scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    feeds = {"x": rng.standard_normal((2, k)).astype(np.float32)}
    return Item(
        "int4_block_dq_helper",
        "opset 21 DequantizeLinear of an INT4 initializer with block_size=32 (axis 0) feeding "
        "MatMul",
        "onnx.helper, built here",
        ["onnx"],
        model=model,
        feeds=feeds,
    )


def fp8_dq() -> Item:
    """float8e4m3fn weight dequantized per tensor (opset 19), built with onnx.helper."""
    rng = rng_for("fp8_dq")
    w = (rng.standard_normal((128, 64)) * 4).astype(np.float32)
    wq = helper.make_tensor("w1_q", TensorProto.FLOAT8E4M3FN, [128, 64], w.flatten().tolist())
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "w1_scale")
    dq = helper.make_node("DequantizeLinear", ["w1_q", "w1_scale"], ["w1"])
    graph = mlp_graph("fp8_dq", [dq], 128, [wq, scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    feeds = {"x": rng.standard_normal((2, 128)).astype(np.float32)}
    return Item(
        "fp8_dq_helper",
        "opset 19 DequantizeLinear of a FLOAT8E4M3FN initializer (per-tensor scale) feeding MatMul",
        "onnx.helper, built here",
        ["onnx"],
        model=model,
        feeds=feeds,
    )


# ------------------------------------------------------------------------------- 6. IR 3


@generator("ir3", "ir3_convnet")
def gen_ir3(ctx: Ctx) -> list[Item]:
    rng = rng_for("ir3_convnet")

    def arr(
        name: str, shape: tuple, scale: float = 0.2, low: float | None = None
    ) -> onnx.TensorProto:
        a = rng.uniform(low, 1.0, shape) if low is not None else rng.standard_normal(shape) * scale
        return numpy_helper.from_array(a.astype(np.float32), name)

    inits = [
        arr("conv1.w", (8, 3, 3, 3)),
        arr("conv1.b", (8,)),
        arr("bn.scale", (8,), low=0.5),
        arr("bn.bias", (8,)),
        arr("bn.mean", (8,)),
        arr("bn.var", (8,), low=0.5),
        arr("fc.w", (10, 8 * 8 * 8), 0.05),
        arr("fc.b", (10,)),
    ]
    nodes = [
        helper.make_node(
            "Conv",
            ["data", "conv1.w", "conv1.b"],
            ["c1"],
            pads=[1, 1, 1, 1],
            strides=[2, 2],
            name="conv1",
        ),
        helper.make_node(
            "BatchNormalization",
            ["c1", "bn.scale", "bn.bias", "bn.mean", "bn.var"],
            ["b1"],
            epsilon=1e-5,
            name="bn1",
        ),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node(
            "MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"
        ),
        helper.make_node("Flatten", ["p1"], ["f1"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["f1", "fc.w", "fc.b"], ["fc"], transB=1, name="fc"),
        helper.make_node("Softmax", ["fc"], ["prob"], axis=1, name="softmax"),
    ]
    x = helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 32, 32])
    y = helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, 10])
    graph = helper.make_graph(nodes, "ir3_convnet", [x], [y], inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 8)],
        ir_version=3,
        producer_name="old-exporter",
    )
    return [
        Item(
            "ir3_convnet",
            "IR version 3, opset 8, initializers NOT listed as graph inputs (onnx.checker rejects"
            " it, onnxruntime accepts it): Conv/BN/Relu/MaxPool/Flatten/Gemm/Softmax",
            "onnx.helper, built here",
            ["onnx"],
            model=model,
        )
    ]


# --------------------------------------------------------------------- 7. local functions


def gelu_function() -> onnx.FunctionProto:
    nodes = [
        helper.make_node("Constant", [], ["half"], value_float=0.5),
        helper.make_node("Constant", [], ["one"], value_float=1.0),
        helper.make_node("Constant", [], ["rsqrt2"], value_float=float(1 / np.sqrt(2))),
        helper.make_node("Mul", ["X", "rsqrt2"], ["s"]),
        helper.make_node("Erf", ["s"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["X", "half"], ["xh"]),
        helper.make_node("Mul", ["xh", "e1"], ["Y"]),
    ]
    return helper.make_function("local", "Gelu", ["X"], ["Y"], nodes, [helper.make_opsetid("", 17)])


def block_function() -> onnx.FunctionProto:
    """MatMul -> local.Gelu -> MatMul -> scaled residual; `alpha` is an attribute reference."""
    alpha = helper.make_attribute_ref("value_float", onnx.AttributeProto.FLOAT)
    alpha.ref_attr_name = "alpha"
    const = helper.make_node("Constant", [], ["a"])
    const.attribute.append(alpha)
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h"]),
        helper.make_node("Gelu", ["h"], ["g"], domain="local"),
        helper.make_node("MatMul", ["g", "W2"], ["o"]),
        const,
        helper.make_node("Mul", ["o", "a"], ["oa"]),
        helper.make_node("Add", ["X", "oa"], ["Y"]),
    ]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    return helper.make_function(
        "local", "Block", ["X", "W1", "W2"], ["Y"], nodes, opsets, attributes=["alpha"]
    )


@generator("functions", "local_functions", "onnxscript_functions")
def gen_functions(ctx: Ctx) -> list[Item]:
    items = [helper_functions_model()]
    try:
        items.append(onnxscript_functions_model())
    except Exception as exc:  # one model of the pair may fail on its own
        print(f"skip onnxscript_functions: {type(exc).__name__}: {exc}", file=sys.stderr)
    return items


def helper_functions_model() -> Item:
    rng = rng_for("local_functions")
    d = 32
    inits = [
        numpy_helper.from_array((rng.standard_normal((d, 4 * d)) * 0.1).astype(np.float32), f"w{i}")
        for i in (1, 3)
    ]
    inits += [
        numpy_helper.from_array((rng.standard_normal((4 * d, d)) * 0.1).astype(np.float32), f"w{i}")
        for i in (2, 4)
    ]
    nodes = [
        helper.make_node(
            "Block", ["x", "w1", "w2"], ["b1"], domain="local", alpha=0.5, name="block0"
        ),
        helper.make_node(
            "Block", ["b1", "w3", "w4"], ["b2"], domain="local", alpha=0.25, name="block1"
        ),
        helper.make_node("Gelu", ["b2"], ["y"], domain="local", name="gelu_out"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", d])
    graph = helper.make_graph(nodes, "local_functions", [x], [y], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    model = helper.make_model(
        graph, opset_imports=opsets, functions=[gelu_function(), block_function()], ir_version=8
    )
    return Item(
        "local_functions",
        "model-local functions in domain 'local': a Block function (with an attribute reference) "
        "calling a nested erf-GELU function; only the functions hold the compute",
        "onnx.helper.make_function, built here",
        ["onnx"],
        model=model,
    )


def onnxscript_functions_model() -> Item:
    """Functions written and compiled by onnxscript (FunctionProtos in domain custom.fns) that
    the main graph calls; the graph itself is assembled with onnx.helper."""
    from onnxscript import opset18 as op
    from onnxscript import script
    from onnxscript.values import Opset

    custom = Opset("custom.fns", 1)

    @script(custom)
    def Swish(x):  # noqa: ANN001, ANN202, N802
        return op.Mul(x, op.Sigmoid(x))

    @script(custom)
    def RmsNorm(x, g):  # noqa: ANN001, ANN202, N802
        ms = op.ReduceMean(op.Mul(x, x), op.Constant(value_ints=[-1]), keepdims=1)
        return op.Mul(op.Div(x, op.Sqrt(op.Add(ms, op.Constant(value_float=1e-6)))), g)

    rng = rng_for("onnxscript_functions")
    inits = [
        numpy_helper.from_array((rng.standard_normal((24, 24)) * 0.2).astype(np.float32), "w"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 24).astype(np.float32), "g"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Swish", ["h"], ["s"], domain="custom.fns"),
        helper.make_node("RmsNorm", ["s", "g"], ["y"], domain="custom.fns"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 24])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 24])
    graph = helper.make_graph(nodes, "onnxscript_functions", [x], [y], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("custom.fns", 1)]
    functions = [Swish.to_function_proto(), RmsNorm.to_function_proto()]
    model = helper.make_model(graph, opset_imports=opsets, functions=functions, ir_version=8)
    return Item(
        "onnxscript_functions",
        "model-local functions compiled by onnxscript (custom.fns Swish, RmsNorm with a Constant "
        "value_ints axes) called from the main graph",
        "onnxscript @script(Opset('custom.fns', 1)).to_function_proto() + onnx.helper",
        ["onnxscript"],
        model=model,
    )


# --------------------------------------------------------------------------- 8. skl2onnx


@generator("sklearn", "sklearn_logreg_zipmap", "sklearn_forest_nozipmap")
def gen_sklearn(ctx: Ctx) -> list[Item]:
    from skl2onnx import to_onnx
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    rng = rng_for("sklearn")
    x = rng.standard_normal((300, 6)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] - x[:, 2] > 0).astype(np.int64) + (x[:, 3] > 1)
    logreg = Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(max_iter=500))]).fit(
        x, y
    )
    forest = Pipeline(
        [
            ("scale", StandardScaler()),
            ("clf", RandomForestClassifier(n_estimators=8, max_depth=4, random_state=0)),
        ]
    ).fit(x, y)
    pkgs = ["skl2onnx", "scikit-learn"]
    with quiet():
        zipmapped = to_onnx(logreg, x[:1], target_opset={"": 17, "ai.onnx.ml": 3})
        flat = to_onnx(
            forest, x[:1], target_opset={"": 17, "ai.onnx.ml": 3}, options={"zipmap": False}
        )
    return [
        Item(
            "sklearn_logreg_zipmap",
            "skl2onnx Pipeline(StandardScaler, LogisticRegression), default ZipMap: output is a "
            "sequence of maps; ai.onnx.ml Scaler/LinearClassifier/Normalizer",
            "skl2onnx.to_onnx",
            pkgs,
            model=zipmapped,
        ),
        Item(
            "sklearn_forest_nozipmap",
            "skl2onnx Pipeline(StandardScaler, RandomForestClassifier) with zipmap=False: "
            "ai.onnx.ml TreeEnsembleClassifier, int64 label + float probabilities",
            "skl2onnx.to_onnx(options={'zipmap': False})",
            pkgs,
            model=flat,
        ),
    ]


# ------------------------------------------------------------------------ 9. VAD-like, hand-built


@generator("vadlike", "vadlike_if_loop")
def gen_vadlike(ctx: Ctx) -> list[Item]:
    rng = rng_for("vadlike")
    hid = 48
    outer: list[onnx.TensorProto] = []  # initializers the else branch reads from outer scope
    graph = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], ["sr16k"], value=numpy_helper.from_array(np.array(16000, np.int64))
            ),
            helper.make_node("Equal", ["rate", "sr16k"], ["is16k"]),
            helper.make_node(
                "If",
                ["is16k"],
                ["probs", "state_out"],
                then_branch=vad_branch("wide", 256, 128, hid, rng, None),
                else_branch=vad_branch("narrow", 128, 64, hid, rng, outer),
                name="rate_switch",
            ),
        ],
        "vadlike",
        [
            helper.make_tensor_value_info("pcm", TensorProto.FLOAT, ["n", "samples"]),
            helper.make_tensor_value_info("rate", TensorProto.INT64, []),
            helper.make_tensor_value_info("state_in", TensorProto.FLOAT, [2, "n", hid]),
        ],
        [
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["n", "frames"]),
            helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [2, "n", hid]),
        ],
        outer,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8, producer_name="vadlike"
    )
    feeds = {
        "pcm": rng.uniform(-0.5, 0.5, (1, 4096)).astype(np.float32),
        "rate": np.array(16000, np.int64),
        "state_in": np.zeros((2, 1, hid), np.float32),
    }
    return [
        Item(
            "vadlike_if_loop",
            "hand-built Silero-like: If on the sample rate; each branch = strided Conv front end "
            "+ Loop running an LSTM-like cell over frames, ending in Identity nodes; one branch "
            "keeps its weights as Constant nodes inside, the other reads outer-scope "
            "initializers; state in/out, dynamic dims",
            "onnx.helper, built here",
            ["onnx"],
            model=model,
            feeds=feeds,
        )
    ]


def vad_branch(
    tag: str, win: int, hop: int, hid: int, rng: np.random.Generator, outer: list | None
) -> onnx.GraphProto:
    """One If branch; its weights are Constant nodes inside, or (``outer`` given) initializers
    appended to ``outer`` for the main graph, which the branch and its Loop body read."""
    feat = 24
    weights = {
        f"{tag}_frontend": rng.standard_normal((feat, 1, win)).astype(np.float32) * 0.05,
        f"{tag}_mix": rng.standard_normal((feat, feat, 1)).astype(np.float32) * 0.2,
        f"{tag}_gates": rng.standard_normal((feat + hid, 4 * hid)).astype(np.float32) * 0.1,
        f"{tag}_gate_bias": rng.standard_normal(4 * hid).astype(np.float32) * 0.1,
        f"{tag}_readout": rng.standard_normal((hid, 1)).astype(np.float32) * 0.2,
    }
    consts = []
    for k, v in weights.items():
        if outer is None:
            consts.append(
                helper.make_node(
                    "Constant", [], [k], value=numpy_helper.from_array(v, k + "_value")
                )
            )
        else:
            outer.append(numpy_helper.from_array(v, k))
    c = f"{tag}_"
    nodes = [
        *consts,
        helper.make_node("Unsqueeze", ["pcm", c + "ax1"], [c + "pcm3"]),
        helper.make_node("Conv", [c + "pcm3", f"{tag}_frontend"], [c + "spec"], strides=[hop]),
        helper.make_node("Abs", [c + "spec"], [c + "mag"]),
        helper.make_node("Conv", [c + "mag", f"{tag}_mix"], [c + "mixed"]),
        helper.make_node("Relu", [c + "mixed"], [c + "feats"]),
        helper.make_node("Shape", [c + "feats"], [c + "fshape"], start=2, end=3),
        helper.make_node("Squeeze", [c + "fshape"], [c + "frames"]),
        helper.make_node("Gather", ["state_in", c + "zero"], [c + "h0"], axis=0),
        helper.make_node("Gather", ["state_in", c + "one"], [c + "c0"], axis=0),
        helper.make_node(
            "Loop",
            [c + "frames", "", c + "h0", c + "c0"],
            [c + "hT", c + "cT", c + "steps"],
            body=lstm_body(tag, hid),
        ),
        helper.make_node("Squeeze", [c + "steps", c + "ax2"], [c + "tb"]),
        helper.make_node("Transpose", [c + "tb"], [c + "bt"], perm=[1, 0]),
        helper.make_node("Unsqueeze", [c + "hT", c + "ax0"], [c + "h1"]),
        helper.make_node("Unsqueeze", [c + "cT", c + "ax0"], [c + "c1"]),
        helper.make_node("Concat", [c + "h1", c + "c1"], [c + "state"], axis=0),
        helper.make_node("Identity", [c + "bt"], [c + "probs"]),
        helper.make_node("Identity", [c + "state"], [c + "state_out"]),
    ]
    small = {"ax0": [0], "ax1": [1], "ax2": [2]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), c + k) for k, v in small.items()]
    inits += [
        numpy_helper.from_array(np.array(i, np.int64), c + k) for k, i in (("zero", 0), ("one", 1))
    ]
    outs = [
        helper.make_tensor_value_info(c + "probs", TensorProto.FLOAT, None),
        helper.make_tensor_value_info(c + "state_out", TensorProto.FLOAT, None),
    ]
    return helper.make_graph(nodes, f"{tag}_branch", [], outs, inits)


def lstm_body(tag: str, hid: int) -> onnx.GraphProto:
    c = f"{tag}_b_"
    nodes = [
        helper.make_node("Gather", [f"{tag}_feats", "t"], [c + "x"], axis=2),
        helper.make_node("Concat", [c + "x", "h"], [c + "xh"], axis=1),
        helper.make_node("MatMul", [c + "xh", f"{tag}_gates"], [c + "mm"]),
        helper.make_node("Add", [c + "mm", f"{tag}_gate_bias"], [c + "gates"]),
        helper.make_node("Split", [c + "gates"], [c + "i", c + "f", c + "g", c + "o"], axis=1),
        helper.make_node("Sigmoid", [c + "i"], [c + "si"]),
        helper.make_node("Sigmoid", [c + "f"], [c + "sf"]),
        helper.make_node("Tanh", [c + "g"], [c + "tg"]),
        helper.make_node("Sigmoid", [c + "o"], [c + "so"]),
        helper.make_node("Mul", [c + "sf", "cell"], [c + "fc"]),
        helper.make_node("Mul", [c + "si", c + "tg"], [c + "ig"]),
        helper.make_node("Add", [c + "fc", c + "ig"], ["cell_next"]),
        helper.make_node("Tanh", ["cell_next"], [c + "tc"]),
        helper.make_node("Mul", [c + "so", c + "tc"], ["h_next"]),
        helper.make_node("MatMul", ["h_next", f"{tag}_readout"], [c + "logit"]),
        helper.make_node("Sigmoid", [c + "logit"], ["prob"]),
        helper.make_node("Identity", ["cond"], ["cond_out"]),
    ]
    ins = [
        helper.make_tensor_value_info("t", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", hid]),
        helper.make_tensor_value_info("cell", TensorProto.FLOAT, ["n", hid]),
    ]
    outs = [
        helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info("h_next", TensorProto.FLOAT, ["n", hid]),
        helper.make_tensor_value_info("cell_next", TensorProto.FLOAT, ["n", hid]),
        helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["n", 1]),
    ]
    return helper.make_graph(nodes, f"{tag}_cell", ins, outs)


# --------------------------------------------------------------------- 10. dynamo, fp16


@generator("dynamo", "resnet18_dynamo")
def gen_dynamo(ctx: Ctx) -> list[Item]:
    import torch
    import torchvision

    seed_torch("resnet18_dynamo")
    m = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 224, 224)
    path = ctx.tmp / "resnet18_dynamo.onnx"
    batch = torch.export.Dim("batch", min=1, max=64)
    with quiet(), torch.no_grad():
        prog = torch.onnx.export(
            m,
            (x,),
            dynamo=True,
            dynamic_shapes={"x": {0: batch}},
            input_names=["input"],
            output_names=["logits"],
        )
        prog.save(str(path))
    feeds = {"input": rng_for("resnet18").standard_normal((1, 3, 224, 224)).astype(np.float32)}
    return [
        Item(
            "resnet18_dynamo",
            "torchvision resnet18 (random weights) through torch.onnx.export(dynamo=True): "
            "torch.export + onnxscript, dynamic batch",
            "torch.onnx.export(dynamo=True) of torchvision.models.resnet18(weights=None)",
            ["torch", "torchvision", "onnxscript"],
            model=onnx.load(str(path)),
            feeds=feeds,
        )
    ]


@generator("fp16", "mnv3_small_fp16")
def gen_fp16(ctx: Ctx) -> list[Item]:
    from onnxconverter_common import float16

    src = onnx.load(str(float_cnn(ctx)))
    with quiet():
        half = float16.convert_float_to_float16(src, keep_io_types=True)
    return [
        Item(
            "mnv3_small_fp16",
            "onnxconverter_common float16 conversion (keep_io_types=True) of mobilenet_v3_small: "
            "fp16 weights, Casts at the float32 I/O",
            "onnxconverter_common.float16.convert_float_to_float16",
            ["onnxconverter-common", "torch", "torchvision"],
            model=half,
            feeds=cnn_batches(1)[0],
        )
    ]


# ---------------------------------------------------------------------------- writing


def write_item(item: Item, out: Path) -> dict[str, Any]:
    dst = out / f"{item.name}.onnx"
    if item.path is not None:
        shutil.copyfile(item.path, dst)
    else:
        onnx.save(item.model, str(dst))
    size = dst.stat().st_size
    if size > MAX_BYTES:
        dst.unlink()
        raise RuntimeError(f"{size / 2**20:.0f} MB is over the corpus limit")
    model = onnx.load(str(dst), load_external_data=False)
    feeds, ort_status = check_feeds(dst, item.feeds)
    meta = {
        "name": item.name,
        "source": item.source,
        "exercises": item.exercises,
        "packages": {p: version(p) for p in item.packages},
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "ir_version": model.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "nodes": len(model.graph.node),
        "bytes": size,
        "inputs": None,
        "onnxruntime": ort_status,
        **item.extra,
    }
    if feeds:
        np.savez(out / f"{item.name}.inputs.npz", **feeds)
        meta["inputs"] = f"{item.name}.inputs.npz"
    (out / f"{item.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def check_feeds(path: Path, feeds: dict | None) -> tuple[dict | None, str]:
    """Load the written model in onnxruntime and run it on its inputs, if any."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        return feeds, f"session failed: {str(exc).splitlines()[0][:200]}"
    if not feeds:
        return None, "session ok"
    try:
        sess.run(None, feeds)
    except Exception as exc:
        print(
            f"  {path.stem}: its inputs do not run, dropped: {str(exc).splitlines()[0][:160]}",
            file=sys.stderr,
        )
        return None, f"run failed: {str(exc).splitlines()[0][:200]}"
    return feeds, "runs"


def default_out() -> Path:
    return Path(os.environ.get("GRAPHOPT_WILD") or HERE / "models")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=default_out(),
        help="output folder (default: $GRAPHOPT_WILD or examples/wild/models)",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated generator or model names (" + ",".join(GENERATORS) + ")",
    )
    ap.add_argument("--list", action="store_true", help="print the generators and exit")
    ap.add_argument("--paddle-export", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.paddle_export:
        paddle_export(args.paddle_export)
        return 0
    if args.list:
        print("\n".join(GENERATORS))
        return 0
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    args.out.mkdir(parents=True, exist_ok=True)
    written, skipped = 0, 0
    for gen_name in GENERATORS:
        if wanted(gen_name, only):
            w, k = run_generator(gen_name, only, args.out)
            written, skipped = written + w, skipped + k
    print(f"{written} models written to {args.out}, {skipped} skipped")
    return 0 if written else 1


def run_generator(gen_name: str, only: set[str], out: Path) -> tuple[int, int]:
    """Run one generator and write its models; returns (written, skipped)."""
    written, skipped = 0, 0
    with tempfile.TemporaryDirectory(prefix=f"wild-{gen_name}-") as tmp:
        try:
            items = GENERATORS[gen_name](Ctx(Path(tmp)))
        except Exception as exc:
            print(f"skip {gen_name}: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
            if os.environ.get("GRAPHOPT_WILD_DEBUG"):
                traceback.print_exc()
            return 0, 1
        for item in items:
            if only and gen_name not in only and item.name not in only:
                continue
            try:
                meta = write_item(item, out)
            except Exception as exc:
                skipped += 1
                print(f"skip {item.name}: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
                continue
            written += 1
            size = meta["bytes"] / 2**20
            nodes, ort_status = meta["nodes"], meta["onnxruntime"]
            print(f"wrote {item.name}.onnx  {nodes:4d} nodes  {size:6.2f} MB  {ort_status}")
    return written, skipped


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:240] if lines else ""


def wanted(gen_name: str, only: set[str]) -> bool:
    return not only or gen_name in only or any(m in only for m in MODELS[gen_name])


if __name__ == "__main__":
    sys.exit(main())

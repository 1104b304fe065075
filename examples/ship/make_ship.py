"""Build the "ship" corpus: real exports of the model classes a default run must ship as they are.

    python examples/ship/make_ship.py --out DIR [--only NAME,NAME]

Runs in an export environment (torch, torchvision, transformers, onnx, onnxruntime). Every model
is built from an architecture or config with seeded random weights; nothing is downloaded. Each
class is one way a default run used to fail on models nobody here exported:

* ``maskrcnn``, ``fasterrcnn_mobilenet``: torchvision detectors (RoiAlign, NMS, TopK, Loop-free
  postprocessing) whose own outputs move between onnxruntime's session levels (near-ties);
* ``roberta_dyn``, ``wav2vec2_dyn``: transformers encoders quantized with ``quantize_dynamic``
  (DynamicQuantizeLinear picks its scale from the data);
* ``efficientnet_b0``: an ill-conditioned CNN with random weights;
* ``gpt2_tied``: a decoder whose LM head reads the token embedding (``MatMul(x, Transpose(wte))``,
  exported without constant folding);
* ``gpt2_fp16_unsorted``: the same decoder converted by onnxruntime's float16 converter, nodes
  not topologically sorted;
* ``swinv2``: Swin v2's continuous position bias (a constant MLP cone);
* ``sklearn_forest``, ``lightgbm``: tree ensembles (ai.onnx.ml), which cuda runs on the CPU.

Then ``python examples/wild/run_wild.py DIR --targets cpu,cuda`` tables the default runs.
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from pathlib import Path

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from export_utils import quiet_warnings, seed_all, seed_for  # noqa: E402

GENERATORS = {}


def generator(fn):
    GENERATORS[fn.__name__.removeprefix("gen_")] = fn
    return fn


def export(
    module,
    args: tuple,
    path: Path,
    inputs: list[str],
    outputs: list[str],
    axes=None,
    folding: bool = True,
    opset: int = 17,
) -> None:
    module.eval()
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes or {},
            opset_version=opset,
            do_constant_folding=folding,
            dynamo=False,
        )


class Named(torch.nn.Module):
    """Call a transformers model with keyword inputs; return the named outputs as a tuple."""

    def __init__(self, model, names, outs, **extra):
        super().__init__()
        self.model, self.names, self.outs, self.extra = model, names, outs, extra

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args)), **self.extra)
        return tuple(out[k] for k in self.outs)


def save_inputs(path: Path, feeds: dict[str, np.ndarray]) -> None:
    np.savez(path.with_suffix(".inputs.npz"), **feeds)


# ------------------------------------------------------------------------ detectors
def _detector(builder, path: Path, size: int) -> None:
    model = builder(
        weights=None,
        weights_backbone=None,
        num_classes=5,
        min_size=size,
        max_size=size,
        box_score_thresh=0.0,
    )
    image = torch.rand(3, size, size)
    export(model, ([image],), path, ["image"], None, opset=17)
    save_inputs(path, {"image": image.numpy()})


@generator
def gen_maskrcnn(out: Path) -> None:
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    _detector(maskrcnn_resnet50_fpn, out / "maskrcnn.onnx", 256)


@generator
def gen_fasterrcnn_mobilenet(out: Path) -> None:
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    _detector(fasterrcnn_mobilenet_v3_large_320_fpn, out / "fasterrcnn_mobilenet.onnx", 320)


# ------------------------------------------------------------------------ dynamic int8
def _quantize(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    src.unlink()


@generator
def gen_roberta_dyn(out: Path) -> None:
    from transformers import RobertaConfig, RobertaModel

    cfg = RobertaConfig(
        vocab_size=2000,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=130,
    )
    model = RobertaModel(cfg)
    ids = torch.randint(3, 2000, (1, 64))
    mask = torch.ones(1, 64, dtype=torch.int64)
    fp = out / "roberta_fp32.onnx"
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    export(
        Named(model, ["input_ids", "attention_mask"], ["last_hidden_state"]),
        (ids, mask),
        fp,
        ["input_ids", "attention_mask"],
        ["last_hidden_state"],
        axes,
    )
    _quantize(fp, out / "roberta_dyn.onnx")
    save_inputs(
        out / "roberta_dyn.onnx", {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    )


@generator
def gen_wav2vec2_dyn(out: Path) -> None:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    cfg = Wav2Vec2Config(
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=768,
        conv_dim=(64, 64, 64, 64, 64, 64, 64),
        num_feat_extract_layers=7,
    )
    model = Wav2Vec2Model(cfg)
    audio = torch.randn(1, 16000) * 0.1
    fp = out / "wav2vec2_fp32.onnx"
    export(
        Named(model, ["input_values"], ["last_hidden_state"]),
        (audio,),
        fp,
        ["input_values"],
        ["last_hidden_state"],
        {"input_values": {0: "batch", 1: "samples"}},
    )
    _quantize(fp, out / "wav2vec2_dyn.onnx")
    save_inputs(out / "wav2vec2_dyn.onnx", {"input_values": audio.numpy()})


# ------------------------------------------------------------------------ CNN
@generator
def gen_efficientnet_b0(out: Path) -> None:
    from torchvision.models import efficientnet_b0

    model = efficientnet_b0(weights=None)
    for m in model.modules():  # random running statistics: an ill-conditioned net
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.2, 2.0)
    x = torch.randn(1, 3, 224, 224)
    export(model, (x,), out / "efficientnet_b0.onnx", ["input"], ["logits"])


# ------------------------------------------------------------------------ decoders
def _gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=8000,
        n_positions=256,
        n_embd=256,
        n_layer=layers,
        n_head=4,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg)


TEXT = ["input_ids", "attention_mask"]
TEXT_AXES = {n: {0: "batch", 1: "sequence"} for n in TEXT}


def _text_feeds(vocab: int, seq: int = 32) -> tuple:
    return torch.randint(0, vocab, (1, seq)), torch.ones(1, seq, dtype=torch.int64)


@generator
def gen_gpt2_tied(out: Path) -> None:
    model = _gpt2()
    feeds = _text_feeds(8000)
    export(
        Named(model, TEXT, ["logits"], use_cache=False),
        feeds,
        out / "gpt2_tied.onnx",
        TEXT,
        ["logits"],
        TEXT_AXES,
        folding=False,
    )
    save_inputs(out / "gpt2_tied.onnx", dict(zip(TEXT, (f.numpy() for f in feeds))))


@generator
def gen_gpt2_fp16_unsorted(out: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = _gpt2()
    feeds = _text_feeds(8000)
    fp = out / "gpt2_fp32_tmp.onnx"
    export(Named(model, TEXT, ["logits"], use_cache=False), feeds, fp, TEXT, ["logits"], TEXT_AXES)
    half = convert_float_to_float16(onnx.load(fp), keep_io_types=True)
    nodes = list(half.graph.node)
    random.Random(0).shuffle(nodes)  # the converter's appended Casts, and more: not sorted
    del half.graph.node[:]
    half.graph.node.extend(nodes)
    onnx.save(half, out / "gpt2_fp16_unsorted.onnx")
    fp.unlink()
    save_inputs(out / "gpt2_fp16_unsorted.onnx", dict(zip(TEXT, (f.numpy() for f in feeds))))


# ------------------------------------------------------------------------ Swin v2
@generator
def gen_swinv2(out: Path) -> None:
    from transformers import Swinv2Config, Swinv2Model

    cfg = Swinv2Config(
        image_size=128,
        patch_size=4,
        embed_dim=48,
        depths=[2, 2, 2],
        num_heads=[2, 4, 8],
        window_size=8,
    )
    model = Swinv2Model(cfg)
    x = torch.randn(1, 3, 128, 128)
    export(
        Named(model, ["pixel_values"], ["last_hidden_state"]),
        (x,),
        out / "swinv2.onnx",
        ["pixel_values"],
        ["last_hidden_state"],
    )


# ------------------------------------------------------------------------ tree ensembles
def _tabular(n: int = 256, features: int = 8):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return x, y


@generator
def gen_sklearn_forest(out: Path) -> None:
    from skl2onnx import to_onnx
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = _tabular()
    model = make_pipeline(StandardScaler(), RandomForestClassifier(n_estimators=20, max_depth=6))
    model.fit(x, y)
    onx = to_onnx(model, x[:1], options={"zipmap": False}, target_opset={"": 17, "ai.onnx.ml": 3})
    onnx.save(onx, out / "sklearn_forest.onnx")
    save_inputs(out / "sklearn_forest.onnx", {"X": x[:16]})


@generator
def gen_lightgbm(out: Path) -> None:
    import lightgbm
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType

    x, y = _tabular()
    model = lightgbm.LGBMRegressor(n_estimators=30, num_leaves=15, verbose=-1).fit(x, y)
    onx = convert_lightgbm(
        model, initial_types=[("input", FloatTensorType([None, x.shape[1]]))], target_opset=15
    )
    onnx.save(onx, out / "lightgbm.onnx")
    save_inputs(out / "lightgbm.onnx", {"input": x[:16]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    quiet_warnings()
    only = {n for n in args.only.split(",") if n}
    failed = 0
    for name, gen in GENERATORS.items():
        if only and name not in only:
            continue
        seed_all(seed_for(name))
        try:
            gen(args.out)
            print(f"wrote {name}")
        except Exception:  # noqa: BLE001 - one class failing does not stop the others
            failed += 1
            print(f"skipped {name}:\n{traceback.format_exc(limit=3)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

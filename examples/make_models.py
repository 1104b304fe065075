"""Regenerate the corpus of real-architecture ONNX models (not committed).

    .venv-torch/bin/python examples/make_models.py --out models \
        [--only NAME,...] [--list]

Every model is built from an architecture or config with seeded random weights (nothing is
downloaded) and written as OUT/NAME.onnx (one external-data file only past 2 GB), with
OUT/NAME.json = {"inputs": {name: shape}, ...} giving concrete test shapes for the dynamic dims
(plus the exporter, opset, Softmax count as "layers", node count, bytes and, for transformers
onnxruntime's optimizer knows, "model_type"/"num_heads"/"hidden_size"), and OUT/NAME.npz holding
the test inputs themselves. OUT/index.md lists every model of the folder and is rewritten after
each one. Each model passes onnx.checker, loads in onnxruntime (CPU) and is compared with torch on
the test shape and on a second shape that exercises the dynamic axes. Each model is made in its
own process; a model that fails is reported and the others go on; the exit code is 1 if any failed.

Text models get an attention mask whose row 0 is half padding at every batch size (the trace and
the test inputs both see zeros; an all-ones mask can be folded away). Decoder steps with a KV
cache (gpt2_kv, whisper_tiny_decoder) take past_key_values.I.key/value [batch, heads, past,
head_dim] and return logits and present.I.key/value; their test shape is one new token over a
past of 128, the export and second shapes use 4 new tokens (so the causal mask is traced).

Unless stated otherwise: TorchScript exporter (dynamo=False), opset 17. CNNs with BatchNorm keep
their BatchNormalization nodes (non-trivial running statistics). Variants share their base
model's weights: *_fp16 (onnxconverter-common, keep_io_types, repaired so onnxruntime loads it),
*_dynamo (dynamo=True, opset 18), *_kiai (keep_initializers_as_inputs=True). Every transformer
here also exports with the dynamo exporter (checked with torch 2.14, transformers 5.24).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from export_utils import (
    CacheWrapper,
    Net,
    Wrapper,
    cache_names,
    check_model,
    convert_fp16,
    export_dynamo,
    export_torchscript,
    image_inputs,
    model_info,
    model_size,
    perturb_constant_params,
    quiet_warnings,
    randomize_batchnorm,
    seed_all,
    seed_for,
    summarize,
    text_inputs,
    verify,
    write_index,
    write_shapes,
)
from make_examples import ESRGAN, check_pixel_shuffle
from score_families import score_models

# ---------------------------------------------------------------------------- builders


def image_net(module, size: int = 224, output: str = "logits", name: str = "input") -> Net:
    return Net(
        module=module,
        inputs=image_inputs(3, size, name),
        output_names=[output],
        dynamic_axes={name: {0: "batch"}, output: {0: "batch"}},
        export_shape=(2, 0),
        test_shape=(1, 0),
        alt_shape=(2, 0),
    )


def torchvision_net(arch: str) -> Callable[[], Net]:
    def build() -> Net:
        import torchvision

        if arch == "vit_b_16":  # the MHA fast path has no ONNX symbolic
            torch.backends.mha.set_fastpath_enabled(False)
        model = getattr(torchvision.models, arch)(weights=None)
        perturb_constant_params(model)
        randomize_batchnorm(model, lambda: torch.randn(8, 3, 224, 224))
        return image_net(model)

    return build


def hf_text_net(model, vocab_size: int, names: list[str], outputs: list[str], **extra) -> Net:
    """A transformers model with [batch, seq] integer inputs."""
    perturb_constant_params(model)
    axes = {n: {0: "batch", 1: "seq"} for n in names}
    for out in outputs:
        axes[out] = {0: "batch"} if out == "pooler_output" else {0: "batch", 1: "seq"}
    return Net(
        module=Wrapper(model, names, outputs, **extra),
        inputs=text_inputs(vocab_size, tuple(names)),
        output_names=outputs,
        dynamic_axes=axes,
    )


def build_bert_base() -> Net:
    from transformers import BertConfig, BertModel

    config = BertConfig()
    return hf_text_net(
        BertModel(config),
        config.vocab_size,
        ["input_ids", "attention_mask", "token_type_ids"],
        ["last_hidden_state", "pooler_output"],
    )


def build_distilbert() -> Net:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig()
    return hf_text_net(
        DistilBertModel(config),
        config.vocab_size,
        ["input_ids", "attention_mask"],
        ["last_hidden_state"],
    )


def build_gpt2() -> Net:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(use_cache=False)
    return hf_text_net(
        GPT2LMHeadModel(config),
        config.vocab_size,
        ["input_ids", "attention_mask"],
        ["logits"],
        use_cache=False,
    )


def seq2seq_net(model, vocab_size: int, sidecar: dict | None = None) -> Net:
    """An encoder-decoder LM (use_cache=False): input_ids and a padded attention_mask for the
    encoder, decoder_input_ids a quarter of the encoder's length; output the logits."""
    perturb_constant_params(model)
    encoder_inputs = text_inputs(vocab_size)

    def make(batch: int, seq: int) -> dict[str, torch.Tensor]:
        out = encoder_inputs(batch, seq)
        out["decoder_input_ids"] = torch.randint(0, vocab_size, (batch, max(2, seq // 4)))
        return out

    names = ["input_ids", "attention_mask", "decoder_input_ids"]
    return Net(
        module=Wrapper(model, names, ["logits"], use_cache=False),
        inputs=make,
        output_names=["logits"],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "seq"},
            "attention_mask": {0: "batch", 1: "seq"},
            "decoder_input_ids": {0: "batch", 1: "decoder_seq"},
            "logits": {0: "batch", 1: "decoder_seq"},
        },
        sidecar=sidecar or {},
    )


def build_t5_small() -> Net:
    """Full encoder-decoder with the LM head; decoder length is a quarter of the encoder's."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=32128,
        d_model=512,
        d_kv=64,
        d_ff=2048,
        num_layers=6,
        num_decoder_layers=6,
        num_heads=8,
        feed_forward_proj="relu",
        use_cache=False,
    )
    return seq2seq_net(T5ForConditionalGeneration(config), config.vocab_size)


def build_bart() -> Net:
    """bart-base sizes (d_model 768, 12 heads, FFN 3072, vocab 50265) with 3 encoder and 3
    decoder layers; full encoder-decoder with the LM head."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=50265,
        d_model=768,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=12,
        decoder_attention_heads=12,
        encoder_ffn_dim=3072,
        decoder_ffn_dim=3072,
        max_position_embeddings=1024,
        use_cache=False,
    )
    return seq2seq_net(
        BartForConditionalGeneration(config),
        config.vocab_size,
        {"model_type": "bart", "num_heads": 12, "hidden_size": 768},
    )


def step_length(past: int) -> int:
    """New tokens of a cached decoder step: 4 for the short export/alt shapes (a multi-token
    step traces the causal mask), 1 for a long past (the test shape: one decoding step)."""
    return 1 if past >= 64 else 4


def cache_net(
    module: CacheWrapper, inputs, heads: int, head_dim: int, axes: dict, sidecar: dict
) -> Net:
    """Adds the past inputs ([batch, heads, past_seq, head_dim], length `seq`) to `inputs` and
    the cache's dynamic axes; outputs logits then present.I.key/value."""
    past_names = cache_names(module.layers, "past_key_values")
    present_names = cache_names(module.layers, "present")

    def make(batch: int, seq: int) -> dict[str, torch.Tensor]:
        out = inputs(batch, seq)
        for name in past_names:
            out[name] = torch.randn(batch, heads, seq, head_dim)
        return out

    axes = dict(axes)
    axes.update({n: {0: "batch", 2: "past_seq"} for n in past_names})
    axes.update({n: {0: "batch", 2: "total_seq"} for n in present_names})
    return Net(
        module=module,
        inputs=make,
        output_names=["logits"] + present_names,
        dynamic_axes=axes,
        sidecar=sidecar,
    )


def build_gpt2_kv() -> Net:
    """GPT-2 small, one decoding step with a KV cache (use_cache=True): input_ids [batch, seq]
    (4 new tokens at the export shape, 1 at the test shape), attention_mask [batch, past+seq]
    with row 0 left-padded, past_key_values.I.key/value in, present.I.key/value out."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config()
    model = GPT2LMHeadModel(config)
    perturb_constant_params(model)
    heads, head_dim = config.n_head, config.n_embd // config.n_head

    def make(batch: int, past: int) -> dict[str, torch.Tensor]:
        new = step_length(past)
        mask = torch.ones(batch, past + new, dtype=torch.int64)
        mask[0, : max(1, past // 4)] = 0
        return {
            "input_ids": torch.randint(0, config.vocab_size, (batch, new)),
            "attention_mask": mask,
        }

    return cache_net(
        CacheWrapper(model, ["input_ids", "attention_mask"], config.n_layer),
        make,
        heads,
        head_dim,
        {
            "input_ids": {0: "batch", 1: "seq"},
            "attention_mask": {0: "batch", 1: "total_seq"},
            "logits": {0: "batch", 1: "seq"},
        },
        {"model_type": "gpt2", "num_heads": heads, "hidden_size": config.n_embd},
    )


def whisper_tiny_config():
    from transformers import WhisperConfig

    return WhisperConfig(  # whisper-tiny sizes
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        vocab_size=51865,
    )


def build_whisper_tiny_decoder() -> Net:
    """Whisper-tiny's decoder with the LM head, one step with a self-attention KV cache:
    decoder_input_ids [batch, seq], encoder_hidden_states [batch, 1500, 384] (cross-attention
    keys and values are computed in the graph), past_key_values.I.key/value in (self-attention),
    present.I.key/value out."""
    from transformers import WhisperForConditionalGeneration

    config = whisper_tiny_config()
    model = WhisperForConditionalGeneration(config)
    perturb_constant_params(model)
    heads = config.decoder_attention_heads
    frames = config.max_source_positions

    def make(batch: int, past: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (batch, step_length(past)))
        return {
            "decoder_input_ids": ids,
            "encoder_hidden_states": torch.randn(batch, frames, config.d_model),
        }

    names = ["decoder_input_ids", "encoder_hidden_states"]
    return cache_net(
        CacheWrapper(
            model, names, config.decoder_layers, cross=True, encoder_input="encoder_hidden_states"
        ),
        make,
        heads,
        config.d_model // heads,
        {
            "decoder_input_ids": {0: "batch", 1: "seq"},
            "encoder_hidden_states": {0: "batch"},
            "logits": {0: "batch", 1: "seq"},
        },
        {"model_type": "bart", "num_heads": heads, "hidden_size": config.d_model},
    )


def hf_vision_net(model, outputs: list[str], size: int = 224, sidecar: dict | None = None) -> Net:
    """A transformers vision model on pixel_values [batch, 3, size, size]."""
    perturb_constant_params(model)
    return Net(
        module=Wrapper(model, ["pixel_values"], outputs),
        inputs=image_inputs(3, size, "pixel_values"),
        output_names=outputs,
        dynamic_axes={n: {0: "batch"} for n in ["pixel_values"] + outputs},
        export_shape=(2, 0),
        test_shape=(1, 0),
        alt_shape=(2, 0),
        sidecar=sidecar or {},
    )


POOLED = ["last_hidden_state", "pooler_output"]


def build_vit_hf() -> Net:
    from transformers import ViTConfig, ViTModel

    return hf_vision_net(ViTModel(ViTConfig()), POOLED)


def build_swin_hf() -> Net:
    """transformers' Swin with its default config (Swin-T sizes: embed 96, depths 2/2/6/2,
    heads 3/6/12/24, window 7)."""
    from transformers import SwinConfig, SwinModel

    return hf_vision_net(
        SwinModel(SwinConfig()),
        POOLED,
        sidecar={"model_type": "swin", "num_heads": 0, "hidden_size": 0},
    )


def build_deit() -> Net:
    """DeiT-base (ViT-B/16 with a distillation token)."""
    from transformers import DeiTConfig, DeiTModel

    return hf_vision_net(
        DeiTModel(DeiTConfig()),
        POOLED,
        sidecar={"model_type": "vit", "num_heads": 12, "hidden_size": 768},
    )


def build_beit() -> Net:
    """BEiT-base with a relative position bias in every layer and layer scale."""
    from transformers import BeitConfig, BeitModel

    config = BeitConfig(use_relative_position_bias=True)
    return hf_vision_net(
        BeitModel(config),
        POOLED,
        sidecar={"model_type": "vit", "num_heads": 12, "hidden_size": 768},
    )


def build_segformer_b0() -> Net:
    """SegFormer-B0 (the default config) for semantic segmentation at 512x512: efficient
    self-attention, whose keys and values come from a strided Conv (spatial reduction)."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    return hf_vision_net(SegformerForSemanticSegmentation(SegformerConfig()), ["logits"], 512)


def build_whisper_tiny_encoder() -> Net:
    from transformers import WhisperModel

    config = whisper_tiny_config()
    encoder = WhisperModel(config).encoder
    perturb_constant_params(encoder)

    def make(batch: int, _seq: int) -> dict[str, torch.Tensor]:
        return {"input_features": torch.randn(batch, 80, 3000)}

    return Net(
        module=Wrapper(encoder, ["input_features"], ["last_hidden_state"]),
        inputs=make,
        output_names=["last_hidden_state"],
        dynamic_axes={"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}},
        export_shape=(1, 0),
        test_shape=(1, 0),
        alt_shape=(2, 0),
    )


def audio_net(model) -> Net:
    """A speech encoder on one second of 16 kHz audio (input_values [batch, 16000]: 49 frames
    after the convolutional feature extractor), the batch dynamic."""
    perturb_constant_params(model)

    def make(batch: int, _seq: int) -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(batch, 16000)}

    return Net(
        module=Wrapper(model, ["input_values"], ["last_hidden_state"]),
        inputs=make,
        output_names=["last_hidden_state"],
        dynamic_axes={"input_values": {0: "batch"}, "last_hidden_state": {0: "batch"}},
        export_shape=(2, 0),
        test_shape=(1, 0),
        alt_shape=(2, 0),
    )


def build_wav2vec2() -> Net:
    """Wav2Vec2 with base widths (768, 12 heads, FFN 3072) and 4 encoder layers (eager
    attention over 49 frames)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(num_hidden_layers=4, attn_implementation="eager")
    return audio_net(Wav2Vec2Model(config))


def build_hubert() -> Net:
    """HuBERT with base widths and 4 encoder layers (eager attention over 49 frames)."""
    from transformers import HubertConfig, HubertModel

    config = HubertConfig(num_hidden_layers=4, attn_implementation="eager")
    return audio_net(HubertModel(config))


def build_mobilevit() -> Net:
    """MobileViT-small (the default config) at 256x256: attention over 256, 64 and 16 patches
    (2, 4 and 3 layers)."""
    from transformers import MobileViTConfig, MobileViTModel

    return hf_vision_net(MobileViTModel(MobileViTConfig()), ["last_hidden_state"], 256)


def build_esrgan() -> Net:
    """16 RRDB blocks, nf 64, growth 32, x4 by two view/permute pixel shuffles."""
    check_pixel_shuffle()
    model = ESRGAN(nf=64, gc=32, nb=16, scale=4)
    perturb_constant_params(model)
    return image_net(model.eval(), 64, "output")


# ---------------------------------------------------------------------------- registry


@dataclass
class Spec:
    build: Callable[[], Net]
    base: str | None = None  # weights (seed) come from this model; None: the model itself
    exporter: str = "torchscript"  # torchscript | dynamo | fp16 (converted from base)
    keep_bn: bool = False
    kiai: bool = False  # keep_initializers_as_inputs
    tolerance: float = 1e-3  # relative L2 against torch


FP16_TOL = 5e-2
MODELS: dict[str, Spec] = {
    "resnet50": Spec(torchvision_net("resnet50"), keep_bn=True),
    "mobilenet_v3_large": Spec(torchvision_net("mobilenet_v3_large"), keep_bn=True),
    "efficientnet_b0": Spec(torchvision_net("efficientnet_b0"), keep_bn=True),
    "convnext_tiny": Spec(torchvision_net("convnext_tiny")),
    "vit_b_16": Spec(torchvision_net("vit_b_16")),
    "swin_t": Spec(torchvision_net("swin_t")),
    "bert_base": Spec(build_bert_base),
    "distilbert": Spec(build_distilbert),
    "gpt2": Spec(build_gpt2),
    "t5_small": Spec(build_t5_small),
    "vit_hf": Spec(build_vit_hf),
    "whisper_tiny_encoder": Spec(build_whisper_tiny_encoder),
    "gpt2_kv": Spec(build_gpt2_kv),
    "whisper_tiny_decoder": Spec(build_whisper_tiny_decoder),
    "bart": Spec(build_bart),
    "swin_hf": Spec(build_swin_hf),
    "deit": Spec(build_deit),
    "beit": Spec(build_beit),
    "segformer_b0": Spec(build_segformer_b0),
    "esrgan": Spec(build_esrgan),
    "wav2vec2": Spec(build_wav2vec2),
    "hubert": Spec(build_hubert),
    "mobilevit": Spec(build_mobilevit),
    "resnet50_fp16": Spec(
        torchvision_net("resnet50"), "resnet50", "fp16", keep_bn=True, tolerance=FP16_TOL
    ),
    "bert_base_fp16": Spec(build_bert_base, "bert_base", "fp16", tolerance=FP16_TOL),
    "gpt2_fp16": Spec(build_gpt2, "gpt2", "fp16", tolerance=FP16_TOL),
    "resnet50_dynamo": Spec(torchvision_net("resnet50"), "resnet50", "dynamo"),
    "bert_base_dynamo": Spec(build_bert_base, "bert_base", "dynamo"),
    "gpt2_dynamo": Spec(build_gpt2, "gpt2", "dynamo"),
    "distilbert_dynamo": Spec(build_distilbert, "distilbert", "dynamo"),
    "t5_small_dynamo": Spec(build_t5_small, "t5_small", "dynamo"),
    "vit_hf_dynamo": Spec(build_vit_hf, "vit_hf", "dynamo"),
    "whisper_tiny_encoder_dynamo": Spec(
        build_whisper_tiny_encoder, "whisper_tiny_encoder", "dynamo"
    ),
    "gpt2_kv_dynamo": Spec(build_gpt2_kv, "gpt2_kv", "dynamo"),
    "whisper_tiny_decoder_dynamo": Spec(
        build_whisper_tiny_decoder, "whisper_tiny_decoder", "dynamo"
    ),
    "bart_dynamo": Spec(build_bart, "bart", "dynamo"),
    "swin_t_dynamo": Spec(torchvision_net("swin_t"), "swin_t", "dynamo"),
    "swin_hf_dynamo": Spec(build_swin_hf, "swin_hf", "dynamo"),
    "deit_dynamo": Spec(build_deit, "deit", "dynamo"),
    "beit_dynamo": Spec(build_beit, "beit", "dynamo"),
    "segformer_b0_dynamo": Spec(build_segformer_b0, "segformer_b0", "dynamo"),
    "resnet50_kiai": Spec(torchvision_net("resnet50"), "resnet50", keep_bn=True, kiai=True),
    "bert_base_kiai": Spec(build_bert_base, "bert_base", kiai=True),
}
MODELS.update(score_models(Spec))


def produce(name: str, out_dir: str, reuse_base: bool) -> dict:
    """Export one model into out_dir, check and verify it; returns conversion info and the
    relative errors against torch ("test", "alt")."""
    spec = MODELS[name]
    path = os.path.join(out_dir, name + ".onnx")
    seed_all(seed_for(spec.base or name))
    net = spec.build()
    info: dict = {}
    if spec.exporter == "torchscript":
        export_torchscript(
            net, path, opset=17, keep_bn=spec.keep_bn, keep_initializers_as_inputs=spec.kiai
        )
    elif spec.exporter == "dynamo":
        export_dynamo(net, path, opset=18)
    elif spec.exporter == "fp16":
        if reuse_base:  # the base model (same weights) was exported earlier in this run
            info = convert_fp16(os.path.join(out_dir, spec.base + ".onnx"), path)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                tmp_path = os.path.join(tmp, spec.base + ".onnx")
                export_torchscript(net, tmp_path, opset=17, keep_bn=spec.keep_bn)
                info = convert_fp16(tmp_path, path)
    else:
        raise ValueError(spec.exporter)
    check_model(path)
    info.update(verify(path, net, spec.tolerance))
    write_shapes(path, net, model_info(path, spec.exporter))
    return info


def worker(name: str, out_dir: str, reuse_base: bool, result_path: str) -> int:
    """Child-process entry: produce one model and write a JSON result."""
    quiet_warnings()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        info = produce(name, out_dir, reuse_base)
        path = os.path.join(out_dir, name + ".onnx")
        nodes, top = summarize(path)
        result = {"ok": True, "info": info, "nodes": nodes, "top": top, "size": model_size(path)}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


def run_isolated(name: str, out_dir: str, produced: set[str]) -> dict:
    """Run one model in a fresh interpreter: memory is returned between models (the exporters
    keep a lot alive) and a crash in one export cannot stop the others."""
    fd, result_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--out",
            out_dir,
            "--worker",
            name,
            "--result",
            result_path,
        ]
        if MODELS[name].base in produced:
            cmd.append("--reuse-base")
        proc = subprocess.run(cmd)
        try:
            with open(result_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"ok": False, "error": f"worker exited with code {proc.returncode}"}
    finally:
        os.remove(result_path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models", help="output folder")
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--list", action="store_true", help="list model names and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--reuse-base", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        return worker(args.worker, args.out, args.reuse_base, args.result)
    if args.list:
        for name, spec in MODELS.items():
            detail = (
                spec.exporter
                + (" keep-BN" if spec.keep_bn else "")
                + (" kiai" if spec.kiai else "")
            )
            print(f"{name:<22} {detail}")
        return 0
    names = list(MODELS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODELS]
        if unknown:
            parser.error("unknown model(s): " + ", ".join(unknown) + " (see --list)")
    os.makedirs(args.out, exist_ok=True)

    rows, failed, produced = [], [], set()
    for name in names:
        start = time.time()
        print(f"[{name}] ...", flush=True)
        result = run_isolated(name, args.out, produced)
        secs = time.time() - start
        if not result["ok"]:
            print(f"[{name}] FAILED: {result['error']}", flush=True)
            failed.append((name, result["error"]))
            continue
        produced.add(name)
        write_index(args.out)
        rows.append((name, secs, result))
        print(f"[{name}] ok: {result['nodes']} nodes, {secs:.1f} s, {result['info']}", flush=True)

    print()
    print(
        f"{'name':<22} {'nodes':>6} {'size MB':>8} {'sec':>6} {'RSS GB':>6}  {'rel.err':>7}  "
        "top-5 op types"
    )
    for name, secs, r in rows:
        ops = ", ".join(f"{op} {n}" for op, n in r["top"])
        print(
            f"{name:<22} {r['nodes']:>6} {r['size'] / 2**20:>8.1f} {secs:>6.1f} "
            f"{r['peak_rss'] / 2**30:>6.1f}  {r['info']['test']:>7.1e}  {ops}"
        )
    if failed:
        print("\nFAILED:")
        for name, error in failed:
            print(f"  {name}: {error.splitlines()[0] if error else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

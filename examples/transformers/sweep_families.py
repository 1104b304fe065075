#!/usr/bin/env python3
"""Export many transformers families with eager attention, one tiny config each, for a sweep.

    python examples/transformers/sweep_families.py --out models/sweep [--group all|dec|enc|
        vis|aud|s2s] [--only a,b] [--exporters ts,dynamo] [--list]
    python examples/transformers/run_attention.py models/sweep --targets cpu,cuda --no-measure

Where ``make_more_families.py`` builds one mechanism per family with a hand-made config, this
takes any ``model_type`` transformers knows and asks ``AutoConfig.for_model`` for it with the
same small sizes (2 layers, hidden 64, 4 heads, vocab 256; the vision and speech families
their own image and frame sizes), ``attn_implementation="eager"`` and random weights: the
spelling a held-out export of a family nobody tuned for has.  Each lands as NAME.onnx
(``ts``: TorchScript, opset 17, batch and sequence dynamic; ``dynamo``: torch.export,
opset 18, static) with NAME.json (shapes) and NAME.npz (the test inputs: the second sequence
of a text batch padded by 4 tokens).  The export is checked against torch in onnxruntime; a
family whose config, forward or export fails is printed as FAIL with its reason (some need
inputs this wrapper does not build: a bbox, a language id) and the others go on.  Needs torch
and transformers; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from inspect import signature
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never ask the hub

#: the small sizes, under every name a config may spell them with
TEXT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=128,
    num_key_value_heads=2,
    head_dim=16,
    n_embd=64,
    n_layer=2,
    n_head=4,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    embedding_size=64,
    pad_token_id=0,
)
#: the layers and widths the vision and speech configs share
ENCODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
VISION = dict(ENCODER, image_size=64, patch_size=8)
AUDIO = dict(
    ENCODER,
    conv_dim=(32, 32),
    conv_stride=(5, 4),
    conv_kernel=(10, 4),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
)
GROUPS = {
    "dec": (
        "llama mistral qwen2 phi3 mpt gpt_neo olmo olmo2 granite ctrl jetmoe stablelm nemotron "
        "persimmon gpt_bigcode seed_oss smollm3 arcee hunyuan_v1_dense bitnet apertus cohere "
        "ernie4_5 glm glm4 olmo3 ministral granitemoe phimoe qwen3_moe qwen2_moe "
        "minicpm3 internlm3 vaultgemma doge nanochat helium cwm dots1 hunyuan_v1_moe glm4_moe "
        "ernie4_5_moe openai-gpt imagegpt recurrent_gemma lfm2 cohere2 exaone4 xglm biogpt gpt2 "
        "opt bloom falcon gpt_neox gptj codegen gemma gemma2 mixtral phi starcoder2 qwen3 "
        "deepseek_v3 olmoe gemma3_text exaone gpt_oss granitemoeshared flex_olmo ministral3 "
        "jais2 youtu hyperclovax glm4_moe_lite gpt_neox_japanese diffllama gpt-sw3 mellum "
        "laguna minimax qwen3_vl_text qwen3_5_text modernbert-decoder cpmant qwen3_next "
        "exaone_moe solar_open sarvam_mla mistral4 granite_swa apertus1p5_text cohere2_moe "
        "emu3_text_model granitemoe_swa hrm_text hy_v3 iquestcoder lfm3 mimo_v2_flash "
        "minicpm5_moe minimax_m2 olmo_hybrid param2moe qwen3_vl_moe_text sarvam_moe zaya "
        "gemma4_text kolibri1 inkling_text aria_text deepseek_v4 granite4_vision_text "
        "granite_docling_text minimax_m3_vl_text muse_spark_text muse_glimmer_text hy_v4 "
        "inkling2_text molmo2_text mllama_text_model nemotron_h longcat_flash deepseek_v32 "
        "glm_moe_dsa mistral_large4_text axk1 axk2 qwen2_vl_text qwen2_5_vl_text glm4v_text "
        "glm_ocr_text paddleocr_vl_text glm4v_moe_text step3p5 trocr kosmos_2_text_model"
    ),
    "enc": (
        "albert mpnet mobilebert rembert megatron-bert ernie camembert flaubert xlm "
        "data2vec-text layoutlm ibert roc_bert yoso mra splinter luke markuplm distilbert "
        "electra roberta-prelayernorm esm nystromformer modernbert deberta canine eurobert gte "
        "nomic_bert jina_embeddings_v3 xlm-roberta-xl xmod bert-generation tapas bert roberta "
        "xlm-roberta deberta-v2 squeezebert convbert big_bird roformer longformer fnet xlnet "
        "dpr ultrabert embedding_gemma2_text clip_text_model funnel aimv2_text_model "
        "align_text_model altclip_text_model chinese_clip_text_model clap_text_model "
        "clipseg_text_model groupvit_text_model metaclip_2_text_model openai_privacy_filter "
        "owlv2_text_model owlvit_text_model siglip2_text_model tipsv2_text_model "
        "xclip_text_model siglip_text_model flava_text_model videoprism_text_model "
        "sam3_lite_text_text_model blip_text_model visual_bert bridgetower_text_model "
        "layoutlmv3 bros blip_2_qformer instructblip_qformer perceiver"
    ),
    "vis": (
        "dinov2 yolos vit_msn data2vec-vision ijepa cvt deit clip_vision_model "
        "siglip_vision_model dpt glpn pvt levit vitdet hiera dinov2_with_registers focalnet "
        "poolformer textnet aimv2_vision_model mlcd_vision_model dinov3_vit swiftformer "
        "beit vit mobilevit swin swinv2 donut-swin maskformer-swin pvt_v2 segformer "
        "sam_vision_model idefics3_vision smolvlm_vision internvl_vision mlcd pixtral sapiens2 "
        "radio pixio mobilevitv2 altclip_vision_model blip_2_vision_model blip_vision_model "
        "chinese_clip_vision_model clipseg_vision_model git_vision_model groupvit_vision_model "
        "instructblip_vision_model janus_vision_model metaclip_2_vision_model "
        "owlv2_vision_model owlvit_vision_model phi4_multimodal_vision sam_hq_vision_model "
        "tipsv2_vision_model flava_image_model mask2former sam3_vit_model kosmos_2_vision_model "
        "idefics2_vision detr conditional_detr dab-detr table-transformer deformable_detr "
        "got_ocr2_vision ovis2_vision"
    ),
    "vid": "videomae vivit timesformer",
    "vl": (
        "qwen2_vl_vision qwen2_5_vl_vision qwen3_vl_vision glm4v_vision qwen3_5_vision "
        "glm_ocr_vision lfm3_vl_vision"
    ),
    "aud": (
        "sew sew-d unispeech unispeech-sat data2vec-audio wav2vec2-bert hubert wav2vec2 wavlm "
        "wav2vec2-conformer qwen2_audio_encoder audio-spectrogram-transformer parakeet_encoder "
        "voxtral_encoder"
    ),
    "s2s": (
        "led pegasus m2m_100 blenderbot blenderbot-small plbart bigbird_pegasus nllb-moe t5 "
        "bart prophetnet fsmt longt5 mvp pegasus_x umt5 mbart mt5 marian whisper speech_to_text "
        "moonshine"
    ),
}
#: multi-head latent attention (MiniCPM3, DeepSeek-V2/V3 and the families built on it): low-rank
#: q and kv, a rotary part of each head; dense layers
MLA = dict(
    num_key_value_heads=4,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
    kv_lora_rank=32,
    q_lora_rank=48,
    first_k_dense_replace=2,
    mlp_layer_types=["dense", "dense"],
)
#: Swin's stages: two of two blocks, 4×4 windows over 16×16 patches
SWIN = dict(
    embed_dim=32,
    depths=[2, 2],
    num_heads=[2, 4],
    window_size=4,
    patch_size=4,
    num_attention_heads=None,
    num_hidden_layers=None,
    hidden_size=None,
)
#: PVT-v2 and SegFormer: two stages with spatial reduction of the keys
PYRAMID = dict(
    num_encoder_blocks=2,
    depths=[1, 1],
    sr_ratios=[2, 1],
    hidden_sizes=[32, 64],
    patch_sizes=[7, 3],
    strides=[4, 2],
    num_attention_heads=[1, 2],
    mlp_ratios=[4, 4],
    hidden_size=None,
    num_hidden_layers=None,
)
#: sizes a family's config spells its own way (None: not given, the config derives it)
#: mixtures of experts whose defaults have a hundred experts or more, each of thousands wide
MOE = dict(
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
#: multi-head latent attention with DeepSeek's sparse indexer (DSA)
DSA = "deepseek_v32 glm_moe_dsa mistral_large4_text axk1 axk2".split()
#: Qwen2-VL's multimodal rotary: the 8 frequencies of a 16-wide head in three sections
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
MROPE = dict(rope_parameters={**ROPE, "mrope_section": [2, 3, 3]})
OWN_SIZES = {
    "minicpm3": MLA,
    "gptj": dict(rotary_dim=8),  # a rotated part of the 16-wide heads
    "codegen": dict(rotary_dim=8),
    "falcon": dict(head_dim=None),
    **{f: MLA for f in "deepseek_v3 glm4_moe_lite sarvam_mla youtu mistral4".split()},
    **{f: SWIN for f in "swin swinv2 donut-swin maskformer-swin".split()},
    **{f: PYRAMID for f in ("pvt_v2", "segformer")},
    **{f: MOE for f in "hy_v3 mimo_v2_flash param2moe qwen3_vl_moe_text sarvam_moe".split()},
    "kolibri1": dict(MOE, shared_expert_intermediate_size=32),
    "inkling_text": dict(MOE, rel_extent=16),
    # per-layer input embeddings of a vocabulary of their own
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
    "funnel": dict(block_sizes=[1, 1], block_repeats=[1, 1], num_hidden_layers=None, d_head=16),
    "xlnet": dict(max_position_embeddings=None, d_head=16),
    **{f: dict(encoder_hidden_size=32) for f in ("blip_2_qformer", "instructblip_qformer")},
    "perceiver": dict(
        num_latents=8,
        d_latents=64,
        d_model=32,
        num_self_attends_per_block=2,
        num_self_attention_heads=4,
        num_cross_attention_heads=4,
    ),
    # the box embeddings: 4 coordinates and 2 sizes making up the hidden width
    "layoutlmv3": dict(coordinate_size=12, shape_size=8, input_size=64, patch_size=16),
    "mobilevitv2": dict(image_size=128, patch_size=2, num_hidden_layers=None, hidden_size=None),
    **{f: dict(MLA, index_head_dim=16, index_n_heads=4, index_topk=8) for f in DSA},
    "longcat_flash": dict(
        MLA, **MOE, ffn_hidden_size=128, expert_ffn_hidden_size=32, zero_expert_num=2
    ),
    **{f: MROPE for f in "qwen2_vl_text qwen2_5_vl_text glm4v_text glm_ocr_text".split()},
    "paddleocr_vl_text": MROPE,
    # half the head rotated: 4 frequencies
    "glm4v_moe_text": dict(
        MOE, rope_parameters={**ROPE, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}
    ),
    "step3p5": dict(MOE, sliding_window=8),
    # spectrograms of 64 frames
    "whisper": dict(max_source_positions=32, num_mel_bins=16),
    **{
        f: dict(TEXT, max_source_positions=32, num_mel_bins=16)
        for f in ("qwen2_audio_encoder", "voxtral_encoder")
    },
    "speech_to_text": dict(max_source_positions=64, conv_channels=32, input_feat_per_channel=16),
    "audio-spectrogram-transformer": dict(max_length=64, num_mel_bins=32),
    "parakeet_encoder": dict(subsampling_conv_channels=32, num_mel_bins=16),
    "vivit": dict(tubelet_size=[2, 8, 8]),
    # the hybrids put one full attention after three linear ones
    "qwen3_next": dict(num_hidden_layers=4),
    "qwen3_5_text": dict(num_hidden_layers=4),
}


def _queries(c, rng) -> dict:
    """A Q-Former's inputs: 8 learned queries and the 16 image features they attend to."""
    queries = rng.standard_normal((1, 8, c.hidden_size)).astype(np.float32)
    image = rng.standard_normal((1, 16, c.encoder_hidden_size)).astype(np.float32)
    return {"query_embeds": queries, "encoder_hidden_states": image}


def _instructed_queries(c, rng) -> dict:
    """InstructBLIP's Q-Former: the queries read an instruction of 6 tokens too."""
    ids = rng.integers(3, 200, size=(1, 6)).astype(np.int64)
    return {"input_ids": ids, **_queries(c, rng)}


def _latents(c, rng) -> dict:
    """Perceiver's inputs: 16 embedded tokens of d_model, which its latents attend to."""
    return {"inputs": rng.standard_normal((1, 16, c.d_model)).astype(np.float32)}


#: families whose inputs are neither tokens, pixels nor sound
OWN_INPUTS = {
    "blip_2_qformer": _queries,
    "instructblip_qformer": _instructed_queries,
    "perceiver": _latents,
}
#: document encoders that read a box per token beside it
BOXED = ("layoutlmv3", "bros")
#: encoder-decoders that hear: speech in, the decoder's tokens
SPEECH_TO_TEXT = ("whisper", "speech_to_text", "moonshine")
KIND_SIZES = {
    "dec": TEXT,
    "enc": TEXT,
    "s2s": TEXT,
    "vis": VISION,
    "vid": dict(ENCODER, image_size=32, patch_size=8, num_frames=4, tubelet_size=2),
    # Qwen-VL-style towers: flattened patches of a 4×4 grid, 2 frames each, merged 2×2
    "vl": dict(
        ENCODER,
        depth=2,
        embed_dim=64,
        num_heads=4,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=64,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
        fullatt_block_indexes=[1],
        window_size=8,
    ),
    "aud": AUDIO,
}


#: speech families that read a spectrogram, not samples: its input and shape from the config
def _mel(c):
    """Whisper's encoder input: every mel bin over twice its source positions."""
    return "input_features", (1, c.num_mel_bins, 2 * c.max_source_positions)


FEATURES = {
    "wav2vec2-bert": lambda c: ("input_features", (1, 40, c.feature_projection_input_dim)),
    **{f: _mel for f in ("whisper", "qwen2_audio_encoder", "voxtral_encoder")},
    "speech_to_text": lambda c: (
        "input_features",
        (1, 64, c.input_feat_per_channel * c.input_channels),
    ),
    "audio-spectrogram-transformer": lambda c: ("input_values", (1, c.max_length, c.num_mel_bins)),
    "parakeet_encoder": lambda c: ("input_features", (1, 64, c.num_mel_bins)),
    "moonshine": lambda c: ("input_values", (1, 8000)),  # samples, a longer clip
}


def kind_of(family: str) -> str:
    for kind, names in GROUPS.items():
        if family in names.split():
            return kind
    return "enc"


def _own_class(cfg):
    """The model class built on ``cfg``'s own config class, for a tower AutoModel does not map
    (BlipVisionConfig → BlipVisionModel, Kosmos2VisionConfig → Kosmos2VisionModel,
    TrOCRConfig → TrOCRForCausalLM): the class of that name, else one of the family's modeling
    module whose ``config_class`` it is (a bare model before a head)."""
    import importlib

    import transformers

    cls = getattr(transformers, type(cfg).__name__.removesuffix("Config") + "Model", None)
    if cls is not None:
        return cls
    try:
        where = type(cfg).__module__.replace(".configuration_", ".modeling_")
        module = importlib.import_module(where)
    except ImportError:
        return None
    own = [
        c
        for name, c in vars(module).items()
        if isinstance(c, type)
        and getattr(c, "config_class", None) is type(cfg)
        and not name.endswith("PreTrainedModel")
    ]
    own.sort(key=lambda c: ("For" in c.__name__, c.__name__))
    return own[0] if own else None


def _from_config(cfg, **how):
    """AutoModel's model of ``cfg``, or the model class of its own config (``_own_class``),
    built the same way."""
    from transformers import AutoModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cls = None if type(cfg) in MODEL_MAPPING else _own_class(cfg)
    if cls is None:
        return AutoModel.from_config(cfg, **how)
    cfg._attn_implementation = how.get("attn_implementation", "eager")
    if "experts_implementation" in how:
        cfg._experts_implementation = how["experts_implementation"]
    return cls(cfg)


def build(family: str):
    """(model, test inputs) of ``family`` with the small config and eager attention."""
    import torch
    from transformers import AutoConfig

    kind = kind_of(family)
    try:
        sizes = {**KIND_SIZES[kind], **OWN_SIZES.get(family, {})}
        cfg = AutoConfig.for_model(family, **{k: v for k, v in sizes.items() if v is not None})
    except (TypeError, ValueError):  # a size its config refuses: its defaults
        cfg = AutoConfig.for_model(family)
    for attr in ("layer_types", "mlp_layer_types"):  # one entry per layer of the defaults
        types = getattr(cfg, attr, None)
        if isinstance(types, list) and getattr(cfg, "num_hidden_layers", None):
            setattr(cfg, attr, types[: cfg.num_hidden_layers])
    if getattr(cfg, "architectures", []) is None:  # Funnel's loader iterates over it
        cfg.architectures = []
    torch.manual_seed(0)
    # experts as batched MatMuls: the default loop counts tokens with histc, which no exporter
    # takes (a transformers older than 5 has no such choice)
    try:
        how = dict(attn_implementation="eager", experts_implementation="batched_mm")
        model = _from_config(cfg, **how).eval()
    except TypeError:
        model = _from_config(cfg, attn_implementation="eager").eval()
    rng = np.random.default_rng(0)
    if kind == "vis":
        size = getattr(cfg, "image_size", 64)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(cfg, "num_channels", 3)
        pixels = rng.standard_normal((1, channels, size, size)).astype(np.float32)
        return model, {"pixel_values": pixels}
    if kind == "vid":
        size, frames = cfg.image_size, cfg.num_frames
        pixels = rng.standard_normal((1, frames, 3, size, size)).astype(np.float32)
        return model, {"pixel_values": pixels}
    if kind == "vl":  # one image of a 4×4 patch grid, each patch flattened over its frames
        width = getattr(cfg, "in_channels", 3) * cfg.temporal_patch_size * cfg.patch_size**2
        patches = rng.standard_normal((16, width)).astype(np.float32)
        name = "hidden_states" if "hidden_states" in signature(model.forward).parameters else None
        return model, {name or "pixel_values": patches, "grid_thw": np.array([[1, 4, 4]])}
    if family in OWN_INPUTS:
        return model, OWN_INPUTS[family](cfg, rng)
    if family in FEATURES:
        name, shape = FEATURES[family](cfg)
        feeds = {name: rng.standard_normal(shape).astype(np.float32)}
    else:
        feeds = {"input_values": rng.standard_normal((1, 1600)).astype(np.float32)}
    if kind == "aud":
        return model, feeds
    if kind == "s2s" and family in SPEECH_TO_TEXT:
        feeds["decoder_input_ids"] = rng.integers(3, 200, size=(1, 8)).astype(np.int64)
        return model, feeds
    ids = rng.integers(3, 200, size=(2, 16)).astype(np.int64)
    mask = np.ones((2, 16), np.int64)
    mask[1, 12:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    if family in BOXED:  # a box per token, [x0, y0, x1, y1] on the 0..1000 page
        corner = rng.integers(0, 500, size=(2, 16, 2))
        feeds["bbox"] = np.concatenate([corner, corner + rng.integers(1, 500, size=(2, 16, 2))], -1)
    if kind == "s2s":
        feeds["decoder_input_ids"] = rng.integers(3, 200, size=(2, 8)).astype(np.int64)
    return model, feeds


def wrapped(model, names: list[str]):
    """The model as a module of positional tensors returning its first output."""
    import torch

    class First(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *args):
            out = self.m(**dict(zip(names, args)))
            hidden = getattr(out, "last_hidden_state", None)
            return hidden if hidden is not None else out[0]

    return First().eval()


def export(family: str, exporter: str, out: Path) -> str:
    """Export one family; the line to print."""
    import onnxruntime as ort
    import torch

    name = f"{family.replace('-', '_')}_{exporter}"
    path = out / f"{name}.onnx"
    try:
        model, feeds = build(family)
        names = list(feeds)
        net = wrapped(model, names)
        args = tuple(torch.from_numpy(feeds[k]) for k in names)
        with torch.no_grad():
            want = net(*args).numpy()
        if exporter == "ts":
            # token inputs: batch and their own length dynamic; pixels and frames: batch; a
            # patch grid static (the towers split their attention by its lengths when traced)
            dynamic = {
                k: {0: "batch", 1: f"len_{k}"} if k.endswith(("ids", "mask")) else {0: "batch"}
                for k in names
                if kind_of(family) != "vl"
            }
            if "bbox" in dynamic:  # the boxes are as long as the tokens
                dynamic["bbox"] = {0: "batch", 1: "len_input_ids"}
            how = dict(opset_version=17, dynamic_axes=dynamic, dynamo=False)
        else:
            how = dict(opset_version=18, dynamo=True, external_data=False)
        torch.onnx.export(net, args, str(path), input_names=names, output_names=["out"], **how)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        used = {i.name: feeds[i.name] for i in sess.get_inputs()}
        err = float(np.abs(sess.run(None, used)[0] - want).max())
    except Exception as e:  # noqa: BLE001 - reported per family, the others go on
        if path.exists():
            path.unlink()
        return f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    np.savez(out / f"{name}.npz", **used)
    sidecar = {"inputs": {k: list(v.shape) for k, v in used.items()}, "family": family}
    (out / f"{name}.json").write_text(json.dumps(sidecar) + "\n")
    return f"OK {name} max|onnxruntime - torch| = {err:.2e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for NAME.onnx, NAME.json, NAME.npz")
    ap.add_argument("--group", default="all", choices=["all", *GROUPS], help="families")
    ap.add_argument(
        "--only", default="", help="comma-separated model types (any transformers knows)"
    )
    ap.add_argument("--exporters", default="ts,dynamo", help="comma-separated: ts, dynamo")
    ap.add_argument("--list", action="store_true", help="list the groups and exit")
    args = ap.parse_args(argv)
    if args.list:
        for kind, names in GROUPS.items():
            print(f"{kind}: {names}")
        return 0
    if args.out is None:
        ap.error("--out is required")
    exporters = [e for e in args.exporters.split(",") if e]
    if set(exporters) - {"ts", "dynamo"}:
        ap.error(f"unknown exporters in {args.exporters!r}")
    families = [f for f in args.only.split(",") if f]
    if not families:
        groups = GROUPS if args.group == "all" else {args.group: GROUPS[args.group]}
        families = [f for names in groups.values() for f in names.split()]
    import warnings

    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for family in families:
        for exporter in exporters:
            line = export(family, exporter, args.out)
            failed += line.startswith("FAIL")
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""More transformer families, one attention mechanism each: decoders with a KV cache, encoders,
vision and speech encoders and encoder-decoders, exported with random weights from configs.

    python examples/make_more_families.py --out models/families [--only a,b]
        [--exporters torchscript,dynamo] [--list]
    python examples/transformers/run_attention.py models/families --targets cpu,cuda

Needs torch and transformers (nothing is downloaded). The decoders go through
examples/make_llms.py (CachedDecoder: past/present tensors as graph inputs and outputs, checked
on a prefill and a decode step), the others through examples/make_models.py (``produce``:
checked against torch at two shapes). Each export is NAME.onnx (TorchScript, opset 17) or
NAME_dynamo.onnx (torch.export, opset 18) with its NAME.json sidecar (and NAME.npz test inputs
for the non-decoders), the files run_attention.py reads; each result is printed and appended
to export_log.jsonl in --out. MAKE_LLMS_DEBUG=1 prints the traceback of a failed export.

Decoders (2 layers, hidden 256, 8 query heads, vocab 1024):

- p_deepseek_v3: DeepSeek-V3 latent attention with unequal K/V head sizes (q/kv LoRA, keys of
  32 nope + 16 rotary dims, values of 32), the compressed latents as the cache
- p_gpt_oss: GPT-OSS attention sinks (a learned logit per head in the Softmax), sliding/full
  layers, GQA 8/2, MoE 4 experts top-2
- p_starcoder2: Starcoder2 GQA 8/2 with projection biases, LayerNorm, sliding window 16
- p_dbrx: DBRX clip_qkv (the fused Wqkv output clamped to ±8), GQA 8/2, MoE 2 experts top-1
- p_olmoe: OLMoE q/k RMSNorm over the whole projection, MoE 4 experts top-2
- p_llama4: Llama4 text chunked attention (16) with q/k L2 norm on the rotary layer, a NoPE
  layer with attention temperature tuning
- p_exaone4: EXAONE 4 q/k RMSNorm per head, sliding/global layers (the global one NoPE)
- p_helium: Helium GQA 8/2 with head_dim 32
- p_cohere2: Cohere2 interleaved rotary on sliding layers, a NoPE full layer, parallel block
- p_biogpt: BioGPT multi-head attention, learned positions, scaled embeddings
- p_xglm: XGLM multi-head attention, sinusoidal positions, biases

Encoders, vision, speech and encoder-decoders (small configs, hidden 64 to 128):

- p_roformer: RoFormer rotary position embedding in a BERT encoder
- p_esm: ESM-2 rotary encoder (protein masked LM)
- p_squeezebert: SqueezeBERT channel-first attention (grouped 1x1 convolutions project q, k
  and v over [B,C,S]; the key is Kᵀ as it is)
- p_xlm_roberta: XLM-RoBERTa post-norm BERT attention, padding-offset positions
- p_bigbird: BigBird in its full-attention mode
- p_convbert: ConvBERT mixed attention (half the heads a span-based dynamic convolution)
- p_funnel: Funnel Transformer relative attention (position terms, token-type bias), pooling
- p_longformer: Longformer sliding-window (4) chunked attention
- p_levit: LeViT learned bias table (indexed per query/key offset), value dim twice the key's
- p_sam_vision: SAM ViT windowed (4) and global attention, decomposed relative positions
- p_sam2_hiera: SAM2's Hiera image encoder (q, k and v unbound from a packed projection of
  the image per head; max-pooled queries at stage changes, windowed and global blocks)
- p_vitmae: ViT-MAE encoder (mask ratio 0, a fixed patch order)
- p_pvt_v2: PVTv2 spatial-reduction attention (keys and values from a strided convolution)
- p_w2v2_conformer_rel: Wav2Vec2-Conformer relative positional self-attention
- p_w2v2_conformer_rotary: Wav2Vec2-Conformer rotary self-attention
- p_mt5: mT5 bucketed relative position bias, unscaled scores, cross-attention
- p_umt5: UMT5 relative position bias of its own in every layer
- p_mbart: mBART pre-norm encoder-decoder, scaled embeddings
- p_marian: Marian post-norm encoder-decoder, sinusoidal positions
- p_siglip_vision: SigLIP vision encoder and its attention-pooling head (nn.MultiheadAttention)
- p_torch_encoder: torch's own nn.TransformerEncoder (2 layers, batch-first; its
  nn.MultiheadAttention without weights)
- p_torch_pool: nn.MultiheadAttention with its weights (the default) pooling a sequence with a
  learned query

Llama4 exports with neither exporter (torch.polar in its rotary); Helium and Cohere2 with the
dynamo exporter only (TorchScript stops with "All tensors must have the same rank"), Longformer
with TorchScript only; the two torch modules with dynamo only (TorchScript bakes
nn.MultiheadAttention's batch and length into its Reshapes, which then fail at other sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never ask the hub

import make_llms
import make_models
import torch
from export_utils import Net, perturb_constant_params, quiet_warnings
from make_llms import Family, _small
from make_models import Spec

VOCAB = 1024
EXPORTERS = ("torchscript", "dynamo")
# MoE experts: the default grouped_mm counts tokens per expert with torch.histc, which neither
# exporter converts; batched_mm gathers every token's experts instead
EXPERTS = "batched_mm"


# ------------------------------------------------------------------------------ decoders
def kv_dims(model) -> tuple[int, int, int]:
    """(kv heads, key dim, value dim) of the cache tensors CachedDecoder passes through."""
    cfg = model.config
    if cfg.model_type == "deepseek_v3":  # the cache holds the single-head latents: the
        # compressed kv (kv_lora_rank) as key and the shared rotary key as value
        return 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.model_type == "dbrx":  # its kv head count lives in attn_config
        d = cfg.d_model // cfg.n_heads
        return cfg.attn_config.kv_n_heads, d, d
    heads, dim = make_llms.kv_shape(model)
    return heads, dim, dim


def make_feeds(model, batch: int, seq: int, past: int, vocab: int, gen: torch.Generator):
    """make_llms.make_feeds with the key and value dims of kv_dims."""
    heads, kd, vd = kv_dims(model)
    feeds = {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=gen),
        "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
        "position_ids": torch.arange(past, past + seq).repeat(batch, 1),
    }
    for name in make_llms.past_names(model.config.num_hidden_layers):
        d = kd if name.endswith(".key") else vd
        feeds[name] = torch.randn(batch, heads, past, d, generator=gen)
    return feeds


def write_shapes(path: str, model) -> None:
    """make_llms.write_shapes with the key and value dims of kv_dims."""
    heads, kd, vd = kv_dims(model)
    shapes = {"input_ids": [1, 8], "attention_mask": [1, 24], "position_ids": [1, 8]}
    for n in make_llms.past_names(model.config.num_hidden_layers):
        shapes[n] = [1, heads, 16, kd if n.endswith(".key") else vd]
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"inputs": shapes}, f, indent=2)
        f.write("\n")


# make_llms sizes keys and values alike; its make_net and check_generation look these up at
# call time, so the DeepSeek and DBRX caches get their own dims
make_llms.make_feeds = make_feeds
make_llms.write_shapes = write_shapes


def _lm(cls_name: str, lm_name: str = "", **kw):
    """A builder of make_llms' small causal LM with vocab 1024 and intermediate 512."""
    return lambda: _small(
        cls_name, lm_name, **{"vocab_size": VOCAB, "intermediate_size": 512, **kw}
    )


def _dense_dbrx_experts(self, hidden_states, top_k_index, top_k_weights):
    """DbrxExperts.forward without its loop over the experts some token picked (data-dependent:
    torch.export cannot trace it, TorchScript bakes in the traced picks): every expert on every
    token, weighted by its routing weight (0 where not picked). The same result."""
    batch_size = hidden_states.shape[0]
    x = hidden_states.reshape(-1, self.hidden_size)
    out = torch.zeros_like(x)
    shape = (-1, self.ffn_hidden_size, self.hidden_size)
    for e in range(self.num_experts):
        w = (top_k_weights * (top_k_index == e).to(top_k_weights.dtype)).sum(-1, keepdim=True)
        mlp = self.mlp
        y = mlp(x, mlp.w1.view(shape)[e], mlp.v1.view(shape)[e], mlp.w2.view(shape)[e])
        out = out + y * w
    return out.view(batch_size, -1, self.hidden_size)


def _dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM
    from transformers.models.dbrx import modeling_dbrx

    modeling_dbrx.DbrxExperts.forward = _dense_dbrx_experts
    cfg = DbrxConfig(
        d_model=256,
        n_heads=8,
        n_layers=2,
        max_seq_len=2048,
        vocab_size=VOCAB,
        attn_config={"clip_qkv": 8.0, "kv_n_heads": 2},
        ffn_config={"ffn_hidden_size": 512, "moe_num_experts": 2, "moe_top_k": 1},
        experts_implementation=EXPERTS,
    )
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not set
    object.__setattr__(cfg.attn_config, "rope_theta", 10000.0)
    return DbrxForCausalLM(cfg)


def _xglm():
    from transformers import XGLMConfig, XGLMForCausalLM

    cfg = XGLMConfig(
        vocab_size=VOCAB,
        d_model=256,
        num_layers=2,
        attention_heads=8,
        ffn_dim=512,
        max_position_embeddings=2048,
    )
    return XGLMForCausalLM(cfg)


SLIDING_FULL = ["sliding_attention", "full_attention"]
DECODERS = [
    Family(
        "p_deepseek_v3",
        _lm(
            "DeepseekV3",
            num_key_value_heads=8,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=128,
        ),
        "DeepSeek-V3: MLA (q/kv LoRA, decoupled rope 16 + nope 32, v 32), latent cache, dense",
    ),
    Family(
        "p_gpt_oss",
        _lm(
            "GptOss",
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=4,
            experts_implementation=EXPERTS,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=SLIDING_FULL,
        ),
        "GPT-OSS: attention sinks, sliding/full layers, GQA 8/2, tiny MoE",
    ),
    Family(
        "p_starcoder2",
        _lm("Starcoder2", num_key_value_heads=2, sliding_window=16, use_bias=True),
        "Starcoder2: GQA 8/2, biases, LayerNorm, sliding window 16",
    ),
    Family("p_dbrx", _dbrx, "DBRX: clip_qkv 8, fused Wqkv, GQA 8/2, MoE 2 experts top-1"),
    Family(
        "p_olmoe",
        _lm(
            "Olmoe",
            num_key_value_heads=8,
            num_experts=4,
            experts_implementation=EXPERTS,
            num_experts_per_tok=2,
        ),
        "OLMoE: q/k RMSNorm over the whole projection, MoE 4 top-2",
    ),
    Family(
        "p_llama4",
        _lm(
            "Llama4Text",
            "Llama4",
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size_mlp=512,
            moe_layers=[],
            no_rope_layers=[1, 0],
            attention_chunk_size=16,
            use_qk_norm=True,
        ),
        "Llama4 text: chunked (16) rope layer with qk L2 norm, NoPE layer with temperature tuning",
    ),
    Family(
        "p_exaone4",
        _lm("Exaone4", num_key_value_heads=2, sliding_window=16, layer_types=SLIDING_FULL),
        "EXAONE 4: q/k RMSNorm per head, sliding/global (NoPE global) layers",
    ),
    Family("p_helium", _lm("Helium", num_key_value_heads=2, head_dim=32), "Helium: GQA 8/2"),
    Family(
        "p_cohere2",
        _lm("Cohere2", num_key_value_heads=2, sliding_window=16, layer_types=SLIDING_FULL),
        "Cohere2: interleaved rotary on sliding layers, NoPE full layer, parallel block",
    ),
    Family("p_biogpt", _lm("BioGpt"), "BioGPT: MHA, learned positions, scaled embeddings"),
    Family("p_xglm", _xglm, "XGLM: MHA, sinusoidal positions, biases"),
]


# ------------------------------------------------------------- encoders, vision, audio
TT = ["input_ids", "attention_mask", "token_type_ids"]
AM = ["input_ids", "attention_mask"]
LH = ["last_hidden_state"]
ENC = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    attn_implementation="eager",
)


def _text(model, names: list[str], outputs: list[str], vocab: int = VOCAB) -> Net:
    return make_models.hf_text_net(model, vocab, names, outputs)


def _static_shapes(net: Net, seq: int = 16, batch: bool = True) -> Net:
    """Fix the sequence length (and the batch unless ``batch``) of every input and output."""
    net.dynamic_axes = {k: {0: "batch"} for k in net.dynamic_axes} if batch else {}
    if batch:
        net.export_shape, net.test_shape, net.alt_shape = (2, seq), (1, seq), (3, seq)
    else:
        net.export_shape = net.test_shape = net.alt_shape = (1, seq)
    return net


def b_roformer():
    from transformers import RoFormerConfig, RoFormerModel

    return _text(RoFormerModel(RoFormerConfig(embedding_size=128, **ENC)), TT, LH)


def b_squeezebert():
    from transformers import SqueezeBertConfig, SqueezeBertModel

    cfg = SqueezeBertConfig(
        **ENC,
        embedding_size=128,
        q_groups=2,
        k_groups=2,
        v_groups=2,
        post_attention_groups=1,
        intermediate_groups=4,
        output_groups=4,
    )
    return _text(SqueezeBertModel(cfg), TT, LH)


def b_esm():
    from transformers import EsmConfig, EsmForMaskedLM

    cfg = EsmConfig(
        **{**ENC, "vocab_size": 33},
        position_embedding_type="rotary",
        pad_token_id=1,
        mask_token_id=32,
        max_position_embeddings=1026,
        token_dropout=False,
    )
    return _text(EsmForMaskedLM(cfg), AM, ["logits"], 33)


def b_xlm_roberta():
    from transformers import XLMRobertaConfig, XLMRobertaModel

    cfg = XLMRobertaConfig(**ENC, pad_token_id=1, max_position_embeddings=514)
    return _text(XLMRobertaModel(cfg), AM, LH)


def b_bigbird():
    from transformers import BigBirdConfig, BigBirdModel

    cfg = BigBirdConfig(**ENC, attention_type="original_full", max_position_embeddings=512)
    return _text(BigBirdModel(cfg), TT, LH)


def b_convbert():
    from transformers import ConvBertConfig, ConvBertModel

    cfg = ConvBertConfig(**ENC, embedding_size=128, head_ratio=2, conv_kernel_size=9)
    return _text(ConvBertModel(cfg), TT, LH)


def b_funnel():
    from transformers import FunnelConfig, FunnelModel

    cfg = FunnelConfig(
        vocab_size=VOCAB,
        block_sizes=[1, 1],
        num_decoder_layers=1,
        d_model=128,
        n_head=4,
        d_head=32,
        d_inner=256,
        attn_implementation="eager",
    )
    # its relative position tables are built in Python from the sequence length, so both
    # exporters bake that length into the graph
    return _static_shapes(_text(FunnelModel(cfg), TT, LH))


def b_longformer():
    from transformers import LongformerConfig, LongformerModel

    cfg = LongformerConfig(**ENC, attention_window=4, pad_token_id=1, max_position_embeddings=514)
    # the sliding-chunk reshapes are computed in Python: TorchScript bakes the sequence length
    # and the batch (a Gather over batch * seq positions) into the graph
    return _static_shapes(_text(LongformerModel(cfg), AM, LH), batch=False)


def b_levit():
    from transformers import LevitConfig, LevitModel

    cfg = LevitConfig(
        image_size=224,
        hidden_sizes=[64, 96, 128],
        num_attention_heads=[2, 3, 4],
        depths=[1, 1, 1],
        key_dim=[16, 16, 16],
        mlp_ratio=[2, 2, 2],
        attention_ratio=[2, 2, 2],
    )
    return make_models.hf_vision_net(LevitModel(cfg), LH, 224)


def b_sam_vision():
    from transformers import SamVisionConfig, SamVisionModel

    cfg = SamVisionConfig(
        hidden_size=64,
        output_channels=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=256,
        patch_size=16,
        mlp_dim=128,
        window_size=4,
        global_attn_indexes=[1],
        use_rel_pos=True,
        attn_implementation="eager",
    )
    return make_models.hf_vision_net(SamVisionModel(cfg), LH, 256)


def b_sam2_hiera():
    from transformers import Sam2HieraDetConfig, Sam2HieraDetModel

    cfg = Sam2HieraDetConfig(
        hidden_size=32,
        image_size=[128, 128],
        window_positional_embedding_background_size=[4, 4],
        num_query_pool_stages=2,
        blocks_per_stage=[1, 2, 2, 1],
        embed_dim_per_stage=[32, 64, 128, 256],
        num_attention_heads_per_stage=[1, 2, 4, 8],
        window_size_per_stage=[8, 4, 4, 2],
        global_attention_blocks=[4],
        attn_implementation="eager",
    )
    return make_models.hf_vision_net(Sam2HieraDetModel(cfg), LH, 128)


class MaeNoShuffle(torch.nn.Module):
    """ViTMAEModel with mask ratio 0 and a fixed ascending noise: its random patch shuffle is
    the identity, so the export is deterministic."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        cfg = model.config
        self.patches = (cfg.image_size // cfg.patch_size) ** 2

    def forward(self, pixel_values):
        b = pixel_values.shape[0]
        noise = torch.arange(self.patches, dtype=torch.float32).unsqueeze(0).expand(b, -1)
        noise = noise + pixel_values.new_zeros(b, 1)
        return self.model(pixel_values=pixel_values, noise=noise)["last_hidden_state"]


#: the small ViT encoder of the vision families (64x64 images in 8x8 patches)
VIT = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    image_size=64,
    patch_size=8,
    attn_implementation="eager",
)


def b_vitmae():
    from transformers import ViTMAEConfig, ViTMAEModel

    cfg = ViTMAEConfig(**VIT, mask_ratio=0.0)
    model = ViTMAEModel(cfg)
    perturb_constant_params(model)
    return Net(
        module=MaeNoShuffle(model),
        inputs=lambda b, _s: {"pixel_values": torch.randn(b, 3, 64, 64)},
        output_names=LH,
        dynamic_axes={"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}},
        export_shape=(2, 0),
        test_shape=(1, 0),
        alt_shape=(2, 0),
    )


def b_pvt_v2():
    from transformers import PvtV2Config, PvtV2Model

    cfg = PvtV2Config(
        image_size=224,
        depths=[1, 1, 1, 1],
        hidden_sizes=[32, 64, 96, 128],
        num_attention_heads=[1, 2, 3, 4],
        sr_ratios=[8, 4, 2, 1],
        mlp_ratios=[2, 2, 2, 2],
    )
    return make_models.hf_vision_net(PvtV2Model(cfg), LH, 224)


def _conformer(kind: str):
    """A builder of a Wav2Vec2-Conformer with ``kind`` position embeddings."""

    def build():
        from transformers import Wav2Vec2ConformerConfig, Wav2Vec2ConformerModel

        cfg = Wav2Vec2ConformerConfig(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            conv_dim=(32,) * 7,
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            conv_depthwise_kernel_size=7,
            position_embeddings_type=kind,
            attn_implementation="eager",
        )
        return make_models.audio_net(Wav2Vec2ConformerModel(cfg))

    return build


T5 = dict(
    vocab_size=VOCAB,
    d_model=128,
    d_kv=32,
    d_ff=256,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    use_cache=False,
    decoder_start_token_id=0,
    attn_implementation="eager",
)
BART = dict(
    vocab_size=VOCAB,
    d_model=128,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=256,
    decoder_ffn_dim=256,
    max_position_embeddings=512,
    use_cache=False,
)


def b_mt5():
    from transformers import MT5Config, MT5ForConditionalGeneration

    return make_models.seq2seq_net(MT5ForConditionalGeneration(MT5Config(**T5)), VOCAB)


def b_umt5():
    from transformers import UMT5Config, UMT5ForConditionalGeneration

    return make_models.seq2seq_net(UMT5ForConditionalGeneration(UMT5Config(**T5)), VOCAB)


def b_mbart():
    from transformers import MBartConfig, MBartForConditionalGeneration

    return make_models.seq2seq_net(MBartForConditionalGeneration(MBartConfig(**BART)), VOCAB)


def b_marian():
    from transformers import MarianConfig, MarianMTModel

    cfg = MarianConfig(**BART, pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1)
    return make_models.seq2seq_net(MarianMTModel(cfg), VOCAB)


def b_siglip_vision():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(**VIT)
    outputs = ["last_hidden_state", "pooler_output"]
    return make_models.hf_vision_net(SiglipVisionModel(cfg), outputs, 64)


class _TorchPool(torch.nn.Module):
    """A learned query pooling a sequence through ``nn.MultiheadAttention`` with its weights
    (the default ``need_weights=True``: torch's 3-D path over batch × heads)."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.query = torch.nn.Parameter(torch.randn(1, 1, width))
        self.attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, x):
        q = self.query.expand(x.shape[0], -1, -1)
        return self.attention(q, x, x)[0]


def _torch_net(module: torch.nn.Module, out: str) -> Net:
    """A torch module on x [batch, seq, 64]."""
    perturb_constant_params(module)
    return Net(
        module=module,
        inputs=lambda batch, seq: {"x": torch.randn(batch, seq, 64)},
        output_names=[out],
        dynamic_axes={"x": {0: "batch", 1: "seq"}, out: {0: "batch"}},
        export_shape=(2, 16),
        test_shape=(1, 24),
        alt_shape=(3, 9),
    )


def b_torch_encoder():
    torch.backends.mha.set_fastpath_enabled(False)  # TorchScript cannot export the fused path
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return _torch_net(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), "y")


def b_torch_pool():
    return _torch_net(_TorchPool(), "y")


#: name -> (builder, mechanism), registered into make_models.MODELS as NAME and NAME_dynamo
OTHERS = {
    "p_roformer": (b_roformer, "RoFormer: rotary position embedding in a BERT encoder"),
    "p_esm": (b_esm, "ESM-2: rotary encoder, protein masked LM"),
    "p_squeezebert": (b_squeezebert, "SqueezeBERT: 1x1 grouped-conv q/k/v over [B,C,S]"),
    "p_xlm_roberta": (b_xlm_roberta, "XLM-RoBERTa: post-norm MHA, padding-offset positions"),
    "p_bigbird": (b_bigbird, "BigBird: full-attention mode"),
    "p_convbert": (b_convbert, "ConvBERT: mixed attention, half the heads span-based conv"),
    "p_funnel": (b_funnel, "Funnel: relative attention with token-type bias, pooling"),
    "p_longformer": (b_longformer, "Longformer: sliding-window (4) chunked attention"),
    "p_levit": (b_levit, "LeViT: learned attention bias table, value dim 2x the key's"),
    "p_sam_vision": (b_sam_vision, "SAM ViT: windowed/global, decomposed relative positions"),
    "p_sam2_hiera": (b_sam2_hiera, "SAM2 Hiera: packed q/k/v of an image, pooled queries"),
    "p_vitmae": (b_vitmae, "ViT-MAE: encoder with a fixed patch order"),
    "p_pvt_v2": (b_pvt_v2, "PVTv2: spatial-reduction attention"),
    "p_w2v2_conformer_rel": (_conformer("relative"), "Wav2Vec2-Conformer: relative positions"),
    "p_w2v2_conformer_rotary": (_conformer("rotary"), "Wav2Vec2-Conformer: rotary"),
    "p_mt5": (b_mt5, "mT5: bucketed relative position bias, unscaled scores"),
    "p_umt5": (b_umt5, "UMT5: a relative position bias in every layer"),
    "p_mbart": (b_mbart, "mBART: pre-norm encoder-decoder, scaled embeddings"),
    "p_marian": (b_marian, "Marian: post-norm encoder-decoder, sinusoidal positions"),
    "p_siglip_vision": (b_siglip_vision, "SigLIP vision: attention-pooling head"),
    "p_torch_encoder": (b_torch_encoder, "torch nn.TransformerEncoder (nn.MultiheadAttention)"),
    "p_torch_pool": (b_torch_pool, "torch nn.MultiheadAttention pooling with a learned query"),
}
for _name, (_build, _note) in OTHERS.items():
    make_models.MODELS[_name] = Spec(_build)
    make_models.MODELS[_name + "_dynamo"] = Spec(_build, _name, "dynamo")
# Longformer's TorchScript graph computes its sliding-chunk attention over the padded rows in
# another order than torch: a relative L2 of about 1e-3, at the edge of the default tolerance
make_models.MODELS["p_longformer"].tolerance = 1e-2


def export_other(name: str, exporter: str, out: str) -> dict:
    """make_models.produce for one exporter of a non-decoder; the result row."""
    reg = name if exporter == "torchscript" else name + "_dynamo"
    t0 = time.perf_counter()
    row = {"name": reg, "exporter": exporter, "family": OTHERS[name][1]}
    try:
        row["info"] = make_models.produce(reg, out, False)
        row["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported per model, the others go on
        row["ok"] = False
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        if os.environ.get("MAKE_LLMS_DEBUG"):
            traceback.print_exc()
        for ext in (".json", ".npz"):  # a sidecar left from an earlier run would list it
            Path(out, reg + ext).unlink(missing_ok=True)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row, default=str), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models/families", help="folder for NAME.onnx and NAME.json")
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument(
        "--exporters",
        default="torchscript,dynamo",
        help="comma-separated: torchscript (opset 17), dynamo (opset 18)",
    )
    ap.add_argument("--list", action="store_true", help="list the families and exit")
    args = ap.parse_args()
    decoders = {f.name: f for f in DECODERS}
    if args.list:
        notes = [(f.name, f.note) for f in DECODERS] + [(n, o[1]) for n, o in OTHERS.items()]
        for name, note in notes:
            print(f"{name:24s} {note}")
        return 0
    wanted = [s for s in args.only.split(",") if s] or [*decoders, *OTHERS]
    unknown = sorted(set(wanted) - set(decoders) - set(OTHERS))
    if unknown:
        print(f"error: unknown families {unknown}", file=sys.stderr)
        return 2
    exporters = [e for e in args.exporters.split(",") if e]
    if set(exporters) - set(EXPORTERS):
        print(f"error: unknown exporters in {args.exporters!r}", file=sys.stderr)
        return 2
    quiet_warnings()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in wanted:
        if name in decoders:
            rows += make_llms.export_family(decoders[name], args.out, exporters, False)
        else:
            rows += [export_other(name, e, args.out) for e in exporters]
    with open(os.path.join(args.out, "export_log.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
    failed = [r["name"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} exported, failed: {failed or 'none'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Transformer families whose attention scores are transformed before the Softmax, or whose
attention is spelled by PyTorch itself (small configs, random weights, eager attention unless
said), registered into make_models.py's ``MODELS``.

- gemma2, gemma2_kv: logit soft-capping ``tanh(s / c) · c`` between the scaled QKᵀ and the
  mask (Gemma2ForCausalLM; gemma2_kv is one decoder step with a KV cache).
- bloom: ALiBi, slopes times key positions built from the attention mask, added to the scores
  (BloomForCausalLM; ``baddbmm`` over [B·N, S, T]).
- deberta_v2: disentangled content-to-position and position-to-content terms added to the
  scores (DebertaV2Model).
- wavlm: a gated relative position bias (WavLMModel; its test shape is 49 frames).
- swinv2: cosine attention (normalized q and k, a clamped and exponentiated logit scale) with a
  continuous relative position bias (Swinv2Model).
- bmm_encoder: the attention of transformers' eager BART, Marian, Whisper and CLIP before 4.4x
  (``torch.bmm`` over [B·N,T,H], the padding mask added to the scores viewed as [B,N,T,S], the
  Softmax over them viewed back), a post-norm encoder of 2 layers written out here.
- einsum_unet_block: Stable Diffusion's transformer block as ldm writes its CrossAttention:
  heads folded to ``(b h) n d``, ``einsum('b i d, b j d -> b i j')`` scores, self-attention
  over the latent tokens and cross-attention to a text context of another length.
- sdpa_llama, sdpa_llama_kv: a grouped-query Llama with transformers' default ``sdpa``
  attention (the dynamo exporter folds HF's repeat_kv into its 3-D key); sdpa_llama_kv is one
  decoder step with a KV cache.
- timm_sdpa: timm's ViT attention, one qkv projection unbound into q, k and v, then
  ``F.scaled_dot_product_attention``; timm_qknorm with ``qk_norm=True`` (a LayerNorm over each
  head of q and k).
- detr_mha: DETR's transformer as its code calls it: ``torch.nn.MultiheadAttention`` with the
  attention weights left on (its default, the 3-D path over [B·N,T,H]), sequence-first, a key
  padding mask, and learned object queries cross-attending to the encoder's memory.

Each has a ``*_dynamo`` variant (dynamo exporter, opset 18); the others are TorchScript, opset 17.
"""

from __future__ import annotations

import torch
from export_utils import (
    CacheWrapper,
    Net,
    Wrapper,
    cache_names,
    image_inputs,
    perturb_constant_params,
    text_inputs,
)

VOCAB = 1024


def _text_net(model, names: list[str], outputs: list[str], **extra) -> Net:
    perturb_constant_params(model)
    axes = {n: {0: "batch", 1: "seq"} for n in names}
    axes.update({o: {0: "batch", 1: "seq"} for o in outputs})
    return Net(
        module=Wrapper(model, names, outputs, **extra),
        inputs=text_inputs(VOCAB, tuple(names)),
        output_names=outputs,
        dynamic_axes=axes,
    )


def _kv_step_net(model, heads: int, head_dim: int) -> Net:
    """One decoder step of ``model`` over a KV cache of ``heads`` × ``head_dim``: 1 new token
    over a past of 128 (test), 4 over 16 (export)."""
    perturb_constant_params(model)
    layers = model.config.num_hidden_layers
    past_names = cache_names(layers, "past_key_values")
    present_names = cache_names(layers, "present")

    def make(batch: int, past: int) -> dict[str, torch.Tensor]:
        new = 1 if past >= 64 else 4
        mask = torch.ones(batch, past + new, dtype=torch.int64)
        out = {
            "input_ids": torch.randint(0, VOCAB, (batch, new)),
            "attention_mask": mask,
        }
        for name in past_names:
            out[name] = torch.randn(batch, heads, past, head_dim)
        return out

    axes = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total_seq"},
        "logits": {0: "batch", 1: "seq"},
    }
    axes.update({n: {0: "batch", 2: "past_seq"} for n in past_names})
    axes.update({n: {0: "batch", 2: "total_seq"} for n in present_names})
    return Net(
        module=CacheWrapper(model, ["input_ids", "attention_mask"], layers),
        inputs=make,
        output_names=["logits"] + present_names,
        dynamic_axes=axes,
    )


def gemma2_config():
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=64,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        attn_implementation="eager",
    )


def build_gemma2() -> Net:
    from transformers import Gemma2ForCausalLM

    return _text_net(
        Gemma2ForCausalLM(gemma2_config()),
        ["input_ids", "attention_mask"],
        ["logits"],
        use_cache=False,
    )


def build_gemma2_kv() -> Net:
    """One decoder step: 1 new token over a past of 128 (test), 4 over 16 (export)."""
    from transformers import Gemma2ForCausalLM

    config = gemma2_config()
    return _kv_step_net(Gemma2ForCausalLM(config), config.num_key_value_heads, config.head_dim)


def build_bloom() -> Net:
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        vocab_size=VOCAB, hidden_size=128, n_layer=2, n_head=4, attn_implementation="eager"
    )
    return _text_net(
        BloomForCausalLM(config), ["input_ids", "attention_mask"], ["logits"], use_cache=False
    )


def build_deberta_v2() -> Net:
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=512,
        relative_attention=True,
        position_buckets=64,
        max_relative_positions=-1,
        pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        attn_implementation="eager",
    )
    return _text_net(
        DebertaV2Model(config),
        ["input_ids", "attention_mask"],
        ["last_hidden_state"],
    )


#: audio samples per WavLM frame (the conv feature extractor's stride) and the receptive field
HOP, FIELD = 320, 400


def build_wavlm() -> Net:
    """``seq`` is the number of frames: ``(seq - 1) · 320 + 400`` samples."""
    from transformers import WavLMConfig, WavLMModel

    config = WavLMConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        conv_dim=(64,) * 7,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        num_buckets=64,
        max_bucket_distance=200,
        attn_implementation="eager",
    )
    model = WavLMModel(config)
    perturb_constant_params(model)

    def make(batch: int, frames: int) -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(batch, (frames - 1) * HOP + FIELD)}

    return Net(
        module=Wrapper(model, ["input_values"], ["last_hidden_state"]),
        inputs=make,
        output_names=["last_hidden_state"],
        dynamic_axes={
            "input_values": {0: "batch", 1: "samples"},
            "last_hidden_state": {0: "batch", 1: "frames"},
        },
        export_shape=(2, 32),
        test_shape=(1, 49),
        alt_shape=(2, 40),
    )


def build_swinv2() -> Net:
    from transformers import Swinv2Config, Swinv2Model

    config = Swinv2Config(
        image_size=128,
        patch_size=4,
        embed_dim=48,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=8,
        attn_implementation="eager",
    )
    model = Swinv2Model(config)
    perturb_constant_params(model)
    outputs = ["last_hidden_state"]
    return Net(
        module=Wrapper(model, ["pixel_values"], outputs),
        inputs=image_inputs(3, 128, "pixel_values"),
        output_names=outputs,
        dynamic_axes={n: {0: "batch"} for n in ["pixel_values"] + outputs},
        export_shape=(2, 0),
        test_shape=(1, 0),
        alt_shape=(2, 0),
    )


class BmmAttention(torch.nn.Module):
    """BartAttention's forward as transformers 4.2x wrote it (self-attention)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.scaling = self.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            torch.nn.Linear(width, width) for _ in range(4)
        )

    def _shape(self, t, seq: int, bsz: int):
        return t.view(bsz, seq, self.heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, x, mask):
        bsz, tgt, width = x.size()
        proj_shape = (bsz * self.heads, -1, self.head_dim)
        q = self._shape(self.q_proj(x) * self.scaling, tgt, bsz).view(*proj_shape)
        k = self._shape(self.k_proj(x), -1, bsz).view(*proj_shape)
        v = self._shape(self.v_proj(x), -1, bsz).view(*proj_shape)
        src = k.size(1)
        w = torch.bmm(q, k.transpose(1, 2))
        w = w.view(bsz, self.heads, tgt, src) + mask
        w = torch.nn.functional.softmax(w.view(bsz * self.heads, tgt, src), dim=-1)
        out = torch.bmm(w, v).view(bsz, self.heads, tgt, self.head_dim).transpose(1, 2)
        return self.out_proj(out.reshape(bsz, tgt, width))


class BmmEncoder(torch.nn.Module):
    def __init__(self, width: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.attn = torch.nn.ModuleList([BmmAttention(width, heads) for _ in range(layers)])
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(width) for _ in range(layers)])

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        neg = torch.finfo(x.dtype).min
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * neg
        for attn, norm in zip(self.attn, self.norms):
            x = norm(x + attn(x, mask))
        return x


def build_bmm_encoder() -> Net:
    model = BmmEncoder()
    perturb_constant_params(model)
    names = ["input_ids", "attention_mask"]
    return Net(
        module=model,
        inputs=text_inputs(VOCAB, tuple(names)),
        output_names=["hidden"],
        dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "hidden"]},
    )


class EinsumAttention(torch.nn.Module):
    """ldm's CrossAttention (Stable Diffusion), einops' rearranges written as reshapes."""

    def __init__(self, width: int, context: int, heads: int = 4):
        super().__init__()
        self.heads, self.scale = heads, (width // heads) ** -0.5
        self.to_q = torch.nn.Linear(width, width, bias=False)
        self.to_k = torch.nn.Linear(context, width, bias=False)
        self.to_v = torch.nn.Linear(context, width, bias=False)
        self.to_out = torch.nn.Linear(width, width)

    def forward(self, x, context):
        h = self.heads

        def fold(t):  # 'b n (h d) -> (b h) n d'
            b, n, _ = t.shape
            return t.reshape(b, n, h, -1).permute(0, 2, 1, 3).reshape(b * h, n, -1)

        q, k, v = fold(self.to_q(x)), fold(self.to_k(context)), fold(self.to_v(context))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        out = torch.einsum("b i j, b j d -> b i d", sim.softmax(dim=-1), v)
        b, n = x.shape[0], x.shape[1]
        out = out.reshape(b, h, n, -1).permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.to_out(out)


class EinsumBlock(torch.nn.Module):
    def __init__(self, width: int = 64, context: int = 32):
        super().__init__()
        self.attn1 = EinsumAttention(width, width)
        self.attn2 = EinsumAttention(width, context)
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)

    def forward(self, hidden, context):
        x = self.norm1(hidden)
        hidden = hidden + self.attn1(x, x)
        return hidden + self.attn2(self.norm2(hidden), context)


def build_einsum_unet_block() -> Net:
    model = EinsumBlock()
    perturb_constant_params(model)

    def make(batch: int, seq: int) -> dict[str, torch.Tensor]:
        return {"hidden": torch.randn(batch, seq, 64), "context": torch.randn(batch, 77, 32)}

    return Net(
        module=model,
        inputs=make,
        output_names=["out"],
        dynamic_axes={
            "hidden": {0: "batch", 1: "seq"},
            "context": {0: "batch"},
            "out": {0: "batch", 1: "seq"},
        },
        test_shape=(1, 256),
    )


class DetrStyle(torch.nn.Module):
    """Encoder self-attention over image features [B,S,C] with a padding mask, then object
    queries: self-attention, and cross-attention to the memory; post-norm residuals."""

    def __init__(self, channels: int = 32, width: int = 64, heads: int = 4, queries: int = 10):
        super().__init__()
        nn = torch.nn
        self.proj = nn.Linear(channels, width)
        self.enc = nn.ModuleList([nn.MultiheadAttention(width, heads) for _ in range(2)])
        self.dec_self = nn.ModuleList([nn.MultiheadAttention(width, heads) for _ in range(2)])
        self.dec_cross = nn.ModuleList([nn.MultiheadAttention(width, heads) for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(6)])
        self.queries = nn.Parameter(torch.randn(queries, 1, width))

    def forward(self, features, pad_mask):
        src = self.proj(features).transpose(0, 1)  # [S, B, width]
        pad = pad_mask == 0
        for attn, norm in zip(self.enc, self.norms[:2]):
            src = norm(src + attn(src, src, src, key_padding_mask=pad)[0])
        tgt = self.queries.expand(-1, features.shape[0], -1)
        for i, (sa, ca) in enumerate(zip(self.dec_self, self.dec_cross)):
            tgt = self.norms[2 + 2 * i](tgt + sa(tgt, tgt, tgt)[0])
            tgt = self.norms[3 + 2 * i](tgt + ca(tgt, src, src, key_padding_mask=pad)[0])
        return tgt.transpose(0, 1)


def build_detr_mha() -> Net:
    model = DetrStyle()
    perturb_constant_params(model)

    def make(batch: int, seq: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, max(1, seq // 2) :] = 0
        return {"features": torch.randn(batch, seq, 32), "pad_mask": mask}

    return Net(
        module=model,
        inputs=make,
        output_names=["hidden"],
        # the TorchScript tracer bakes the sequence length into nn.MultiheadAttention's views
        dynamic_axes={"features": {0: "batch"}, "pad_mask": {0: "batch"}, "hidden": {0: "batch"}},
        test_shape=(1, 16),
        alt_shape=(3, 16),
    )


def sdpa_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )


def build_sdpa_llama() -> Net:
    """A grouped-query decoder with transformers' default ``sdpa`` attention: HF's repeat_kv
    folded into dynamo's 3-D key."""
    from transformers import LlamaForCausalLM

    names = ["input_ids", "attention_mask"]
    return _text_net(LlamaForCausalLM(sdpa_llama_config()), names, ["logits"], use_cache=False)


def build_sdpa_llama_kv() -> Net:
    """The same decoder as deployed: one step over a KV cache (1 new token over a past of 128
    at test, 4 over 16 at export)."""
    from transformers import LlamaForCausalLM

    config = sdpa_llama_config()
    head_dim = config.hidden_size // config.num_attention_heads
    return _kv_step_net(LlamaForCausalLM(config), config.num_key_value_heads, head_dim)


class TimmAttention(torch.nn.Module):
    """timm's ViT attention: one qkv projection, ``reshape(B,N,3,h,d).permute(2,0,3,1,4)``,
    ``unbind(0)``, ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int = 64, heads: int = 4, qk_norm: bool = False):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        norm = torch.nn.LayerNorm if qk_norm else torch.nn.Identity
        self.q_norm, self.k_norm = norm(width // heads), norm(width // heads)

    def forward(self, x):
        b, n, c = x.shape
        h = self.norm(x)
        qkv = self.qkv(h).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


class TimmBlocks(torch.nn.Module):
    def __init__(self, depth: int = 2, qk_norm: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(TimmAttention(qk_norm=qk_norm) for _ in range(depth))

    def forward(self, tokens):
        for block in self.blocks:
            tokens = block(tokens)
        return tokens


def build_timm_sdpa(qk_norm: bool = False) -> Net:
    model = TimmBlocks(qk_norm=qk_norm)
    perturb_constant_params(model)
    return Net(
        module=model,
        inputs=lambda batch, seq: {"tokens": torch.randn(batch, seq, 64)},
        output_names=["hidden"],
        dynamic_axes={"tokens": {0: "batch", 1: "seq"}, "hidden": {0: "batch", 1: "seq"}},
        test_shape=(1, 49),
        alt_shape=(2, 49),
    )


BUILDERS = {
    "gemma2": build_gemma2,
    "gemma2_kv": build_gemma2_kv,
    "bloom": build_bloom,
    "deberta_v2": build_deberta_v2,
    "wavlm": build_wavlm,
    "swinv2": build_swinv2,
    "detr_mha": build_detr_mha,
    "bmm_encoder": build_bmm_encoder,
    "einsum_unet_block": build_einsum_unet_block,
    "sdpa_llama": build_sdpa_llama,
    "sdpa_llama_kv": build_sdpa_llama_kv,
    "timm_sdpa": build_timm_sdpa,
    "timm_qknorm": lambda: build_timm_sdpa(qk_norm=True),
}


def score_models(spec) -> dict:
    """make_models.py's registry entries: each family, TorchScript and dynamo."""
    found = {}
    for name, build in BUILDERS.items():
        found[name] = spec(build)
        found[f"{name}_dynamo"] = spec(build, name, "dynamo")
    return found

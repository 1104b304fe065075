"""Small decoder LLMs with a KV cache, exported like a deployment would (not committed).

    /path/to/venv/bin/python examples/make_llms.py --out models/llm [--only NAME,...] [--list]
        [--fp16 [--fp16-only]]

Needs torch and transformers (built with torch 2.14, transformers 5.24). Every model is a
transformers causal LM built from a small config (2 layers, hidden 256, vocab >= 32k) with
seeded random weights (nothing is downloaded), wrapped so that its ONNX graph has the inputs a
generation loop feeds and the outputs it reads back:

    input_ids (batch, sequence_length), attention_mask (batch, total_sequence_length),
    position_ids (batch, sequence_length),
    past_key_values.{i}.key / .value (batch, kv_heads, past_sequence_length, head_dim)
    -> logits (batch, sequence_length, vocab), present.{i}.key / .value
       (batch, kv_heads, total_sequence_length, head_dim)

The cache is transformers' DynamicCache filled with the past tensors, so every layer's present
is Concat(past, new) — also for Mistral's sliding-window layers, whose window is applied by
the attention mask (a full cache, as onnxruntime's GroupQueryAttention with local_window_size
keeps it). Families: llama (GQA 8/2), qwen2 (GQA, q/k/v biases), mistral (GQA, sliding window
16), phi3 (MHA, fused qkv_proj and gate_up_proj), gemma (MQA, head_dim 64, GELU-tanh, scaled
embeddings), gpt_neox (MHA, partial rotary: a quarter of each head), qwen3 (GQA, q/k RMSNorm
before the rotation), and more, one mechanism each (``--list``): interleaved partial rotary
before the heads' Transpose (gptj, codegen), multi-query with a fused c_attn (gpt_bigcode), a
LayerNorm per head (stablelm), q/k/v interleaved per head (persimmon), q/k norms over the whole
projection (olmo2), attention_multiplier (granite), local/global layers (gemma3), NoPE layers
(smollm3). Cohere and GLM are exported with the dynamo exporter only (TorchScript stops with
"All tensors must have the same rank"). Each is written as NAME.onnx (TorchScript, opset 17)
and NAME_dynamo.onnx (torch.export, opset 18) with NAME.json = {"inputs": {name: shape}} (a
prefill of 8 tokens after 16 cached ones, batch 1).

Each export passes onnx.checker, loads in onnxruntime (CPU) and is compared with torch on two
steps of a generation: a prefill of 20 tokens with an empty cache (batch 2; longer than the
Mistral window), then one decode step fed with the prefill's present tensors. A model that
fails is reported and the others go on; the exit code is 1 if any failed.

``--fp16`` also writes two float16 forms of each export, converted here from the float32 ONNX
(every float32 initializer, Constant, ConstantOfShape value and Cast target in float16, clipped
to its finite range): NAME_fp16.onnx computes and exchanges float16 (logits and cache too), and
NAME_fp16io.onnx keeps the float32 interface, cast at the graph's boundary
(onnxconverter-common's keep_io_types). Each is compared with the float32 export on a prefill
and a decode step fed with its own cache (relative L2 <= 2e-2; measured 6.5e-4 to 9.0e-4).
``--fp16-only`` converts the NAME.onnx files already in --out (no torch export).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from export_utils import (
    Net,
    check_model,
    export_dynamo,
    export_torchscript,
    perturb_constant_params,
    quiet_warnings,
    rel_l2,
    seed_all,
    seed_for,
    summarize,
)
from onnx import numpy_helper
from torch import nn

VOCAB = 32000
TOLERANCE = 1e-4  # relative L2 of logits and presents, onnxruntime vs torch


# ------------------------------------------------------------------------------ configs
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(cfg)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=16,
        rms_norm_eps=1e-5,
    )
    return MistralForCausalLM(cfg)


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        vocab_size=32064,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        original_max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        pad_token_id=32000,
    )
    return Phi3ForCausalLM(cfg)


def _gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
    )
    return GemmaForCausalLM(cfg)


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        rotary_pct=0.25,
        max_position_embeddings=2048,
        use_parallel_residual=True,
    )
    return GPTNeoXForCausalLM(cfg)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg)


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        bias=False,
        alibi=False,
        max_position_embeddings=2048,
    )
    return FalconForCausalLM(cfg)


def _falcon_gqa():
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_kv_heads=2,
        new_decoder_architecture=True,
        bias=False,
        alibi=False,
        max_position_embeddings=2048,
    )
    return FalconForCausalLM(cfg)


def _phi(qk_layernorm: bool = False):
    from transformers import PhiConfig, PhiForCausalLM

    cfg = PhiConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        partial_rotary_factor=0.4,
        qk_layernorm=qk_layernorm,
        max_position_embeddings=2048,
    )
    return PhiForCausalLM(cfg)


def _small(cls_name: str, lm_name: str = "", **kw):
    """A causal LM of transformers' ``cls_name`` family (``lm_name``ForCausalLM when its name
    differs): 2 layers, hidden 256, 8 heads."""
    import transformers

    base = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        max_position_embeddings=2048,
    )
    base.update(kw)
    cfg = getattr(transformers, f"{cls_name}Config")(**base)
    return getattr(transformers, f"{lm_name or cls_name}ForCausalLM")(cfg)


def _gptj():
    from transformers import GPTJConfig, GPTJForCausalLM

    cfg = GPTJConfig(
        vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=8, rotary_dim=16, n_positions=2048
    )
    return GPTJForCausalLM(cfg)


def _codegen():
    from transformers import CodeGenConfig, CodeGenForCausalLM

    cfg = CodeGenConfig(
        vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=8, rotary_dim=16, n_positions=2048
    )
    return CodeGenForCausalLM(cfg)


def _gpt_bigcode():
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    cfg = GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=8, multi_query=True, n_positions=2048
    )
    return GPTBigCodeForCausalLM(cfg)


#: a sliding-window layer (8 keys) then a global one
SLIDING_THEN_GLOBAL = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])


@dataclass
class Family:
    name: str
    build: Callable[[], nn.Module]
    note: str
    exporters: tuple[str, ...] = ("torchscript", "dynamo")  # the ones that can export it


FAMILIES = [
    Family("llama", _llama, "Llama: GQA 8 query / 2 kv heads, RoPE theta 1e4"),
    Family("qwen2", _qwen2, "Qwen2: GQA 8/2, q/k/v projection biases, RoPE theta 1e6"),
    Family("mistral", _mistral, "Mistral: GQA 8/2, sliding window 16 (mask), full cache"),
    Family("phi3", _phi3, "Phi-3: MHA 8 heads, fused qkv_proj and gate_up_proj"),
    Family("gemma", _gemma, "Gemma: MQA 4/1, head_dim 64, GELU-tanh MLP, (1+w) RMSNorm"),
    Family("gpt_neox", _gpt_neox, "GPT-NeoX: MHA 8 heads, partial rotary (a quarter of the head)"),
    Family("qwen3", _qwen3, "Qwen3: GQA 8/2, q/k RMSNorm before the rotation, RoPE theta 1e6"),
    Family("falcon", _falcon, "Falcon: multi-query (8/1), fused query_key_value, parallel attn"),
    Family("falcon_gqa", _falcon_gqa, "Falcon new_decoder_architecture: GQA 8/2, fused QKV"),
    Family("phi2", _phi, "Phi-2: MHA 8 heads, 40 % partial rotary (12 of 32 dims), LayerNorm"),
    Family("phi2_qkln", lambda: _phi(True), "Phi-2 with q/k LayerNorm before the rotation"),
    Family("gptj", _gptj, "GPT-J: interleaved partial rotary (16 of 32) before the head transpose"),
    Family("codegen", _codegen, "CodeGen: fused qkv in 4 groups, interleaved partial rotary"),
    Family("gpt_bigcode", _gpt_bigcode, "GPT-BigCode: multi-query, fused c_attn, no rotary"),
    Family(
        "stablelm",
        lambda: _small(
            "StableLm", num_key_value_heads=2, partial_rotary_factor=0.25, qk_layernorm=True
        ),
        "StableLM: GQA, 25 % rotary, a LayerNorm per head on q and k",
    ),
    Family(
        "persimmon",
        lambda: _small("Persimmon", qk_layernorm=True, partial_rotary_factor=0.5),
        "Persimmon: fused qkv [N,3,H], q/k LayerNorm, half rotary",
    ),
    Family(
        "cohere",
        lambda: _small("Cohere", num_key_value_heads=2, use_qk_norm=True),
        "Cohere: interleaved rotary, q/k LayerNorm, parallel block",
        ("dynamo",),
    ),
    Family(
        "olmo2",
        lambda: _small("Olmo2", num_key_value_heads=2),
        "OLMo 2: q/k RMSNorm over the whole projection before the head split",
    ),
    Family(
        "granite",
        lambda: _small(
            "Granite",
            num_key_value_heads=2,
            attention_multiplier=0.05,
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        ),
        "Granite: GQA, attention_multiplier instead of 1/sqrt(d)",
    ),
    Family(
        "glm",
        lambda: _small(
            "Glm", num_key_value_heads=2, pad_token_id=0, head_dim=32, partial_rotary_factor=0.5
        ),
        "GLM-4: interleaved half rotary, GQA",
        ("dynamo",),
    ),
    Family(
        "gemma3",
        lambda: _small(
            "Gemma3Text",
            "Gemma3",
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
        ),
        "Gemma 3: q/k RMSNorm, local/global layers, query_pre_attn_scalar",
    ),
    Family(
        "nemotron",
        lambda: _small("Nemotron", num_key_value_heads=2, partial_rotary_factor=0.5),
        "Nemotron: half rotary, LayerNorm1p, relu2",
    ),
    Family(
        "smollm3",
        lambda: _small("SmolLM3", num_key_value_heads=2, pad_token_id=0, no_rope_layers=[1, 0]),
        "SmolLM3: GQA, a NoPE layer",
    ),
    # the KV-cache half of examples/transformers/sweep_families.py: families tuned for by none
    # of the above
    Family("olmo", lambda: _small("Olmo", num_key_value_heads=2), "OLMo: GQA, LayerNorm"),
    Family("bitnet", lambda: _small("BitNet", num_key_value_heads=2), "BitNet: sub-norms"),
    Family(
        "seed_oss",
        lambda: _small("SeedOss", num_key_value_heads=2, head_dim=32),
        "Seed-OSS: GQA, q/k/v biases",
    ),
    Family("arcee", lambda: _small("Arcee", num_key_value_heads=2), "Arcee: GQA, ReLU² MLP"),
    Family(
        "hunyuan_dense",
        lambda: _small("HunYuanDenseV1", num_key_value_heads=2, head_dim=32),
        "HunYuan dense: q/k RMSNorm after the rotation",
    ),
    Family(
        "ernie4_5",
        lambda: _small("Ernie4_5", num_key_value_heads=2, head_dim=32),
        "ERNIE 4.5: interleaved rotary",
        ("dynamo",),
    ),
    Family(
        "gpt_neo",
        lambda: _small(
            "GPTNeo",
            num_layers=2,
            num_heads=8,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            max_position_embeddings=512,
        ),
        "GPT-Neo: global and local (8) layers, unscaled scores",
    ),
    Family(
        "exaone4",
        lambda: _small(
            "Exaone4",
            num_key_value_heads=2,
            head_dim=32,
            **SLIDING_THEN_GLOBAL,
        ),
        "EXAONE 4: q/k RMSNorm, sliding and global layers",
    ),
    Family(
        "apertus",
        lambda: _small("Apertus", num_key_value_heads=2),
        "Apertus: xIELU MLP, q/k RMSNorm",
        ("dynamo",),
    ),
    # the KV-cache half of sweep_families.py's third batch: one new mechanism each
    Family(
        "diffllama",
        lambda: _small("DiffLlama", num_key_value_heads=2),
        "DiffLlama: differential attention (one Softmax, two value halves)",
        ("dynamo",),  # TorchScript has no aten::rms_norm at opset 17
    ),
    Family(
        "cohere2",
        lambda: _small(
            "Cohere2",
            num_key_value_heads=2,
            **SLIDING_THEN_GLOBAL,
        ),
        "Cohere 2: parallel block, interleaved rotary on sliding layers only",
        ("dynamo",),  # TorchScript's export of its mask fails
    ),
    Family(
        "granite_swa",
        lambda: _small(
            "GraniteSWA",
            num_key_value_heads=2,
            **SLIDING_THEN_GLOBAL,
        ),
        "Granite SWA: attention sinks as a gate on the context, sliding and global layers",
    ),
    Family(
        "gpt_oss",
        lambda: _experts(
            _small(
                "GptOss",
                num_key_value_heads=2,
                head_dim=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                **SLIDING_THEN_GLOBAL,
            )
        ),
        "GPT-OSS: a learned sink logit per head, sliding and global layers, experts",
    ),
]


def _experts(model):
    """``model`` with its experts as batched MatMuls: the default loop counts tokens with
    histc, which no exporter takes."""
    model.config._experts_implementation = "batched_mm"
    return model


# ------------------------------------------------------------------------------ wrapping
class CachedDecoder(nn.Module):
    """forward(input_ids, attention_mask, position_ids, k0, v0, k1, v1, ...) ->
    (logits, present k0, v0, ...): the cache as plain tensors, so that the graph's inputs and
    outputs are the past/present tensors a generation loop binds."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.layers = model.config.num_hidden_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers.cache_utils import DynamicCache, DynamicLayer

        cache = DynamicCache()
        cache.layers = []
        for i in range(self.layers):
            layer = DynamicLayer()
            # filled directly: DynamicLayer.update would first concatenate an empty 1-D tensor
            layer.lazy_initialization(past[2 * i], past[2 * i + 1])
            layer.keys, layer.values = past[2 * i], past[2 * i + 1]
            cache.layers.append(layer)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        present = []
        for layer in out.cache.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def kv_shape(model: nn.Module) -> tuple[int, int]:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if cfg.model_type == "falcon":  # multi-query caches one kv head; the new architecture
        # caches its grouped kv heads broadcast to every query head
        kv_heads = (
            1 if cfg.multi_query and not cfg.new_decoder_architecture else cfg.num_attention_heads
        )
    return kv_heads, head_dim


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def make_feeds(
    model: nn.Module, batch: int, seq: int, past: int, vocab: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random tokens, an all-ones mask over past + new, contiguous positions and a random cache
    of ``past`` rows (the values of the cache do not change the graph's computation)."""
    heads, dim = kv_shape(model)
    feeds = {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=gen),
        "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
        "position_ids": torch.arange(past, past + seq).repeat(batch, 1),
    }
    for name in past_names(model.config.num_hidden_layers):
        feeds[name] = torch.randn(batch, heads, past, dim, generator=gen)
    return feeds


def make_net(model: nn.Module, vocab: int) -> Net:
    layers = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    dyn_past = {0: "batch", 2: "past_sequence_length"}
    dyn_present = {0: "batch", 2: "total_sequence_length"}
    axes = {
        "input_ids": {0: "batch", 1: "sequence_length"},
        "attention_mask": {0: "batch", 1: "total_sequence_length"},
        "position_ids": {0: "batch", 1: "sequence_length"},
        "logits": {0: "batch", 1: "sequence_length"},
        **{n: dyn_past for n in past_names(layers)},
        **{n: dyn_present for n in present_names(layers)},
    }
    return Net(
        module=CachedDecoder(model),
        # (batch, seq): a cache of seq rows, so the traced graph has a non-empty past
        inputs=lambda batch, seq: make_feeds(model, batch, seq, seq, vocab, gen),
        output_names=["logits", *present_names(layers)],
        dynamic_axes=axes,
        export_shape=(2, 8),
        test_shape=(1, 8),
        alt_shape=None,
    )


# ------------------------------------------------------------------------------ fp16
FP16_MAX = float(np.finfo(np.float16).max)
FP16_TOLERANCE = 2e-2  # relative L2 of logits and presents, fp16 export vs the fp32 one


def _fp16_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    """A float32 tensor as float16, clipped to fp16's finite range (a mask's float32 minimum
    becomes -65504, not -inf)."""
    if t.data_type != onnx.TensorProto.FLOAT:
        return t
    v = np.clip(numpy_helper.to_array(t), -FP16_MAX, FP16_MAX).astype(np.float16)
    return numpy_helper.from_array(v, t.name)


def _fp16_graph(g: onnx.GraphProto) -> None:
    """Every float32 value of ``g`` (and its subgraphs) in float16: initializers, Constant and
    ConstantOfShape values, Cast targets, graph inputs and outputs; value_info is dropped."""
    for i, t in enumerate(g.initializer):
        g.initializer[i].CopyFrom(_fp16_tensor(t))
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(_fp16_tensor(a.t))
            elif a.type == onnx.AttributeProto.GRAPH:
                _fp16_graph(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _fp16_graph(sub)
            elif node.op_type == "Cast" and a.name == "to" and a.i == onnx.TensorProto.FLOAT:
                a.i = onnx.TensorProto.FLOAT16
            elif node.op_type == "Constant" and a.name == "value_float":
                value = np.float16(np.clip(a.f, -FP16_MAX, FP16_MAX))
                a.CopyFrom(onnx.helper.make_attribute("value", numpy_helper.from_array(value)))
    for vi in [*g.input, *g.output]:
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    del g.value_info[:]


def to_fp16(model: onnx.ModelProto, keep_io_types: bool) -> onnx.ModelProto:
    """The model computing in float16.  ``keep_io_types``: float32 inputs and outputs stay
    float32, cast to and from float16 at the graph's boundary (onnxconverter-common's
    ``keep_io_types``); else the interface is float16 too (the cache included)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    io = [vi for vi in [*g.input, *g.output] if vi.type.tensor_type.elem_type == 1]
    kept = {vi.name for vi in io} if keep_io_types else set()
    _fp16_graph(g)
    if not kept:
        return m
    rename = {name: f"{name}_fp16" for name in kept}
    for node in g.node:
        node.input[:] = [rename.get(i, i) for i in node.input]
        node.output[:] = [rename.get(o, o) for o in node.output]
    ins = [vi for vi in g.input if vi.name in kept]
    outs = [vi for vi in g.output if vi.name in kept]
    head = [
        onnx.helper.make_node("Cast", [vi.name], [rename[vi.name]], to=onnx.TensorProto.FLOAT16)
        for vi in ins
    ]
    tail = [
        onnx.helper.make_node("Cast", [rename[vi.name]], [vi.name], to=onnx.TensorProto.FLOAT)
        for vi in outs
    ]
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    for vi in [*ins, *outs]:
        vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return m


def write_fp16(path: str, vocab: int) -> list[dict]:
    """NAME_fp16.onnx (float16 interface) and NAME_fp16io.onnx (float32 interface) beside the
    float32 export ``path``, each checked against it on a prefill and a decode step."""
    rows = []
    base = onnx.load(path)
    for suffix, keep in (("_fp16", False), ("_fp16io", True)):
        out = path.replace(".onnx", f"{suffix}.onnx")
        row = {"name": os.path.basename(out)[:-5], "from": os.path.basename(path)}
        try:
            onnx.save(to_fp16(base, keep), out)
            check_model(out)
            row["errors"] = compare_onnx(out, path, vocab)
            json_path = os.path.splitext(path)[0] + ".json"
            with open(json_path) as f, open(os.path.splitext(out)[0] + ".json", "w") as g:
                g.write(f.read())
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported per model, the others go on
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def compare_onnx(path: str, reference: str, vocab: int) -> dict[str, float]:
    """A prefill (batch 2, 20 tokens, empty cache), then one decode step fed with each model's
    own present tensors: relative L2 of every output against ``reference`` (onnxruntime CPU)."""
    import onnxruntime as ort

    sess = {
        k: ort.InferenceSession(p, providers=["CPUExecutionProvider"])
        for k, p in (("got", path), ("want", reference))
    }
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, (2, 20))
    state = {k: {} for k in sess}
    errors: dict[str, float] = {}
    for step, total in (("prefill", 20), ("decode", 21)):
        outs = {}
        for k, s in sess.items():
            feeds = {
                "input_ids": ids,
                "attention_mask": np.ones((2, total), np.int64),
                "position_ids": np.tile(np.arange(total - ids.shape[1], total), (2, 1)),
            }
            for i in s.get_inputs():
                if i.name.startswith("past_key_values."):
                    dtype = np.float16 if i.type == "tensor(float16)" else np.float32
                    heads, dim = i.shape[1], i.shape[3]
                    feeds[i.name] = state[k].get(i.name, np.zeros((2, heads, 0, dim), dtype))
            names = [o.name for o in s.get_outputs()]
            got = s.run(names, feeds)
            outs[k] = dict(zip(names, got))
            state[k] = {
                n.replace("present.", "past_key_values."): v
                for n, v in outs[k].items()
                if n.startswith("present.")
            }
        worst = max(rel_l2(outs["got"][n], outs["want"][n]) for n in outs["want"])
        if not worst <= FP16_TOLERANCE or not all(
            np.isfinite(v).all() for v in outs["got"].values()
        ):
            raise AssertionError(f"{step}: relative L2 {worst:.3g} > {FP16_TOLERANCE:g}")
        errors[step] = worst
        ids = np.argmax(outs["want"]["logits"][:, -1:], axis=-1)
    return errors


# ------------------------------------------------------------------------------ checking
def check_generation(path: str, net: Net, model: nn.Module, vocab: int) -> dict[str, float]:
    """Prefill (batch 2, 20 tokens, empty cache), then one decode step fed with the prefill's
    present tensors: onnxruntime against torch, relative L2 of every output."""
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(1)
    layers = model.config.num_hidden_layers
    errors: dict[str, float] = {}
    feeds = make_feeds(model, 2, 20, 0, vocab, gen)
    for step in ("prefill", "decode"):
        with torch.no_grad():
            want = net.module(*feeds.values())
        got = sess.run(None, {k: v.numpy() for k, v in feeds.items()})
        worst = 0.0
        for name, g, w in zip(net.output_names, got, want):
            if g.shape != tuple(w.shape):
                raise AssertionError(f"{step} {name}: shape {g.shape} != torch {tuple(w.shape)}")
            if not np.isfinite(g).all():
                raise AssertionError(f"{step} {name}: non-finite values")
            worst = max(worst, rel_l2(g, w.numpy()))
        if not worst <= TOLERANCE:
            raise AssertionError(f"{step}: relative L2 {worst:.3g} > {TOLERANCE:g}")
        errors[step] = worst
        # the next step: one token per row after the cache the prefill returned
        total = feeds["attention_mask"].shape[1]
        feeds = {
            "input_ids": torch.randint(0, vocab, (2, 1), generator=gen),
            "attention_mask": torch.ones(2, total + 1, dtype=torch.int64),
            "position_ids": torch.full((2, 1), total, dtype=torch.int64),
        }
        feeds.update(dict(zip(past_names(layers), (w for w in want[1:]))))
    return errors


def write_shapes(path: str, model: nn.Module) -> None:
    """NAME.json: batch 1, 8 new tokens after 16 cached ones."""
    heads, dim = kv_shape(model)
    shapes = {"input_ids": [1, 8], "attention_mask": [1, 24], "position_ids": [1, 8]}
    shapes.update({n: [1, heads, 16, dim] for n in past_names(model.config.num_hidden_layers)})
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"inputs": shapes}, f, indent=2)
        f.write("\n")


def export_family(fam: Family, out: str, exporters: list[str], fp16: bool) -> list[dict]:
    seed_all(seed_for(fam.name))
    model = fam.build().eval()
    perturb_constant_params(model)  # RMSNorm weights are all ones at init
    vocab = model.config.vocab_size
    net = make_net(model, vocab)
    results = []
    for exporter in [e for e in exporters if e in fam.exporters]:
        name = fam.name if exporter == "torchscript" else f"{fam.name}_dynamo"
        path = os.path.join(out, f"{name}.onnx")
        t0 = time.perf_counter()
        row = {"name": name, "exporter": exporter, "family": fam.note}
        try:
            if exporter == "torchscript":
                export_torchscript(net, path, opset=17)
            else:
                export_dynamo(net, path, opset=18)
            check_model(path)
            row["errors"] = check_generation(path, net, model, vocab)
            write_shapes(path, model)
            row["nodes"], row["top_ops"] = summarize(path)
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported per model, the others go on
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            if os.environ.get("MAKE_LLMS_DEBUG"):
                traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(row)
        print(json.dumps(row), flush=True)
        if fp16 and row["ok"]:
            results += write_fp16(path, vocab)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for NAME.onnx and NAME.json (required unless --list)")
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument(
        "--exporters",
        default="torchscript,dynamo",
        help="comma-separated: torchscript (opset 17), dynamo (opset 18)",
    )
    ap.add_argument("--list", action="store_true", help="list the families and exit")
    ap.add_argument(
        "--fp16",
        action="store_true",
        help="also write NAME_fp16.onnx (float16 interface) and NAME_fp16io.onnx (float32 "
        "interface, float16 inside) from each float32 export",
    )
    ap.add_argument(
        "--fp16-only",
        action="store_true",
        help="with --fp16: convert the NAME.onnx files already in --out, export nothing",
    )
    args = ap.parse_args()
    if args.list:
        for fam in FAMILIES:
            print(f"{fam.name:8s} {fam.note}")
        return 0
    if not args.out:
        ap.error("--out is required")
    wanted = [s for s in args.only.split(",") if s]
    unknown = sorted(set(wanted) - {f.name for f in FAMILIES})
    if unknown:
        print(f"error: unknown families {unknown}", file=sys.stderr)
        return 2
    exporters = [s for s in args.exporters.split(",") if s]
    if set(exporters) - {"torchscript", "dynamo"}:
        print(f"error: unknown exporters in {args.exporters!r}", file=sys.stderr)
        return 2
    quiet_warnings()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for fam in FAMILIES:
        if wanted and fam.name not in wanted:
            continue
        if args.fp16_only:
            for exporter in exporters:
                name = fam.name if exporter == "torchscript" else f"{fam.name}_dynamo"
                path = os.path.join(args.out, f"{name}.onnx")
                vocab = onnx.load(path, load_external_data=False).graph.output[0]
                dims = vocab.type.tensor_type.shape.dim
                results += write_fp16(path, int(dims[-1].dim_value))
            continue
        results += export_family(fam, args.out, exporters, args.fp16)
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} exported, failed: {failed or 'none'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

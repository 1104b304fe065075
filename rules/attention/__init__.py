"""Scaled-dot-product attention → ``com.microsoft.MultiHeadAttention`` or ONNX ``Attention``.

One rule, ``fuse-attention`` (phase ``attention``: before the linear-layer rules that would take
its MatMuls), in three stages, each a module with typed results:

1. core (:mod:`.core`): read back from the Transpose that merges the heads —
   ``MatMul(Q·c_q, Kᵀ·c_k) [·c | ÷c]``, additive terms, a ``Where(cond, scores, −big)`` mask,
   Swin's window regroup, ``Softmax`` (with the ``Where(IsNaN(P), 0, P)`` guard of SDPA
   exports), ``MatMul(P, V)`` [→ a Reshape to itself]; logit soft-capping
   ``tanh(s/c)·c`` before the mask (lowered only to a kernel with ``softcap``: GroupQueryAttention,
   or ONNX Attention at opset ≥ 23); ``masked_fill``'s ``Where(cond, fill, scores)``; batch and
   heads folded into one axis around the Softmax (bmm-style [B·N,S,T] scores and terms); a
   per-head score factor [N,1,1] (cosine attention's logit scale) multiplies each head's query;
   attention sinks (a constant logit per head concatenated to the scores, the row maximum
   subtracted, its column sliced off: GPT-OSS; or the context gated by
   ``sigmoid(logsumexp(scores) − sink)``, the same sink: Granite's sliding-window decoders);
   terms added under the mask's Where (ALiBi, then masked_fill); a 0/1 mask multiplied in with
   an additive fill ≤ −1e4 (OpenAI GPT).
2. lift (:mod:`.heads`, :mod:`.masks`): how q/k/v ``[B,S,D]`` are split into heads
   (batch-first, sequence-first — also with dynamo's 3-D Kᵀ, nn.MultiheadAttention —, one
   packed projection, dynamo's 3-D Kᵀ; a constant query [B,N,S,H]; a cross-attention
   key split may name the query's batch) and ``num_heads``/head size from the Reshape targets
   (constants or shape glue, resolved symbolically with :mod:`graphopt.opt.graph.dims`); a key and
   value already per head ``[B,N,T,H]`` (a KV cache's ``Concat(past, new)``, which stays as the
   ``present`` output) go to the kernel as they are, so do a decoder's kv heads repeated for
   grouped-query attention (HF's repeat_kv stays in front of MultiHeadAttention); a query
   rotated by RotaryEmbedding after its split is rotated on [B,S,D] instead (``num_heads``);
   a query with other per-head math between the split and the MatMul (Qwen3's q norm, partial
   rotary's Concat of a rotated and a pass-through slice, scale Muls, Clip, the rotation
   fused or not — :func:`.heads.per_head_split` walks it back to the split, also through a
   Reshape that keeps every dim, a Slice or Split of some heads of a fused projection's
   [B,S,G,H] (Falcon's query_key_value) and a packed [B,S,3,N,H] unbound by Split/Squeeze or
   Gather (ModernBERT)) stays per head as the model computes it and reaches the kernel as
   [B,S,N·H]; so does a key with per-head math beside a value that is a plain split (an
   encoder's rotated key); any other query [B,N,S,H] or key [B,T,N,H] with the key's batch
   and heads (Conditional DETR's per-head Concat of content and position parts), or Kᵀ
   [B,N,H,T] transposed into place from any order (XLNet's sequence-first heads), goes to the
   kernel merged too; one cached key/value head that the MatMuls broadcast over the
   query heads (multi-query) is repeated for MultiHeadAttention;
   the additive terms (padding, causal,
   relative position bias — a tensor shared by every layer is an input of each fusion) and
   the Where mask summed into
   ``attention_bias`` ``[B|1, N|1, S, T]``, expanded to ``[1,1,S,T]`` at run time where its last
   two dims are not provably S and T (one Expand shared by layers with provably the same ones);
   Swin's per-window mask tiled over the images; q/k/v bias Adds with constant vectors moved
   into the kernel's ``bias``.
3. lower (:mod:`.lower`): the target's kernel table decides ``MultiHeadAttention`` (contrib) or
   ``Attention`` (opset ≥ 23: 3-D q/k/v, ``q_num_heads``/``kv_num_heads``, ``attn_mask``); the
   result replaces the heads' merging Reshape, or — where the merged [B,S,N,H] heads have other
   readers (a Reshape for the output projection beside one for shapes) — the merging Transpose,
   or, for a context that per-head readers cut on its last axis before any merge (DeepSeek-V4's
   inverse rotary), the P·V MatMul, split back into [B,N,S,H] heads.
   A decoder's self-attention over a ``Concat(past, new)`` cache with a batch or a new-token
   count provably 1, or declared generation steps (option ``decoder_steps="generate"``, an
   ``analysis`` remark per fusion), lowers to ``GroupQueryAttention`` where the target has it
   with ``causal=0`` (cpu; :mod:`.gqa`:
   the new k/v and the past in, the present outputs out, ``causal=0`` and the whole mask as
   ``attention_bias``, exact for any padding); a per-head query and a per-head new key or
   value (q/k norms, partial rotary, a fused projection's head slice) are merged to [B,S,·]
   for it, and a single broadcast kv head is ``kv_num_heads=1``.  Sinks go to
   GroupQueryAttention's ``head_sink``; elsewhere MultiHeadAttention gets one more key, zero,
   whose bias column is the sink logit (exact: ``q·0 = 0`` and its zero value adds nothing)
   — or the computed column itself, for sinks projected from each token (Inkling 2).

Spellings the stages do not read are first rewritten, exactly, into ones they do, in the same
phase and only where a kernel and the cost bound would take the result (a refusal is said by
that rule): :mod:`.unfold3d` (attention over folded [B·N,T,H] heads, nn.MultiheadAttention
with its weights; a Softmax over folded scores), :mod:`.packed3d` (SAM's packed heads folded
before the unbind, its [B,N,h,w,H] merge, ViTDet's regrouped scores), :mod:`.channel_first`
(SqueezeBERT's [B,C,S] heads), :mod:`.query_rows` (GPT-BigCode's multi-query heads as query
rows), :mod:`.distribute` (a scale applied after a term was added to the raw product: BROS;
a subtracted mask: XLNet) and :mod:`.contexts` (one Softmax times two values, the contexts
concatenated: DiffLlama; a term added to the context before the heads merge: Nyströmformer's
convolution of the values).

Guards (missed remarks carry ``stage``, ``tensor`` and ``softmax`` in their arguments):
``unrecognized-layout`` (a spelling the stages do not know), ``unknown-shape`` (q/k/v not known
to be 3-D), ``shared-intermediate`` (a tensor inside the attention, other than through Shape,
read elsewhere or a graph output; a head split read elsewhere stays for that reader),
``softmax-axis``, ``dynamic-heads``, ``scale-mismatch`` (a per-head, zero or negative scale; the
product of the constant factors becomes the ``scale`` attribute unless it is 1/√H),
``non-constant-param`` (a computed scale), ``dtype-mismatch``, ``reshape-not-identity`` (a
Reshape between the two MatMuls not provably a no-op), ``mask-shape`` (a bias term of rank > 4
or another dtype, a Where fill milder than −1e4, a window regroup that is not static),
``slower-on-target`` (a static key length below the bound from which the target's kernel was
measured to pay: onnxruntime CPU 128 keys), ``no-kernel`` / ``opset-too-old``. It is assumed, as
every exporter guarantees, that the bias does not broadcast the scores to a larger shape (the
kernel would fail at run time, not compute wrong numbers).
"""

from . import (  # noqa: F401  (register the rules)
    census,
    channel_first,
    contexts,
    distribute,
    packed3d,
    query_rows,
    rule,
    unfold3d,
    windows5d,
)
from .lifted import Attention
from .rule import FuseMultiHeadAttention, lift

__all__ = ["Attention", "FuseMultiHeadAttention", "lift"]

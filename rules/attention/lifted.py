"""The lifted attention: what stage 2 reads from the graph and the guards decide, which
stage 3 lowers (:class:`Attention`, with its q/k/v bias and its decoder caches)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphopt.opt.graph.ir import Node, Tensor

from .core import Core
from .heads import HeadSplit, source_axis
from .masks import BiasPlan


@dataclass
class KvCache:
    """One side (key or value) of a decoder's cache feeding the attention."""

    present: Tensor | None  # Concat(past, new): a graph output; None without a cache
    past: Tensor | None
    new: HeadSplit  # the split of the [B,S,Nkv·H] projection (with its rotary, for the key)
    kv_heads: int


@dataclass
class GqaPlan:
    """The key and value caches of an attention that lowers to GroupQueryAttention."""

    key: KvCache
    value: KvCache


@dataclass
class QkvBias:
    """Bias Adds of the q/k/v projections that move into the kernel's ``bias`` input."""

    sources: tuple[Tensor, Tensor, Tensor]  # the MatMul outputs (packed: the one, three times)
    vector: np.ndarray
    adds: tuple[Node, ...]


@dataclass
class Attention:
    """A recognized attention: its core, how q/k/v are split into heads, the merge Reshape when
    it is the root, and what the guards decided."""

    core: Core
    q: HeadSplit
    k: HeadSplit
    v: HeadSplit
    merge_reshape: Node | None = None
    op: str = "MultiHeadAttention"
    num_heads: int = 0
    head_size: int = 0
    v_head_size: int = 0
    scale: float | None = None
    head_scale: np.ndarray | None = None  # a per-head factor [N] of the scores, folded into Q
    bias: BiasPlan | None = None
    qkv_bias: QkvBias | None = None
    out_direct: bool = False
    gqa: GqaPlan | None = None  # lowered to GroupQueryAttention: the decoder's key/value caches
    kv_broadcast: bool = False  # one key/value head [B,1,T,H] broadcast over the query heads

    def nodes(self) -> list[Node]:
        """Every node of the fusion, consumers first."""
        found = [self.merge_reshape] if self.merge_reshape is not None else []
        found += self.core.nodes()
        for s in (self.q, self.k, self.v):
            found += s.nodes + ([s.reshape] if s.reshape is not None else [])
        if self.qkv_bias is not None:
            found += list(self.qkv_bias.adds)
        return list({id(n): n for n in found}.values())

    def axis(self, role: str, which: str) -> int:
        return source_axis(getattr(self, role).layout, which)

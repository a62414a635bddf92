"""`Attention`: the module a model places in each layer; it owns the layer's constants and calls
the backend with the per-forward metadata and this layer's slice of the KV cache."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.attention.backend import AttentionBackend, AttentionParams
from llmserve.layers.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.params = AttentionParams(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        p = self.params
        T = q.shape[0]
        out = self.backend.forward(
            p,
            q.view(T, p.num_heads, p.head_dim),
            k.view(T, p.num_kv_heads, p.head_dim),
            v.view(T, p.num_kv_heads, p.head_dim),
            kv_cache,
            metadata,
        )
        return out.reshape(T, p.num_heads * p.head_dim)  # a copy only when out is strided

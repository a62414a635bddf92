"""`Attention`: the module a model places in each layer; it owns the layer's constants and calls
the backend with the per-forward metadata and this layer's slice of the KV cache.

RoPE is applied here, not in the model: a backend that rotates q and k inside its cache-write
kernel (`fuses_rope`, the Triton backend) gets them unrotated with the positions and the table;
any other gets them rotated by torch ops first."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.attention.backend import AttentionBackend, AttentionParams
from llmserve.layers.attention.metadata import AttentionMetadata, LayerKVCache
from llmserve.layers.rotary_embedding import RotaryInputs


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        sinks: bool = False,
        softcap: float | None = None,
    ) -> None:
        """`sinks`: the layer has learned per-head sink logits (gpt-oss), a parameter of this
        module that the backend reads through `params.sinks`. `softcap`: Gemma 2's cap on the
        scaled attention scores."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        self.params = AttentionParams(
            num_heads, num_kv_heads, head_dim, scale, sliding_window, self.sinks, softcap
        )
        self.backend = backend

    @property
    def rope_in_backend(self) -> bool:
        """Whether the backend rotates q and k itself (models then skip computing cos/sin)."""
        return bool(getattr(self.backend, "fuses_rope", False))

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """`q`, `k` unrotated when `rotary` is given (rotated here or by the backend), else as they
        are (a model without RoPE, or one that rotated them itself)."""
        p = self.params
        T = q.shape[0]
        q3 = q.view(T, p.num_heads, p.head_dim)
        k3 = k.view(T, p.num_kv_heads, p.head_dim)
        v3 = v.view(T, p.num_kv_heads, p.head_dim)
        if rotary is not None and rotary.cos is None:  # the backend rotates while writing K/V
            rope = rotary.rope
            out = self.backend.forward_rope(  # type: ignore[attr-defined]
                p, q3, k3, v3, kv_cache, metadata, rotary.positions, rope.cos_sin_cache, rope.rotary_dim
            )
        else:
            if rotary is not None:
                q3, k3 = rotary.rotate(q3), rotary.rotate(k3)
            out = self.backend.forward(p, q3, k3, v3, kv_cache, metadata)
        return out.reshape(T, p.num_heads * p.head_dim)  # a copy only when out is strided

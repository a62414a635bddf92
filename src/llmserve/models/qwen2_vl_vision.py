"""Qwen2-VL's vision transformer: Qwen2.5-VL's (qwen2_5_vl_vision.py) without window attention,
with LayerNorms and a plain MLP.

    x = patches @ W_patch^T                               the Conv3d as a matmul
    for each block:                                       2-D RoPE as Qwen2.5-VL's
        x = x + proj(attn(rope(q), rope(k), v))           every patch attends within its frame
        x = x + fc2(act(fc1(norm2(x))))                   act: quick GELU in the released checkpoints
    merger: LayerNorm, each m * m run concatenated -> Linear -> GELU -> Linear   -> [L / m^2, H_text]

Its config names the tower's width `embed_dim` and the language model's `hidden_size` (Qwen2.5-VL:
`hidden_size` and `out_hidden_size`); the MLP is `embed_dim * mlp_ratio` wide. Architecture only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.layers.activation import get_activation
from llmserve.layers.layernorm import LayerNorm
from llmserve.layers.linear import Linear
from llmserve.models.qwen2_5_vl_vision import NORM_EPS, PatchMerger, VisionAttention, VisionTower


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, intermediate, bias=True)
        self.act = get_activation(act)
        self.fc2 = Linear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionBlock(nn.Module):
    """LayerNorms and a plain MLP of `intermediate` units (Qwen2-VL's and Qwen3-VL's blocks)."""

    def __init__(self, hidden: int, intermediate: int, num_heads: int, act: str) -> None:
        super().__init__()
        self.norm1 = LayerNorm(hidden, NORM_EPS)
        self.attn = VisionAttention(hidden, num_heads)
        self.norm2 = LayerNorm(hidden, NORM_EPS)
        self.mlp = VisionMLP(hidden, intermediate, act)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class Qwen2VisionTransformer(VisionTower):
    """Checkpoint names under the tower's prefix: `patch_embed.proj.weight`, `blocks.<i>.*`
    (`attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`, `norm1`, `norm2`), `merger.*`."""

    def __init__(self, config: Any) -> None:
        C, merge = config.embed_dim, int(config.spatial_merge_size)
        blocks = nn.ModuleList(
            Qwen2VisionBlock(C, int(C * config.mlp_ratio), config.num_heads, config.hidden_act)
            for _ in range(config.depth)
        )
        super().__init__(config, C, blocks, PatchMerger(config.hidden_size, C, merge, LayerNorm))

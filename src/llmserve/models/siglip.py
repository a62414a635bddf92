"""SigLIP's vision transformer (the image encoder of Gemma 3, PaliGemma and others), without its
pooling head:

    x = patch_embed(pixels) + pos_embed          conv with stride = patch size: one vector per patch
    for each layer:
        x = x + out_proj(attn(q, k, v))          q, k, v = split(qkv_proj(ln1(x))), every patch sees all
        x = x + fc2(gelu_tanh(fc1(ln2(x))))
    return post_layernorm(x)                     [N, num_patches, hidden]

No KV cache: an image is encoded once, in one batched call, before its tokens enter the language
model. Architecture only; the pixels come in preprocessed (multimodal/image.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.activation import get_activation
from llmserve.layers.layernorm import LayerNorm
from llmserve.layers.linear import Linear


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        C, P = config.hidden_size, config.patch_size
        self.patch_size = P
        self.num_patches = (config.image_size // P) ** 2
        self.patch_embedding = _Conv(C, config.num_channels, P)
        self.position_embedding = _Table(self.num_patches, C)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, patches, C]
        p = self.patch_embedding
        x = F.conv2d(pixels.to(p.weight.dtype), p.weight, p.bias, stride=self.patch_size)  # [N, C, S/P, S/P]
        return x.flatten(2).transpose(1, 2) + self.position_embedding.weight


class _Conv(nn.Module):
    """The patch embedding's weights as checkpoints name them (`weight`, `bias`)."""

    def __init__(self, out_channels: int, in_channels: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, size, size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_channels), requires_grad=False)


class _Table(nn.Module):
    """A learned table read whole (every image has every position): `weight` [rows, dim]."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)


class SiglipAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        C = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = C // self.num_heads
        self.qkv_proj = Linear(C, [C, C, C], bias=True)
        self.out_proj = Linear(C, C, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, C]
        N, L, C = x.shape
        qkv = self.qkv_proj(x).view(N, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [N, heads, L, head_dim] each
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # full, no mask
        return self.out_proj(out.transpose(1, 2).reshape(N, L, C))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        C, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = LayerNorm(C, eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = LayerNorm(C, eps)
        self.fc1 = Linear(C, config.intermediate_size, bias=True)
        self.fc2 = Linear(config.intermediate_size, C, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class SiglipVisionModel(nn.Module):
    """Checkpoint names under the tower's prefix: `embeddings.*`, `encoder.layers.<i>.*` (the
    fused `qkv_proj` takes `q_proj`/`k_proj`/`v_proj`, `mlp.fc1` is `fc1`), `post_layernorm.*`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, patches, C]
        x = self.embeddings(pixels)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    @staticmethod
    def map_weight_name(name: str) -> str | None:
        """A tower-relative checkpoint name -> this module's ("encoder.layers.0.mlp.fc1.weight" ->
        "layers.0.fc1.weight"); older transformers nest everything under `vision_model.`. A
        pooling head (`head.*`, classification only) is skipped: the VLMs read every patch."""
        name = name.removeprefix("vision_model.")
        if name.startswith("head."):
            return None
        return name.removeprefix("encoder.").replace(".mlp.fc", ".fc")

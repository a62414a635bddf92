"""Qwen3-VL's vision transformer: Qwen2-VL's tower (qwen2_vl_vision.py: LayerNorm blocks, a plain
MLP, no windows) with a biased patch projection, learned position embeddings and DeepStack.

    x = patches @ W_patch^T + b                  the Conv3d (with its bias) as a matmul
    x = x + pos_embed(bilinear(row, col))        a side x side table of learned embeddings,
                                                 resampled to the image's h x w patch grid
    for each block:                              2-D RoPE as Qwen2.5-VL's
        x = x + proj(attn(rope(q), rope(k), v))  every patch attends within its frame
        x = x + fc2(gelu_tanh(fc1(norm2(x))))
        at block deepstack[k]: deep_k = merger_k(x)  (its norm over each m * m run concatenated)
    out = [merger(x) | deep_0 | deep_1 | ...]    [L / m^2, out_hidden * (1 + len(deepstack))]

The table is resampled as transformers does it, `F.interpolate`'s bilinear with aligned corners
over the table seen as a side x side image; each patch takes the value at its own (row, col), so
the processor's merge-block order needs no reordering. The deep vectors ride along with the main
ones: the language model (qwen3_vl.py) splits each row and adds deep_k to its hidden states after
layer k. Architecture only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.layernorm import LayerNorm
from llmserve.models.qwen2_5_vl_vision import PatchLayout, PatchMerger, VisionTower
from llmserve.models.qwen2_vl_vision import Qwen2VisionBlock


class Qwen3VisionTransformer(VisionTower):
    """Checkpoint names under the tower's prefix (the model maps `linear_fc*` to `fc*` and a
    merger's `norm` to `ln_q`): `patch_embed.proj.weight`/`bias`, `pos_embed.weight`, `blocks.<i>.*`
    (`attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`, `norm1`, `norm2`), `merger.*`,
    `deepstack_merger_list.<k>.*`."""

    def __init__(self, config: Any) -> None:
        C, merge, out = config.hidden_size, int(config.spatial_merge_size), config.out_hidden_size
        blocks = nn.ModuleList(
            Qwen2VisionBlock(C, config.intermediate_size, config.num_heads, config.hidden_act)
            for _ in range(config.depth)
        )
        deepstack = list(config.deepstack_visual_indexes)
        if any(not 0 <= i < config.depth for i in deepstack):
            raise ValueError(f"deepstack_visual_indexes {deepstack} must name blocks of the {config.depth}")
        mergers = nn.ModuleList(PatchMerger(out, C, merge, LayerNorm, postshuffle=True) for _ in deepstack)
        super().__init__(config, C, blocks, PatchMerger(out, C, merge, LayerNorm), True, deepstack, mergers)
        self.side = int(config.num_position_embeddings**0.5)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = nn.Parameter(
            torch.empty(config.num_position_embeddings, C), requires_grad=False
        )

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack)

    def embed_patches(self, patches: torch.Tensor, layout: PatchLayout) -> torch.Tensor:  # -> [L, C]
        _, h, w = layout.grid
        table = self.pos_embed.weight  # [side * side, C], row-major over the side x side grid
        image = table.t().reshape(1, -1, self.side, self.side).float()  # [1, C, side, side]
        grid = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=True)[0]  # [C, h, w]
        pos = grid[:, layout.rows.long(), layout.cols.long()].t()  # [L, C]: each patch's own cell
        return super().embed_patches(patches, layout) + pos.to(table.dtype)

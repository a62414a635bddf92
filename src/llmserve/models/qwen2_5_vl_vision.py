"""Qwen2.5-VL's vision transformer: one image's patches in, the language model's image vectors out.

    patches [L, 3 * T * P * P]      L = h * w patches (multimodal/qwen_vl.py), in merge-block order:
                                    each run of m * m patches is one m x m square of the image
    x = patches @ W_patch^T         the Conv3d over (temporal, P, P) with stride = kernel is a matmul
    for each block:                 2-D RoPE: a patch's row rotates half of each head, its column the other
        x = x + proj(attn(rope(q), rope(k), v))      window attention, or full at fullatt_block_indexes
        x = x + down(silu(gate(n2(x))) * up(n2(x)))
    merger: RMSNorm, each m * m run concatenated -> Linear -> GELU -> Linear   -> [L / m^2, H_text]

Window attention: patches attend only within their window, a square of
`window_size / patch_size / m` merged cells a side (the image's last row and column of windows
may be smaller). transformers reorders the patches window by window and back; this keeps the
processor's order and masks instead, the same sums per query. No KV cache: an image is encoded
once, when a prefill chunk first reaches its tokens. Architecture only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.linear import Linear
from llmserve.layers.mlp import GatedMLP

_NORM_EPS = 1e-6
"""Every norm of the tower (transformers hard-codes it)."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = Linear(hidden, 3 * hidden, bias=True)  # one tensor in checkpoints
        self.proj = Linear(hidden, hidden, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:  # x [L, C]; cos, sin [L, 1, head_dim] float32; mask [L, L] bool (True: attend)
        L, C = x.shape
        q, k, v = self.qkv(x).view(L, 3, self.num_heads, self.head_dim).unbind(1)  # [L, heads, D] each
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.proj(out.transpose(0, 1).reshape(L, C))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        C = config.hidden_size
        self.norm1 = RMSNorm(C, _NORM_EPS)
        self.attn = VisionAttention(C, config.num_heads)
        self.norm2 = RMSNorm(C, _NORM_EPS)
        self.mlp = GatedMLP(C, config.intermediate_size, config.hidden_act, bias=True)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Checkpoint names `ln_q`, `mlp.0`, `mlp.2` (the model maps the last two to fc1, fc2)."""

    def __init__(self, out_hidden: int, hidden: int, merge: int) -> None:
        super().__init__()
        self.width = hidden * merge * merge
        self.ln_q = RMSNorm(hidden, _NORM_EPS)
        self.fc1 = Linear(self.width, self.width, bias=True)
        self.fc2 = Linear(self.width, out_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L, C] -> [L / m^2, out_hidden]
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.width))))


class _PatchProjection(nn.Module):
    def __init__(self, hidden: int, in_features: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, *in_features), requires_grad=False)


class Qwen2_5_VisionTransformer(nn.Module):
    """Checkpoint names under the tower's prefix: `patch_embed.proj.weight`, `blocks.<i>.*`
    (`attn.qkv`, `attn.proj`, `mlp.gate_proj`/`up_proj`/`down_proj`, `norm1`, `norm2`), `merger.*`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        C, P, T = config.hidden_size, config.patch_size, config.temporal_patch_size
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(P)
        self.window_cells = config.window_size // self.merge // P  # merged cells a window side
        self.full_attention = frozenset(config.fullatt_block_indexes)
        self.head_dim = C // config.num_heads
        self.patch_embed = nn.Module()
        self.patch_embed.proj = _PatchProjection(C, (config.in_channels, T, P, P))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, C, self.merge)
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / theta ** (quarter / (self.head_dim // 2))  # head_dim / 4 frequencies
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """`patches` [t * h * w, 3 * T * P * P] of one image, `grid` (t, h, w) in patches ->
        [t * h * w / m^2, out_hidden]."""
        w_patch = self.patch_embed.proj.weight
        x = patches.to(w_patch.dtype) @ w_patch.flatten(1).t()  # [L, C]
        rows, cols, window = self._layout(grid, x.device)
        freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [L, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        windowed = window[:, None] == window[None, :]  # [L, L]: same window
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if i in self.full_attention else windowed)
        return self.merger(x)

    def _layout(
        self, grid: tuple[int, int, int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each patch's row, column (float32) and window index, [L] each, in the processor's
        order [t, h/m, w/m, m, m]: frames, m x m blocks row-major, a block's patches row-major."""
        t, h, w = grid
        m, c = self.merge, self.window_cells
        # index grids of each patch's frame f, block (bh, bw) and place (i, j) in the block
        f, bh, bw, i, j = (g.flatten() for g in torch.meshgrid(
            *(torch.arange(n, device=device) for n in (t, h // m, w // m, m, m)), indexing="ij"
        ))  # fmt: skip
        windows_h, windows_w = -(-(h // m) // c), -(-(w // m) // c)
        window = (f * windows_h + bh // c) * windows_w + bw // c  # per frame, row-major
        return (bh * m + i).float(), (bw * m + j).float(), window

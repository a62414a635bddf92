"""Qwen2.5-VL's vision transformer: one image's patches in, the language model's image vectors out.

    patches [L, 3 * T * P * P]      L = h * w patches (multimodal/qwen_vl.py), in merge-block order:
                                    each run of m * m patches is one m x m square of the image
    x = patches @ W_patch^T         the Conv3d over (temporal, P, P) with stride = kernel is a matmul
    for each block:                 2-D RoPE: a patch's row rotates half of each head, its column the other
        x = x + proj(attn(rope(q), rope(k), v))      window attention, or full at fullatt_block_indexes
        x = x + down(silu(gate(n2(x))) * up(n2(x)))
    merger: RMSNorm, each m * m run concatenated -> Linear -> GELU -> Linear   -> [L / m^2, H_text]

Attention never crosses frames: a video's patches attend within their own frame (transformers'
`cu_seqlens`, one sequence a frame); an image is one frame. Window attention: patches attend only
within their window, a square of
`window_size / patch_size / m` merged cells a side (the image's last row and column of windows
may be smaller). transformers reorders the patches window by window and back; this keeps the
processor's order and masks instead, the same sums per query. No KV cache: an image or a video is
encoded once, when a prefill chunk first reaches its tokens. `VisionTower` is what Qwen2-VL's tower
(qwen2_vl_vision.py: LayerNorm, a fc1/fc2 MLP, no windows) shares with this one. Architecture only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.linear import Linear
from llmserve.layers.mlp import GatedMLP

NORM_EPS = 1e-6
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
        self.norm1 = RMSNorm(C, NORM_EPS)
        self.attn = VisionAttention(C, config.num_heads)
        self.norm2 = RMSNorm(C, NORM_EPS)
        self.mlp = GatedMLP(C, config.intermediate_size, config.hidden_act, bias=True)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Checkpoint names `ln_q`, `mlp.0`, `mlp.2` (the model maps the last two to fc1, fc2); `ln_q`
    an RMSNorm (Qwen2.5-VL) or a LayerNorm (Qwen2-VL, Qwen3-VL). `postshuffle`: the norm runs over
    each m * m run concatenated (Qwen3-VL's DeepStack mergers), else over each patch."""

    def __init__(
        self,
        out_hidden: int,
        hidden: int,
        merge: int,
        norm: type[nn.Module] = RMSNorm,
        postshuffle: bool = False,
    ) -> None:
        super().__init__()
        self.width = hidden * merge * merge
        self.ln_q = norm(self.width if postshuffle else hidden, NORM_EPS)
        self.fc1 = Linear(self.width, self.width, bias=True)
        self.fc2 = Linear(self.width, out_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L, C] -> [L / m^2, out_hidden]
        x = self.ln_q(x.view(-1, self.ln_q.weight.shape[0])).view(-1, self.width)
        return self.fc2(F.gelu(self.fc1(x)))


class _PatchProjection(nn.Module):
    def __init__(self, hidden: int, in_features: tuple[int, ...], bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, *in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden), requires_grad=False) if bias else None


class PatchLayout:
    """Each patch's frame, merge block (bh, bw) and place (i, j) in it, [L] each, in the processor's
    order [t, h/m, w/m, m, m]: frames, m x m blocks row-major, a block's patches row-major."""

    def __init__(self, grid: tuple[int, int, int], merge: int, device: torch.device) -> None:
        t, h, w = grid
        self.grid, self.merge = grid, merge
        self.frame, self.bh, self.bw, i, j = (g.flatten() for g in torch.meshgrid(
            *(torch.arange(n, device=device) for n in (t, h // merge, w // merge, merge, merge)), indexing="ij"
        ))  # fmt: skip
        self.rows, self.cols = (self.bh * merge + i).float(), (self.bw * merge + j).float()

    def frame_mask(self) -> torch.Tensor | None:  # [L, L] (True: attend), None for one frame
        return None if self.grid[0] == 1 else self.frame[:, None] == self.frame[None, :]


class VisionTower(nn.Module):
    """The patch projection, 2-D RoPE, the blocks and the merger; `block_masks` says whom each
    block's patches attend to (by default their own frame). `deepstack`: the blocks whose outputs
    `deepstack_mergers` merge too, one merger each (Qwen3-VL's DeepStack); their vectors follow the
    main merger's in each output row, [L / m^2, out_hidden * (1 + len(deepstack))]."""

    def __init__(
        self,
        config: Any,
        hidden: int,
        blocks: nn.ModuleList,
        merger: PatchMerger,
        patch_bias: bool = False,
        deepstack: Sequence[int] = (),
        deepstack_mergers: nn.ModuleList | None = None,
    ) -> None:
        super().__init__()
        P, T = config.patch_size, config.temporal_patch_size
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(P)
        self.head_dim = hidden // config.num_heads
        self.patch_embed = nn.Module()
        self.patch_embed.proj = _PatchProjection(hidden, (config.in_channels, T, P, P), patch_bias)
        self.blocks = blocks
        self.merger = merger
        self.deepstack = tuple(int(i) for i in deepstack)
        if deepstack_mergers is not None:
            self.deepstack_merger_list = deepstack_mergers
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / theta ** (quarter / (self.head_dim // 2))  # head_dim / 4 frequencies
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """`patches` [t * h * w, 3 * T * P * P] of one image or video, `grid` (t, h, w) in patches ->
        [t * h * w / m^2, out_hidden]."""
        layout = PatchLayout(grid, self.merge, patches.device)
        x = self.embed_patches(patches, layout)  # [L, C]
        freqs = torch.cat(
            [layout.rows[:, None] * self.inv_freq, layout.cols[:, None] * self.inv_freq], dim=-1
        )
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [L, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        deep = []
        for i, (block, mask) in enumerate(zip(self.blocks, self.block_masks(layout), strict=True)):
            x = block(x, cos, sin, mask)
            if i in self.deepstack:
                deep.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1) if deep else self.merger(x)

    def embed_patches(self, patches: torch.Tensor, layout: PatchLayout) -> torch.Tensor:  # -> [L, C]
        proj = self.patch_embed.proj
        x = patches.to(proj.weight.dtype) @ proj.weight.flatten(1).t()
        return x if proj.bias is None else x + proj.bias

    def block_masks(self, layout: PatchLayout) -> list[torch.Tensor | None]:
        return [layout.frame_mask()] * len(self.blocks)


class Qwen2_5_VisionTransformer(VisionTower):
    """Checkpoint names under the tower's prefix: `patch_embed.proj.weight`, `blocks.<i>.*`
    (`attn.qkv`, `attn.proj`, `mlp.gate_proj`/`up_proj`/`down_proj`, `norm1`, `norm2`), `merger.*`."""

    def __init__(self, config: Any) -> None:
        C, merge = config.hidden_size, int(config.spatial_merge_size)
        blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        super().__init__(config, C, blocks, PatchMerger(config.out_hidden_size, C, merge))
        self.window_cells = config.window_size // merge // config.patch_size  # merged cells a window side
        self.full_attention = frozenset(config.fullatt_block_indexes)

    def block_masks(self, layout: PatchLayout) -> list[torch.Tensor | None]:
        """Full attention (within the frame) at `fullatt_block_indexes`, else within the window."""
        _, h, w = layout.grid
        c = self.window_cells
        windows_h, windows_w = -(-(h // self.merge) // c), -(-(w // self.merge) // c)
        window = (layout.frame * windows_h + layout.bh // c) * windows_w + layout.bw // c  # row-major a frame
        windowed = window[:, None] == window[None, :]  # [L, L]: same window
        full = layout.frame_mask()
        return [full if i in self.full_attention else windowed for i in range(len(self.blocks))]

"""Multimodal RoPE (M-RoPE, Qwen2-VL / Qwen2.5-VL / Qwen3-VL): three position ids per token,
temporal, height and width, each rotating its own set of the frequencies. A video's frames (after
temporal patching: one grid frame per pair of video frames) step the temporal id.

    frequencies  [ f_0 ... f_a-1 | f_a ... f_a+b-1 | f_a+b ... f_D/2-1 ]     mrope_section = [a, b, c]
    rotated by     temporal pos     height pos          width pos

Qwen3-VL interleaves the axes instead (`mrope_interleaved`): frequency j takes the height id when
j % 3 == 1 and j < 3b, the width id when j % 3 == 2 and j < 3c, else the temporal id

    frequencies  [ f_0 f_1 f_2 f_3 f_4 f_5 ... ]
    rotated by     t   h   w   t   h   w  ...  t t t     (the high end temporal only)

A text token has the same id on all three axes, so a prompt without images is plain RoPE. An
image's tokens (a grid of h x w after the merger) sit at (s, s + row, s + col), s the position
the image starts at, and the text after it continues from s + max(h, w):

    text  t t t [image  h x w ]  t    t    ...  decode token at sequence index i
    pos   0 1 2 (3,3+r,3+c)     3+m  4+m         i + delta,   delta = last position + 1 - length

so past the prompt every axis is the sequence index plus the request's `delta`, which the runner
keeps (decode steps, prefix-cache hits and recomputed prompts all take the same positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from llmserve.layers.rotary_embedding import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    backend_can_rotate: ClassVar[bool] = False

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        mrope_section: Sequence[int],
        interleaved: bool = False,
    ) -> None:
        super().__init__(head_dim, head_dim, max_position, params)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {head_dim // 2}"
            )
        self.mrope_section = tuple(int(n) for n in mrope_section)
        self.interleaved = interleaved
        half = head_dim // 2
        if interleaved:
            j = torch.arange(half, device="cpu")
            axis = torch.zeros(half, dtype=torch.int64, device="cpu")
            for a in (1, 2):
                axis[(j % 3 == a) & (j < 3 * self.mrope_section[a])] = a
        else:
            axis = torch.repeat_interleave(
                torch.arange(3, device="cpu"), torch.tensor(self.mrope_section, device="cpu")
            )
        # the table's row is [cos f_0..f_D/2-1 | sin f_0..]: each column's axis, both halves alike
        self.register_buffer(
            "column_axis", torch.cat([axis, axis]).to(torch.get_default_device()), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` [3, T] (temporal, height, width) -> cos, signed sin [T, 1, head_dim]."""
        rows = self.cos_sin_cache[positions]  # [3, T, head_dim]: each axis's table rows
        T, D = rows.shape[1], rows.shape[2]
        cs = rows.gather(0, self.column_axis.expand(1, T, D))[0]  # [T, head_dim]: each column's axis
        return self._signed(cs, dtype)


def mrope_prompt_positions(
    num_tokens: int, images: Sequence[tuple[int, int, int, int] | tuple[int, int, int, int, float]]
) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions [3, num_tokens] and its delta. `images`: (offset, t, h, w) of
    each image or video in prompt order, its t * h * w tokens from `offset` (the grid the language
    model sees, after the merger), row-major over (t, h, w); a fifth item, a video's time interval,
    spaces its frames' temporal ids (Qwen2.5-VL: `tokens_per_second * second_per_grid_t`, each
    frame at int(f * interval) as transformers' float32 product; default 1)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    index = pos = 0  # the next token's index in the prompt, its text position
    for offset, t, h, w, *interval in images:
        n = offset - index  # text before the image
        out[:, index:offset] = np.arange(pos, pos + n)
        pos += n
        grid = np.indices((t, h, w)).reshape(3, -1)  # [3, t*h*w]: (frame, row, col) of each token
        if interval:
            times = (np.arange(t, dtype=np.float32) * np.float32(interval[0])).astype(np.int64)
            grid[0] = np.repeat(times, h * w)
        out[:, offset : offset + t * h * w] = grid + pos
        # as transformers: the text after a video too goes on from max(h, w), whatever its length
        index, pos = offset + t * h * w, pos + max(h, w)
    out[:, index:] = np.arange(pos, pos + num_tokens - index)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta

"""MXFP4 (the OCP microscaling format OpenAI ships gpt-oss's experts in): blocks of 32 FP4 (E2M1)
codes sharing one E8M0 exponent.

    blocks [..., G, 16] uint8    byte j of a block: element 2j in its low nibble, 2j + 1 in its high
    scales [..., G]     uint8    the block's exponent e: every element is E2M1(code) * 2^(e - 127)

(llama.cpp's GGUF MXFP4 stores the same numbers in another nibble order; gguf_quant.py reads that.)
"""

from __future__ import annotations

import numpy as np
import torch

MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
"""The E2M1 (FP4) codes' values doubled (llama.cpp's kvalues_mxfp4): exact in int8; the block
scale is halved to match."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] codes and [..., G] exponents -> float32 [..., G * 32]. Both hold integers in
    0..255 in any dtype (a loader that casts every tensor to the model's float type keeps them
    exact: bfloat16 holds every integer up to 256)."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"([..., G, 16] and [..., G])"
        )
    codes = blocks.to(torch.uint8)
    table = torch.from_numpy(MXFP4_VALUES.astype(np.float32))
    pairs = torch.stack([codes & 0x0F, codes >> 4], dim=-1).long()  # [..., G, 16, 2]: 2j, 2j + 1
    values = table[pairs].flatten(-3)  # [..., G * 32], doubled
    exponent = scales.to(torch.int32) - 128  # halved, for the doubled table
    scale = torch.ldexp(torch.ones((), dtype=torch.float32), exponent.float())  # [..., G]
    return (values.unflatten(-1, (-1, 32)) * scale[..., None]).flatten(-2)

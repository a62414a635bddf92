"""Normalisation layers, computed in float32 whatever the activation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, or x / rms(x) * (1 + w) for Gemma (`weight_offset=1.0`)."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and not self.weight_offset:
            # One fused kernel instead of five ops: same math in fp32, less per-layer overhead.
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            # Gemma scales in float32 before casting back.
            return (xf * (self.weight_offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


class LayerNorm(nn.Module):
    """Standard LayerNorm with bias (GPT-2)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)

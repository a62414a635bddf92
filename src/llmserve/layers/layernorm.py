"""Normalisation layers, computed in float32 whatever the activation dtype.

`RMSNorm` also takes the residual stream: `norm(x, residual)` adds first and returns the sum too,
which on CPU runs as one fused numba pass (cpu_fused.py) instead of torch's nine ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.activation import gpu_kernels

try:
    from llmserve.layers import cpu_fused
except ImportError:  # numba missing or broken: torch ops only
    cpu_fused = None  # type: ignore[assignment]


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, or x / rms(x) * (1 + w) for Gemma (`weight_offset=1.0`)."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual). The fused CPU path writes
        the sum into `residual`'s memory, so pass a residual tensor the caller owns. On CUDA the
        add and the norm are one Triton kernel (the same rounding as the torch ops below)."""
        if x.is_cuda and (kernels := gpu_kernels()) is not None:
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps, self.weight_offset)
            return kernels.add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        fused = cpu_fused is not None and cpu_fused.applies(x, self.weight)
        if residual is None:
            if fused:
                return cpu_fused.rms_norm(x, self.weight, self.eps, self.weight_offset)
            return self._norm(x)
        if fused and cpu_fused.applies(residual):
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
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
    """Standard LayerNorm with bias (GPT-2), or without (`bias=False`: ModernBERT's)."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)

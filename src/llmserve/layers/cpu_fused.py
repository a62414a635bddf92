"""Fused elementwise kernels for the CPU (numba): one pass where torch runs several ops.

    add_rms_norm(x, residual, w):  residual += x;  out = residual / rms(residual) * (offset + w)
    rms_norm(x, w):                out = x / rms(x) * (offset + w)

torch's `rms_norm` on CPU is a composite of about eight ops (two of them copies), and the residual
add before it is one more; per call that is ~10-25 µs of dispatch at decode sizes and a few passes
over memory at prefill sizes, twice per layer. These kernels read each row once, in float32, in
the calling thread (benchmarks/bench_fused.py has the figures). They take contiguous 2-D float32
CPU tensors; `applies` says when, and the layers fall back to torch otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.layers.numba_jit import FASTMATH, jit


@jit(fastmath=FASTMATH, boundscheck=False, nogil=True)
def _rms_norm_rows(x, residual, weight, eps, offset, add, out):  # type: ignore[no-untyped-def]
    """Row by row: (residual += x if add); out = src / rms(src) * (offset + weight), src =
    residual if add else x."""
    M, H = x.shape
    for i in range(M):
        ss = np.float32(0.0)
        if add:
            for j in range(H):
                v = x[i, j] + residual[i, j]
                residual[i, j] = v
                ss += v * v
        else:
            for j in range(H):
                ss += x[i, j] * x[i, j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps)
        src = residual if add else x
        for j in range(H):
            out[i, j] = src[i, j] * inv * (offset + weight[j])


def applies(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a contiguous float32 CPU tensor (weights 1-D, the rest 2-D)."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.dim() <= 2
        for t in tensors
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x [M, H] -> x / rms(x) * (offset + weight), a new tensor."""
    out = torch.empty_like(x)
    xn = x.detach().numpy()
    _rms_norm_rows(xn, xn, weight.detach().numpy(), np.float32(eps), np.float32(offset), False, out.numpy())
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place); returns (residual / rms(residual) * (offset + weight), residual)."""
    out = torch.empty_like(x)
    _rms_norm_rows(
        x.detach().numpy(),
        residual.detach().numpy(),
        weight.detach().numpy(),
        np.float32(eps),
        np.float32(offset),
        True,
        out.numpy(),
    )
    return out, residual

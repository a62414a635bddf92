"""oneDNN's matmul for CPU linear layers, on weights reordered once into its blocked layout.

torch's CPU `matmul`/`bmm` call MKL's sgemm. On AMD CPUs MKL runs its AVX2 code path even where
the CPU has AVX-512, and tops out near 145 GFLOP/s on the project's 2-core EPYC; oneDNN (bundled
with torch, the library behind inductor's CPU weight prepacking) picks its kernel from the CPU's
own features. With the weight reordered into oneDNN's blocked layout ahead of time, its fp32
matmul reaches 200-400 GFLOP/s there, and is still faster than MKL when capped at AVX2
(benchmarks/bench_linear.py, figures in docs/benchmarks.md). bfloat16 weights (`--dtype bfloat16`)
are packed the same way where oneDNN supports bf16 (AVX-512 CPUs).

    pack(W [out, in])  -> an opaque oneDNN tensor, same bytes, blocked for the kernel
    linear(x [..., in], packed, bias [out] | None) -> x @ W.T + bias

The ops are torch's own (`torch.ops.mkldnn`), private but stable across the 2.x releases;
`available()` checks once that they exist and compute the right thing before the loader relies on
them.
"""

from __future__ import annotations

import functools

import torch

# oneDNN picks the weight's blocked format from an expected batch size; every size from 4 up gives
# the same format (AB16b64a on AVX-512), and 1 would keep the plain layout.
PACK_BATCH_HINT = 16


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias); `weight` packed by `pack` or a plain [out, in] tensor."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has oneDNN's linear ops for `dtype` (float32, or bfloat16 on CPUs
    whose oneDNN supports it) and they agree with `torch.matmul` on a small problem."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(40, 24, generator=gen).to(dtype)
        b = torch.randn(40, generator=gen).to(dtype)
        x = torch.randn(5, 24, generator=gen).to(dtype)
        with torch.inference_mode():
            got = linear(x, pack(w), b).float()
        want = x.float() @ w.float().T + b.float()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return torch.allclose(got, want, rtol=tol, atol=tol)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False

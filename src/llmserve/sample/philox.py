"""Counter-based exponentials for seeded rows: q[row, v] ~ Exp(1), a pure function of (seed,
position, v), every seeded row of a step in one launch.

    key      (k0, k1) = (seed & 0xFFFFFFFF, seed >> 32)          the request's seed, 63 bits
    counter  (c0, c1, c2, c3) = (v, position & 0xFFFFFFFF, position >> 32, 0)
    r        = word 0 of Philox4x32-10(key, counter)               uint32, uniform
    u        = (r + 1/2) / 2^32, capped at 1 - 2^-24               float32 in (0, 1)
    q        = -log(1 - u) = -log1p(-u)                            Exp(1)

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) is the
counter-based generator of cuRAND, of torch's CUDA RNG and of `tl.rand`; it passes BigCrush. A
draw depends only on its key and counter, so a row's draws are the same alone or in any batch
and after preemption (the position, not a hidden generator state, is what advances), and
speculative verification draws position j by simply computing it (no rewinding). Transform:
-log(1 - u) puts the fine end of the float grid (u near 0) at small q, where the race
argmax(p / q) is decided; below u = 2^-5 it is the series u + u^2/2 + u^3/3 + u^4/4, because
1 - u would round those u's low bits away (q is within 2^-19 of -log1p(-u) throughout). The cap
keeps q finite (q <= 16.6).

Two implementations give the same r bit for bit: a Triton kernel (philox_triton.py; CUDA, and
the CPU tests under TRITON_INTERPRET=1) and the torch ops below (any device: the fallback where
triton is missing, and the reference the kernel is tested against). q then differs at most by
the last bits of their `log`. Statistical check: tests/unit/test_sampler_philox.py (a KS and a
chi-square test of exp(-q) over a million draws with a fixed seed).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
"""The multipliers of Philox4x32's round function."""
PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
"""The key schedule's increments (golden ratio and sqrt(3) - 1, in 32 bits)."""
PHILOX_ROUNDS = 10
SERIES_BELOW = 2.0**-5
"""Below this u, -log(1 - u) is summed as a series (1 - u would lose u's low bits)."""
U_MAX = 1.0 - 2.0**-24
"""The largest float32 below 1: u's cap."""
_MASK32 = 0xFFFFFFFF


def philox_exponentials_(
    q: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> None:
    """Fill rows `rows` [S] of `q` [B, V] fp32 with the Exp(1) draws of (`seeds`, `positions`) [S]."""
    kernels = _triton_kernels() if q.is_cuda else None
    if kernels is not None:
        kernels.philox_exponentials_(q, rows, seeds, positions)
        return
    r = philox_uint32(seeds, positions, q.shape[1])  # [S, V]
    q.index_copy_(0, rows, exponential_from_uint32(r))


def philox_uint32(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] int64 in [0, 2^32): word 0 of Philox4x32-10 for key `seeds` [S] and counters
    (v, `positions` [S]) for v < V."""
    c0 = torch.arange(vocab_size, device=seeds.device).expand(len(seeds), vocab_size)  # [S, V]
    c1 = (positions & _MASK32).unsqueeze(1)  # [S, 1]
    c2 = (positions >> 32).unsqueeze(1)
    key = ((seeds & _MASK32).unsqueeze(1), ((seeds >> 32) & _MASK32).unsqueeze(1))  # [S, 1] each
    return philox4x32((c0, c1, c2, torch.zeros_like(c1)), key)[0]


def philox4x32(
    counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 over broadcastable int64 tensors holding 32-bit words (every product in
    int64 stays below 2^49, so no op overflows)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(PHILOX_ROUND[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_ROUND[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_WEYL[0]) & _MASK32
        k1 = (k1 + PHILOX_WEYL[1]) & _MASK32
    return c0, c1, c2, c3


def exponential_from_uint32(r: torch.Tensor) -> torch.Tensor:
    """Exp(1) float32 draws from uniform 32-bit integers (the module docstring's transform)."""
    u = ((r.to(torch.float32) + 0.5) * 2.0**-32).clamp_(max=U_MAX)
    series = u * (1.0 + u * (0.5 + u * (1.0 / 3.0 + u * 0.25)))
    return torch.where(u < SERIES_BELOW, series, -torch.log(1.0 - u))


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of a * b (a, b < 2^32), without overflowing int64: b in 16-bit halves.

    a * b = a * b_hi * 2^16 + a * b_lo,  each product < 2^48
    """
    low_part = a * (b & 0xFFFF)
    high_part = a * (b >> 16)
    low = low_part + ((high_part & 0xFFFF) << 16)  # < 2^49
    return (high_part >> 16) + (low >> 32), low & _MASK32


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """philox_triton.py, or None where triton is missing (the torch ops above then run)."""
    try:
        from llmserve.sample import philox_triton
    except ImportError:
        return None
    return philox_triton

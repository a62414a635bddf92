"""The Triton kernel of philox.py: every seeded row's V exponentials in one launch.

    grid (S, cdiv(V, BLOCK)): program (i, b) loads seeded row i's batch row, seed and position,
    runs `tl.philox` (Philox4x32-10) over counters (v, pos lo, pos hi, 0) for its BLOCK tokens
    and writes q = -log(1 - u) into q[row, v] (philox.py states the transform once)

Importing this module needs triton; philox.py imports it only for CUDA tensors (and the CPU
tests run it under TRITON_INTERPRET=1; compiled, its tests pass on an H100). Speed not measured:
one read of three scalars and one write of V floats per row, with ~40 integer ops per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.sample.philox import PHILOX_ROUNDS, SERIES_BELOW, U_MAX

BLOCK = 1024


@triton.jit
def _philox_exponential_kernel(
    q_ptr, rows_ptr, seeds_ptr, positions_ptr, stride_q, vocab_size,
    N_ROUNDS: tl.constexpr, SERIES_BELOW: tl.constexpr, U_MAX: tl.constexpr, RAW: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    seed = tl.load(seeds_ptr + i)
    position = tl.load(positions_ptr + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab_size
    c0 = cols.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (position & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + (position >> 32).to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, zero, N_ROUNDS)
    if RAW:  # the integers themselves, for the tests against philox.philox_uint32
        tl.store(q_ptr + row * stride_q + cols, r.to(tl.int64), mask=ok)
    else:
        u = tl.minimum((r.to(tl.float32) + 0.5) * 2.3283064365386963e-10, U_MAX)  # 2^-32
        series = u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * 0.25)))
        q = tl.where(u < SERIES_BELOW, series, -tl.log(1.0 - u))
        tl.store(q_ptr + row * stride_q + cols, q, mask=ok)


def philox_exponentials_(
    q: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, raw: bool = False
) -> None:
    """philox.philox_exponentials_ in one launch. `raw`: write the uint32 words instead (into an
    int64 `q`), for the tests."""
    assert q.stride(1) == 1 and q.dtype == (torch.int64 if raw else torch.float32)
    num_seeded, vocab_size = len(rows), q.shape[1]
    if num_seeded == 0:
        return
    grid = (num_seeded, triton.cdiv(vocab_size, BLOCK))
    _philox_exponential_kernel[grid](
        q, rows, seeds, positions, q.stride(0), vocab_size,
        N_ROUNDS=PHILOX_ROUNDS, SERIES_BELOW=SERIES_BELOW, U_MAX=U_MAX, RAW=raw, BLOCK=BLOCK,
    )  # fmt: skip

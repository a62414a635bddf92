"""The LoRA delta of a step's mixed adapters as two Triton kernels (punica's BGMV: each row reads
only its own adapter's ranks), for the GPU path; `layers.py`'s masked matmul pair is the torch
reference (and the CPU path). Importing this module needs triton.

Weights are the wrapper's packed ones: the step's adapters' A's side by side and B's stacked,

    a_t [in, R]   b_t [R, out]   row t owns columns/rows start[t] .. start[t] + rank[t]
                                 (rank[t] = 0: a base-model row, or an adapter without this layer)

    shrink   grid (T, R_max / BLOCK_R):   h[t, r] = sum_k x[t, k] * a_t[k, start[t] + r]     r < rank[t]
    expand   grid (T, out / BLOCK_N):     y[t, n] += sum_r h[t, r] * b_t[start[t] + r, n]

`h` is [T, R_max] float32 (R_max: the largest rank of the step's adapters on this layer), so a
row does rank[t] / R of the masked pair's work; sums are float32, `y` is rounded once, at the add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.layers.triton_ops import cast


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, start_ptr, rank_ptr, n_in, stride_x, stride_a, stride_h,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    r_off = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank = tl.load(rank_ptr + row)
    if rank == 0:
        return
    start = tl.load(start_ptr + row)
    r_ok = r_off < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < n_in
        x = tl.load(x_ptr + row * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(
            a_ptr + k[:, None] * stride_a + (start + r_off)[None, :],
            mask=k_ok[:, None] & r_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_R]
        acc += tl.sum(x[:, None] * a, 0)
    tl.store(h_ptr + row * stride_h + r_off, acc, mask=r_ok)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, start_ptr, rank_ptr, n_out, stride_h, stride_b, stride_y,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rank = tl.load(rank_ptr + row)
    if rank == 0:
        return
    start = tl.load(start_ptr + row)
    n_ok = n < n_out
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rank
        h = tl.load(h_ptr + row * stride_h + r, mask=r_ok, other=0.0)  # [BLOCK_R] float32
        b = tl.load(
            b_ptr + (start + r)[:, None] * stride_b + n[None, :],
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        acc += tl.sum(h[:, None] * b, 0)
    y = tl.load(y_ptr + row * stride_y + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + n, cast(y + acc, y_ptr.dtype.element_ty), mask=n_ok)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
    start: torch.Tensor, rank: torch.Tensor, max_rank: int,
) -> torch.Tensor:  # fmt: skip
    """y += each row's own adapter delta, in place (see the module docstring); returns y.
    x [T, in], y [T, out] (rows contiguous), a_t [in, R], b_t [R, out], start / rank [T] int."""
    num_rows, n_in = x.shape
    n_out = y.shape[1]
    assert x.stride(1) == 1 and y.stride(1) == 1 and a_t.stride(1) == 1 and b_t.stride(1) == 1
    if num_rows == 0 or max_rank == 0:
        return y
    h = torch.empty(num_rows, max_rank, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(max_rank))
    _shrink_kernel[(num_rows, triton.cdiv(max_rank, block_r))](
        x, a_t, h, start, rank, n_in, x.stride(0), a_t.stride(0), h.stride(0), BLOCK_K=64, BLOCK_R=block_r
    )
    block_n = 128
    _expand_kernel[(num_rows, triton.cdiv(n_out, block_n))](
        h,
        b_t,
        y,
        start,
        rank,
        n_out,
        h.stride(0),
        b_t.stride(0),
        y.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )
    return y

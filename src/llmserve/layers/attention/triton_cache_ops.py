"""Triton KV-cache writes: RoPE fused with the write (q rotated, k rotated and stored, v stored, in
one pass over the new tokens), and the plain write for models that rotate q and k themselves.
Importing this module needs triton (the backend imports it lazily).

One program per new token; its heads are one 2-D tile, so a decode step of B tokens is B programs:

    q[t]: [H, D]     --rotate-->  q_out[t]                    (in place when q_out is q)
    k[t]: [H_kv, D]  --rotate-->  kv_cache[0, :, slot // bs, slot % bs, :]
    v[t]: [H_kv, D]  ----------> kv_cache[1, :, slot // bs, slot % bs, :]     slot = slot_mapping[t]

RoPE, "half rotation" (NeoX / HF) over the first rotary_dim dims, the rest passed through:

    x1 = x[:R/2], x2 = x[R/2:R], (c, s) = cos_sin[position, :R/2], cos_sin[position, R/2:]
    out = [x1 c - x2 s | x2 c + x1 s | x[R:]]            computed in float32, rounded once

A rotated k is rounded to k's dtype, then to the cache's (as the torch reference rounds it). A slot
below 0 writes nothing: a padded token of a CUDA-graph batch. Speed not measured (no GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.layers.triton_ops import cast


@triton.jit
def _rotate(x_ptrs, mask, cos, sin, HALF: tl.constexpr):
    """The rotated halves (float32) of the rows at x_ptrs [rows, HALF_PAD] (first half)."""
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, positions_ptr, cos_sin_ptr, slot_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_cs,
    stride_kv, stride_kvh, stride_blk, stride_row, block_size,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    H_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr, D_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr, COPY_Q_PASS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    p = 2 * HALF + tl.arange(0, PASS_PAD)  # the dims past rotary_dim
    p_ok = p < HEAD_DIM

    # 1. q -> q_out
    h = tl.arange(0, H_PAD)
    h_ok = h < NUM_HEADS
    m = h_ok[:, None] & i_ok[None, :]
    q1, q2 = _rotate(q_ptr + t * stride_qt + h[:, None] * stride_qh + i[None, :], m, cos, sin, HALF)
    o_ptrs = q_out_ptr + t * stride_ot + h[:, None] * stride_oh
    tl.store(o_ptrs + i[None, :], cast(q1, q_out_ptr.dtype.element_ty), mask=m)
    tl.store(o_ptrs + HALF + i[None, :], cast(q2, q_out_ptr.dtype.element_ty), mask=m)
    if COPY_Q_PASS:
        mp = h_ok[:, None] & p_ok[None, :]
        x = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + p[None, :], mask=mp, other=0.0)
        tl.store(o_ptrs + p[None, :], x, mask=mp)

    # 2. k, v -> the cache at this token's slot
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = (slot // block_size) * stride_blk + (slot % block_size) * stride_row
    kh = tl.arange(0, HKV_PAD)
    # (not `& (slot >= 0)`: the interpreter cannot load under a mask built from a scalar predicate)
    kh_ok = kh < tl.where(slot >= 0, NUM_KV_HEADS, 0)
    dst = cache_ptr + row + kh[:, None].to(tl.int64) * stride_kvh  # [HKV_PAD, 1] K rows
    m = kh_ok[:, None] & i_ok[None, :]
    k_src = k_ptr + t * stride_kt + kh[:, None] * stride_kh
    k1, k2 = _rotate(k_src + i[None, :], m, cos, sin, HALF)
    k_ty = k_ptr.dtype.element_ty
    c_ty = cache_ptr.dtype.element_ty
    tl.store(dst + i[None, :], cast(cast(k1, k_ty), c_ty), mask=m)
    tl.store(dst + HALF + i[None, :], cast(cast(k2, k_ty), c_ty), mask=m)
    if 2 * HALF < HEAD_DIM:
        mp = kh_ok[:, None] & p_ok[None, :]
        tl.store(dst + p[None, :], cast(tl.load(k_src + p[None, :], mask=mp, other=0.0), c_ty), mask=mp)
    d = tl.arange(0, D_PAD)
    mv = kh_ok[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + t * stride_vt + kh[:, None] * stride_vh + d[None, :], mask=mv, other=0.0)
    tl.store(dst + stride_kv + d[None, :], cast(v, c_ty), mask=mv)


@triton.jit
def _cache_write_kernel(
    k_ptr, v_ptr, slot_ptr, cache_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv, stride_kvh, stride_blk, stride_row, block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HKV_PAD: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    kh = tl.arange(0, HKV_PAD)
    d = tl.arange(0, D_PAD)
    m = (kh < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = cache_ptr + (slot // block_size) * stride_blk + (slot % block_size) * stride_row
    dst += kh[:, None].to(tl.int64) * stride_kvh + d[None, :]
    c_ty = cache_ptr.dtype.element_ty
    k = tl.load(k_ptr + t * stride_kt + kh[:, None] * stride_kh + d[None, :], mask=m, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + kh[:, None] * stride_vh + d[None, :], mask=m, other=0.0)
    tl.store(dst, cast(k, c_ty), mask=m)
    tl.store(dst + stride_kv, cast(v, c_ty), mask=m)


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, ...]:
    assert kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    s = kv_cache.stride()
    return s[0], s[1], s[2], s[3]


def write_kv_cache(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D]
    slot_mapping: torch.Tensor,  # [T] int64 (or int32); < 0: skip the token
) -> None:
    """Store each token's K and V rows at its slot, rounded to the cache's dtype."""
    T, H_kv, D = key.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    if T == 0:
        return
    _cache_write_kernel[(T,)](
        key, value, slot_mapping, kv_cache, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *_cache_strides(kv_cache), kv_cache.shape[3],
        NUM_KV_HEADS=H_kv, HEAD_DIM=D, HKV_PAD=triton.next_power_of_2(H_kv),
        D_PAD=triton.next_power_of_2(D), num_warps=1 if H_kv * D <= 1024 else 4,
    )  # fmt: skip


def rope_and_write_kv_cache(
    query: torch.Tensor,  # [T, H, D], pre-RoPE
    key: torch.Tensor,  # [T, H_kv, D], pre-RoPE
    value: torch.Tensor,  # [T, H_kv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_table: torch.Tensor,  # [max_position, rotary_dim] float32: [cos | sin] per frequency
    rotary_dim: int,
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D]
    slot_mapping: torch.Tensor,  # [T] int64 (or int32); < 0: skip the token's K/V
    query_out: torch.Tensor | None = None,  # [T, H, D]; `query` itself rotates in place
) -> torch.Tensor:  # the rotated query (query_out, or a new tensor)
    """Rotate q and k by their positions and store the rotated k and v at their slots, one pass."""
    T, H, D = query.shape
    H_kv = key.shape[1]
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= D, (rotary_dim, D)
    assert cos_sin_table.shape[1] == rotary_dim and cos_sin_table.stride(1) == 1
    assert all(x.stride(-1) == 1 for x in (query, key, value))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if query_out is None else query_out
    if T == 0:
        return out
    half = rotary_dim // 2
    pass_dims = D - rotary_dim
    _rope_cache_kernel[(T,)](
        query, key, value, out, positions, cos_sin_table, slot_mapping, kv_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1), cos_sin_table.stride(0), *_cache_strides(kv_cache), kv_cache.shape[3],
        NUM_HEADS=H, NUM_KV_HEADS=H_kv, HEAD_DIM=D, HALF=half,
        H_PAD=triton.next_power_of_2(H), HKV_PAD=triton.next_power_of_2(H_kv),
        HALF_PAD=triton.next_power_of_2(half), D_PAD=triton.next_power_of_2(D),
        PASS_PAD=triton.next_power_of_2(max(pass_dims, 1)),
        COPY_Q_PASS=pass_dims > 0 and out.data_ptr() != query.data_ptr(),
        num_warps=1 if H * D <= 1024 else 4,
    )  # fmt: skip
    return out

"""The grouped mixture-of-experts MLP as two Triton kernels, for the GPU path (moe.py's `SparseMoE`
with `moe_kernel` "triton"); moe.py's `grouped_forward` is the torch reference. Importing this
module needs triton.

1. routing metadata (`align_routing`, torch ops on the device, no host sync): the T * k (token,
   expert) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M, so that
   every block of BLOCK_M rows belongs to one expert:

       pair p = t * k + j (token t's j-th choice)       ids [T, k] -> flat [P], P = T * k
       sorted_pairs  [ e0 p p p P P | e2 p P P P | e3 p p p p p p P P | P ... ]   P = padding
                       block 0        block 1      blocks 2, 3            unused blocks
       block_expert  [ e0           | e2         | e3        | e3     | E ... ]   E = nothing to do

   An expert that no token chose has no block. The buffers are sized for the worst case,
   P + min(E, P) * (BLOCK_M - 1) rows, which depends only on T: shapes are fixed for a batch
   size, nothing is read back, and the whole forward can be captured in a CUDA graph. (A count
   with `torch.bincount` would sync on CUDA to size its output; `scatter_add_` does not.)
2. gate_up   grid (blocks, I / BLOCK_N): the block's rows of x gathered by token, times the
   expert's [gate | up] columns, act(gate) * up -> h [rows, I] in the padded row order;
3. down      grid (blocks, H / BLOCK_N): h's rows times the expert's down_proj, times the pair's
   routing weight -> pair_out [P, H] at row p;
4. the top-k sum: pair_out viewed [T, k, H], summed over k by torch.

Why a separate sum instead of atomic adds into out [T, H] from the down kernel: atomics add a
token's k rows in whatever order the blocks finish, so a token's output would change from run to
run (and with the rest of the batch) by a rounding unit, and greedy or seeded outputs would not be
reproducible; bf16 atomics are also not native on every GPU. The sum reads P * H more elements,
a small cost beside the expert weights.

Rounding follows the torch path's (`GatedMLP` on CUDA with the fused activation kernel): float32
dot products, gate/up rounded to the dtype, act(gate) rounded, the product rounded; the down
output rounded, then times the weight and rounded. The torch path adds the k results one by one
in the dtype; the sum here rounds once, so 16-bit outputs can differ by a rounding unit.

Weights are the experts' own, stacked (moe.py's `SparseMoE.use_kernel`), input-major as `Linear`
stores them: w13 [E, H, 2I] (gate columns, then up) and w2 [E, I, H]; float16, bfloat16 or
float32. Tiles are fixed (BLOCK_N 64, BLOCK_K 64; BLOCK_M 16 or 64 by rows per expert), not
tuned on a GPU yet: benchmarks/gpu/moe_kernel.py measures them against the dense fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmserve.layers.activation import fused_gated_name
from llmserve.layers.triton_ops import UPCAST_BF16, cast, dot, gated_act

BLOCK_N = 64
BLOCK_K = 64


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's minimum) while experts get few rows each (decode), 64 once
    they average more than 32 (prefill), where wider tiles read each weight tile fewer times."""
    return 64 if num_pairs > 32 * num_experts else 16


@dataclass(frozen=True, slots=True)
class MoERouting:
    """Where each (token, expert) pair's row sits once sorted by expert (module docstring, step 1)."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: pair index, or num_pairs for padding
    block_expert: torch.Tensor  # [num_blocks] int32: the block's expert, or num_experts (no work)
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def align_routing(ids: torch.Tensor, num_experts: int, block_m: int) -> MoERouting:
    """The routing metadata of `ids` [T, k] (expert ids), with torch ops on ids' device and no
    host sync: every shape follows from T, k, num_experts and block_m alone."""
    num_pairs = ids.numel()
    flat = ids.reshape(num_pairs)
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E]: where each expert's padded run ends
    order = torch.argsort(flat, stable=True)  # [P]: pair indices grouped by expert
    expert = flat[order]
    first = counts.cumsum(0) - counts  # [E]: the expert's first pair in `order`
    rank = torch.arange(num_pairs, device=device) - first[expert]  # the pair's place in its run
    dest = ends[expert] - padded[expert] + rank
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=device) * block_m
    # the first expert whose run ends after the block's first row: empty runs are skipped, and
    # a block past the last run gets num_experts
    block_expert = torch.searchsorted(ends, starts, right=True, out_int32=True)
    return MoERouting(sorted_pairs, block_expert, block_m)


@triton.jit(do_not_specialize=["num_pairs"])  # (inlined: the kernels' flag is what counts)
def _tile(
    block_expert_ptr,
    pairs_ptr,
    w_ptr,
    num_pairs,
    n_cols,
    stride_we,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """This program's tile: (expert, padded rows, their pairs, which rows are real, output columns,
    which are in range, the expert's weight). The expert is num_experts for a block with no work."""
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, rows, pair, pair < num_pairs, cols, cols < n_cols, w_ptr + e.to(tl.int64) * stride_we


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_experts, hidden, inter,
    stride_xt, stride_we, stride_wk, stride_h,
    TOP_K: tl.constexpr, GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """h[row, n] = act(x[token] @ W13[e, :, n]) * (x[token] @ W13[e, :, I + n]) for one block of rows."""
    e, rows, pair, row_ok, cols, col_ok, w = _tile(
        block_expert_ptr, pairs_ptr, w_ptr, num_pairs, inter, stride_we, BLOCK_M, BLOCK_N
    )
    if e >= num_experts:
        return
    token = (pair // TOP_K).to(tl.int64)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(
            x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        b_ptrs = w + k[:, None].to(tl.int64) * stride_wk + cols[None, :]  # [BLOCK_K, BLOCK_N]
        b_ok = k_ok[:, None] & col_ok[None, :]
        acc_gate += dot(a, tl.load(b_ptrs, mask=b_ok, other=0.0), IEEE, UPCAST)
        acc_up += dot(a, tl.load(b_ptrs + inter, mask=b_ok, other=0.0), IEEE, UPCAST)
    dtype = h_ptr.dtype.element_ty
    # gate and up rounded to the dtype, as the torch path's matmul output is
    gate = cast(acc_gate, dtype).to(tl.float32)
    up = cast(acc_up, dtype).to(tl.float32)
    h = gated_act(gate, up, dtype, GELU)
    tl.store(
        h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :],
        h,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    h_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr, num_pairs, num_experts, inter,
    hidden, stride_h, stride_we, stride_wk, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """out[pair, n] = (h[row] @ W2[e, :, n]) * weight[pair] for one block of rows."""
    e, rows, pair, row_ok, cols, col_ok, w = _tile(
        block_expert_ptr, pairs_ptr, w_ptr, num_pairs, hidden, stride_we, BLOCK_M, BLOCK_N
    )
    if e >= num_experts:
        return
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_h
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(h_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            w + k[:, None].to(tl.int64) * stride_wk + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += dot(a, b, IEEE, UPCAST)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = cast(cast(acc, dtype).to(tl.float32) * weight[:, None], dtype)
    tl.store(
        out_ptr + pair[:, None].to(tl.int64) * stride_o + cols[None, :],
        y,
        mask=row_ok[:, None] & col_ok[None, :],
    )


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act: str
) -> torch.Tensor:
    """sum_j weights[t, j] * expert[ids[t, j]](x[t]) for every token t (see the module docstring).

    x [T, H]; w13 [E, H, 2I] and w2 [E, I, H], rows contiguous, in x's dtype; weights [T, k] in
    x's dtype; ids [T, k] int64. Returns [T, H]."""
    kind = fused_gated_name(act)
    if kind is None:
        raise ValueError(f"the grouped MoE kernel computes SiLU and GELU-tanh experts, not {act!r}")
    T, hidden = x.shape
    num_experts, _, two_inter = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    assert w13.dtype == x.dtype == w2.dtype and w2.shape == (num_experts, inter, hidden)
    assert w13.stride(2) == 1 and w2.stride(2) == 1
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = weights.to(x.dtype).contiguous()
    num_pairs = T * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    routing = align_routing(ids, num_experts, pick_block_m(num_pairs, num_experts))
    h = torch.empty(routing.num_blocks * routing.block_m, inter, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    flags = dict(
        BLOCK_M=routing.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
        UPCAST=UPCAST_BF16 and x.dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    _gate_up_kernel[(routing.num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13, h, routing.sorted_pairs, routing.block_expert, num_pairs, num_experts, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, GELU=kind == "gelu_tanh_and_mul", **flags,
    )  # fmt: skip
    _down_kernel[(routing.num_blocks, triton.cdiv(hidden, BLOCK_N))](
        h, w2, pair_out, routing.sorted_pairs, routing.block_expert, weights, num_pairs, num_experts,
        inter, hidden, h.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), **flags,
    )  # fmt: skip
    if top_k == 1:
        return pair_out
    return pair_out.view(T, top_k, hidden).sum(1)  # [T, k, H] -> [T, H], the k rows in a fixed order

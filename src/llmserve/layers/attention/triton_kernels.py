"""Triton paged attention over llmserve's KV cache: a split-K decode kernel and a varlen kernel for
prefill chunks and mixed batches. Both read K/V in place through the block table; nothing is
gathered. Importing this module needs triton (the backend imports it lazily).

Memory-access pattern (the cache layout of metadata.py):

    kv_cache[0 = K | 1 = V, kv_head]: [num_blocks, block_size, D]   rows of D contiguous elements

    key t of sequence s --> block b = block_tables[s, t // block_size], row t % block_size of b
    a tile of BLOCK_N keys = BLOCK_N row loads of D elements after one gather of block ids; the rows
    of one block are adjacent (16 rows x 64 x bf16 = 2 KiB), so a 64-key tile is 4 runs of 2 KiB

    query rows of one program (the GQA group of one KV head, padded for tl.dot):
        decode: [G_PAD, D]              G_PAD = max(16, next_pow2(group))  (tl.dot's minimum M)
        varlen: [BLOCK_Q * G_PAD, D]    row r = new token r // G_PAD, query head r % G_PAD
    each K/V tile is loaded once per program and serves every row through one tl.dot.

Decode (`paged_decode_attention`, max_query_len == 1), grid (num_seqs, num_kv_heads, num_splits):

    visible keys [lo, seq_len) = | split 0 | split 1 | ... | split S-1 |   spans of whole tiles
    each split: online softmax (float32, base 2) over its tiles -> (acc [G, D], max m [G], sum l [G])
    in a float32 workspace; `_merge_kernel` (grid num_seqs x num_heads) weighs split s by
    exp2(m_s - max_s m_s) and divides by the weighed sum of l. With one split the kernel normalises
    and writes the output itself (no workspace, no second launch).
    The grid depends only on (num_seqs, num_kv_heads, num_splits); each program reads its length
    from `seq_lens` on the device and returns at once when its split is empty, so one captured
    CUDA graph serves every context length.

Varlen (`varlen_paged_attention`), grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads):

    sequence i owns programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): at least
    ceil(query_len / BLOCK_Q) of them, so a program finds its sequence by binary search over
    `query_start_loc` and returns when it has no tokens. Static grid again (num_tokens, num_seqs).
    Query j of sequence i sits at position p = seq_len - query_len + j and sees keys t with
    t <= p (and t > p - window): a program visits only tiles in [lowest visible key, its last p].

Sinks (gpt-oss): a layer's per-head sink logit s adds exp2(s log2 e - m) to the final softmax
denominator (`_with_sinks`: in the one-split decode and the varlen kernel at normalisation, in the
merge against the splits' common max), a key with no value; `HAS_SINKS` compiles it out elsewhere.

Why two kernels rather than one: a decode-only batch (every CUDA-graph step) in the varlen kernel
fills one of BLOCK_Q token slots per program and runs only num_seqs x num_kv_heads programs, too
few to stream a long context at HBM speed at small batch; the decode kernel drops the token
dimension and splits long contexts instead. Mixed batches (and prefill) go to the varlen kernel,
decodes included: they are a minority of its work there.

Tuning (`_decode_tiles`, `_varlen_tiles`): fixed per head_dim, no autotuning in the hot path.
BLOCK_N 64 keeps 2 x 64 x 128 x 2 B = 32 KiB of K/V per stage at D 128; num_stages 2 to 3 lets
the compiler's pipeliner overlap the next tile's loads with this tile's dots. Decode pads a GQA
group of 4 to 16 dot rows: wasted tensor-core work on a step bound by reading K/V, not by math.
Block tables may be int32 or int64; block ids and cache offsets are widened to int64 (a cache
of more than 2^31 elements per layer stays addressable).
Measured on an H100 with triton 3.6 (the 1.07B Llama of bench_gpu.py, D 128, group 4, bf16): a
batch-1 decode at ~200 positions takes 3.6 us (decode kernel) + 2.0 us (merge) per layer; an
8,192-token step of four 2,048-token prompts takes 312 us per layer in the varlen kernel (137 GFLOP
of causal attention: ~440 TFLOP/s, under half the tensor cores' bf16 peak). Not tuned yet: the tile
sizes, warps and stages, and the split policy (`pick_decode_splits`). Checked without a GPU:
results under triton 3.9's interpreter (test_triton_kernels.py), and compilation for sm_90 down to
SASS (test_triton_compile.py); in that PTX, with 16-byte-aligned strides (what the launcher's
specialisation sees for D = 64 or 128), K/V tiles load as 16-byte cp.async, pipelined at
num_stages >= 2. bf16 dots run as float32 dots under the interpreter (`UPCAST_BF16`: its numpy
matmul mis-reads bf16), a cast on exact values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.layers.triton_ops import UPCAST_BF16, cast, dot

LOG2E = 1.4426950408889634
MAX_DECODE_SPLITS = 16
"""Powers of two up to this; the merge kernel loads all of a head's splits as one tile."""


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pos, k_base, v_base, table_row, kv_lo, kv_hi, window, stride_blk, stride_row,
    scale_log2, softcap, BLOCK_SIZE: tl.constexpr, MASK_PER_ROW: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax of the rows `q` [M, D_PAD] over keys [kv_lo, kv_hi) of one sequence.

    1. gather the tile's block ids, load K [BLOCK_N, D] and score s = q K^T (base-2 logits;
       SOFTCAP: Gemma 2's c * tanh(s / c) on the natural-log scores first);
    2. mask keys past kv_hi and, per row (MASK_PER_ROW), keys after q_pos or out of the window;
    3. rescale the running (acc, m, l) by exp2(m_old - m_new) and add this tile's p V.
    A row that has seen no visible key keeps m = -inf; m_safe keeps its exp2 finite (0).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    for start in range(kv_lo, kv_hi, BLOCK_N):
        t = start + offs_n  # [BLOCK_N] key positions
        t_ok = t < kv_hi
        blk = tl.load(table_row + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        rows = blk * stride_blk + (t % BLOCK_SIZE).to(tl.int64) * stride_row  # [BLOCK_N]
        kv_offs = rows[:, None] + offs_d[None, :]  # [BLOCK_N, D_PAD]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = cast(tl.load(k_base + kv_offs, mask=kv_mask, other=0.0), q.dtype)
        s = dot(q, tl.trans(k), IEEE, UPCAST) * scale_log2  # [M, BLOCK_N]
        if SOFTCAP:  # tanh(x) = 2 / (1 + e^-2x) - 1, which saturates to +-1 without overflow
            x = s * (1.0 / 1.4426950408889634) / softcap
            s = (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0) * (softcap * 1.4426950408889634)
        visible = t_ok[None, :]
        if MASK_PER_ROW:
            visible = visible & (t[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (t[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = cast(tl.load(v_base + kv_offs, mask=kv_mask, other=0.0), q.dtype)
        acc = acc * alpha[:, None] + dot(cast(p, q.dtype), v, IEEE, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _with_sinks(l_i, m_i, sinks_ptr, heads, ok, HAS_SINKS: tl.constexpr):
    """The softmax denominator l (over keys, base 2, running max m), plus exp2(sink - m) for a
    layer with learned sink logits (gpt-oss: a key with no value). A row that saw no key keeps
    m = -inf; its sink term is taken against 0 (its acc is 0, its output 0)."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        l_i = l_i + tl.where(ok, tl.exp2(sink - m_safe), 0.0)
    return l_i


@triton.jit
def _split_range(seq_len, window, HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first visible key, keys per split): splits cover whole tiles, so the last ones may be empty."""
    kv_lo = seq_len * 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    span = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return kv_lo, span


# Ints that change from step to step are not specialised on (Triton compiles a variant per value
# class: == 1, divisible by 16, other): the block table's width follows the batch's longest context
# in eager steps, and a new variant mid-serving is a compile of ~0.5 s on the request path (seen on
# an H100: the first batch of 2,048-token prompts, 128-block tables, waited 0.8 s per step).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, scale_log2,
    softcap, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kv, stride_kvh, stride_blk,
    stride_row, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo, span = _split_range(seq_len, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N)
    start = kv_lo + split * span
    end = tl.minimum(start + span, seq_len)
    if start >= end:
        return

    g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + g  # [G_PAD] query heads of this KV head
    row = seq.to(tl.int64)  # a decode-only batch: sequence i's one token is row i
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )

    k_base = cache_ptr + kv_head.to(tl.int64) * stride_kvh
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, g, k_base, k_base + stride_kv, table_ptr + seq.to(tl.int64) * stride_bt,
        start, end, window, stride_blk, stride_row, scale_log2, softcap,
        BLOCK_SIZE, False, False, HEAD_DIM, D_PAD, BLOCK_N, IEEE, UPCAST, SOFTCAP,
    )  # fmt: skip
    if NUM_SPLITS == 1:
        l_i = _with_sinks(l_i, m_i, sinks_ptr, heads, g_ok, HAS_SINKS)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, cast(out, out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # workspace [num_seqs, num_heads, NUM_SPLITS] x (acc [D] | (m, l))
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [G_PAD]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _merge_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, sinks_ptr, window, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """One (sequence, query head): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp2(m_s - max m)
    (the sink term, once, against max m: `_with_sinks`).
    Only the splits the decode kernel wrote are read (recomputed from seq_len): the workspace
    holds stale values past them."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo, span = _split_range(seq_len, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N)
    num_active = tl.cdiv(seq_len - kv_lo, tl.maximum(span, 1))
    s = tl.arange(0, NUM_SPLITS)
    s_ok = s < num_active
    part = (seq * num_heads + head) * NUM_SPLITS + s  # [NUM_SPLITS]
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(s_ok, tl.exp2(m - m_max), 0.0)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    denom = _with_sinks(tl.sum(w * l_s, 0), m_max, sinks_ptr, head, True, HAS_SINKS)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        cast(out, out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _varlen_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, q_start_ptr, out_ptr, sinks_ptr,
    scale_log2, softcap, window, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kv, stride_kvh, stride_blk, stride_row,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # 1. this program's sequence: the last i with qsl[i] // BLOCK_Q + i <= pid
    lo = pid * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(q_start_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of this program
    if first >= q_len:
        return

    # 2. rows = BLOCK_Q tokens x G_PAD heads, their positions and the keys they can see
    r = tl.arange(0, BLOCK_Q * G_PAD)
    tok = first + r // G_PAD
    g = r % G_PAD
    offs_d = tl.arange(0, D_PAD)
    row_ok = (tok < q_len) & (g < GROUP)
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + g
    flat = (q_start + tok).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + flat[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # tokens cached before this step's
    q_pos = ctx + tok
    kv_hi = ctx + tl.minimum(first + BLOCK_Q, q_len)  # one past the last query's position
    kv_lo = seq_len * 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx + first - window + 1, 0)

    # 3. online softmax over the visible tiles, then normalise
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_kvh
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, k_base, k_base + stride_kv, table_ptr + seq.to(tl.int64) * stride_bt,
        kv_lo, kv_hi, window, stride_blk, stride_row, scale_log2, softcap,
        BLOCK_SIZE, True, HAS_WINDOW, HEAD_DIM, D_PAD, BLOCK_N, IEEE, UPCAST, SOFTCAP,
    )  # fmt: skip
    l_i = _with_sinks(l_i, m_i, sinks_ptr, heads, row_ok, HAS_SINKS)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + flat[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, cast(out, out_ptr.dtype.element_ty), mask=q_mask)


def _decode_tiles(d_pad: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel for a padded head_dim."""
    return (64, 4, 3) if d_pad <= 128 else (32, 4, 2)


def _varlen_tiles(d_pad: int, g_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps, num_stages) of the varlen kernel: 64 query rows per program
    (BLOCK_Q tokens x the padded group), 16 at least for tl.dot."""
    rows = 64 if d_pad <= 128 else 32
    return max(rows // g_pad, 16 // g_pad, 1), (64 if d_pad <= 128 else 32), 4, 2


def pick_decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per context so that a decode step runs about two programs per SM: the smallest power
    of two reaching 2 x num_sms programs, at most MAX_DECODE_SPLITS. Depends only on static sizes."""
    programs, splits = num_seqs * num_kv_heads, 1
    while splits < MAX_DECODE_SPLITS and programs * splits < 2 * num_sms:
        splits *= 2
    return splits


def decode_workspace_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of the split-K workspace: (acc [head_dim], m, l) per (sequence, head, split)."""
    return 0 if num_splits == 1 else num_seqs * num_heads * num_splits * (head_dim + 2)


def _check(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, group) after checking the layouts the kernels assume."""
    _, H, D = query.shape
    H_kv = kv_cache.shape[1]
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert kv_cache.shape[-1] == D and H % H_kv == 0, (tuple(query.shape), tuple(kv_cache.shape))
    return H, H_kv, D, H // H_kv


def _cache_args(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[int, ...]:
    s = kv_cache.stride()
    return block_tables.stride(0), s[0], s[1], s[2], s[3]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, H, D]: row i is sequence i's one new token
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D], this step's K/V already written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 or int64
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    workspace: torch.Tensor | None = None,  # float32, >= decode_workspace_numel(...)
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,  # [H] sink logits (gpt-oss)
    softcap: float | None = None,  # Gemma 2's cap on the scaled scores
) -> torch.Tensor:  # [num_seqs, H, D]
    """Attention of each sequence's one new token over its paged context (split-K when
    num_splits > 1: the decode kernel, then `_merge_kernel`)."""
    H, H_kv, D, group = _check(query, kv_cache)
    num_seqs = seq_lens.shape[0]
    assert query.shape[0] == num_seqs, "a decode batch has one token per sequence"
    assert num_splits & (num_splits - 1) == 0 and num_splits <= MAX_DECODE_SPLITS, num_splits
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    d_pad = max(16, triton.next_power_of_2(D))
    block_n, num_warps, num_stages = _decode_tiles(d_pad)
    numel = decode_workspace_numel(num_seqs, H, D, num_splits)
    if numel:
        assert workspace is not None and workspace.numel() >= numel and workspace.dtype == torch.float32
        part_acc = workspace[: num_seqs * H * num_splits * D]
        part_ml = workspace[part_acc.numel() : numel]
    else:
        part_acc = part_ml = out  # unused
    window = sliding_window or 0
    _decode_kernel[(num_seqs, H_kv, num_splits)](
        query, kv_cache, block_tables, seq_lens, out, part_acc, part_ml, query if sinks is None else sinks,
        scale * LOG2E, softcap or 1.0, window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *_cache_args(kv_cache, block_tables),
        BLOCK_SIZE=kv_cache.shape[3], GROUP=group, HEAD_DIM=D, G_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=d_pad, BLOCK_N=block_n, NUM_SPLITS=num_splits, HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None,
        IEEE=query.dtype == torch.float32, UPCAST=UPCAST_BF16 and query.dtype == torch.bfloat16,
        SOFTCAP=softcap is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(num_seqs, H)](
            out, part_acc, part_ml, seq_lens, query if sinks is None else sinks, window, out.stride(0),
            out.stride(1), HEAD_DIM=D, D_PAD=d_pad, BLOCK_N=block_n, NUM_SPLITS=num_splits,
            HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None,
            num_warps=4 if D > 64 else 2,
        )  # fmt: skip
    return out


def varlen_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, H_kv, num_blocks, block_size, D], this step's K/V already written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 or int64
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,  # [H] sink logits (gpt-oss)
    softcap: float | None = None,  # Gemma 2's cap on the scaled scores
) -> torch.Tensor:  # [T, H, D]
    """Causal attention (aligned to each context's end) for any mix of prefill chunks and decodes."""
    _, H_kv, D, group = _check(query, kv_cache)
    T, num_seqs = query.shape[0], seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    d_pad = max(16, triton.next_power_of_2(D))
    g_pad = triton.next_power_of_2(group)
    block_q, block_n, num_warps, num_stages = _varlen_tiles(d_pad, g_pad)
    window = sliding_window or 0
    _varlen_kernel[(T // block_q + num_seqs, H_kv)](
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, query if sinks is None else sinks,
        scale * LOG2E, softcap or 1.0, window, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *_cache_args(kv_cache, block_tables),
        BLOCK_SIZE=kv_cache.shape[3], GROUP=group, HEAD_DIM=D, G_PAD=g_pad, D_PAD=d_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None,
        IEEE=query.dtype == torch.float32, UPCAST=UPCAST_BF16 and query.dtype == torch.bfloat16,
        SOFTCAP=softcap is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out

"""The CPU attention backend: decode attention read in place from the paged KV cache by a numba
kernel. K/V writes and prefill chunks stay on the torch reference path (this class subclasses it),
as do tensors the kernel does not take (not on the CPU, or not float32/bfloat16/float16). The
kernel computes in float32 whatever the model's dtype, and reads a 16-bit cache as it is,
widening each element as it is loaded, so a 16-bit cache halves the bytes it moves.

The reference backend gathers every decode sequence's blocks into a padded workspace and then
runs two matmuls over it, moving each KV byte three to four times. Here each K row and each V row
is read once, straight from its block, by all the query heads that share its KV head:

    kv_cache[0 or 1, h]: [num_blocks, block_size, D]         work item = (sequence, KV head h)
                          block_table[i // block_size] --> row i % block_size of that block

    for each work item, in parallel over threads:
        1. s[g, t] = q[g] . K[t]                  g: the group's query heads, t: visible positions
        2. s[g, :] = softmax(scale * s[g, :])      s is only G x context floats: no running rescale
                                                   (a layer's sink logit, gpt-oss, joins the sum)
        3. out[g]  = sum_t s[g, t] V[t]

Blocks sit anywhere in the cache, so the kernel prefetches its own stream (K blocks, V blocks,
then the next item's K blocks) two blocks ahead. Work items are split into one contiguous run per
thread, balanced by context length, once per forward; every layer reuses that split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from llmserve.layers.attention.backend import AttentionParams, register_attention_backend
from llmserve.layers.attention.metadata import AttentionMetadata, KVCacheSpec, KVDtypes, LayerKVCache
from llmserve.layers.attention.torch_ref import TorchAttentionBackend, _write_rows
from llmserve.layers.numba_jit import FASTMATH, jit, keep_torch_threads


@intrinsic
def _prefetch(typingctx: Any, arr: types.Array, index: types.Integer) -> Any:
    """Ask the CPU to start loading the cache line that holds `arr.flat[index]`. Blocks sit at
    random places in the cache, so the hardware prefetcher loses the stream at each new block."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        ptr = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        # Unmangled name: LLVM's IR parser renames it to its pointer type's intrinsic.
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch"
        )
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

    return types.void(arr, index), codegen


@intrinsic
def _bits_to_float32(typingctx: Any, bits: types.Integer) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _bf16_bits_to_float32(typingctx: Any, bits: types.Integer) -> Any:
    """A bfloat16 (stored as uint16) as float32: its bits are the top half of the float32's."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        return builder.bitcast(builder.shl(builder.zext(args[0], i32), i32(16)), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f16_bits_to_float32(typingctx: Any, bits: types.Integer) -> Any:
    """A float16 (stored as int16: numba has no float16 type) as float32 (F16C's vcvtph2ps)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


def _as_float32(x: Any) -> Any:
    """A cache element as float32; compiled per storage type (see the overload below)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_as_float32, inline="always")
def _as_float32_impl(x):  # type: ignore[no-untyped-def]  # numba wants the lambdas' exact signature
    # The cache's storage type picks the conversion: float32 as is, bfloat16 viewed as uint16,
    # float16 viewed as int16 (see `_cache_view`).
    if isinstance(x, types.Float):
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bf16_bits_to_float32(x)
    if x == types.int16:
        return lambda x: _f16_bits_to_float32(x)
    return None


def _cache_view(half: torch.Tensor) -> np.ndarray:
    """A numpy view of one cache half, in the storage type `_as_float32` converts from."""
    if half.dtype == torch.bfloat16:
        return half.view(torch.int16).numpy().view(np.uint16)
    if half.dtype == torch.float16:
        return half.view(torch.int16).numpy()
    return half.numpy()


_KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@jit(inline="always", fastmath=FASTMATH)
def _exp_nonpositive(x: float) -> float:
    """exp(x) for x <= 0 in float32 as plain arithmetic, so that LLVM vectorises the softmax loop
    (libm's expf is one call per score: as much time as the dot products). Cephes' expf: x =
    n ln 2 + r with |r| <= ln 2 / 2, exp(r) by a degree-7 polynomial, 2^n built in the exponent
    bits; about 1 ulp, and 0 below exp(-87.3) where float32 leaves normal numbers."""
    x = max(x, np.float32(-88.0))
    n = np.float32(math.floor(x * np.float32(1.4426950408889634) + np.float32(0.5)))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln 2 in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _bits_to_float32((np.int32(n) + np.int32(127)) << np.int32(23))  # n = -127: 0.0


# K/V rows handled together (the helpers below unroll exactly four): four independent FMA chains
# per query head, one read-modify-write of out per four V rows, and prefetches issued at a steady
# rate - a burst of 64 at the start of each block bought almost nothing (9 vs 15 GB/s, 1 thread).
_ROWS = 4
# Prefetch distance in blocks: rows of the block two ahead are requested as this one's are read.
_AHEAD = 2


@jit(inline="always")
def _visible(seq_len, window, bs):  # type: ignore[no-untyped-def]
    """(first visible position, its block, one past the last block) of a context."""
    start = max(0, seq_len - window) if window > 0 else 0
    return start, start // bs, (seq_len + bs - 1) // bs


@jit(inline="always", boundscheck=False)
def _prefetch_rows(flat, block_start, t, row_bytes):  # type: ignore[no-untyped-def]
    """Prefetch rows t .. t + _ROWS - 1 of the block at byte `block_start` of `flat` (bytes; past
    its end when t is not a multiple of _ROWS: a prefetch never faults, so that is harmless)."""
    for i in range(block_start + t * row_bytes, block_start + (t + _ROWS) * row_bytes, 64):
        _prefetch(flat, i)  # one per 64-byte line


@jit(inline="always", fastmath=FASTMATH, boundscheck=False)
def _score_rows(q, kb, t, n, s, col):  # type: ignore[no-untyped-def]
    """s[g, col + j] = q[g] . kb[t + j] for j < n <= _ROWS."""
    G, D = q.shape
    for g in range(G):
        if n == 4:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for d in range(D):
                qd = q[g, d]
                a0 += qd * _as_float32(kb[t, d])
                a1 += qd * _as_float32(kb[t + 1, d])
                a2 += qd * _as_float32(kb[t + 2, d])
                a3 += qd * _as_float32(kb[t + 3, d])
            s[g, col], s[g, col + 1], s[g, col + 2], s[g, col + 3] = a0, a1, a2, a3
        else:
            for j in range(n):
                a = np.float32(0.0)
                for d in range(D):
                    a += q[g, d] * _as_float32(kb[t + j, d])
                s[g, col + j] = a


@jit(inline="always", fastmath=FASTMATH, boundscheck=False)
def _accumulate_rows(s, col, vb, t, n, out):  # type: ignore[no-untyped-def]
    """out[g] += sum_j s[g, col + j] * vb[t + j] for j < n <= _ROWS."""
    G, D = out.shape
    for g in range(G):
        if n == 4:
            p0, p1, p2, p3 = s[g, col], s[g, col + 1], s[g, col + 2], s[g, col + 3]
            for d in range(D):
                out[g, d] += (
                    p0 * _as_float32(vb[t, d])
                    + p1 * _as_float32(vb[t + 1, d])
                    + p2 * _as_float32(vb[t + 2, d])
                    + p3 * _as_float32(vb[t + 3, d])
                )
        else:
            for j in range(n):
                p = s[g, col + j]
                for d in range(D):
                    out[g, d] += p * _as_float32(vb[t + j, d])


@jit(fastmath=FASTMATH, boundscheck=False, nogil=True)
def _attend_one(
    q, k, v, table, seq_len, window, scale, softcap, sinks, out, next_k, next_table, next_first, next_end
):  # type: ignore[no-untyped-def]
    """One work item: the query heads q [G, D] that share KV head k, v [num_blocks, block_size, D]
    over the last `window` positions (all when 0) of a `seq_len` context whose block ids are
    `table`; into out [G, D]. `softcap`: Gemma 2's cap c on the scaled scores (0: none). `sinks`:
    the heads' sink logits [G], or [0] for none. Blocks are
    read in the order K blocks, V blocks, then the next work item's K blocks (`next_*`), and
    prefetched _AHEAD blocks down that stream."""
    G, D = q.shape
    bs = k.shape[1]
    start, first, end = _visible(seq_len, window, bs)
    # The prefetch stream runs over K's and V's blocks, which may be of two types (`kv_cache_dtype`
    # K,V): it addresses them as bytes, so that one variable holds either array.
    k_bytes, v_bytes = k.reshape(-1).view(np.uint8), v.reshape(-1).view(np.uint8)
    next_bytes = next_k.reshape(-1).view(np.uint8)
    k_row, v_row = D * k.itemsize, D * v.itemsize  # bytes of a K row and of a V row
    s = np.empty((G, seq_len - start), np.float32)

    # 1. raw scores s[g, t - start] = q[g] . K[t]
    for i in range(first, end):
        j = i + _AHEAD  # block to prefetch: this pass's, then the V pass's first ones
        ahead_flat, ahead, row = k_bytes, table[min(j, end - 1)] * bs * k_row, k_row
        if j >= end:
            ahead_flat, ahead, row = v_bytes, table[min(first + j - end, end - 1)] * bs * v_row, v_row
        kb = k[table[i]]  # [bs, D]
        t0, t1 = max(start - i * bs, 0), min(seq_len - i * bs, bs)
        for t in range(t0, t1, _ROWS):
            _prefetch_rows(ahead_flat, ahead, t, row)
            _score_rows(q, kb, t, min(_ROWS, t1 - t), s, i * bs + t - start)

    # 2. probabilities in place: exp(scale * (s - max)) / sum; a soft cap c first replaces the
    #    scores by c * tanh(scale * s / c), which the softmax then takes unscaled
    sc = np.float32(scale)
    if softcap > 0:
        cap = np.float32(softcap)
        for g in range(G):
            for t in range(s.shape[1]):
                s[g, t] = cap * np.float32(math.tanh(sc * s[g, t] / cap))
        sc = np.float32(1.0)
    for g in range(G):
        m = np.float32(-3.0e38)
        for t in range(s.shape[1]):
            m = max(m, s[g, t])
        total = np.float32(0.0)
        for t in range(s.shape[1]):
            p = _exp_nonpositive(sc * (s[g, t] - m))
            s[g, t] = p
            total += p
        if sinks.shape[0] > 0:  # exp(sink - max) joins the denominator; an overflow means ~0 out
            total += np.float32(math.exp(sinks[g] - sc * m))
        inv = np.float32(1.0) / total
        for t in range(s.shape[1]):
            s[g, t] *= inv

    # 3. out[g] = sum_t p[g, t] V[t]
    out[:, :] = 0.0
    for i in range(first, end):
        j = i + _AHEAD  # this pass's blocks, then the next work item's first K blocks
        ahead_flat, ahead, row = v_bytes, table[min(j, end - 1)] * bs * v_row, v_row
        if j >= end:
            ahead = next_table[min(next_first + j - end, next_end - 1)] * bs * k_row
            ahead_flat, row = next_bytes, k_row
        vb = v[table[i]]
        t0, t1 = max(start - i * bs, 0), min(seq_len - i * bs, bs)
        for t in range(t0, t1, _ROWS):
            _prefetch_rows(ahead_flat, ahead, t, row)
            _accumulate_rows(s, i * bs + t - start, vb, t, min(_ROWS, t1 - t), out)


@jit(parallel=True, boundscheck=False)
def _paged_decode(query, k_cache, v_cache, block_tables, decodes, bounds, scale, softcap, window, sinks, out):  # type: ignore[no-untyped-def]
    """query, out: [T, H_kv, G, D]; k_cache, v_cache: [H_kv, num_blocks, block_size, D];
    sinks: [H_kv, G] sink logits, or [H_kv, 0] for a layer without them;
    decodes: [B, 3] (sequence index, batch row, seq_len). Work item i is (decode i // H_kv,
    KV head i % H_kv); thread w runs items bounds[w] to bounds[w + 1] - 1."""
    H_kv, bs = k_cache.shape[0], k_cache.shape[2]
    for w in prange(bounds.shape[0] - 1):
        for i in range(bounds[w], bounds[w + 1]):
            b, h = i // H_kv, i % H_kv
            nb, nh = min(i + 1, bounds[w + 1] - 1) // H_kv, min(i + 1, bounds[w + 1] - 1) % H_kv
            _, next_first, next_end = _visible(decodes[nb, 2], window, bs)
            row = decodes[b, 1]
            _attend_one(
                query[row, h],
                k_cache[h],
                v_cache[h],
                block_tables[decodes[b, 0]],
                decodes[b, 2],
                window,
                scale,
                softcap,
                sinks[h],
                out[row, h],
                k_cache[nh],
                block_tables[decodes[nb, 0]],
                next_first,
                next_end,
            )


@dataclass(frozen=True, slots=True)
class _DecodeWork:
    """This forward's decode sequences and their split over threads (shared by all layers)."""

    decodes: np.ndarray  # [B, 3] int64: sequence index, flat-batch row, seq_len
    bounds: np.ndarray  # [num_threads + 1] int64: thread w runs work items bounds[w]:bounds[w + 1]
    block_tables: np.ndarray  # [num_seqs, max_blocks] int64, a view of metadata.block_tables
    others: list[int]  # sequences with more than one new token (prefill chunks)


# Fixed cost of a work item in tokens' worth of time (allocation, softmax setup, output).
_ITEM_OVERHEAD_TOKENS = 32


def _num_threads() -> int:
    """Run numba with torch's intra-op thread count (numba's own default is one per core);
    numba's setting is per calling thread, and this runs in the thread that runs the model."""
    n = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


def _decode_work(metadata: AttentionMetadata, num_kv_heads: int, window: int) -> _DecodeWork | None:
    """This forward's decode work (None without decodes): built by the first layer, reused by
    every other layer with the same KV head count and window."""
    key = ("cpu_decode", num_kv_heads, window)
    if key in metadata.derived:
        return metadata.derived[key]  # type: ignore[return-value]
    seqs = [i for i, q in enumerate(metadata.query_lens) if q == 1]
    work = None
    if seqs:
        decodes = np.array(
            [(i, metadata.query_start_loc[i], metadata.seq_lens[i]) for i in seqs], dtype=np.int64
        )
        visible = decodes[:, 2] if window == 0 else np.minimum(decodes[:, 2], window)
        # Contiguous runs of items with equal total cost, in batch order: each thread's share is
        # off by at most one item, and no sort is needed.
        cost = np.cumsum(np.repeat(visible + _ITEM_OVERHEAD_TOKENS, num_kv_heads))
        n = _num_threads()
        inner = np.searchsorted(cost, cost[-1] * np.arange(1, n) / n)
        work = _DecodeWork(
            decodes=decodes,
            bounds=np.concatenate([[0], inner, [cost.shape[0]]]).astype(np.int64),
            block_tables=metadata.block_tables.numpy(),
            others=[i for i, q in enumerate(metadata.query_lens) if q != 1],
        )
    metadata.derived[key] = work
    return work


def _kernel_applies(query: torch.Tensor, k_half: torch.Tensor, v_half: torch.Tensor) -> bool:
    """The kernel takes each half in its own storage type (numba compiles one specialisation per
    pair of K and V types: float16 keys with bfloat16 values run as they are); an int8 half sends
    the layer to the reference path."""
    return (
        query.device.type == "cpu"
        and query.dtype in _KERNEL_CACHE_DTYPES
        and _kernel_takes(k_half)
        and _kernel_takes(v_half)
    )


def _kernel_takes(half: torch.Tensor) -> bool:
    return half.device.type == "cpu" and half.dtype in _KERNEL_CACHE_DTYPES and half.is_contiguous()


class CpuPagedAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def prepare(self, kv_cache_dtype: torch.dtype | KVDtypes) -> None:
        dtypes = KVDtypes.of(kv_cache_dtype)
        if dtypes.k in _KERNEL_CACHE_DTYPES and dtypes.v in _KERNEL_CACHE_DTYPES:
            with keep_torch_threads():  # the kernel's first call starts numba's pool
                _warm_up(dtypes)

    def build_metadata(
        self, metadata: AttentionMetadata, layers: Sequence[AttentionParams], spec: KVCacheSpec
    ) -> None:
        """The kernel's decode work per layer geometry, and the reference's values for what the
        kernel does not run (prefill chunks; caches it does not take)."""
        kernel_types = spec.dtypes.k in _KERNEL_CACHE_DTYPES and spec.dtypes.v in _KERNEL_CACHE_DTYPES
        if not kernel_types or metadata.slot_mapping.device.type != "cpu":
            return super().build_metadata(metadata, layers, spec)
        for p in layers:
            _write_rows(metadata, p.num_kv_heads, spec.num_blocks * spec.block_size)
            work = _decode_work(metadata, p.num_kv_heads, int(p.sliding_window or 0))
            self._build_sequences(
                metadata, p, spec, range(metadata.num_seqs) if work is None else work.others
            )

    def forward(
        self,
        params: AttentionParams,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,  # [2, H_kv, num_blocks, block_size, D], or a KVPair
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self._write_kv(params, key, value, kv_cache, metadata)
        window = int(params.sliding_window or 0)
        k_half, v_half = kv_cache[0].detach(), kv_cache[1].detach()
        work = (
            _decode_work(metadata, params.num_kv_heads, window)
            if _kernel_applies(query, k_half, v_half)
            else None
        )
        if work is None:  # no decodes, or tensors the kernel does not take
            return self._attend_batch(params, query, key, value, kv_cache, metadata)

        # The kernel computes in float32 whatever the model's and the cache's dtypes.
        T, H, D = query.shape
        H_kv = params.num_kv_heads
        out = torch.empty((T, H, D), dtype=torch.float32)
        G = H // H_kv
        sinks = (
            np.zeros((H_kv, 0), np.float32)
            if params.sinks is None
            else params.sinks.detach().to(torch.float32).numpy().reshape(H_kv, G)
        )
        _paged_decode(
            query.detach().to(torch.float32).contiguous().numpy().reshape(T, H_kv, H // H_kv, D),
            _cache_view(k_half),
            _cache_view(v_half),
            work.block_tables,
            work.decodes,
            work.bounds,
            float(params.scale),
            float(params.softcap or 0.0),
            window,
            sinks,
            out.numpy().reshape(T, H_kv, H // H_kv, D),
        )
        out = out.to(query.dtype)
        for i in work.others:
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            out[start:end] = self._sequence(params, i, query, key, value, kv_cache, metadata)
        return out


def _warm_up(kv_cache_dtype: torch.dtype | KVDtypes = torch.float32) -> None:
    """Compile the kernel for a cache dtype (or load it from numba's cache) on a tiny input with
    the argument types of every real call, so that the cost falls at model load rather than in the
    first request: about 4 s the first time on a machine, 0.3 s from the cache."""
    q = np.zeros((1, 1, 1, 16), np.float32)
    dtypes = KVDtypes.of(kv_cache_dtype)
    k, v = (_cache_view(torch.zeros((1, 1, 1, 16), dtype=d)) for d in (dtypes.k, dtypes.v))
    decodes, bounds = np.array([[0, 0, 1]], np.int64), np.array([0, 1], np.int64)
    sinks = np.zeros((1, 0), np.float32)
    _paged_decode(q, k, v, np.zeros((1, 1), np.int64), decodes, bounds, 1.0, 0.0, 0, sinks, np.empty_like(q))


@register_attention_backend("cpu")
def _make_cpu_backend() -> CpuPagedAttentionBackend:
    return CpuPagedAttentionBackend()

"""The numba "cpu" attention backend against the torch reference backend: same outputs and same
cache writes on random caches with scattered block tables, over batches that mix decodes and
prefill chunks, GQA ratios, head sizes, block sizes and sliding windows; "auto" selection; and a
tiny model's greedy tokens through the engine with either backend."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.layers.attention import Attention, AttentionMetadata, cpu_paged, get_attention_backend
from llmserve.layers.attention.backend import AttentionParams
from llmserve.layers.attention.cpu_paged import CpuPagedAttentionBackend
from llmserve.layers.attention.torch_ref import TorchAttentionBackend
from tests.models.tiny import make_tiny_model


def _batch(
    block_size: int, query_lens: list[int], seq_lens: list[int], num_blocks: int, seed: int
) -> AttentionMetadata:
    """Metadata whose sequences own blocks drawn at random from a shuffled pool."""
    pool = random.Random(seed).sample(range(num_blocks), num_blocks)
    tables = []
    for s_len in seq_lens:
        n = -(-s_len // block_size)
        tables.append(pool[:n])
        pool = pool[n:]
    return AttentionMetadata.build(query_lens, seq_lens, tables, block_size)


def _run_both(
    params: AttentionParams,
    md_args: tuple,
    num_blocks: int,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(out_cpu, out_torch, cache_cpu, cache_torch, cpu metadata) for one random batch."""
    gen = torch.Generator().manual_seed(seed)
    md_cpu, md_ref = (_batch(block_size, *md_args, num_blocks, seed) for _ in range(2))
    T, H, H_kv, D = md_cpu.num_tokens, params.num_heads, params.num_kv_heads, params.head_dim
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k, v = torch.randn(T, H_kv, D, generator=gen).to(dtype), torch.randn(T, H_kv, D, generator=gen).to(dtype)
    cache_cpu = torch.randn(2, H_kv, num_blocks, block_size, D, generator=gen).to(cache_dtype)
    cache_ref = cache_cpu.clone()
    with torch.inference_mode():
        out_cpu = get_attention_backend("cpu").forward(params, q, k, v, cache_cpu, md_cpu)
        out_ref = get_attention_backend("torch").forward(params, q, k, v, cache_ref, md_ref)
    return out_cpu, out_ref, cache_cpu, cache_ref, md_cpu


# Decodes with contexts of 1 token, a partial block, exactly one block, one past it and several
# blocks; a fresh prompt; a prefill chunk over cached context; a long decode.
QUERY_LENS = [1, 1, 1, 1, 7, 1, 5, 1, 1]
SEQ_LENS = [1, 3, 16, 17, 7, 45, 20, 8, 70]


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])  # GQA 1, 3, 4
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("sliding_window", [None, 5, 20])
def test_cpu_matches_torch_on_mixed_batches(block_size, num_heads, num_kv_heads, head_dim, sliding_window):
    params = AttentionParams(num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window)
    CpuPagedAttentionBackend().prepare(torch.float32)
    compiled = set(cpu_paged._paged_decode.signatures)
    out, ref, cache, cache_ref, md = _run_both(params, (QUERY_LENS, SEQ_LENS), 64, block_size)
    assert md.derived[("cpu_decode", num_kv_heads, sliding_window or 0)] is not None  # the kernel ran
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, cache_ref)
    # The specialisation `prepare` built is the one that ran: nothing compiles mid-run.
    assert set(cpu_paged._paged_decode.signatures) == compiled


@pytest.mark.parametrize("sliding_window", [None, 20])
def test_softcap_matches_torch(sliding_window):
    """Gemma 2's soft cap (c * tanh(scale * q.k / c) before the softmax), at a cap of 0.5 that
    bends every score: the kernel's decodes equal the reference's, and differ from no cap."""
    params = AttentionParams(6, 2, 64, 64**-0.5, sliding_window, softcap=0.5)
    out, ref, cache, cache_ref, md = _run_both(params, (QUERY_LENS, SEQ_LENS), 64, 16, seed=4)
    assert md.derived[("cpu_decode", 2, sliding_window or 0)] is not None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, cache_ref)
    uncapped = _run_both(
        AttentionParams(6, 2, 64, 64**-0.5, sliding_window), (QUERY_LENS, SEQ_LENS), 64, 16, seed=4
    )
    assert not torch.allclose(uncapped[0], out, atol=1e-3)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("block_size", [16, 8])
def test_cpu_reads_16_bit_caches_as_the_reference_does(cache_dtype, sliding_window, block_size):
    """A 16-bit cache under a float32 model: new K/V rounded when written (the same bits on both
    backends), the kernel widening each element as it reads it, in place."""
    params = AttentionParams(9, 3, 64, 0.125, sliding_window)
    CpuPagedAttentionBackend().prepare(cache_dtype)
    compiled = set(cpu_paged._paged_decode.signatures)
    out, ref, cache, cache_ref, md = _run_both(
        params, (QUERY_LENS, SEQ_LENS), 64, block_size, seed=3, cache_dtype=cache_dtype
    )
    assert md.derived[("cpu_decode", 3, sliding_window or 0)] is not None
    assert out.dtype == torch.float32 and cache.dtype == cache_dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, cache_ref)
    assert set(cpu_paged._paged_decode.signatures) == compiled
    # The same inputs again give the same bits (a fixed split over threads, a fixed order).
    again = _run_both(params, (QUERY_LENS, SEQ_LENS), 64, block_size, seed=3, cache_dtype=cache_dtype)
    assert torch.equal(again[0], out)


@pytest.mark.parametrize("query_lens,seq_lens", [([1], [33]), ([1] * 12, list(range(3, 99, 8))), ([9], [9])])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_single_decode_decode_only_and_prefill_only_batches(query_lens, seq_lens, num_threads):
    """Any thread count (numba follows torch, capped at its own pool) splits the work correctly."""
    old = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        params = AttentionParams(9, 3, 64, 0.125)
        out, ref, cache, cache_ref, _ = _run_both(params, (query_lens, seq_lens), 256, 16, seed=1)
        if 1 in query_lens:
            assert numba.get_num_threads() == min(num_threads, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, cache_ref)


def test_bf16_model_runs_the_kernel_in_float32():
    """A bfloat16 model with a bfloat16 cache: the kernel computes in float32, so it is closer to
    float32 attention over the same cache than the reference computing in bfloat16 is."""
    params = AttentionParams(9, 3, 64, 0.125)
    args = ((QUERY_LENS, SEQ_LENS), 64, 16, 5)
    out, ref, cache, cache_ref, md = _run_both(
        params, *args, dtype=torch.bfloat16, cache_dtype=torch.bfloat16
    )
    assert md.derived[("cpu_decode", 3, 0)] is not None and out.dtype == torch.bfloat16
    assert torch.equal(cache, cache_ref)
    # float32 queries over the same (bfloat16) cache contents
    exact = _run_both(params, *args, dtype=torch.float32, cache_dtype=torch.bfloat16)[1]
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)
    assert (out.float() - exact).abs().mean() <= (ref.float() - exact).abs().mean()


def test_unsupported_dtypes_fall_back_to_torch():
    params = AttentionParams(4, 2, 32, 32**-0.5)
    md_cpu, md_ref = _batch(8, [1, 1], [12, 30], 16, 0), _batch(8, [1, 1], [12, 30], 16, 0)
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    cache = torch.randn(2, 2, 16, 8, 32, dtype=torch.float64)
    out = get_attention_backend("cpu").forward(params, *(x.double() for x in (q, k, v)), cache, md_cpu)
    ref = get_attention_backend("torch").forward(params, *(x.double() for x in (q, k, v)), cache, md_ref)
    assert not any(isinstance(key, tuple) and key[0] == "cpu_decode" for key in md_cpu.derived)
    torch.testing.assert_close(out, ref)


def test_softmax_exp_is_accurate():
    """The kernel's own exp is as accurate as float32 allows over the whole normal range."""
    xs = np.linspace(-87.0, 0.0, 2001, dtype=np.float32)
    got = np.array([cpu_paged._exp_nonpositive(x) for x in xs], dtype=np.float64)
    want = np.exp(xs.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 3e-7
    assert cpu_paged._exp_nonpositive(np.float32(-1e30)) == 0.0


def test_auto_picks_cpu_for_cpu_devices_only():
    assert isinstance(get_attention_backend("auto", "cpu"), CpuPagedAttentionBackend)
    assert type(get_attention_backend("auto", torch.device("meta"))) is TorchAttentionBackend
    assert type(get_attention_backend("torch")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


def test_engine_greedy_tokens_equal_with_either_backend(tmp_path, monkeypatch):
    """A tiny Llama through the engine (in-flight batching with chunked prefill, so steps mix
    decodes and prefill chunks) gives the same greedy tokens on the kernel and on torch."""
    make_tiny_model("llama", tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 5, 17, 40, 9, 63)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(
        str(tmp_path),
        num_kv_blocks=256,
        block_size=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        show_progress=False,
    )
    layers = [m for m in llm.engine.loaded.model.modules() if isinstance(m, Attention)]
    assert all(isinstance(m.backend, CpuPagedAttentionBackend) for m in layers)  # "auto" on CPU

    calls = []
    kernel = cpu_paged._paged_decode
    monkeypatch.setattr(cpu_paged, "_paged_decode", lambda *a: calls.append(1) or kernel(*a))
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls

    torch_backend = get_attention_backend("torch")
    for m in layers:
        m.backend = torch_backend
    with_torch = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert with_kernel == with_torch


# -- the int8 KV cache: rows of int8 values with a float16 scale per 32 ------------------------------


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_int8_cache_rows_round_within_half_a_step(head_dim):
    from llmserve.layers.attention.metadata import dequantize_rows, int8_row_size, quantize_rows

    x = torch.randn(50, head_dim) * torch.linspace(0.1, 8, head_dim)
    x[3] = 0.0  # an all-zero row stays exactly zero
    rows = quantize_rows(x)
    groups = -(-head_dim // 32)
    assert rows.dtype == torch.int8 and rows.shape == (50, int8_row_size(head_dim)) == (
        50,
        head_dim + 2 * groups,
    )
    back = dequantize_rows(rows, torch.float32)
    padded = torch.nn.functional.pad(x, (0, groups * 32 - head_dim)).view(50, groups, 32)
    step = (padded.abs().amax(-1) / 127).half().float().repeat_interleave(32, dim=1)[:, :head_dim]
    assert ((back - x).abs() <= 0.5 * step + 1e-6).all()
    assert (back[3] == 0).all()


def test_int8_cache_spec_sizes():
    from llmserve.layers.attention import KVCacheSpec

    spec = KVCacheSpec(num_blocks=4, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.int8)
    assert spec.shape() == (2, 3, 4, 16, 68)
    assert spec.bytes_per_token() == 2 * 3 * 68  # 3.76x fewer than float32's 2 * 3 * 256


def test_preparing_the_backend_keeps_the_thread_count():
    """numba's OpenMP pool, started by the kernel's warm-up, must not change the OpenMP thread
    count that torch and the fused C++ decoder share: a process set to one thread stays at one
    (it became numba's default, one per core). Its own process: the pool starts once per process."""
    code = """
import ctypes, torch
torch.set_num_threads(1)
from llmserve.layers.attention import get_attention_backend
get_attention_backend("cpu").prepare(torch.float32)
from numba.np.ufunc import parallel
assert parallel._is_initialized, "the warm-up starts numba's pool"
gomp = [line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line]
print(ctypes.CDLL(gomp[0]).omp_get_max_threads() if gomp else 1, parallel.NUM_THREADS)
"""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"], out.stdout + out.stderr

"""K and V cache types apart (`kv_cache_dtype` "K,V", llama.cpp's `--cache-type-k/-v`): the
option's spelling and refusals, the spec's bytes, the `KVPair` allocation, and the torch and cpu
attention backends over a pair against attention over K and V rounded by hand."""

from __future__ import annotations

import pytest
import torch

from llmserve.config import CacheConfig
from llmserve.config.cache import parse_kv_cache_dtype
from llmserve.layers.attention import KVCacheSpec, KVDtypes, KVPair, get_attention_backend
from llmserve.layers.attention.backend import AttentionParams
from llmserve.layers.attention.cpu_paged import CpuPagedAttentionBackend
from llmserve.layers.attention.metadata import dequantize_rows, int8_row_size, quantize_rows
from llmserve.model_executor.forward_runner import _allocate_kv_caches, kv_cache_nbytes
from tests.unit.test_attention_cpu import _batch

I8, F16, BF16, F32 = torch.int8, torch.float16, torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    "value,canonical",
    [
        ("auto", "auto"),
        ("int8", "int8"),
        ("int8,float16", "int8,float16"),
        ("float16,bfloat16", "float16,bfloat16"),
        ("float16,float16", "float16"),  # the same cache as one type
        ("f16", "float16"),
        ("q8_0,f16", "int8,float16"),
        ("bf16, f32", "bfloat16,float32"),
    ],
)
def test_kv_cache_dtype_spellings(value, canonical):
    assert parse_kv_cache_dtype(value) == canonical
    assert CacheConfig(kv_cache_dtype=value).kv_cache_dtype == canonical


@pytest.mark.parametrize(
    "bad", ["float16,", ",int8", "int4,float16", "int8,float16,float32", "auto,int8", "q4_0", "fp8", ""]
)
def test_bad_kv_cache_dtypes_name_the_value(bad):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype must be 'auto' or one of .*K,V; got {bad!r}"):
        CacheConfig(kv_cache_dtype=bad)


def test_cli_reads_a_pair_and_refuses_a_bad_one(capsys):
    import argparse

    from llmserve.cli.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "q8_0,f16"]).kv_cache_dtype == "int8,float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4,float16"])
    assert "got 'int4,float16'" in capsys.readouterr().err


def test_pair_spec_counts_each_half_at_its_own_row_bytes():
    spec = KVCacheSpec.build(4, 16, 3, 64, KVDtypes(I8, F16))
    assert spec.dtypes == KVDtypes(I8, F16) and spec.dtypes.name == "int8,float16"
    assert spec.half_shape(0) == (3, 4, 16, 68) and spec.half_shape(1) == (3, 4, 16, 64)
    assert spec.bytes_per_token() == 3 * 68 + 3 * 64 * 2
    same = KVCacheSpec.build(4, 16, 3, 64, KVDtypes(F16, F16))
    assert same == KVCacheSpec(4, 16, 3, 64, F16) and same.shape() == (2, 3, 4, 16, 64)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_pair_halves_share_one_buffer_per_layer(device):
    spec = KVCacheSpec.build(5, 4, 2, 40, KVDtypes(I8, BF16))  # int8 rows of 44 bytes: odd K size
    caches = _allocate_kv_caches(spec, 3, torch.device(device))
    for c in caches:
        assert isinstance(c, KVPair) and c[0] is c.k and c[1] is c.v
        assert c.k.dtype == I8 and c.k.shape == (2, 5, 4, int8_row_size(40))
        assert c.v.dtype == BF16 and c.v.shape == (2, 5, 4, 40)
        assert kv_cache_nbytes(c) == 5 * 4 * spec.bytes_per_token()
    if device == "cpu":
        assert all(c.k.is_contiguous() and c.v.is_contiguous() for c in caches)
        offsets = {c.v.data_ptr() - c.k.data_ptr() for c in caches}
        assert len(offsets) == 1 and offsets.pop() % 64 == 0  # the same for every layer, aligned
        caches[0].v.fill_(1.0)
        assert not caches[0].k.any() and not caches[1].k.any() and not caches[1].v.any()


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] as a cache of `dtype` holds it, back in float32."""
    if dtype == I8:
        return dequantize_rows(quantize_rows(x.reshape(-1, x.shape[-1])), F32).view(x.shape)
    return x.to(dtype).float()


def _store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [H_kv, NB, bs, D] float32 -> a cache half of `dtype` holding it."""
    if dtype == I8:
        return quantize_rows(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
    return x.to(dtype)


# decodes over 1 token, a partial block, several blocks; a fresh prompt; a chunk over cached context
QUERY_LENS = [1, 1, 1, 7, 5, 1]
SEQ_LENS = [1, 3, 17, 7, 20, 45]


def _pair_vs_rounded(backend: str, kv: KVDtypes, sliding_window: int | None = None):
    """The backend over a pair cache of `kv`, and the torch reference over a float32 cache holding
    the same context and new K/V rounded by hand to K's and V's types."""
    NB, bs, H, H_kv, D = 32, 8, 6, 2, 64
    params = AttentionParams(H, H_kv, D, D**-0.5, sliding_window)
    gen = torch.Generator().manual_seed(7)
    md, md_ref = (_batch(bs, QUERY_LENS, SEQ_LENS, NB, seed=0) for _ in range(2))
    T = md.num_tokens
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (H, H_kv, H_kv))
    ctx_k, ctx_v = (torch.randn(H_kv, NB, bs, D, generator=gen) for _ in range(2))
    pair = KVPair(_store(ctx_k, kv.k), _store(ctx_v, kv.v))
    ref_cache = torch.stack([_round(ctx_k, kv.k), _round(ctx_v, kv.v)])
    get_attention_backend(backend).prepare(kv)
    with torch.inference_mode():
        out = get_attention_backend(backend).forward(params, q, k, v, pair, md)
        ref = get_attention_backend("torch").forward(
            params, q, _round(k, kv.k), _round(v, kv.v), ref_cache, md_ref
        )
    return out, ref, pair, ref_cache, md


@pytest.mark.parametrize("kv", [KVDtypes(I8, F16), KVDtypes(F16, I8), KVDtypes(F16, BF16), KVDtypes(I8, F32)])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_reference_over_a_pair_equals_attention_over_values_rounded_by_hand(kv, sliding_window):
    out, ref, pair, ref_cache, _ = _pair_vs_rounded("torch", kv, sliding_window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the new rows were written in each half's own format: widened, they are the hand-rounded ones
    for half, (cache, dtype) in enumerate(((pair.k, kv.k), (pair.v, kv.v))):
        back = dequantize_rows(cache, F32) if dtype == I8 else cache.float()
        assert torch.equal(back, ref_cache[half])


@pytest.mark.parametrize("kv", [KVDtypes(F16, BF16), KVDtypes(BF16, F32), KVDtypes(I8, F16)])
def test_cpu_backend_over_a_pair(kv):
    """16-bit and float32 halves in any mix run the numba kernel (a specialisation per pair of
    types, built by `prepare`); an int8 half sends decode to the reference path."""
    out, ref, _, _, md = _pair_vs_rounded("cpu", kv)
    kernel = kv.k != I8 and kv.v != I8
    assert (md.derived.get(("cpu_decode", 2, 0)) is not None) == kernel
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_cpu_backend_compiles_pairs_at_prepare():
    from llmserve.layers.attention import cpu_paged

    CpuPagedAttentionBackend().prepare(KVDtypes(F16, BF16))
    compiled = set(cpu_paged._paged_decode.signatures)
    _pair_vs_rounded("cpu", KVDtypes(F16, BF16))
    assert set(cpu_paged._paged_decode.signatures) == compiled  # nothing compiled mid-run

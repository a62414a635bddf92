"""The Triton kernels against the torch code they replace: attention (decode split-K, varlen
prefill / mixed batches) against the torch reference backend, the RoPE-fused and plain KV-cache
writes against `RotaryEmbedding` and the reference's write, the fused norm and gated activations
against `RMSNorm` and the activation functions.

Without CUDA every kernel runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported); with CUDA the same tests run compiled, plus the `gpu` ones with larger
shapes. Caches hold random values and sequences own shuffled blocks, so a wrong block lookup, mask,
window or merge moves outputs far past the tolerances (a few units of the dtype's rounding; 2e-5
in float32): each such one-token mutation of the kernels, tried while writing these tests, failed.
Dtypes: float32, float16 and bfloat16 models, and a float32 model over 16-bit caches. Head sizes
64 and the non-powers of two 80 and 96 (padded to 128 inside the kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from llmserve.layers import triton_ops
from llmserve.layers.activation import get_activation
from llmserve.layers.attention.backend import AttentionParams
from llmserve.layers.attention.metadata import AttentionMetadata, KVCacheSpec, KVDtypes
from llmserve.layers.attention.torch_ref import TorchAttentionBackend
from llmserve.layers.attention.triton_backend import TritonAttentionBackend
from llmserve.layers.attention.triton_cache_ops import rope_and_write_kv_cache, write_kv_cache
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.rotary_embedding import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 2e-5, F16: 4e-3, BF16: 3e-2}
"""Absolute tolerance on attention outputs (weighted means of N(0, 1) values, |out| < 1 mostly),
by the model's dtype: under a float32 model a 16-bit cache is read as the same rounded values."""


def _ulp(dtype: torch.dtype) -> float:
    """About one unit of rounding, relative (2^-23, 2^-10, 2^-7 rounded up)."""
    return {F32: 1e-6, F16: 1e-3, BF16: 8e-3}[dtype]


# Batches as (query_len, seq_len) per sequence.
DECODE = ((1, 37), (1, 5), (1, 64), (1, 100))  # partial, one block, whole blocks, several
LONG_DECODE = ((1, 300), (1, 129), (1, 17), (1, 1))  # later splits empty for the short ones
PREFILL = ((23, 23), (40, 40), (7, 7), (2, 2))  # fresh prompts from position 0
PREFIX = ((10, 45), (30, 47), (5, 21))  # prefix-cache hits: the new tokens follow cached ones
CHUNKED = ((32, 64), (32, 32), (16, 80))  # second chunk, first chunk, last chunk of prompts
MIXED = ((1, 50), (20, 20), (1, 9), (12, 40), (1, 33))  # decodes and prefill chunks together


@dataclass(frozen=True)
class Case:
    seqs: tuple[tuple[int, int], ...]
    group: int = 2  # query heads per KV head
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = F32
    cache_dtype: torch.dtype | None = None  # None: the model's dtype
    window: int | None = None
    splits: int | None = 1  # decode split-K factor; None: the backend's policy
    num_kv_heads: int = 2
    table_dtype: torch.dtype = torch.int64
    sinks: bool = False  # learned per-head sink logits (gpt-oss)
    softcap: float | None = None  # Gemma 2's attention logit soft cap


CASES = {
    "decode-g1-d64-f32": Case(DECODE, group=1),
    "decode-g2-d80-bs32-f16": Case(DECODE, head_dim=80, block_size=32, dtype=F16),
    "decode-g4-bf16": Case(DECODE, group=4, dtype=BF16),
    "decode-g8-mqa-f32": Case(DECODE, group=8, num_kv_heads=1),
    "decode-split4-g2-f32": Case(LONG_DECODE, splits=4),
    "decode-split8-g4-d80-bs32-f16": Case(
        LONG_DECODE, group=4, head_dim=80, block_size=32, dtype=F16, splits=8
    ),
    "decode-split16-g1-bf16": Case(LONG_DECODE, group=1, dtype=BF16, splits=16),
    "decode-split-auto-b1": Case(((1, 300),), splits=None),
    "decode-window20-split4-g2": Case(LONG_DECODE, window=20, splits=4),
    "decode-window8-g4-f16": Case(DECODE, group=4, window=8, dtype=F16),
    "decode-f32-over-bf16-cache": Case(DECODE, cache_dtype=BF16, splits=2),
    "prefill-g1-f32": Case(PREFILL, group=1),
    "prefill-g2-d80-bs32-bf16": Case(PREFILL, head_dim=80, block_size=32, dtype=BF16),
    "prefill-g4-f16": Case(PREFILL, group=4, dtype=F16),
    "prefill-window16-g2": Case(PREFILL, window=16),
    "prefix-g2-f32": Case(PREFIX),
    "prefix-g4-d80-bs32-f16": Case(PREFIX, group=4, head_dim=80, block_size=32, dtype=F16),
    "chunked-g1-bf16": Case(CHUNKED, group=1, dtype=BF16),
    "chunked-window24-g2-f32": Case(CHUNKED, window=24),
    "mixed-g1-f32": Case(MIXED, group=1),
    "mixed-g2-d80-bs32-bf16": Case(MIXED, head_dim=80, block_size=32, dtype=BF16),
    "mixed-window10-g4-f16": Case(MIXED, group=4, window=10, dtype=F16),
    "mixed-f32-over-f16-cache": Case(MIXED, cache_dtype=F16),
    "mixed-int32-tables": Case(MIXED, table_dtype=torch.int32),
    "decode-sinks-g2-f32": Case(DECODE, sinks=True),
    "decode-sinks-split4-window20-g4-f16": Case(
        LONG_DECODE, group=4, window=20, splits=4, dtype=F16, sinks=True
    ),
    "prefill-sinks-window16-g4-bf16": Case(PREFILL, group=4, window=16, dtype=BF16, sinks=True),
    "mixed-sinks-g2-f32": Case(MIXED, sinks=True),
    # a cap of 2 on scores of about N(0, 1): tanh bends most of them, a missing cap fails by far
    "decode-softcap-split4-window20-g2-f32": Case(LONG_DECODE, window=20, splits=4, softcap=2.0),
    "mixed-softcap-g4-bf16": Case(MIXED, group=4, dtype=BF16, softcap=2.0),
    "prefill-softcap-window16-g2-f16": Case(PREFILL, window=16, dtype=F16, softcap=2.0),
}


@dataclass
class Batch:
    params: AttentionParams
    metadata: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    positions: torch.Tensor


def make_batch(case: Case, seed: int = 0) -> Batch:
    """A random cache and batch whose sequences own blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    bs, D, H_kv = case.block_size, case.head_dim, case.num_kv_heads
    counts = [-(-s // bs) for _, s in case.seqs]
    num_blocks = sum(counts) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in counts:
        tables.append(pool[:n])
        pool = pool[n:]
    md = AttentionMetadata.build([q for q, _ in case.seqs], [s for _, s in case.seqs], tables, bs, DEVICE)
    md.block_tables = md.block_tables.to(case.table_dtype)
    T, H = md.num_tokens, H_kv * case.group

    def randn(*shape: int, dtype: torch.dtype = case.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    positions = torch.cat([torch.arange(s - q, s) for q, s in case.seqs]).to(DEVICE)
    return Batch(
        params=AttentionParams(
            H, H_kv, D, D**-0.5, case.window, randn(H) * 3 if case.sinks else None, case.softcap
        ),
        metadata=md,
        q=randn(T, H, D),
        k=randn(T, H_kv, D),
        v=randn(T, H_kv, D),
        cache=randn(2, H_kv, num_blocks, bs, D, dtype=case.cache_dtype or case.dtype),
        positions=positions,
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_matches_reference(case: Case) -> None:
    b = make_batch(case)
    ref_cache, tri_cache = b.cache.clone(), b.cache.clone()
    ref = TorchAttentionBackend().forward(b.params, b.q, b.k, b.v, ref_cache, b.metadata)
    out = TritonAttentionBackend(case.splits).forward(b.params, b.q, b.k, b.v, tri_cache, b.metadata)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[case.dtype], rtol=0)
    assert torch.equal(tri_cache, ref_cache)  # the same writes, rounded the same way


ROPE_CASES = {
    "mixed-full-rotary-f32": (Case(MIXED), 64),
    "mixed-partial-rotary-g4-f16": (Case(MIXED, group=4, dtype=F16), 32),
    "decode-partial-rotary-d80-bf16": (Case(DECODE, head_dim=80, dtype=BF16, splits=2), 64),
    "prefix-f32-over-bf16-cache": (Case(PREFIX, cache_dtype=BF16), 64),
}


def _rope(head_dim: int, rotary_dim: int) -> RotaryEmbedding:
    rope = RotaryEmbedding(head_dim, rotary_dim, 512, {"rope_type": "default", "rope_theta": 10000.0})
    return rope.to(DEVICE)


@pytest.mark.parametrize(("case", "rotary_dim"), ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_forward_rope_matches_reference(case: Case, rotary_dim: int) -> None:
    """forward_rope == RotaryEmbedding on q and k, then the reference's forward: outputs and caches."""
    b = make_batch(case, seed=1)
    rope = _rope(case.head_dim, rotary_dim)
    cos, sin = rope.cos_sin(b.positions, case.dtype)
    ref_cache, tri_cache = b.cache.clone(), b.cache.clone()
    q_in = b.q.clone()
    ref = TorchAttentionBackend().forward(
        b.params, rope(b.q, cos, sin), rope(b.k, cos, sin), b.v, ref_cache, b.metadata
    )
    out = TritonAttentionBackend(case.splits).forward_rope(
        b.params, b.q, b.k, b.v, tri_cache, b.metadata, b.positions, rope.cos_sin_table(DEVICE), rotary_dim
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[case.dtype], rtol=0)
    # RoPE in float32 rounded once vs torch's ops in the model's dtype: about a unit of rounding.
    tol = {"atol": _ulp(case.dtype), "rtol": 2 * _ulp(case.cache_dtype or case.dtype)}
    torch.testing.assert_close(tri_cache.float(), ref_cache.float(), **tol)
    assert torch.equal(b.q, q_in)  # the caller's q is left as it was


def test_decode_splits_agree() -> None:
    """Every split-K factor gives the one-split result (the merge is exact up to float32 sums)."""
    b = make_batch(Case(LONG_DECODE, group=4))
    outs = [
        TritonAttentionBackend(s).forward(b.params, b.q, b.k, b.v, b.cache.clone(), b.metadata)
        for s in (1, 2, 4, 16)
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-5)


def test_engine_steps_match_reference() -> None:
    """A tiny end-to-end run: two prompts prefilled in chunks, then decoded for a few steps, each
    step through forward_rope (and forward) on both backends; outputs and the whole cache stay
    the same."""
    D, H_kv, group, bs, num_blocks = 64, 2, 2, 16, 12
    params = AttentionParams(H_kv * group, H_kv, D, D**-0.5)
    rope = _rope(D, D)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, H_kv, num_blocks, bs, D, generator=gen).to(DEVICE)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    tables = [[7, 2, 9], [4, 0, 11]]
    ref_backend, tri_backend = TorchAttentionBackend(), TritonAttentionBackend()
    # (query_lens, seq_lens) per step: chunked prefill (24 + 16 tokens, 10 tokens), then decodes
    steps = [([24, 10], [24, 10]), ([16, 1], [40, 11])] + [([1, 1], [40 + i, 11 + i]) for i in range(1, 4)]
    for query_lens, seq_lens in steps:
        md = AttentionMetadata.build(query_lens, seq_lens, tables, bs, DEVICE)
        T, H = md.num_tokens, H_kv * group
        # q, k, v as the model hands them over: strided views of one fused projection output
        qkv = torch.randn(T, (H + 2 * H_kv) * D, generator=gen).to(DEVICE)
        q, k, v = (x.view(T, -1, D) for x in qkv.split([H * D, H_kv * D, H_kv * D], dim=1))
        positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens, strict=True)])
        positions = positions.to(DEVICE)
        cos, sin = rope.cos_sin(positions, torch.float32)
        q_rot, k_rot = rope(q, cos, sin), rope(k, cos, sin)
        ref = ref_backend.forward(params, q_rot, k_rot, v, ref_cache, md)
        out = tri_backend.forward_rope(
            params, q, k, v, tri_cache, md, positions, rope.cos_sin_table(DEVICE), D
        )
        torch.testing.assert_close(out, ref, atol=TOL[F32], rtol=0)
        torch.testing.assert_close(tri_cache, ref_cache, atol=1e-6, rtol=0)
        # the same step again through forward (q, k rotated by torch): rewrites the same K/V
        out = tri_backend.forward(params, q_rot, k_rot, v, tri_cache, md)
        torch.testing.assert_close(out, ref, atol=TOL[F32], rtol=0)
        torch.testing.assert_close(tri_cache, ref_cache, atol=1e-6, rtol=0)


def test_metadata_without_device_lens() -> None:
    """Metadata built without the device tensors (older runners): the backend builds them once."""
    b = make_batch(Case(MIXED))
    b.metadata.seq_lens_tensor = b.metadata.query_start_loc_tensor = None
    b.metadata.max_query_len = 0
    ref = TorchAttentionBackend().forward(b.params, b.q, b.k, b.v, b.cache.clone(), b.metadata)
    out = TritonAttentionBackend().forward(b.params, b.q, b.k, b.v, b.cache.clone(), b.metadata)
    torch.testing.assert_close(out, ref, atol=TOL[F32], rtol=0)


@pytest.mark.parametrize("prepare", ["reserve", "build_metadata"])
def test_workspace_allocated_before_forward(prepare: str) -> None:
    """The split-K workspace exists before the forward (`reserve` for CUDA-graph capture, or the
    runner's `build_metadata` call) and persists: no layer allocates it."""
    backend = TritonAttentionBackend(decode_splits=4)
    b = make_batch(Case(LONG_DECODE))
    p = b.params
    if prepare == "reserve":
        backend.reserve(8, p.num_heads, p.num_kv_heads, p.head_dim, DEVICE)
    else:
        spec = KVCacheSpec(b.cache.shape[2], b.cache.shape[3], p.num_kv_heads, p.head_dim, b.cache.dtype)
        backend.build_metadata(b.metadata, [p], spec)
    ptr = backend._workspace[b.q.device].data_ptr()
    for _ in range(2):
        backend.forward(p, b.q, b.k, b.v, b.cache.clone(), b.metadata)
    assert backend._workspace[b.q.device].data_ptr() == ptr


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64])
def test_unsupported_cache_dtype_refused(dtype: torch.dtype) -> None:
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match=str(dtype)):
        backend.prepare(dtype)
    b = make_batch(Case(DECODE))
    with pytest.raises(ValueError, match="int8 caches run on the 'torch' backend"):
        backend.forward(b.params, b.q, b.k, b.v, b.cache.to(dtype), b.metadata)
    for attr, value in (("name", "triton"), ("fuses_rope", True), ("supports_cuda_graphs", True)):
        assert getattr(TritonAttentionBackend, attr) == value


def test_k_and_v_of_two_types_refused() -> None:
    """The kernels take one cache tensor of one type per layer: `kv_cache_dtype` K,V is refused
    at start-up, naming the pair and where it runs; K == V is the single type."""
    backend = TritonAttentionBackend()
    with pytest.raises(
        ValueError, match="one KV cache type for K and V; got kv_cache_dtype 'float16,bfloat16'"
    ):
        backend.prepare(KVDtypes(torch.float16, torch.bfloat16))
    backend.prepare(KVDtypes(torch.float16, torch.float16))


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "dtype", "cache_dtype", "in_place"),
    [
        (64, 64, F32, F32, False),
        (64, 32, F16, F16, True),
        (80, 64, BF16, BF16, False),
        (64, 64, F32, BF16, True),
        (96, 48, F16, F32, False),
    ],
)
def test_rope_cache_write(head_dim: int, rotary_dim: int, dtype, cache_dtype, in_place: bool) -> None:
    """The fused kernel alone: q rotated (into q or a new tensor, pass-through dims kept), rotated
    k and v at their slots, a slot of -1 skipped, every other slot untouched."""
    gen = torch.Generator().manual_seed(5)
    T, H, H_kv, bs, nb = 6, 6, 3, 16, 4
    q, k, v = (torch.randn(T, n, head_dim, generator=gen).to(dtype).to(DEVICE) for n in (H, H_kv, H_kv))
    positions = torch.tensor([0, 5, 17, 300, 2, 511], device=DEVICE)
    slots = torch.tensor([3, 40, -1, 17, 63, 0], device=DEVICE)
    cache = torch.randn(2, H_kv, nb, bs, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    rope = _rope(head_dim, rotary_dim)
    cos, sin = rope.cos_sin(positions, dtype)
    q_ref, k_ref = rope(q, cos, sin), rope(k, cos, sin)
    expected = cache.clone()
    written = slots >= 0
    flat = expected.view(2, H_kv, nb * bs, head_dim)
    flat[0][:, slots[written]] = k_ref[written].transpose(0, 1).to(cache_dtype)
    flat[1][:, slots[written]] = v[written].transpose(0, 1).to(cache_dtype)

    q_in = q.clone()
    q_out = rope_and_write_kv_cache(
        q,
        k,
        v,
        positions,
        rope.cos_sin_table(DEVICE),
        rotary_dim,
        cache,
        slots,
        query_out=q if in_place else None,
    )
    # float32 math rounded once vs torch's ops in the dtype (cos/sin rounded too): two units
    tol = {"atol": _ulp(dtype), "rtol": 2 * _ulp(dtype)}
    torch.testing.assert_close(q_out.float(), q_ref.float(), **tol)
    torch.testing.assert_close(cache.float(), expected.float(), **tol)  # untouched slots: equal
    assert torch.equal(q_out[..., rotary_dim:], q_in[..., rotary_dim:])
    assert (q_out.data_ptr() == q.data_ptr()) == in_place


@pytest.mark.parametrize("cache_dtype", [F32, F16, BF16])
def test_plain_cache_write(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    T, H_kv, D, bs, nb = 5, 3, 80, 16, 3
    k, v = (torch.randn(T, H_kv, D, generator=gen).to(DEVICE) for _ in range(2))
    slots = torch.tensor([0, 47, -1, 16, 5], device=DEVICE)
    cache = torch.zeros(2, H_kv, nb, bs, D, dtype=cache_dtype, device=DEVICE)
    expected = cache.clone()
    flat = expected.view(2, H_kv, nb * bs, D)
    keep = slots >= 0
    flat[0][:, slots[keep]] = k[keep].transpose(0, 1).to(cache_dtype)
    flat[1][:, slots[keep]] = v[keep].transpose(0, 1).to(cache_dtype)
    write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)


NORM_DTYPES = [F32, F16, BF16]


def _assert_rounded_like(out: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    """Within `ulps` units of rounding everywhere (float32 sums in another order, another exp),
    and, in 16-bit dtypes, rounded at the same steps as torch: nearly every element bit-identical
    (a missing or extra rounding step leaves a third of them one unit off)."""
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=ulps * _ulp(out.dtype))
    if out.dtype != F32:
        assert (out == ref).float().mean().item() >= 0.9


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 2048])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, weight_offset: float, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(hidden, 1e-6, weight_offset).to(dtype)
    norm.weight.data = (torch.randn(hidden, generator=gen) * 0.5 + (0 if weight_offset else 1)).to(dtype)
    norm.to(DEVICE)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(5, hidden, generator=gen).to(dtype).to(DEVICE)
    if with_residual:
        ref_out, ref_res = norm(x.clone(), residual.clone())
        out, res = triton_ops.add_rms_norm(x, residual, norm.weight, norm.eps, weight_offset)
        assert torch.equal(res, ref_res)
    else:
        ref_out = norm(x.clone())
        out = triton_ops.rms_norm(x, norm.weight, norm.eps, weight_offset)
    assert out.dtype == dtype
    _assert_rounded_like(out, ref_out)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("inter", [64, 100, 1500])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul(dtype: torch.dtype, inter: int, act: str) -> None:
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 2 * inter, generator=gen) * 3).to(dtype).to(DEVICE)
    ref = get_activation(act)(x[:, :inter]) * x[:, inter:]
    fused = triton_ops.silu_and_mul if act == "silu" else triton_ops.gelu_tanh_and_mul
    out = fused(x)
    assert out.shape == (3, inter) and out.dtype == dtype
    # GELU's tanh is built from exp, a few float32 units away from CUDA's tanhf: where that flips
    # the rounding of act(gate) to the dtype, the product moves by up to |up| such units (seen on
    # an H100: one fp16 element of 4,500 two units off)
    _assert_rounded_like(out, ref, ulps=1 if act == "silu" else 2)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("width", [64, 300, 2048])
def test_fp8_activation_rounding_is_bitwise_quantize_fp8(dtype: torch.dtype, width: int) -> None:
    """One kernel for fp8's per-token rounding: the scales and e4m3 bits of `quantize_fp8`, over
    rows of very different magnitudes, a zero row, e4m3 ties (the midpoints between neighbours,
    scaled by each row's scale) and values in the subnormal range."""
    from llmserve.layers.quantization.fp8 import FP8_INV_MAX, FP8_MAX, MIN_SCALE, quantize_fp8

    gen = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=gen) * torch.logspace(-6, 3, 7)[:, None]
    x[3] = 0.0
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = torch.cat([(grid[:-1] + grid[1:]) / 2, grid]).repeat(width)[:width]
    x[5] = ties * (ties.abs().amax() / FP8_MAX)  # x / scale lands on the midpoints themselves
    x[5, 0] = FP8_MAX * (ties.abs().amax() / FP8_MAX)
    x = x.to(dtype).to(DEVICE)
    q, scale = triton_ops.quantize_fp8_rows(x[:, :width], FP8_MAX, FP8_INV_MAX, MIN_SCALE)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    # torch's ops on the same device (on CUDA, torch divides by 448 as a product with 1/448)
    ref_q, ref_scale = quantize_fp8(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


# ---- larger shapes, compiled kernels only -----------------------------------------------------

GPU_CASES = {
    "decode-b32-bf16-auto-splits": Case(
        tuple((1, 64 + 97 * i) for i in range(32)),
        group=4,
        head_dim=128,
        dtype=BF16,
        splits=None,
        num_kv_heads=8,
    ),
    "decode-b1-long-bf16": Case(((1, 4000),), group=4, head_dim=128, dtype=BF16, splits=None, num_kv_heads=8),
    "mixed-bf16-window": Case(
        ((1, 900), (300, 300), (128, 1000), (1, 77)),
        group=4,
        head_dim=128,
        dtype=BF16,
        window=256,
        num_kv_heads=8,
    ),
    "prefill-f16-d64": Case(((512, 512), (256, 768)), group=4, dtype=F16, num_kv_heads=8, block_size=32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_forward_matches_reference_gpu(case: Case) -> None:
    test_forward_matches_reference(case)


@pytest.mark.gpu
def test_fused_elementwise_gpu() -> None:
    for weight_offset in (0.0, 1.0):
        test_rms_norm(BF16, 8192, weight_offset, True)
    test_act_and_mul(BF16, 8192, "silu")
    test_fp8_activation_rounding_is_bitwise_quantize_fp8(BF16, 8192)
    test_rope_cache_write(128, 128, BF16, BF16, False)

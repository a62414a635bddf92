"""q4k: GGUF Q4_K's super-block d, dmin and 6-bit sub-scales kept (formats.py, csrc/qgemm.h). Its
matmuls and row lookups give q4's bits (the half scale and minimum per block of 32 that the
loader made of them before) on every kernel set; its rows read from a file are the file's fields,
and as q4 they are what the loader produced before (its code kept here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.formats import QuantizedRows, k_scales, pack, unpack
from llmserve.model_executor.model_loader.gguf_quant import read_rows
from tests.gguf_writer import random_blocks

_ORDER = ["avx512_vnni", "avx2"]
NATIVE_SETS = _ORDER[_ORDER.index(cpu_kernels.best_kernels()) :] if cpu_kernels.has_native_kernels() else []


@pytest.fixture(params=NATIVE_SETS)
def kernels(request):
    cpu_kernels.set_kernels(request.param)
    yield request.param
    cpu_kernels.set_kernels("auto")


def _random_q4k(n: int, k: int, seed: int = 0) -> QuantizedRows:
    """Random q4k rows: d and dmin over six decades (half subnormals included, where d sc and
    dmin mn round), zero and full multipliers among the random ones."""
    g = torch.Generator().manual_seed(seed)
    S, nb = k // 256, k // 32
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)

    def scale() -> torch.Tensor:
        return (torch.rand(n, S, generator=g) * 2 - 0.5) * 10 ** torch.randint(-7, -1, (n, S), generator=g)

    sub = torch.randint(0, 64, (n, nb, 2), generator=g, dtype=torch.uint8)
    sub[0, 0] = 0
    sub[0, 1] = 63
    return QuantizedRows("q4k", q, scale().half(), scale().half(), k, sub)


def _old_k_scales(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's Q4_K / Q5_K scales before q4k (gguf_quant._k_scales as it was)."""
    rows, n = b.shape[:2]
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    s = b[..., 4:16].astype(np.uint8)
    sc = np.empty((rows, n, 8), np.float32)
    mn = np.empty((rows, n, 8), np.float32)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    scale = torch.from_numpy((d[..., None] * sc).reshape(rows, n * 8)).half()
    minimum = torch.from_numpy((-dmin[..., None] * mn).reshape(rows, n * 8)).half()
    return scale, minimum


def test_pack_round_trip_and_bytes():
    rows = _random_q4k(37, 768)
    packed = pack(rows)
    back = unpack(packed)
    assert back.fmt == "q4k" and back.in_features == 768
    for a, b in ((back.q, rows.q), (back.d, rows.d), (back.m, rows.m), (back.scales, rows.scales)):
        assert torch.equal(a, b)
    # 3 tiles x 3 super-blocks: 16 rows x (128 bytes of nibbles + 4 of d, dmin + 16 of sc, mn)
    assert packed.nbytes() == 3 * 3 * 16 * (128 + 4 + 16)
    assert pack(rows.as_q4()).nbytes() == 3 * 24 * 16 * (16 + 2 + 2)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K])
def test_read_rows_keep_the_file_fields_and_the_old_q4(qtype):
    raw = random_blocks(qtype, 24, 512, seed=3)
    size = 144 if qtype == Q.Q4_K else 176
    blocks = raw.reshape(24, -1, size)
    halves = np.random.default_rng(4).uniform(-1e-3, 1e-3, size=(24, 2, 2)).astype(np.float16)
    blocks[..., 0:4] = halves.view(np.uint8)  # finite d, dmin (random bytes can be NaN)
    rows = read_rows(raw, qtype, 512)
    want_scale, want_min = _old_k_scales(blocks)
    if qtype == Q.Q4_K:
        assert rows.fmt == "q4k"
        assert torch.equal(
            rows.d.view(torch.int16), torch.from_numpy(blocks[..., 0:2].copy()).view(torch.int16)[..., 0]
        )
        rows = rows.as_q4()
    assert torch.equal(rows.d.view(torch.int16), want_scale.view(torch.int16))  # -0.0 too
    assert torch.equal(rows.m.view(torch.int16), want_min.view(torch.int16))


def test_k_scales_round_once_to_nearest_even():
    """half(d sc) from the exact float32 product: equal to rounding the float64 product."""
    rows = _random_q4k(64, 1024, seed=5)
    scale, minimum = k_scales(rows.d, rows.m, rows.scales)
    per = lambda t: t.double().repeat_interleave(8, dim=1)  # noqa: E731
    exact = per(rows.d) * rows.scales[..., 0].double()
    assert torch.equal(scale, exact.half())
    assert torch.equal(minimum, (-per(rows.m) * rows.scales[..., 1].double()).half())


@pytest.mark.parametrize("M", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("act_bits", [16, 8])
def test_matmul_is_q4_bits(kernels, M, act_bits):
    """N not a multiple of 16 (and below one register tile), several super-blocks. From 17 tokens
    (three groups of 8) the AVX-512 int16 kernel makes a tile pair's scales once for all groups
    (expand_scales): the same bits as made per block."""
    for N, K, seed in ((37, 768, 0), (100, 1024, 1), (5, 256, 2)):
        rows = _random_q4k(N, K, seed)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
        x[0, :5] *= 100  # an outlier channel
        bias = torch.randn(N, generator=torch.Generator().manual_seed(seed))
        got = cpu_kernels.linear(x, pack(rows), bias, act_bits=act_bits)
        want = cpu_kernels.linear(x, pack(rows.as_q4()), bias, act_bits=act_bits)
        assert torch.isfinite(want).all()
        assert torch.equal(got, want), (N, K)


def test_row_lookup_is_q4_bits(kernels):
    rows = _random_q4k(50, 512, seed=7)
    ids = torch.tensor([0, 49, 16, 17, 3, 0])
    got = cpu_kernels.embedding(ids, pack(rows))
    assert torch.equal(got, cpu_kernels.embedding(ids, pack(rows.as_q4())))
    assert torch.equal(got, rows.dequantize()[ids])

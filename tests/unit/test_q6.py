"""The q6 format (GGUF Q6_K's own super-blocks): read from the file's bytes, packed and unpacked,
and the C++ kernels on every kernel set this CPU runs against a float64 reference computed from
gguf's own dequantization with the kernels' int16 activation rounding.

Q6_K tensors come from `tests/gguf_writer.random_blocks` (random valid super-blocks: gguf has no
Q6_K quantizer) and are checked against `gguf.quants.dequantize` and the C reference the writer
transcribes. K is always a multiple of 256: a Q6_K row is whole super-blocks (its file type cannot
hold anything else), so `pack` refuses other widths; N (rows) is any count."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.distributed.sharding import _columns, _rows
from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.formats import QuantizedRows, pack, quantize, unpack
from llmserve.layers.quantization.layers import QuantizedLinear, as_rows
from llmserve.model_executor.model_loader.gguf_quant import read_rows
from tests.gguf_writer import REFERENCE_DEQUANT, random_blocks
from tests.unit.conftest import KERNEL_SETS  # and its `kernels` fixture: every kernel set this CPU runs


def _q6_k(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random Q6_K rows [n, k]: the raw bytes and gguf's float32 dequantization."""
    raw = random_blocks(Q.Q6_K, n, k, seed=seed)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K))


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 with x rounded as the kernels round it: per token to int16."""
    amax = x.abs().amax(-1, keepdim=True)
    xq = torch.round(x * (32767 / amax))
    return (xq.double() @ w.double().T) * (amax.double() / 32767)


def test_q6_k_reads_as_the_files_weights_exactly():
    raw, want = _q6_k(5, 512, seed=1)
    ref, _ = REFERENCE_DEQUANT[Q.Q6_K]  # ggml's C code, transcribed
    c_ref = torch.tensor([v for block in raw.reshape(-1, 210) for v in ref(block.tobytes())]).reshape(5, 512)
    rows = read_rows(raw, Q.Q6_K, 512)
    assert rows is not None and rows.fmt == "q6" and rows.m is None
    assert rows.q.dtype == torch.uint8 and int(rows.q.max()) <= 63
    assert rows.d.shape == (5, 2) and rows.scales is not None and rows.scales.shape == (5, 32)
    assert torch.equal(rows.dequantize(), want)
    assert torch.equal(rows.dequantize(), c_ref.float())


@pytest.mark.parametrize("n", [1, 16, 37])
def test_pack_unpack_roundtrip_and_size(n):
    raw, _ = _q6_k(n, 768, seed=n)
    rows = read_rows(raw, Q.Q6_K, 768)
    assert rows is not None
    w = pack(rows)
    back = unpack(w)
    assert (back.fmt, back.in_features) == ("q6", 768)
    assert (
        torch.equal(back.q, rows.q) and torch.equal(back.d, rows.d) and torch.equal(back.scales, rows.scales)
    )
    # 6.5625 bits a weight, as in the file (rows padded to whole tiles of 16)
    assert w.nbytes() == -(-n // 16) * 16 * 768 // 256 * 210


def test_q6_refuses_widths_that_are_not_whole_super_blocks():
    raw, _ = _q6_k(4, 256)
    rows = read_rows(raw, Q.Q6_K, 256)
    assert rows is not None
    cut = QuantizedRows("q6", rows.q[:, :128], rows.d, None, 128, rows.scales[:, :8])
    with pytest.raises(ValueError, match="super-blocks of 256"):
        pack(cut)
    with pytest.raises(ValueError, match="q6"):
        quantize(torch.randn(4, 256), "q6")
    ext = cpu_kernels.native_extension()
    if ext is not None:  # the kernels refuse such a width too, before reading a byte
        with pytest.raises(ValueError, match="K is 128"):
            ext.gemm(6, 0, 128, 1, 128, 16, 0, 0, 0, 0, 0, 16, 16)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", [(16, 256), (37, 512), (50, 1024), (20, 8192)])  # 8192: 16 tokens a chunk
def test_linear_matches_the_dequantized_file(kernels, n, k, m):
    """Equal to float rounding: the integer sums are exact, each sub-block's (d sc) scaling and
    the float sum over sub-blocks round once per step (K / 16 steps of 2^-24)."""
    raw, w = _q6_k(n, k, seed=n + k)
    q6 = pack(read_rows(raw, Q.Q6_K, k))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    x[:, 7] *= 40  # an outlier channel, as real activations have
    bias = torch.randn(n, generator=g)
    got = cpu_kernels.linear(x, q6, bias).double()
    want = _reference(x, w) + bias.double()
    scale = want.abs().amax()
    if kernels == "torch":  # float activations, a float32 matmul on the dequantized weights
        want = x.double() @ w.double().T + bias.double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale.item())
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=(k // 16) * 2**-23 * scale.item())


def test_a_tokens_row_is_the_same_in_any_batch(kernels):
    if kernels == "torch":
        pytest.skip("the torch path makes no such promise (cpu_kernels.py)")
    raw, _ = _q6_k(40, 512, seed=3)
    q6 = pack(read_rows(raw, Q.Q6_K, 512))  # type: ignore[arg-type]
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(0))
    whole = cpu_kernels.linear(x, q6)
    for i in (0, 5, 16):
        assert torch.equal(cpu_kernels.linear(x[i : i + 1], q6), whole[i : i + 1])
    assert torch.equal(cpu_kernels.linear(x[3:7], q6), whole[3:7])


@pytest.mark.parametrize("m", [2, 4, 5, 8, 16, 21])
def test_every_register_tile_gives_a_token_its_row_alone(kernels, m):
    """A batch of m tokens runs in register tiles of up to 8 tokens (AVX-512; 2 with AVX2) and
    remainders of every size: each token's row is the bits of that token alone (one token runs
    the batch-1 tile, the same code whatever the batch tiles are), so widening a tile changes
    no output."""
    if kernels == "torch":
        pytest.skip("the torch path makes no such promise (cpu_kernels.py)")
    raw, _ = _q6_k(50, 1024, seed=5)
    q6 = pack(read_rows(raw, Q.Q6_K, 1024))  # type: ignore[arg-type]
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m))
    x[:, 3] *= 40
    batch = cpu_kernels.linear(x, q6)
    alone = torch.cat([cpu_kernels.linear(x[i : i + 1], q6) for i in range(m)])
    assert torch.equal(batch, alone)


def test_kernel_sets_agree_to_float_rounding():
    if "avx2" not in KERNEL_SETS or "avx512_vnni" not in KERNEL_SETS:
        pytest.skip("needs both native kernel sets")
    raw, _ = _q6_k(33, 512, seed=9)
    q6 = pack(read_rows(raw, Q.Q6_K, 512))  # type: ignore[arg-type]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        for name in ("avx512_vnni", "avx2"):
            cpu_kernels.set_kernels(name)
            out[name] = cpu_kernels.linear(x, q6)
    finally:
        cpu_kernels.set_kernels("auto")
    torch.testing.assert_close(out["avx2"], out["avx512_vnni"], rtol=1e-6, atol=1e-6)


def test_embedding_rows_are_the_files_exactly(kernels):
    raw, w = _q6_k(37, 512, seed=4)
    q6 = pack(read_rows(raw, Q.Q6_K, 512))  # type: ignore[arg-type]
    ids = torch.tensor([0, 36, 15, 16, 5, 5])
    assert torch.equal(cpu_kernels.embedding(ids, q6), w[ids])


def test_q6_layers_and_their_fallbacks():
    """A q6 layer keeps Q6_K rows as they are; float input (a tensor-parallel slice inside a
    super-block) falls back to q8, as Q6_K was held before; a q8 layer (mixed shards) takes q6
    rows requantized from the file's floats."""
    raw, w = _q6_k(48, 512, seed=5)
    rows = read_rows(raw, Q.Q6_K, 512)
    assert rows is not None
    assert as_rows("w", rows, "q6", (48, 512)) is rows
    q8 = as_rows("w", rows, "q8", (48, 512))
    assert q8.fmt == "q8" and torch.equal(q8.q, quantize(w, "q8").q)
    assert as_rows("w", w, "q6", (48, 512)).fmt == "q8"
    fused = QuantizedLinear(512, [16, 32], bias=False, fmt="q6")
    fused.load_shard("a", rows.select_rows(torch.arange(16)), 0)
    fused.load_shard("b", rows.select_rows(torch.arange(16, 48)), 1)
    assert fused.fmt == "q6" and torch.equal(fused.logical_weight(), w)


def test_tensor_parallel_cuts_along_super_blocks():
    raw, w = _q6_k(20, 1024, seed=6)
    rows = read_rows(raw, Q.Q6_K, 1024)
    assert rows is not None
    half = _columns("down_proj", rows, 512, 512)
    assert isinstance(half, QuantizedRows) and half.fmt == "q6"
    assert torch.equal(half.dequantize(), w[:, 512:])
    inside = _columns("down_proj", rows, 384, 256)  # cuts two super-blocks: the file's floats
    assert isinstance(inside, torch.Tensor) and torch.equal(inside, w[:, 384:640])
    padded = _rows(rows, 16, 8)  # vocabulary-parallel: zero rows past the end
    assert isinstance(padded, QuantizedRows) and padded.num_rows == 8
    assert torch.equal(padded.dequantize()[:4], w[16:]) and not padded.dequantize()[4:].any()

"""Block-quantized weights: formats, the C++ kernels against a dequantized float reference, GGUF
blocks read without a float round trip, and the quantized layers' loading."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from llmserve.layers.quantization import cpu_kernels, formats
from llmserve.layers.quantization.formats import BLOCK, QuantizedRows, pack, quantize, unpack
from llmserve.layers.quantization.layers import QuantizedLinear, as_rows
from llmserve.load_errors import WeightShapeError
from llmserve.model_executor.model_loader.gguf_quant import EXACT_TYPES, read_rows
from tests.gguf_writer import REFERENCE_DEQUANT, random_blocks

# The `kernels` fixture (conftest.py) runs a test on every kernel set this machine runs.


def _random_rows(fmt: str, n: int, k: int, with_min: bool, seed: int = 0) -> QuantizedRows:
    """Random rows; q4 without minimums is symmetric (GGUF Q4_0: m = -8 d, not stored)."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-k // BLOCK)
    if fmt == "q4":
        q = torch.randint(0, 16, (n, nb * BLOCK), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-127, 128, (n, nb * BLOCK), generator=g, dtype=torch.int8)
    q[:, k:] = 0
    d = (torch.rand(n, nb, generator=g) * 0.1 + 0.01).half()
    m = (torch.randn(n, nb, generator=g) * 0.2).half() if with_min else None
    return QuantizedRows(fmt, q, d, m, k)  # type: ignore[arg-type]


# -- formats ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,with_min", [("q8", False), ("q8", True), ("q4", True), ("q4", False)])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 70), (200, 576)])
def test_pack_unpack_roundtrip(fmt, with_min, n, k):
    rows = _random_rows(fmt, n, k, with_min)
    packed = pack(rows)
    assert packed.data.shape[:2] == (-(-n // 16), -(-k // 32))
    back = unpack(packed)
    assert torch.equal(back.q, rows.q) and torch.equal(back.d, rows.d)
    assert (back.m is None) == (rows.m is None) and (rows.m is None or torch.equal(back.m, rows.m))
    assert torch.equal(back.dequantize(), rows.dequantize())


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantize_error_within_half_a_step(fmt):
    """Round to nearest on half-float scales: each weight within half a step of its block (plus the
    scale's own rounding); padding columns (K = 70) stay zero and never widen a block's range."""
    w = torch.randn(64, 70) * torch.linspace(0.1, 3, 70)
    rows = quantize(w, fmt)
    assert rows.q.shape == (64, 96) and (rows.q[:, 70:] == 0).all()
    err = (rows.dequantize() - w).abs().view(64, -1)
    step = rows.d.float().repeat_interleave(BLOCK, dim=1)[:, :70]
    slack = 2**-10 * w.abs().amax()  # half-float rounding of the scale and the minimum
    assert (err <= 0.5 * step + slack).all(), (err - 0.5 * step).max()


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantize_in_row_chunks_is_the_whole_at_once(fmt, monkeypatch):
    """`quantize` works on row chunks (a bounded load-time peak); rows are independent, so any
    chunking gives the same bits, zero rows and a padded last block included."""
    w = torch.randn(129, 100) * 3
    w[5] = 0
    whole = quantize(w, fmt)
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK_ELEMENTS", 7 * 128)  # 7 rows a chunk, the last short
    chunked = quantize(w, fmt)
    assert torch.equal(chunked.q, whole.q) and torch.equal(chunked.d, whole.d)
    assert (chunked.m is None) == (fmt == "q8") and (chunked.m is None or torch.equal(chunked.m, whole.m))


# -- kernels ----------------------------------------------------------------------------------------


def _int8_blocks(kernels: str, fmt: str, act_bits: int) -> bool:
    """Whether the kernel rounds activations to int8 per block of 32 (asked for, and on AVX-512
    VNNI's q4: llama.cpp's arithmetic for 4-bit weights) rather than to int16 per token."""
    return act_bits == 8 and kernels == "avx512_vnni" and fmt == "q4"


def _bound(w: torch.Tensor, x: torch.Tensor, int8_blocks: bool = False) -> torch.Tensor:
    """Largest |kernel - float| per output: each activation rounded to int16 per token (an error of
    at most max|x| / 65534) or to int8 per block of 32 (at most the block's max|x| / 254), through
    |W|; plus float32 accumulation."""
    if int8_blocks:
        pad = -x.shape[-1] % 32
        xb = F.pad(x.abs(), (0, pad)).view(x.shape[0], -1, 32).amax(-1) / 254  # [m, blocks]
        wb = F.pad(w.abs(), (0, pad)).view(w.shape[0], -1, 32).sum(-1)  # [n, blocks]
        rounding = xb @ wb.T
    else:
        rounding = x.abs().amax(-1, keepdim=True) / 65534 * w.abs().sum(-1)
    return rounding + 1e-5 * (x.abs() @ w.abs().T) + 1e-6


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("fmt,with_min", [("q8", False), ("q8", True), ("q4", True), ("q4", False)])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 70), (200, 576)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 40])
def test_linear_matches_dequantized_reference(kernels, fmt, with_min, n, k, m, act_bits):
    rows = _random_rows(fmt, n, k, with_min, seed=n + k)
    w = rows.dequantize()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 4, k)
    bias = torch.randn(n)
    got = cpu_kernels.linear(x, pack(rows), bias, act_bits)
    want = F.linear(x, w, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    bound = _bound(w, x, _int8_blocks(kernels, fmt, act_bits))
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    if _int8_blocks(kernels, fmt, act_bits):  # not int16's result: the int8 rounding is really used
        assert not ((got - want).abs() <= _bound(w, x)).all()


# int16 activations whose bytes are at their edges: the AVX-512 q4 tile multiplies each activation's
# low byte (unsigned) and high byte (signed) apart and joins the sums as lo + 256 hi
EDGE_ACTIVATIONS = [32767, -32767, 256, -256, 255, -255, 128, -128, 127, -129, 1, -1, 0, 32512, -32513, 12345]


@pytest.mark.parametrize("fmt,with_min", [("q8", False), ("q4", True), ("q4", False)])
@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_int16_activations_at_their_byte_edges(kernels, fmt, with_min, m):
    """Activations that are int16 values already (max |x| = 32767, so the scale is 1 and nothing
    rounds): the result is the dequantized weights times them up to float32 accumulation, whatever
    the batch (one weight stream up to 32 tokens, two tiles sharing broadcasts from 33)."""
    rows = _random_rows(fmt, 48, 96, with_min, seed=7)
    w = rows.dequantize().double()
    x = torch.stack([torch.tensor(EDGE_ACTIVATIONS * 6, dtype=torch.float32).roll(i) for i in range(m)])
    got = cpu_kernels.linear(x, pack(rows), None, 16).double()
    want = x.double() @ w.T
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("fmt,with_min", [("q8", False), ("q8", True), ("q4", True), ("q4", False)])
def test_a_tokens_row_is_the_same_in_any_batch(kernels, fmt, with_min, act_bits):
    """With the C++ kernels a token's output does not depend on the other tokens computed with it,
    to the bit: a speculative step's rows then equal what plain decoding computes one token at a
    time. (The torch fallback's float matmul makes no such promise.)"""
    if kernels == "torch":
        pytest.skip("torch's matmul may sum in another order for another batch size")
    rows = pack(_random_rows(fmt, 200, 576, with_min))
    # 40 tokens: above 32 (q8: 8) the AVX-512 kernels share each broadcast between two tiles, up to
    # there a tile runs alone (one weight stream); a row is the same bits either way
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 4, 576)
    together = cpu_kernels.linear(x, rows, act_bits=act_bits)
    for start, stop in [(0, 1), (5, 6), (39, 40), (2, 5), (3, 11), (8, 17), (0, 32), (3, 39)]:
        alone = cpu_kernels.linear(x[start:stop], rows, act_bits=act_bits)
        assert torch.equal(alone, together[start:stop]), (start, stop)


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("fmt,with_min", [("q8", False), ("q8", True), ("q4", True), ("q4", False)])
def test_an_output_rows_value_is_the_same_in_any_register_tile(kernels, fmt, with_min, act_bits):
    """The AVX-512 kernels compute two tiles of 16 rows at once where N has them, the odd last tile
    alone: a row's result is the same bits whichever way it was computed, for every group size of
    tokens (35 = 4 x 8 + 3: above 32 tokens, where the tile pairs share broadcasts)."""
    if kernels == "torch":
        pytest.skip("torch's matmul may sum in another order for another shape")
    rows = _random_rows(fmt, 200, 576, with_min)  # 13 tiles
    x = torch.randn(35, 576, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.01, 4, 576)
    bias = torch.randn(200)
    together = cpu_kernels.linear(x, pack(rows), bias, act_bits)
    for start, stop in [(0, 16), (16, 48), (32, 200), (176, 200), (48, 80)]:
        part = QuantizedRows(
            rows.fmt,
            rows.q[start:stop],
            rows.d[start:stop],
            None if rows.m is None else rows.m[start:stop],
            576,
        )
        alone = cpu_kernels.linear(x, pack(part), bias[start:stop], act_bits)
        assert torch.equal(alone, together[:, start:stop]), (start, stop)


def test_linear_keeps_leading_dims_and_dtype(kernels):
    rows = _random_rows("q4", 48, 64, True)
    x = torch.randn(2, 3, 64)
    got = cpu_kernels.linear(x.to(torch.bfloat16), pack(rows))
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), F.linear(x.to(torch.bfloat16).float(), rows.dequantize()), atol=0.05, rtol=0.02
    )


@pytest.mark.parametrize("fmt,with_min", [("q8", False), ("q8", True), ("q4", True), ("q4", False)])
def test_embedding_rows_are_exact(kernels, fmt, with_min):
    rows = _random_rows(fmt, 53, 70, with_min)
    ids = torch.tensor([0, 52, 17, 17, 31])
    assert torch.equal(cpu_kernels.embedding(ids, pack(rows)), rows.dequantize()[ids])


@pytest.mark.parametrize("act_bits", [16, 8])
def test_symmetric_q4_is_its_stored_minimum_to_the_bit(kernels, act_bits):
    """Symmetric q4 (GGUF Q4_0) stores no minimum, 18 bytes a block, and every kernel takes
    m = -8 d: the same bits as with the half -8 d stored (the representation before), for every
    register tile of tokens and for embedding rows. The comparison sees another arithmetic: the
    same weights as q8 values q - 8 (the term folded into the integer dot products), or minimums
    one ulp off, give other bits."""
    rows = _random_rows("q4", 200, 576, with_min=False)
    stored = replace(rows, m=rows.minimums())  # the representation before: the half -8 d stored
    assert rows.m is None and torch.equal(stored.m, -8 * rows.d)
    sym, ref = pack(rows), pack(stored)
    assert sym.m is None and sym.nbytes() == 208 * 18 * 18 and ref.nbytes() == 208 * 18 * 20
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 4, 576)
    bias = torch.randn(200)
    for m in (1, 2, 3, 4, 5, 8, 9, 17, 40):
        got = cpu_kernels.linear(x[:m], sym, bias, act_bits)
        assert torch.equal(got, cpu_kernels.linear(x[:m], ref, bias, act_bits)), m
    ids = torch.tensor([0, 199, 17, 17, 131])
    assert torch.equal(cpu_kernels.embedding(ids, sym), cpu_kernels.embedding(ids, ref))
    if kernels == "torch":
        return  # it dequantizes in float32, where d q - 8 d and d (q - 8) are both exact
    folded = cpu_kernels.linear(
        x, pack(QuantizedRows("q8", rows.q.to(torch.int8) - 8, rows.d, None, 576)), bias
    )
    w = stored.dequantize()
    assert (
        (folded - got).abs() <= _bound(w, x, _int8_blocks(kernels, "q4", act_bits))
    ).all()  # the same math
    assert not torch.equal(got, folded)
    ulp_off = replace(ref, m=(ref.m.view(torch.int16) + 1).view(torch.float16))
    assert not torch.equal(got, cpu_kernels.linear(x, ulp_off, bias, act_bits))


def test_unknown_kernel_set_is_refused():
    with pytest.raises(ValueError, match="'avx9000'"):
        cpu_kernels.set_kernels("avx9000")


@pytest.mark.skipif(cpu_kernels.best_kernels() == "avx512_vnni", reason="this CPU has AVX-512 VNNI")
def test_kernel_set_the_cpu_lacks_is_refused():
    with pytest.raises(ValueError, match="avx512_vnni"):
        cpu_kernels.set_kernels("avx512_vnni")


@pytest.mark.skipif(cpu_kernels._ext is None, reason="the C++ kernels are not built")
@pytest.mark.parametrize("n,parts,threads", [(64, 1, 2), (61, 3, 2), (7, 2, 3), (0, 1, 2), (40, 1, 1)])
def test_matmul_jobs_run_once_and_a_slow_threads_run_is_taken_over(n, parts, threads):
    """The matmuls' jobs (job_runs.h): each job of each part (chunk of tokens) runs exactly once,
    whichever thread takes it; with the first thread slowed (2 ms a job), the others take over its
    run, where a static split would leave it its share."""
    runs_of, by_thread = cpu_kernels._ext.job_runs_trial(n, parts, threads, 2000)
    assert runs_of == [1] * (n * parts)
    assert len(by_thread) == threads and sum(by_thread) == n * parts
    if threads == 2 and n >= 32:
        assert by_thread[0] < n * parts // 4
    with pytest.raises(ValueError, match="n=-1"):
        cpu_kernels._ext.job_runs_trial(-1, 1, 1, 0)


@pytest.mark.skipif(cpu_kernels._ext is None, reason="the C++ kernels are not built")
@pytest.mark.parametrize(("threads", "team"), [(2, 1), (2, 3), (1, 2), (4, 2)])
def test_matmul_jobs_run_once_in_a_team_of_another_size(threads, team):
    """A matmul planned for `threads` threads but run by a region of another size (a nested one,
    whose team is one thread) splits its jobs statically over the team it has: each job of each
    part once, every thread of the team given its share."""
    n, parts = 37, 3
    runs_of, by_thread = cpu_kernels._ext.job_runs_trial(n, parts, threads, 0, team)
    assert runs_of == [1] * (n * parts)
    assert len(by_thread) == team and sum(by_thread) == n * parts
    assert all(abs(k - n * parts / team) <= parts for k in by_thread)
    with pytest.raises(ValueError, match="team=0"):
        cpu_kernels._ext.job_runs_trial(n, parts, threads, 0, 0)


# -- GGUF blocks ------------------------------------------------------------------------------------


def _raw_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks (finite half-float scales), as tests/gguf_writer.py's references take."""
    _, offsets = REFERENCE_DEQUANT[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for o in offsets:
        raw[:, o : o + 2] = rng.uniform(0.01, 0.1, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", [q for q in EXACT_TYPES if q in REFERENCE_DEQUANT], ids=lambda q: q.name)
def test_gguf_blocks_read_as_rows(qtype):
    """Against ggml's reference dequantization (written from its C code): exact for the 32-value
    types and Q6_K (its own super-blocks, q6); Q4_K's and Q5_K's sub-block scales and minimums
    are rounded to half floats."""
    ref, _ = REFERENCE_DEQUANT[qtype]
    raw = _raw_blocks(qtype, 3, 512)
    expected = torch.tensor([v for block in raw for v in ref(block.tobytes())]).reshape(3, 512)
    rows = read_rows(raw.reshape(3, -1), qtype, 512)
    fmt = {Q.Q4_0: "q4", Q.Q4_1: "q4", Q.Q4_K: "q4k", Q.Q6_K: "q6"}.get(qtype, "q8")  # K types: own scales
    assert rows is not None and rows.fmt == fmt
    # Q4_0: symmetric, 18 bytes a block; Q6_K: sub-block scales, no minimums
    assert (rows.m is None) == (qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q6_K))
    got = rows.dequantize()
    if qtype in (Q.Q4_K, Q.Q5_K):
        # |d sc q| <= 31 |d sc| and |dmin m| each off by a half-float rounding (2^-11 relative)
        assert ((got - expected).abs() <= 2**-10 * expected.abs().amax()).all()
    else:
        assert torch.equal(got, expected)


NONLINEAR_TYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]


@pytest.mark.parametrize("qtype", NONLINEAR_TYPES, ids=lambda q: q.name)
def test_table_types_read_as_rows(qtype):
    """IQ4_NL, IQ4_XS and MXFP4 (levels from a table) against the gguf package's dequantization,
    which the loader does not use for them: IQ4_NL and MXFP4 exactly; IQ4_XS's sub-block scales
    d (ls - 32) are rounded to half floats (2^-11 relative)."""
    assert set(EXACT_TYPES) - set(REFERENCE_DEQUANT) == set(NONLINEAR_TYPES)  # every type has a test
    raw = random_blocks(qtype, 3, 512, seed=int(qtype))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).float()
    rows = read_rows(raw, qtype, 512)
    assert rows is not None and rows.fmt == "q8" and rows.m is None
    got = rows.dequantize()
    if qtype == Q.IQ4_XS:
        assert ((got - expected).abs() <= 2**-10 * expected.abs().amax()).all()
    else:
        assert torch.equal(got, expected)


def test_mxfp4_beyond_half_float_scales_is_left_to_float():
    raw = random_blocks(Q.MXFP4, 2, 64)
    raw[1, 0] = 100  # 2^-28: below the smallest half float
    assert read_rows(raw, Q.MXFP4, 64) is None


def test_gguf_types_without_a_block_format_are_left_to_float():
    for qtype in (Q.Q2_K, Q.Q3_K):
        assert read_rows(random_blocks(qtype, 2, 256), qtype, 256) is None


# -- quantized layers -------------------------------------------------------------------------------


def test_fused_layer_packs_once_every_shard_arrived():
    layer = QuantizedLinear(64, [32, 16, 16], bias=True, fmt="q8")
    shards = [torch.randn(32, 64), torch.randn(16, 64), torch.randn(16, 64)]
    for i in (2, 0):
        layer.load_shard("x", shards[i], shard=i)
        assert layer.qweight is None
    layer.load_shard("x", shards[1], shard=1)
    layer.load_shard("b", torch.arange(16.0), shard=2, is_bias=True)
    assert layer.qweight is not None
    want = torch.cat([quantize(s, "q8").dequantize() for s in shards])
    assert torch.equal(layer.logical_weight(), want)
    assert torch.equal(layer.bias[48:], torch.arange(16.0)) and not layer.bias[:48].any()


def test_layer_load_errors_name_the_tensor():
    layer = QuantizedLinear(64, [32, 32], bias=False, fmt="q4")
    with pytest.raises(WeightShapeError, match="up_proj"):
        layer.load_shard("up_proj.weight", torch.randn(32, 48), shard=1)
    with pytest.raises(WeightShapeError, match="gate_proj"):
        layer.load_shard("gate_proj.weight", _random_rows("q4", 16, 64, True), shard=0)


@pytest.mark.parametrize("with_min", [True, False])
def test_four_bit_rows_become_eight_bit_exactly(with_min):
    """q8 has no symmetric form: a symmetric q4 shard widened to q8 stores its -8 d."""
    rows = _random_rows("q4", 20, 64, with_min)
    as8 = as_rows("w", rows, "q8", (20, 64))
    assert as8.fmt == "q8" and as8.q.dtype == torch.int8
    assert as8.m is not None and torch.equal(as8.m, rows.minimums())
    assert torch.equal(as8.dequantize(), rows.dequantize())


def test_fused_layer_stores_minimums_only_where_its_shards_disagree():
    """A layer of symmetric shards (every one Q4_0) stores none; one with a shard that has
    minimums (a Q4_1 v_proj) stores them for all, -8 d for the symmetric ones."""
    sym = [_random_rows("q4", 32, 64, False, seed=s) for s in (1, 2)]
    asym = _random_rows("q4", 16, 64, True, seed=3)
    layers = {}
    for name, shards in (("symmetric", sym), ("mixed", [*sym, asym])):
        layer = QuantizedLinear(64, [s.num_rows for s in shards], bias=False, fmt="q4")
        for i, shard in enumerate(shards):
            layer.load_shard(f"shard{i}", shard, shard=i)
        want = torch.cat([s.dequantize() for s in shards])
        assert torch.equal(layer.logical_weight(), want)
        layers[name] = layer.qweight
    assert layers["symmetric"].m is None and layers["symmetric"].nbytes() == 64 * 2 * 18
    back = unpack(layers["mixed"])
    assert back.m is not None and torch.equal(back.m, torch.cat([-8 * sym[0].d, -8 * sym[1].d, asym.m]))


def test_rows_concatenated_are_the_parts_one_after_another() -> None:
    """A fused layer's shards stored apart (a GGUF projector's q, k, v) joined without a float
    round trip: the same values as the parts' rows stacked; mixed formats, widths or minimums
    are refused (None: the loader then takes the float path)."""
    parts = [_random_rows("q8", n, 96, False, seed=n) for n in (4, 8, 4)]
    joined = QuantizedRows.concat(parts)
    assert joined is not None and joined.num_rows == 16
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    q4 = [_random_rows("q4", 4, 96, True, seed=1), _random_rows("q4", 4, 96, True, seed=2)]
    assert torch.equal(QuantizedRows.concat(q4).dequantize(), torch.cat([p.dequantize() for p in q4]))  # type: ignore[union-attr]
    assert QuantizedRows.concat([parts[0], _random_rows("q8", 4, 64, False)]) is None
    assert QuantizedRows.concat([parts[0], q4[0]]) is None
    assert QuantizedRows.concat([q4[0], _random_rows("q4", 4, 96, False)]) is None

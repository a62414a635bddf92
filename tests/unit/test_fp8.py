"""FP8 arithmetic (layers/quantization/fp8.py) against a reference written from the e4m3fn
definition, and `Fp8Linear` on the CPU: shard loading, the reference path, and the fast path's
`torch._scaled_mm` call where this torch runs it on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.layers.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    Fp8Linear,
    fp8_matmul,
    quantize_fp8,
)


def e4m3_round(v: float) -> float:
    """Round to the nearest e4m3fn value, ties to even, from the format's definition: 1 sign bit,
    4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest value 448. Normal numbers
    from 2^-6 are spaced 2^(e-3) in [2^e, 2^(e+1)); subnormals below 2^-6 are spaced 2^-9."""
    a = abs(v)
    if a == 0.0:
        return 0.0
    _, exp = math.frexp(a)  # a = m * 2^exp, m in [0.5, 1): the binade is [2^(exp-1), 2^exp)
    step = 2.0 ** (max(exp - 1, -6) - 3)
    k = round(a / step)  # Python rounds half to even; an even k is an even mantissa
    return math.copysign(min(k * step, FP8_MAX), v)


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """Magnitudes from 2^-12 (subnormal territory) to 448, both signs, plus exact ties."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.empty(n).uniform_(-12, math.log2(FP8_MAX), generator=g))
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    # Midpoints between neighbouring e4m3 values: 1 + 1/16 (1 and 1.125), 2.5 * 2^-9 (subnormals)
    ties = torch.tensor([1.0625, 1.1875, 3.0 * 2**-10, 5.0 * 2**-10, 17.0 / 16 * 64, 464.0 - 16])
    return torch.cat([mags * signs, ties, -ties]).float()


def test_cast_rounds_as_the_definition_says():
    v = _values(20000)
    got = v.to(FP8_DTYPE).float()
    want = torch.tensor([e4m3_round(float(x)) for x in v])
    assert torch.equal(got, want)


def test_rounding_error_bounds():
    """3 mantissa bits: each normal element within 2^-4 of itself, relative; subnormals within
    half their spacing (2^-10)."""
    v = _values(20000, seed=1)
    q = v.to(FP8_DTYPE).float()
    normal = v.abs() >= 2**-6
    assert ((q - v).abs() / v.abs())[normal].max() <= 2**-4
    assert (q - v).abs()[~normal].max() <= 2**-10


@pytest.mark.parametrize("shape", [(7, 64), (1, 96), (33, 17)])
def test_quantize_rows_matches_the_reference(shape):
    """Per row (a weight's output channel, an activation's token): scale = max|row| / 448 exactly
    (float32), q = e4m3(row / scale); the row's largest element maps to +-448."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, (shape[0], 1), generator=g).float())
    q, scale = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    assert torch.equal(scale, x.abs().amax(-1) / 448.0)
    want = torch.tensor([[e4m3_round(float(v)) for v in row] for row in (x / scale[:, None])])
    assert torch.equal(q.float(), want)
    assert torch.equal(q.float().abs().amax(-1), torch.full((shape[0],), FP8_MAX))
    deq = q.float() * scale[:, None]
    big = x.abs() >= (2**-6) * scale[:, None]  # normal in scaled units
    assert ((deq - x).abs() / x.abs())[big].max() <= 2**-4


def test_zero_rows_quantize_to_zeros():
    q, scale = quantize_fp8(torch.zeros(3, 32))
    assert torch.equal(scale, torch.full((3,), MIN_SCALE)) and not q.float().any()


def _layer(
    in_features: int, output_sizes: list[int], bias: bool, seed: int = 0
) -> tuple[Fp8Linear, torch.Tensor]:
    """An Fp8Linear loaded shard by shard from a float weight [out, in] (returned too)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(output_sizes), in_features, generator=g) * 0.1
    layer = Fp8Linear(in_features, output_sizes, bias)
    start = 0
    for shard, n in enumerate(output_sizes):
        layer.load_shard(f"w{shard}", w[start : start + n], shard)
        if bias:
            layer.load_shard(f"b{shard}", torch.arange(n, dtype=torch.float32) / 7, shard, is_bias=True)
        start += n
    return layer, w


def test_fused_shards_quantize_as_one_matrix():
    """Per-channel scales commute with concatenation: q, k, v loaded one at a time are the whole
    matrix quantized at once."""
    layer, w = _layer(64, [64, 32, 32], bias=False)
    q, scale = quantize_fp8(w)
    assert torch.equal(layer.weight.float(), q.float()) and torch.equal(layer.weight_scale, scale)
    assert torch.allclose(layer.logical_weight(), w, rtol=2**-4, atol=1e-6)


def test_forward_is_the_scaled_product():
    """y = s_x s_w (q_x q_w^T) + b, in float64 from the quantized operands; leading dims kept."""
    layer, _ = _layer(64, [48, 48], bias=True)
    x = torch.randn(2, 5, 64)
    y = layer(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    x_q, x_s = quantize_fp8(x.reshape(-1, 64))
    want = (x_q.double() @ layer.weight.double().t()) * x_s.double()[:, None] * layer.weight_scale.double()
    want = want + layer.bias.double()
    torch.testing.assert_close(y.reshape(-1, 96).double(), want, rtol=1e-5, atol=1e-5)


def test_padding_rows_give_the_bias():
    layer, _ = _layer(32, [16], bias=True)
    y = layer(torch.zeros(4, 32))
    assert torch.equal(y, layer.bias.expand(4, 16))


def test_bfloat16_inputs_come_back_in_bfloat16():
    layer, _ = _layer(64, [32], bias=False)
    x = torch.randn(3, 64)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), layer(x), rtol=0.1, atol=0.05)  # bf16 input rounding only


def test_scaled_mm_needs_aligned_dimensions():
    aligned, _ = _layer(64, [32], bias=False)
    aligned.use_kernel("scaled_mm")
    odd, _ = _layer(40, [24], bias=False)
    odd.use_kernel("scaled_mm")
    assert aligned.kernel == "scaled_mm" and odd.kernel == "reference"


def _cpu_scaled_mm() -> bool:
    try:
        a = torch.ones(1, 16).to(FP8_DTYPE)
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(1, 1), scale_b=torch.ones(1, 1), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


@pytest.mark.skipif(
    not _cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm with row-wise scales"
)
def test_fast_path_call_matches_the_reference_on_the_cpu():
    """The CUDA path's exact call (q_w transposed to column-major, scales [T, 1] and [1, N],
    bf16 out), run by torch's CPU implementation: the reference path's result to bf16 rounding."""
    layer, _ = _layer(128, [64, 64], bias=True)
    x = torch.randn(9, 128)
    ref = layer(x)
    layer.use_kernel("scaled_mm")
    fast = layer(x)
    torch.testing.assert_close(fast, ref, rtol=2**-7, atol=1e-2)
    x_q, x_s = quantize_fp8(x)
    raw = fp8_matmul(x_q, x_s, layer.weight, layer.weight_scale, "scaled_mm")
    assert raw.dtype == torch.bfloat16 and raw.shape == (9, 128)

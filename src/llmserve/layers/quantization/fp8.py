"""FP8 weights (`--quantization fp8`): linear layers in float8 e4m3 with one float32 scale per
output channel, activations rounded to e4m3 per token at each matmul (vLLM's "fp8" with dynamic
per-token activation scales, W8A8).

    weight   W[n, :] = q_w[n, :] * s_w[n]     s_w[n] = max|W[n, :]| / 448   (once, at load)
    input    x[t, :] = q_x[t, :] * s_x[t]     s_x[t] = max|x[t, :]| / 448   (every forward)
    output   y[t, n] = s_x[t] * s_w[n] * sum_k q_x[t, k] q_w[n, k]         (fp32 accumulation)

e4m3 (`torch.float8_e4m3fn`) has 3 mantissa bits and a largest finite value of 448: the scale maps
each row's largest magnitude onto 448, and every normal element is rounded with a relative error of
at most 2^-4. Scales are floored at `MIN_SCALE` so a row of zeros (a padding token) quantizes to
zeros instead of dividing by zero. (torch divides by 448 exactly on the CPU; on CUDA it multiplies
by 1/448 rounded to float32, `FP8_INV_MAX`, as it does for any division by a Python number, so a
scale can differ by a float32 unit between the devices. The Triton kernel rounds as torch does on
each.)

Two kernels compute `y`, picked once per model (`fp8_kernel`):

    scaled_mm   torch._scaled_mm(q_x, q_w.T, scale_a=s_x [T,1], scale_b=s_w [1,N], out_dtype=bf16):
                cuBLASLt / CUTLASS FP8 tensor cores, CUDA devices of compute capability >= 8.9
                (Ada, Hopper). Its row-wise kernel writes bf16, cast to the model's dtype after.
    reference   the same arithmetic in float32 on dequantized values: the CPU and older GPUs. It
                reads a float32 copy of each weight per matmul, so it is slower than the float
                model; it exists so the numbers can be tested where there is no FP8 hardware (CI),
                not to be fast.

Embeddings and the LM head stay in the model's dtype (as vLLM keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from llmserve.layers.activation import gpu_kernels
from llmserve.layers.linear import Linear
from llmserve.layers.quantization.formats import QuantizedRows
from llmserve.load_errors import WeightShapeError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite e4m3fn value."""
FP8_INV_MAX = (torch.ones((), dtype=torch.float32) / FP8_MAX).item()
"""1/448 rounded to float32 (a Python float holding that value): torch on CUDA computes
`amax / 448` as `amax * FP8_INV_MAX`."""
MIN_SCALE = 1e-12
"""Floor of every scale. Any positive floor keeps |x / scale| <= 448; it only decides what an all
(near-)zero row becomes: zeros."""

Fp8Kernel = Literal["scaled_mm", "reference"]


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A weight stored in e4m3 by an FP8 checkpoint, taken as it is: q [N, K] float8_e4m3fn and
    its float32 scale per row [N] (a per-tensor scale repeated: the same values)."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 (exact: e4m3 values times a float32 scale, one rounding at most)."""
        return self.q.float() * self.scale.unsqueeze(1)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [R, K] as (q [R, K] e4m3fn, scale [R] float32), x ~ q * scale per row. Weight
    rows are output channels, activation rows are tokens: the same rounding for both."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)  # [R]
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # round to nearest even
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` of activation rows, in one Triton kernel on CUDA (triton_ops.py's
    `quantize_fp8_rows`: the same bits, one launch instead of eight)."""
    kernels = gpu_kernels() if x.is_cuda else None
    if kernels is not None and x.shape[-1] <= kernels.MAX_NORM_WIDTH:
        return kernels.quantize_fp8_rows(x, FP8_MAX, FP8_INV_MAX, MIN_SCALE)
    return quantize_fp8(x)


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA devices of compute capability 8.9 or newer. (A capability check on
    the hardware the kernel runs on, as `cpu_kernels` checks CPU features.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_kernel(device: torch.device) -> Fp8Kernel:
    return "scaled_mm" if scaled_mm_supported(device) else "reference"


def fp8_matmul(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, kernel: Fp8Kernel
) -> torch.Tensor:
    """q_x [T, K] (scales [T]) times q_w [N, K] (scales [N]) -> [T, N]: bf16 from `scaled_mm`,
    float32 from `reference`."""
    if kernel == "scaled_mm":
        # mat2 must be column-major: q_w is [N, K] row-major, so q_w.t() is [K, N] column-major.
        return torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale.unsqueeze(1), scale_b=w_scale.unsqueeze(0), out_dtype=torch.bfloat16
        )
    acc = x_q.float() @ w_q.float().t()  # [T, N]: exact products, fp32 sums, as the tensor cores
    return acc * x_scale.unsqueeze(1) * w_scale.unsqueeze(0)


class Fp8Linear(Linear):
    """y = x @ W.T + b with W in e4m3 per output channel and x rounded to e4m3 per token."""

    packed = True  # forward takes and gives the plain [..., in] -> [..., out] layout
    weight_format = "fp8"
    """The load report's name for the weight and its scales (quantization.weight_groups)."""

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool) -> None:
        nn.Module.__init__(self)
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        N, K = self.out_features, in_features
        # Parameters (not buffers), so everything that moves a layer's weights moves these too.
        self.weight = nn.Parameter(torch.empty(N, K, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(N, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(N), requires_grad=False) if bias else None
        self.kernel: Fp8Kernel = "reference"
        """Set by the loader (`use_kernel`) once the device is known."""

    @classmethod
    def like(cls, layer: Linear, fmt: str = "fp8") -> Fp8Linear:
        """An FP8 layer with `layer`'s shape (its float weight is never filled)."""
        return cls(layer.in_features, layer.output_sizes, layer.bias is not None)

    def use_kernel(self, kernel: Fp8Kernel) -> None:
        """`scaled_mm` needs both matrix dimensions divisible by 16 (cuBLASLt's FP8 alignment);
        a layer that is not keeps the reference path."""
        aligned = self.in_features % 16 == 0 and self.out_features % 16 == 0
        self.kernel = kernel if aligned else "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        x_q, x_scale = quantize_activations(x.reshape(-1, self.in_features))  # [T, K], [T]
        y = fp8_matmul(x_q, x_scale, self.weight, self.weight_scale, self.kernel).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def load_shard(
        self,
        name: str,
        loaded: torch.Tensor | QuantizedRows | Fp8Weight,
        shard: int = 0,
        is_bias: bool = False,
    ) -> None:
        """A checkpoint tensor into `shard`. Scales are per output row, so a fused layer's shards
        (q, k, v; gate, up) are quantized one at a time straight into place: nothing is staged.
        An `Fp8Weight` (a pre-quantized FP8 checkpoint) is copied as it is, its per-tensor scale
        kept per shard."""
        if is_bias:  # the float layer's bias, as it is
            super().load_shard(name, loaded, shard, is_bias=True)  # type: ignore[arg-type]
            return
        start, end = self._shard_range(shard)
        if isinstance(loaded, QuantizedRows):  # a GGUF block tensor (quant_plan refuses these)
            loaded = loaded.dequantize()
        expected = (end - start, self.in_features)
        got = loaded.q.shape if isinstance(loaded, Fp8Weight) else loaded.shape
        if tuple(got) != expected:
            raise WeightShapeError(name, expected, tuple(got))
        if isinstance(loaded, Fp8Weight):  # an FP8 checkpoint's bytes and scales, as they are
            q, scale = loaded.q, loaded.scale
        else:
            q, scale = quantize_fp8(loaded.to(self.weight.device))  # on the target device: fast on GPUs
        self.weight.data[start:end].copy_(q)
        self.weight_scale.data[start:end].copy_(scale)

    def use_onednn(self) -> None:
        """Nothing to repack: FP8 has its own layout."""

    def logical_weight(self) -> torch.Tensor:
        """The dequantized [out, in] weight in float32 (inspection and tests; allocates)."""
        return self.weight.float() * self.weight_scale.unsqueeze(1)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, fp8 {self.kernel}"
        )

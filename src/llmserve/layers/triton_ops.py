"""Fused elementwise Triton kernels for the GPU path: residual add + RMSNorm, the gated
activations (SiLU-and-mul, GELU-tanh-and-mul), and fp8's per-token activation rounding. Plain
functions over torch tensors; importing this module needs triton, so callers import it where the
device profile chose the Triton path.

Each matches the torch layers' rounding (layernorm.py's `RMSNorm`, activation.py + `gate * up`):
sums and statistics in float32, rounded to the activation dtype where the torch code rounds.

    add_rms_norm: one program per row, the row as one tile   [x | residual] -> [normed | sum]
    gated act:    grid (rows, I / BLOCK), [gate | up] halves of one row -> act(gate) * up
    fp8 rows:     one program per row: max |x|, the scale, x / scale rounded to e4m3 -> [q | scale]

Both are a single read and write of their tensors. On an H100 (the 1.07B Llama of bench_gpu.py):
rms_norm 1.9 us and act_and_mul 1.2 us per call at batch 1; 42 us and 136 us per call in an
8,192-token prefill step.
The module also holds what every llmserve Triton kernel shares: `cast`, `dot`, `gated_act` and
`INTERPRETED`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NORM_WIDTH = 65536
"""Widest row the norm keeps in registers as one tile (hidden sizes are at most ~16k)."""


@triton.jit
def _probe():
    pass


INTERPRETED = type(_probe).__name__ == "InterpretedFunction"
"""The kernels run under Triton's interpreter (TRITON_INTERPRET=1 when triton.jit decorated them)."""
_ON_INTERPRETER = tl.constexpr(INTERPRETED)
"""`INTERPRETED` as a constexpr, for static ifs inside kernels."""


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x.to(dtype), with float32 -> bfloat16 rounded to nearest even under the interpreter too: its
    own cast truncates, which would make the CPU tests disagree with torch by a unit of rounding."""
    out = x.to(dtype)
    # nested static ifs, not one `and`: compiled Triton takes two operands per `and`, no more
    if _ON_INTERPRETER:  # noqa: SIM102
        if x.dtype == tl.float32:  # noqa: SIM102
            if dtype == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return out


UPCAST_BF16 = INTERPRETED
"""The interpreter's numpy dot reads bfloat16 bits as integers: feed it float32 (exact) instead."""


@triton.jit
def dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation; float32 inputs as true float32 (the torch reference's
    precision, not tf32); UPCAST: the interpreter's bf16 workaround (`UPCAST_BF16`)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps, offset,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype and normalised as rounded (torch's `x + residual`).
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = cast(x.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        y = xf * rstd * (offset + w)
    elif ROUND_BEFORE_WEIGHT:
        y = cast(xf * rstd, dtype).to(tl.float32) * w  # `weight * xf.to(dtype)`
    else:
        y = xf * rstd * w
    tl.store(out_ptr + row * stride_o + cols, cast(y, dtype), mask=ok)


@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(u)); tanh from exp (not in every triton's core language), as
    # sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) <= 1, which cannot overflow
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    e = tl.exp(-2.0 * tl.abs(u))
    tanh = (1.0 - e) / (1.0 + e)
    return 0.5 * x * (1.0 + tl.where(u < 0, -tanh, tanh))


@triton.jit
def gated_act(gate, up, dtype: tl.constexpr, GELU: tl.constexpr):
    """act(gate) * up in `dtype` from float32 gate and up (values already in `dtype`): SiLU, or
    GELU-tanh; torch rounds act(gate) to the dtype before the product, and so does this."""
    act = _gelu_tanh(gate) if GELU else gate / (1.0 + tl.exp(-gate))
    return cast(cast(act, dtype).to(tl.float32) * up, dtype)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter, GELU: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, gated_act(gate, up, dtype, GELU), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., n] as [rows, n] with contiguous rows (a copy only when they are not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, weight_offset: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rows of {n} elements are wider than the fused norm's {MAX_NORM_WIDTH}")
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
        n, eps, float(weight_offset),
        HAS_RESIDUAL=residual is not None, GEMMA=bool(weight_offset),
        ROUND_BEFORE_WEIGHT=x.dtype != torch.float32, BLOCK=block,
        num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
    )  # fmt: skip
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """x / rms(x) * w (Gemma: * (weight_offset + w) with weight_offset 1.0), as `RMSNorm(x)`."""
    return _norm(x, None, weight, eps, weight_offset)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), as `RMSNorm(x, residual)`; the inputs are left as they are."""
    out, res = _norm(x, residual, weight, eps, weight_offset)
    assert res is not None
    return out, res


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out, x2.stride(0), out.stride(0), inter, GELU=gelu, BLOCK=block, num_warps=4
    )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] as [gate | up] -> silu(gate) * up [..., I]."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] as [gate | up] -> gelu_tanh(gate) * up [..., I] (Gemma's GeGLU)."""
    return _act_and_mul(x, gelu=True)


@triton.jit
def e4m3_bits(v):
    """float32 v with |v| <= 448 -> the bits (uint8) of v rounded to nearest even in e4m3fn, by
    integer arithmetic: the same bits as torch's `.to(torch.float8_e4m3fn)` compiled and under the
    interpreter (whose own fp8 cast does not round to nearest), whatever rounding a Triton build's
    conversion uses. Normal results (|v| >= 2^-6) keep 3 of float32's 23 mantissa bits; smaller
    ones are multiples of 2^-9, the significand shifted right by 14 - exponent, rounded alike."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)  # rebias 127 -> 7
    shift = tl.minimum(tl.maximum(141 - (a >> 23).to(tl.int32), 1), 31).to(tl.uint32)
    sig = (a & 0x7FFFFF) | 0x800000
    sub = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
    return (tl.where(a < 0x3C800000, sub, normal) | sign).to(tl.uint8)  # 0x3C800000: 2^-6


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, n, inv_max, min_scale, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    # as torch rounds on this device: amax / 448 an IEEE division on the CPU (the interpreter), a
    # product with 1/448 in float32 on CUDA; x / scale an IEEE division (div_rn) on both, as torch
    # divides two tensors (Triton's `/` on float32 is an approximation)
    amax = tl.max(tl.abs(x), 0)
    if _ON_INTERPRETER:  # noqa: SIM108 (a static if on a constexpr)
        scale = tl.math.div_rn(amax, FP8_MAX)
    else:
        scale = amax * inv_max
    scale = tl.maximum(scale, min_scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * n + cols, e4m3_bits(q), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_fp8_rows(
    x: torch.Tensor, fp8_max: float, inv_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.py's `quantize_fp8` in one kernel (its eight torch ops were eight launches per matmul):
    rows of x [R, K] -> (q [R, K] float8_e4m3fn, scale [R] float32), the same bits."""
    n = x.shape[-1]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rows of {n} elements are wider than the fused fp8 rounding's {MAX_NORM_WIDTH}")
    x2 = _rows(x)
    q = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _quantize_fp8_kernel[(x2.shape[0],)](
        x2, q, scale, x2.stride(0), n, inv_max, min_scale, FP8_MAX=fp8_max, BLOCK=block,
        num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
    )  # fmt: skip
    return q.view(torch.float8_e4m3fn), scale

"""The block-quantized matmul and row lookup, on llmserve's C++ kernels or on torch ops.

    linear(x [..., K], w: PackedWeight, bias [N] | None) -> [..., N]      x @ W.T (+ bias)
    embedding(ids [T], w: PackedWeight) -> [T, K]                          rows `ids` of W

Kernel sets, best first (`set_kernels`, or the environment variable LLMSERVE_QUANT_KERNELS):

    avx512_vnni   csrc/qgemm_avx512.cpp: Zen 4, Ice Lake and later
    avx2          csrc/qgemm_avx2.cpp: any x86-64 CPU with AVX2, FMA and F16C (Zen 1-3, Haswell+)
    torch         dequantize the weight with torch ops, then a float matmul: any CPU, slow (the
                  reference the kernels are tested against, and the path where the extension
                  was not built)

The C++ kernels quantize activations per token to int16 (csrc/qgemm.h); the torch path multiplies
float activations, so the two agree to about 1e-4 relative to the output's scale. On avx512_vnni,
q4 weights can take int8 activations per block of 32 instead (`act_bits=8`, llama.cpp's rounding:
~5e-3 relative, faster for several tokens at once); q6 weights (GGUF Q6_K's own blocks,
csrc/qgemm_q6_*.cpp) always take int16 activations. A token's row never depends on the other
tokens of the call in the C++ kernels; the torch path makes no such promise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import torch  # before the extension: it then shares torch's OpenMP runtime (one thread pool)
import torch.nn.functional as F

from llmserve.layers.quantization.formats import PackedWeight, unpack

try:
    from llmserve import _cpu_kernels as _ext
except ImportError:  # the optional extension was not built
    _ext = None

KERNEL_SETS = ("avx512_vnni", "avx2", "torch")


def best_kernels() -> str:
    """The fastest kernel set this machine runs."""
    if _ext is None or _ext.best_isa() == "none":
        return "torch"
    return _ext.best_isa()


def set_kernels(name: str) -> None:
    """Use kernel set `name` ("auto" = the best) for every later call, process-wide."""
    global _kernels
    if name == "auto":
        name = best_kernels()
    if name not in KERNEL_SETS:
        raise ValueError(f"unknown quantized kernel set {name!r}; known: auto, {', '.join(KERNEL_SETS)}")
    if name != "torch":
        if _ext is None:
            raise ValueError(
                f"quantized kernel set {name!r} needs llmserve's C++ extension, which is not built"
            )
        _ext.set_isa(name)  # raises ValueError naming what the CPU lacks
    _kernels = name


def forced() -> bool:
    """True when LLMSERVE_QUANT_KERNELS names the kernel set (the user accepted the torch path)."""
    return bool(os.environ.get("LLMSERVE_QUANT_KERNELS"))


def kernels() -> str:
    """The kernel set in use."""
    return _kernels


def has_native_kernels() -> bool:
    return _kernels != "torch"


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def linear(
    x: torch.Tensor,
    w: PackedWeight | Sequence[PackedWeight],
    bias: torch.Tensor | None = None,
    act_bits: int = 16,
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in float32 (returned in x's dtype). `act_bits` 8: q4 weights take
    int8 activations per block of 32 where the kernel set has them (avx512_vnni; else int16).
    `w` may be several matrices whose rows follow one another (a fused layer whose shards have
    different formats): each writes its columns of the output."""
    parts = [w] if isinstance(w, PackedWeight) else list(w)
    K, N = parts[0].in_features, sum(p.out_features for p in parts)
    if _kernels == "torch":
        out = F.linear(x.float(), torch.cat([unpack(p).dequantize() for p in parts]), bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=torch.float32)
    col = 0  # the part's first output column: its rows of the bias and its columns of out [M, N]
    for p in parts:
        b = 0 if bias is None else bias.data_ptr() + 4 * col
        _ext.gemm(p.code, x2.data_ptr(), K, M, K, p.out_features, p.data.data_ptr(), p.d.data_ptr(), _addr(p.m),
                  b, out.data_ptr() + 4 * col, N, act_bits)  # fmt: skip
        col += p.out_features
    out = out.view(*x.shape[:-1], N)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def embedding(ids: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Rows `ids` [T] (int64) of W as float32 [T, K]."""
    if _kernels == "torch":
        return unpack(w).select_rows(ids).dequantize()
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], w.in_features, dtype=torch.float32)
    _ext.dequant_rows(w.code, w.data.data_ptr(), w.d.data_ptr(), _addr(w.m), w.in_features, ids.data_ptr(),
                      ids.shape[0], out.data_ptr())  # fmt: skip
    return out


def native_extension() -> ModuleType | None:
    """llmserve's compiled extension (also home of the shared-memory collectives), None where it
    was not built."""
    return _ext


def decoder_new(
    config: tuple, layers: list[tuple], cos_sin: int, final_norm: int, comm: object = None
) -> object:
    """A fused decoder stack (csrc/decoder_stack.cpp) over tensors given by address; see fused_decoder.py."""
    assert _ext is not None
    return _ext.decoder_new(config, layers, cos_sin, final_norm, comm)


def decoder_forward(decoder: object, *args: int | tuple[object, ...]) -> None:
    assert _ext is not None
    _ext.decoder_forward(decoder, *args)


def decoder_lora_new(decoder: object, dtype: int, layers: list[tuple]) -> object:
    """A LoRA adapter the fused decoder adds (csrc/decoder_lora.cpp), its tensors by address; see
    lora/fused.py."""
    assert _ext is not None
    return _ext.decoder_lora_new(decoder, dtype, layers)


_kernels = best_kernels()
if os.environ.get("LLMSERVE_QUANT_KERNELS"):
    set_kernels(os.environ["LLMSERVE_QUANT_KERNELS"])

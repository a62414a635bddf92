"""Which block format each layer of a model gets, from `ModelConfig.quantization` and, for GGUF
files, the type each tensor has on disk.

    none   every layer stays float (the checkpoint's values in the model's dtype)
    int8   linear layers, embeddings and LM heads in q8 (blocks of 32 int8, one half scale each)
    int4   linear layers in q4 (blocks of 32 4-bit values, half scale and minimum); embeddings
           and LM heads in q8, as llama.cpp's Q4 mixes keep the output projection at 6-8 bits
    fp8    linear layers in float8 e4m3 with a float32 scale per output channel, activations
           rounded per token (layers/quantization/fp8.py); embeddings and LM heads stay float.
           Quantizes float checkpoints only: an already quantized GGUF file is refused
    auto   a quantized GGUF file keeps its quantization family per layer: Q4_0 / Q4_1 / Q4_K
           tensors become q4 (Q4_K as q4k: its super-blocks' d, dmin and 6-bit sub-scales kept,
           the same values as q4 from 18.5 bytes a block), Q6_K q6 (its own super-blocks, the
           file's weights exactly), anything else (Q8_0, Q5_x, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4,
           F16, ...) q8; a fused layer whose shards differ takes q8, but keeps its 4-bit and q6
           shards as matrices of their own (QuantizedLinear.keep_shard_formats: Q4_K_M's Q4_K q
           and k as q4k beside a Q6_K v as q6). Q8_0, Q4_x, Q5_x, Q6_K, IQ4_NL, IQ4_XS and MXFP4
           are read from their blocks (gguf_quant.py), others are requantized from float; the load
           report says which (`gguf_type_report`). Float checkpoints (HF folders, F32/F16/BF16
           GGUF files) stay float.

A pre-quantized HF checkpoint (GPTQ, AWQ, FP8: `quantization_config`) brings its own plan instead
(prequantized.py): its quantized layers keep their format, `auto` being the checkpoint's method.

q8 / q4 layers run on the CPU only (llmserve's C++ kernels, picked by CPU features). fp8 runs
`torch._scaled_mm` on CUDA devices of compute capability >= 8.9 and a float32 reference path
elsewhere (the CPU, older GPUs: correct, slower than float, meant for tests).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from llmserve.layers.linear import Linear
from llmserve.layers.quantization import PlanFormat, QuantizationPlan, cpu_kernels
from llmserve.layers.quantization.formats import QuantFormat
from llmserve.layers.quantization.fp8 import Fp8Linear, fp8_kernel
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.models import CausalLM

logger = logging.getLogger("llmserve")

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _gguf_format(type_name: str) -> QuantFormat:
    if type_name == "Q6_K":
        return "q6"
    return "q4" if type_name in _FOUR_BIT_TYPES else "q8"


def gguf_type_report(tensor_types: dict[str, str]) -> str:
    """What each quantized GGUF type of a file becomes under `auto`, for the load report:
    "Q4_K -> q4k (blocks kept), Q3_K -> q8 (requantized)"."""
    from llmserve.model_executor.model_loader.gguf_quant import EXACT_TYPES

    kept = {q.name for q in EXACT_TYPES}
    names = sorted({t for t in tensor_types.values() if t not in _FLOAT_TYPES})
    held = lambda t: "q4k" if t == "Q4_K" else _gguf_format(t)  # noqa: E731  (gguf_quant.read_rows)
    return ", ".join(f"{t} -> {held(t)} ({'blocks kept' if t in kept else 'requantized'})" for t in names)


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError, naming the value, for an explicit method this setup cannot run."""
    if method in ("none", "auto"):
        return
    if method == "fp8":
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"quantization 'fp8' needs a float model; dtype is {dtype}")
        return
    if device.type != "cpu":
        raise ValueError(
            f"quantization {method!r} runs on the CPU only; device is {device} (use quantization 'none')"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"quantization {method!r} needs a float32 or bfloat16 model on the CPU; dtype is "
            f"{str(dtype).removeprefix('torch.')}"
        )
    if not cpu_kernels.has_native_kernels() and not cpu_kernels.forced():
        raise ValueError(
            f"quantization {method!r} has no kernel on this machine (llmserve's C++ extension is not "
            f"built, or the CPU lacks AVX2/FMA/F16C); set LLMSERVE_QUANT_KERNELS=torch to run it on "
            f"slow torch ops anyway, or use quantization 'none'"
        )


def plan_quantization(
    method: str,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    tensor_types: dict[str, str] | None = None,
) -> QuantizationPlan | None:
    """The plan for `method`, or None when every layer stays float. `tensor_types`: checkpoint
    tensor name -> GGUF type name (None for HF folders)."""
    check_supported(method, device, dtype)
    if method == "none":
        return None
    if method == "fp8":
        return _fp8_plan(model, device, tensor_types)
    if method == "auto":
        usable = (
            device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and cpu_kernels.has_native_kernels()
        )
        if not usable or not tensor_types or not _is_quantized(tensor_types):
            return None
        return QuantizationPlan("auto", _formats_from_gguf(model, tensor_types))
    formats: dict[str, PlanFormat] = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            formats[path] = "q4" if method == "int4" else "q8"
        elif isinstance(module, (VocabEmbedding, LMHead)):
            formats[path] = "q8"
    return QuantizationPlan(method, formats)


def _fp8_plan(model: CausalLM, device: torch.device, tensor_types: dict[str, str] | None) -> QuantizationPlan:
    """Every linear layer in fp8; embeddings and LM head stay float."""
    if tensor_types and _is_quantized(tensor_types):
        kinds = sorted({t for t in tensor_types.values() if t not in _FLOAT_TYPES})
        raise ValueError(
            f"quantization 'fp8' quantizes float weights, but this GGUF file is already quantized "
            f"({', '.join(kinds)}): use quantization 'auto' to keep its blocks, 'int8'/'int4', or load "
            f"a float checkpoint (HF folder, or an F16/BF16/F32 GGUF) with 'fp8'"
        )
    formats: dict[str, PlanFormat] = {p: "fp8" for p, m in model.named_modules() if isinstance(m, Linear)}
    return QuantizationPlan("fp8", formats, kernel=fp8_kernel_name(device))


def fp8_kernel_name(device: torch.device) -> str:
    """What runs fp8 matmuls on `device`, for the load report; warns when it is the reference."""
    if fp8_kernel(device) == "scaled_mm":
        return "torch._scaled_mm"
    logger.warning(
        "fp8 weights on %s: no FP8 tensor cores (CUDA compute capability >= 8.9 needed), so fp8 runs "
        "the float32 reference path: the FP8 model's numbers, slower than the float model",
        device,
    )
    return "float32 reference"


def use_fp8_kernel(model: torch.nn.Module, device: torch.device) -> None:
    """Point every fp8 layer at the kernel this device runs (once weights are loaded)."""
    kernel = fp8_kernel(device)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_kernel(kernel)


def gguf_tensor_types(per_file: list[dict[str, str]]) -> dict[str, str]:
    """The tensor types `auto` plans from, for a model read from several GGUF files (a language
    model and its vision projector): only quantized files' tensors, so that a float file's layers
    stay float beside a quantized one (an F32 language model with a Q8_0 projector keeps its F32
    weights, as llama.cpp runs them)."""
    return {k: v for types in per_file if _is_quantized(types) for k, v in types.items()}


def _is_quantized(tensor_types: dict[str, str]) -> bool:
    return any(t not in _FLOAT_TYPES for t in tensor_types.values())


def _formats_from_gguf(model: CausalLM, tensor_types: dict[str, str]) -> dict[str, PlanFormat]:
    """Per module, its shards' format where they agree, else q8 (which holds them all)."""
    shard_formats: dict[str, set[QuantFormat]] = defaultdict(set)
    for name, type_name in tensor_types.items():
        route = model.route_weight(name)
        if route is not None and route[1] == "weight":
            shard_formats[route[0]].add(_gguf_format(type_name))
    formats: dict[str, PlanFormat] = {}
    for path, module in model.named_modules():
        if isinstance(module, (Linear, VocabEmbedding, LMHead)) and path in shard_formats:
            kinds = shard_formats[path]
            formats[path] = next(iter(kinds)) if len(kinds) == 1 else "q8"
    return formats

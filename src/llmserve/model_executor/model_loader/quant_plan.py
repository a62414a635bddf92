"""Which block format each layer of a model gets, from `ModelConfig.quantization` and, for GGUF
files, the type each tensor has on disk.

    none   every layer stays float (the checkpoint's values in the model's dtype)
    int8   linear layers, embeddings and LM heads in q8 (blocks of 32 int8, one half scale each)
    int4   linear layers in q4 (blocks of 32 4-bit values, half scale and minimum); embeddings
           and LM heads in q8, as llama.cpp's Q4 mixes keep the output projection at 6-8 bits
    auto   a quantized GGUF file keeps its quantization family per layer: Q4_0 / Q4_1 / Q4_K
           tensors become q4, anything else (Q8_0, Q5_x, Q6_K, F16, ...) q8; a fused layer takes
           the wider format of its shards. Q8_0, Q4_x and Q5_x values are kept exactly (read
           from their blocks, gguf_quant.py), others are requantized from float. Float
           checkpoints (HF folders, F32/F16/BF16 GGUF files) stay float.

Quantized layers run on the CPU only (llmserve's C++ kernels, picked by CPU features).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from llmserve.layers.linear import Linear
from llmserve.layers.quantization import QuantizationPlan, cpu_kernels
from llmserve.layers.quantization.formats import QuantFormat
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.models import CausalLM

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _gguf_format(type_name: str) -> QuantFormat:
    return "q4" if type_name in _FOUR_BIT_TYPES else "q8"


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError, naming the value, for an explicit method this setup cannot run."""
    if method in ("none", "auto"):
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
    if method == "auto":
        usable = (
            device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and cpu_kernels.has_native_kernels()
        )
        if not usable or not tensor_types or not _is_quantized(tensor_types):
            return None
        return QuantizationPlan("auto", _formats_from_gguf(model, tensor_types))
    formats: dict[str, QuantFormat] = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            formats[path] = "q4" if method == "int4" else "q8"
        elif isinstance(module, (VocabEmbedding, LMHead)):
            formats[path] = "q8"
    return QuantizationPlan(method, formats)


def _is_quantized(tensor_types: dict[str, str]) -> bool:
    return any(t not in _FLOAT_TYPES for t in tensor_types.values())


def _formats_from_gguf(model: CausalLM, tensor_types: dict[str, str]) -> dict[str, QuantFormat]:
    """Per module, the wider of its shards' formats."""
    shard_formats: dict[str, set[QuantFormat]] = defaultdict(set)
    for name, type_name in tensor_types.items():
        route = model.route_weight(name)
        if route is not None and route[1] == "weight":
            shard_formats[route[0]].add(_gguf_format(type_name))
    formats: dict[str, QuantFormat] = {}
    for path, module in model.named_modules():
        if isinstance(module, (Linear, VocabEmbedding, LMHead)) and path in shard_formats:
            formats[path] = "q8" if "q8" in shard_formats[path] else "q4"
    return formats

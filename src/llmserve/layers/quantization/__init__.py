"""Weight quantization: which layer gets which format, and the swap of a freshly built model's
float layers for quantized ones before any weight is loaded.

    formats.py     q8 / q4 block formats: quantize, pack into tiles, unpack (torch reference)
    formats_q6.py  q6: GGUF Q6_K's own 6-bit super-blocks, packed and unpacked
    cpu_kernels.py the matmul and row lookup on llmserve's C++ kernels (or torch ops)
    layers.py      QuantizedLinear, QuantizedVocabEmbedding, QuantizedLMHead (CPU)
    fp8.py         Fp8Linear: e4m3 weights per channel, activations per token (torch._scaled_mm
                   on CUDA >= 8.9, a float32 reference path elsewhere)

A `QuantizationPlan` names a format per module path. The model loader builds it from the user's
choice and, for GGUF files, the type each tensor has on disk; `quantize_modules` then replaces the
model's layers. The float layers it drops were created with `torch.empty` and never written, so
their memory was never touched and no float copy of the weights is ever made.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from llmserve.layers.linear import Linear
from llmserve.layers.quantization.formats import QuantFormat
from llmserve.layers.quantization.fp8 import Fp8Linear
from llmserve.layers.quantization.layers import QuantizedLinear, QuantizedLMHead, QuantizedVocabEmbedding
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding

__all__ = [
    "Fp8Linear",
    "QuantizationPlan",
    "QuantizedLMHead",
    "QuantizedLinear",
    "QuantizedVocabEmbedding",
    "WeightGroup",
    "quantize_modules",
    "weight_groups",
]

PlanFormat = QuantFormat | Literal["fp8"]
_LINEAR_CLASSES: dict[str, type[QuantizedLinear] | type[Fp8Linear]] = {
    "q8": QuantizedLinear,
    "q4": QuantizedLinear,
    "q6": QuantizedLinear,
    "fp8": Fp8Linear,
}


@dataclass(frozen=True, slots=True)
class QuantizationPlan:
    """The block format of each weight-carrying module; modules not named stay float."""

    method: str
    """What the user asked for ("int8", "int4", "fp8", or "auto" resolved from a GGUF file)."""
    formats: dict[str, PlanFormat] = field(default_factory=dict)
    """Module path (as in `named_modules()`) -> format, for linear layers, embeddings and LM heads
    (fp8: linear layers only)."""
    kernel: str = ""
    """What runs the quantized matmuls when it is not llmserve's CPU kernels ("torch._scaled_mm",
    "float32 reference" for fp8); empty for q8 / q4."""

    def format_of(self, module_path: str) -> PlanFormat | None:
        return self.formats.get(module_path)


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)


def quantize_modules(model: nn.Module, plan: QuantizationPlan) -> None:
    """Replace every module `plan` names by its quantized counterpart (before loading weights).
    A tied LM head follows its embedding: quantized with it, as its format."""
    named = list(model.named_modules())
    embeddings: dict[int, QuantizedVocabEmbedding] = {}  # id(old float embedding) -> replacement
    dtype = torch.get_default_dtype()
    for path, module in named:
        fmt = plan.format_of(path)
        if fmt is None:
            continue
        if isinstance(module, Linear):
            new_linear = _LINEAR_CLASSES[fmt].like(module, fmt)  # type: ignore[arg-type]
            if isinstance(new_linear, QuantizedLinear):  # a GGUF file's own formats, shard by shard
                new_linear.keep_shard_formats = plan.method == "auto"
            _set_submodule(model, path, new_linear)
        elif isinstance(module, VocabEmbedding):
            new = QuantizedVocabEmbedding(module.vocab_size, module.hidden_size, fmt, dtype)
            embeddings[id(module)] = new
            _set_submodule(model, path, new)
    for path, module in named:
        if not isinstance(module, LMHead):
            continue
        tied = next(
            (e for p, e in named if isinstance(e, VocabEmbedding) and e.weight_t is module.weight_t), None
        )
        if module.tied_to:
            if tied is None or id(tied) not in embeddings:
                continue  # tied to a float embedding: stays float with it
            new_embedding = embeddings[id(tied)]
            _set_submodule(
                model,
                path,
                QuantizedLMHead(module.vocab_size, module.hidden_size, new_embedding.fmt, new_embedding),
            )
        elif (fmt := plan.format_of(path)) is not None:
            _set_submodule(model, path, QuantizedLMHead(module.vocab_size, module.hidden_size, fmt, None))


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """One line of the load report: a role, its storage format, and what it occupies."""

    role: str
    """attention, mlp, embedding, lm_head, other (norms, biases, positions)."""
    fmt: str
    """q8, q4, fp8 (e4m3 weights with their float32 scales), or a float dtype name."""
    num_tensors: int
    num_bytes: int

    def summary(self) -> str:
        return f"{self.role} {self.fmt} {self.num_bytes / 2**20:.1f} MiB"


def _role(path: str, module: nn.Module) -> str:
    if isinstance(module, (LMHead,)):
        return "lm_head"
    if isinstance(module, VocabEmbedding):
        return "embedding"
    if isinstance(module, Linear):
        return "mlp" if ".mlp." in f".{path}." else "attention"
    return "other"


def weight_groups(model: nn.Module) -> list[WeightGroup]:
    """Weight bytes by role and format, each tensor counted once (a tied table under embedding)."""
    seen: set[int] = set()
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(role: str, fmt: str, tensors: list[torch.Tensor]) -> None:
        fresh = [t for t in tensors if id(t) not in seen]
        seen.update(id(t) for t in fresh)
        if fresh:
            g = groups[(role, fmt)]
            g[0] += 1
            g[1] += sum(t.numel() * t.element_size() for t in fresh)

    for path, module in model.named_modules():
        role = _role(path, module)
        qweights = [w] if (w := getattr(module, "qweight", None)) is not None else []
        if isinstance(module, QuantizedLMHead):
            qweights = [module.packed_weight]
        elif isinstance(module, QuantizedLinear):
            qweights = module.packed_weights()
        for qweight in qweights:
            add(role, qweight.fmt, qweight.tensors())
        group_fmt = getattr(module, "weight_format", None)  # fp8: weight and scales, one group
        for name, p in module.named_parameters(recurse=False):
            if group_fmt is not None and name != "bias":
                add(role, group_fmt, [p])
            else:
                add(role if p.dim() > 1 else "other", str(p.dtype).removeprefix("torch."), [p])
    return [WeightGroup(role, fmt, n, b) for (role, fmt), (n, b) in groups.items()]

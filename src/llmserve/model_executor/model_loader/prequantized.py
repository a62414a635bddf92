"""Pre-quantized HF checkpoints (GPTQ, AWQ, FP8): which layers the tensors quantize, and the
stream of checkpoint tensors regrouped into one item per quantized layer for the model's
`load_weights`.

A quantized layer with checkpoint prefix P (e.g. `model.layers.0.self_attn.q_proj`) is stored as

    gptq   P.qweight  P.qzeros  P.scales  [P.g_idx]         [P.bias]
    awq    P.qweight  P.qzeros  P.scales                    [P.bias]
    fp8    P.weight (float8_e4m3fn)  P.weight_scale  [P.input_scale: not used]  [P.bias]

and reaches the model as one tensor named P.weight: q4 rows (`int4_checkpoint.py`; a fused layer
stages its shards as with GGUF blocks), an `Fp8Weight` (the checkpoint's bytes and scales), or,
for the `float` target, the format's own dequantization in the model's dtype. A layer is quantized
when its tensors are (P.qweight present, or P.weight stored in float8): the config's lists of
skipped modules need no parsing, and every other tensor loads as float.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.layers.linear import Linear
from llmserve.layers.quantization import PlanFormat, QuantizationPlan
from llmserve.layers.quantization.fp8 import FP8_DTYPE, Fp8Weight
from llmserve.layers.quantization.int4_checkpoint import awq_groups, gptq_groups
from llmserve.load_errors import ModelLoadError, WeightShapeError
from llmserve.model_executor.model_loader.hf_quant_config import CheckpointQuantization, Target
from llmserve.models import CausalLM

_REQUIRED: dict[str, tuple[str, ...]] = {
    "gptq": ("qweight", "qzeros", "scales"),
    "awq": ("qweight", "qzeros", "scales"),
    "fp8": ("weight", "weight_scale"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {"gptq": ("g_idx",), "awq": (), "fp8": ("input_scale",)}


def fp8_weight(prefix: str, weight: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    """An FP8 checkpoint's weight [N, K] and its scale: a scalar ([] or [1], per tensor) or one per
    output channel ([N] or [N, 1])."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ModelLoadError(
            f"{prefix}.weight: {weight.dtype} {list(weight.shape)}, expected a float8_e4m3fn matrix"
        )
    N = weight.shape[0]
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(N)
    elif s.numel() != N:
        raise WeightShapeError(f"{prefix}.weight_scale", (N, 1), tuple(scale.shape))
    return Fp8Weight(weight, s.contiguous())


@dataclass(frozen=True, slots=True)
class PrequantizedCheckpoint:
    """A checkpoint's quantization and its quantized layers (prefix -> the tensor names it has)."""

    quant: CheckpointQuantization
    layers: dict[str, frozenset[str]]

    @classmethod
    def scan(cls, quant: CheckpointQuantization, dtypes: dict[str, str]) -> PrequantizedCheckpoint:
        """From the checkpoint's tensor names and safetensors dtypes (headers only); raises for a
        layer that lacks a tensor its format needs, naming it."""
        method = quant.method
        if method == "fp8":
            if any(n.endswith(".weight_scale_inv") for n in dtypes):
                raise ValueError(
                    f"pre-quantized checkpoint ({quant.config_name}): its weight_scale_inv tensors are "
                    f"block-wise FP8 scales, which llmserve does not read (per-tensor and per-channel only)"
                )
            odd = sorted({t for t in dtypes.values() if t.startswith("F8") and t != "F8_E4M3"})
            if odd:
                raise ValueError(f"FP8 checkpoint with {', '.join(odd)} tensors: llmserve reads e4m3 only")
            prefixes = {
                n.removesuffix(".weight")
                for n, t in dtypes.items()
                if n.endswith(".weight") and t == "F8_E4M3"
            }
        else:
            prefixes = {n.removesuffix(".qweight") for n in dtypes if n.endswith(".qweight")}
        if not prefixes:
            what = "float8_e4m3fn weight" if method == "fp8" else "*.qweight"
            raise ModelLoadError(
                f"config.json's quantization_config says {quant.config_name}, but the checkpoint has no {what} tensor"
            )
        layers = {}
        for p in sorted(prefixes):
            known = (*_REQUIRED[method], *_OPTIONAL[method], "bias")
            have = frozenset(s for s in known if f"{p}.{s}" in dtypes)
            missing = [s for s in _REQUIRED[method] if s not in have]
            if missing:
                raise ModelLoadError(
                    f"pre-quantized checkpoint ({quant.config_name}) lacks tensor {p}.{missing[0]}"
                )
            layers[p] = have - {"bias"}
        return cls(quant, layers)

    def plan(self, target: Target, model: CausalLM, kernel: str = "") -> QuantizationPlan | None:
        """The quantized layers' modules in `target` (None: everything float). Only linear layers
        may be quantized, and a fused layer's shards all or none."""
        if target == "float":
            return None
        shards: dict[str, set[int]] = {}
        for prefix in self.layers:
            route = model.route_weight(f"{prefix}.weight")
            if route is None:
                continue
            if not _has(model, route[0]):
                continue  # load_weights names the tensor that has no place
            module = model.get_submodule(route[0])
            if not isinstance(module, Linear):
                raise ValueError(
                    f"{prefix}: quantized in the checkpoint, but llmserve reads pre-quantized linear "
                    f"layers only (this is {type(module).__name__})"
                )
            whole = prefix.rpartition(".")[2] == route[0].rpartition(".")[2]  # stored fused (Phi-3)
            shards.setdefault(route[0], set()).update(
                range(len(module.output_sizes)) if whole else {route[2]}
            )
        for path, got in shards.items():
            n = len(model.get_submodule(path).output_sizes)
            if len(got) != n:
                raise ValueError(
                    f"fused layer {path}: shards {sorted(set(range(n)) - got)} are float in the checkpoint "
                    f"while the others are quantized; llmserve fuses them into one matmul of one format"
                )
        formats: dict[str, PlanFormat] = dict.fromkeys(shards, target)
        return QuantizationPlan(f"{self.quant.describe()} -> {target}", formats, kernel=kernel)

    def weights(
        self, raw: Iterator[tuple[str, torch.Tensor, str]], target: Target, dtype: torch.dtype
    ) -> Iterator[tuple[str, Any, str]]:
        """The checkpoint's tensors as the model loads them: float ones in `dtype`, each quantized
        layer's tensors as one P.weight item once all of them have arrived."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor, file in raw:
            prefix, _, suffix = name.rpartition(".")
            wanted = self.layers.get(prefix)
            if wanted is None or suffix not in wanted:
                yield name, tensor.to(dtype), file
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if parts.keys() >= wanted - {"input_scale"}:
                del pending[prefix]
                yield f"{prefix}.weight", self._convert(prefix, parts, target, dtype), file

    def _convert(
        self, prefix: str, parts: dict[str, torch.Tensor], target: Target, dtype: torch.dtype
    ) -> Any:
        q = self.quant
        if q.method == "fp8":
            w = fp8_weight(prefix, parts["weight"], parts["weight_scale"])
            return w if target == "fp8" else w.dequantize().to(dtype)
        if q.method == "gptq":
            groups = gptq_groups(
                prefix, parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                q.group_size, q.zero_offset,
            )  # fmt: skip
        else:
            groups = awq_groups(prefix, parts["qweight"], parts["qzeros"], parts["scales"], q.group_size)
        return groups.dequantize().to(dtype) if target == "float" else groups.to_rows(target)  # type: ignore[arg-type]


def _has(model: torch.nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True

"""A pre-quantized HF checkpoint's `quantization_config` (config.json): which method, whether
llmserve reads it, and what its quantized layers become under `ModelConfig.quantization`.

    gptq                 bits 4, any group size that is a multiple of 32 or -1 (one group per
                         row), sym or not, desc_act (act-order) with g_idx; checkpoint_format
                         "gptq" (v1: zeros stored minus 1) or "gptq_v2"
    awq                  version gemm, bits 4, zero_point true, group size as GPTQ's
    fp8                  e4m3 weights with `weight_scale` per tensor or per output channel
                         (vLLM's / llm-compressor's "fp8"); weight_block_size is refused
    compressed-tensors   format float-quantized: every config group's weights 8-bit float with
                         strategy tensor or channel

Anything else is refused with a ValueError naming the method and the field. Which layers are
quantized is read from the tensors (`prequantized.py`), not from the config's lists of skipped
modules (`modules_to_not_convert`, `ignore`, `lm_head`), so those lists need no parsing.

Activations: llmserve's FP8 layers round every input to e4m3 per token with a dynamic scale
(`layers/quantization/fp8.py`); a checkpoint's static `input_scale`s are not used (a per-token
dynamic scale is never coarser than one per-tensor scale, and needs no clamping), and a
weight-only scheme (input_activations null) runs the same W8A8 arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from llmserve.layers.quantization import cpu_kernels

logger = logging.getLogger("llmserve")

CheckpointMethod = Literal["gptq", "awq", "fp8"]
Target = Literal["q4", "q8", "fp8", "float"]
"""What a checkpoint's quantized layers become: q4 / q8 blocks (CPU kernels), `Fp8Linear`, or
float weights dequantized at load."""


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """What `quantization_config` says, validated."""

    method: CheckpointMethod
    config_name: str
    """The quant_method as written ("gptq", "awq", "fp8", "compressed-tensors")."""
    group_size: int = -1
    """GPTQ / AWQ: input columns per group (-1: one group per row)."""
    desc_act: bool = False
    sym: bool = True
    zero_offset: int = 0
    """Added to every stored GPTQ zero point: 1 for AutoGPTQ's v1 format, 0 for v2 and AWQ."""

    def describe(self) -> str:
        """For the load report: "gptq (4-bit, group 128, act-order)"."""
        if self.method == "fp8":
            via = "" if self.config_name == "fp8" else f", {self.config_name}"
            return f"fp8 (e4m3{via})"
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = (", act-order" if self.desc_act else "") + ("" if self.sym else ", asymmetric")
        return f"{self.method} (4-bit, {group}{extra})"


def _field(qc: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    for k in keys:
        if k in qc and qc[k] is not None:
            return qc[k]
    return default


def _refuse(method: str, field: str, value: Any, supported: str) -> ValueError:
    return ValueError(
        f"pre-quantized checkpoint ({method}): {field} {value!r} is not supported; llmserve reads {supported}"
    )


def _group_size(method: str, qc: dict[str, Any], keys: tuple[str, ...]) -> int:
    bits = _field(qc, ("bits", "w_bit"), None)
    if bits != 4:
        raise _refuse(method, "bits", bits, "4-bit weights")
    group_size = _field(qc, keys, 128)
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % 32 == 0)):
        raise _refuse(method, "group_size", group_size, "group sizes that are multiples of 32, or -1")
    return group_size


def _gptq(qc: dict[str, Any]) -> CheckpointQuantization:
    group_size = _group_size("gptq", qc, ("group_size",))
    fmt = _field(qc, ("checkpoint_format", "format"), "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", "checkpoint_format", fmt, "'gptq' (v1) and 'gptq_v2'")
    if qc.get("dynamic"):
        raise _refuse("gptq", "dynamic", qc["dynamic"], "one bit width and group size for every layer")
    return CheckpointQuantization(
        "gptq",
        "gptq",
        group_size=group_size,
        desc_act=bool(qc.get("desc_act", False)),
        sym=bool(qc.get("sym", True)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _awq(qc: dict[str, Any]) -> CheckpointQuantization:
    group_size = _group_size("awq", qc, ("group_size", "q_group_size"))
    version = str(_field(qc, ("version",), "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", "version", version, "version 'gemm'")
    if qc.get("zero_point", True) is not True:
        raise _refuse("awq", "zero_point", qc["zero_point"], "zero_point true")
    return CheckpointQuantization("awq", "awq", group_size=group_size, sym=False)


def _fp8(qc: dict[str, Any]) -> CheckpointQuantization:
    if qc.get("weight_block_size") is not None:
        raise _refuse(
            "fp8", "weight_block_size", qc["weight_block_size"], "per-tensor and per-channel weight scales"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fp8", "fmt", fmt, "e4m3 weights")
    return CheckpointQuantization("fp8", "fp8")


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuantization:
    name = "compressed-tensors"
    for field in ("kv_cache_scheme", "sparsity_config"):
        if qc.get(field):
            raise _refuse(name, field, qc[field], "dense weights and a float KV cache")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse(name, "config_groups", groups, "at least one config group")
    for group_name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise _refuse(name, f"format (config group {group_name!r})", fmt, "'float-quantized' (FP8)")
        w = group.get("weights") or {}
        scheme = (w.get("type"), w.get("num_bits"), w.get("strategy"))
        if scheme[:2] != ("float", 8) or scheme[2] not in ("tensor", "channel"):
            raise _refuse(
                name,
                f"config_groups.{group_name}.weights (type, num_bits, strategy)",
                scheme,
                "('float', 8, 'tensor' or 'channel')",
            )
    return CheckpointQuantization("fp8", name)


_PARSERS: dict[str, Callable[[dict[str, Any]], CheckpointQuantization]] = {
    "gptq": _gptq,
    "awq": _awq,
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
}


_READ_BY_MODEL: dict[str, set[str]] = {"mxfp4": {"GptOssForCausalLM"}}
"""Methods whose tensors a model class dequantizes as it loads them (gpt-oss's MXFP4 experts:
models/gpt_oss.py), with float weights from then on (and `--quantization` applying to them)."""


def read_checkpoint_quantization(hf_config: Any) -> CheckpointQuantization | None:
    """The checkpoint's quantization, or None for a float checkpoint; ValueError for one that is
    quantized in a way llmserve does not read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "")).lower()
    archs = set(getattr(hf_config, "architectures", None) or [])
    if archs & _READ_BY_MODEL.get(method, set()):
        return None  # the model's load_weights dequantizes these tensors itself
    if method not in _PARSERS:
        raise ValueError(
            f"pre-quantized checkpoint: quant_method {method!r} is not supported; llmserve reads "
            f"{', '.join(_PARSERS)}"
        )
    return _PARSERS[method](qc)


def resolve_target(
    cq: CheckpointQuantization, asked: str, device: torch.device, dtype: torch.dtype
) -> Target:
    """What the checkpoint's quantized layers become. `auto` keeps the checkpoint's method where a
    kernel runs it (GPTQ / AWQ: q4 on the CPU kernels; fp8: `Fp8Linear`); `none` dequantizes to
    float; `int4` / `int8` take GPTQ / AWQ as q4 / q8 (q8 holds the codes exactly); asking for
    a method of the other family is refused, as vLLM refuses a mismatched `--quantization`."""
    if cq.method == "fp8":
        if asked in ("int8", "int4"):
            raise ValueError(
                f"quantization {asked!r} does not apply to this FP8 checkpoint ({cq.describe()}): use "
                f"'auto' or 'fp8' to run it in FP8, or 'none' for float weights"
            )
        if asked == "none":
            return "float"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"an FP8 checkpoint needs a float model dtype; dtype is {dtype}")
        return "fp8"
    if asked == "fp8":
        raise ValueError(
            f"quantization 'fp8' does not apply to this {cq.describe()} checkpoint: use 'auto' "
            f"(its 4-bit blocks), 'int8' or 'none'"
        )
    if asked == "none":
        return "float"
    kernels = cpu_kernels.has_native_kernels() or cpu_kernels.forced()
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernels:
        return "q8" if asked == "int8" else "q4"
    if asked in ("int8", "int4"):
        return "q8" if asked == "int8" else "q4"  # quant_plan.check_supported says why it cannot
    logger.warning(
        "%s checkpoint on %s (%s): llmserve's 4-bit kernels run on the CPU only (float32 or "
        "bfloat16, with its C++ kernels), so its weights are dequantized to %s at load: the "
        "checkpoint's values, at float's memory and speed",
        cq.describe(),
        device,
        str(dtype).removeprefix("torch."),
        str(dtype).removeprefix("torch."),
    )
    return "float"

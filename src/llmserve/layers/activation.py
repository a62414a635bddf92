"""Activations by their HF `hidden_act` names."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:  # CLIP's sigmoid approximation (Qwen2-VL's tower)
    return x * torch.sigmoid(1.702 * x)


# HF `hidden_act` names -> elementwise function.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
    "quick_gelu": _quick_gelu,
}


GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(gate, up) -> the gated MLP's inner activation, for MLPs whose gating is not act(gate) * up."""


def clamped_swiglu(alpha: float, limit: float) -> GatedActivation:
    """gpt-oss's gating: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))

    return glu


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


_GATED_KERNELS = {"silu": "silu_and_mul", "swish": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul",
                  "gelu_new": "gelu_tanh_and_mul", "gelu_fast": "gelu_tanh_and_mul"}  # fmt: skip


def fused_gated_name(name: str) -> str | None:
    """The Triton gated kernel for activation `name` ("silu_and_mul", "gelu_tanh_and_mul"), or None:
    the activations llmserve's Triton kernels compute (triton_ops.py's `gated_act`)."""
    return _GATED_KERNELS.get(name)


@functools.cache
def gpu_kernels() -> ModuleType | None:
    """The fused Triton kernels (layers/triton_ops.py) for tensors on CUDA, or None without triton."""
    try:
        from llmserve.layers import triton_ops
    except ImportError:
        return None
    return triton_ops


def gated_kernel(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """act(gate) * up over [..., 2I] = [gate | up] in one CUDA kernel, for activation `name`
    (None: no fused kernel for it, or no triton)."""
    kernels = gpu_kernels()
    fn = fused_gated_name(name)
    return None if kernels is None or fn is None else getattr(kernels, fn)

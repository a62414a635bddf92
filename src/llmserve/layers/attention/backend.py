"""The attention backend interface and its registry.

A backend turns (q, k, v) for a flat batch into attention outputs, writing the new K/V into the
paged cache and reading each sequence's context through its block table. The cache may hold K/V
in a narrower dtype than the model computes in (`kv_cache_dtype`): writes round, reads widen. The torch reference
backend runs anywhere; faster CPU and CUDA backends register under their own names, and "auto"
picks the fastest one available for a device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from llmserve.layers.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """The per-layer constants a backend needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    """Attend only to the last `sliding_window` positions (the current one included)."""


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        params: AttentionParams,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...

    def prepare(self, kv_cache_dtype: torch.dtype) -> None:
        """Called once the KV cache exists (its dtype may differ from the model's): compile or
        set up whatever the first forward would otherwise pay for."""
        ...


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(
    name: str,
) -> Callable[[Callable[[], AttentionBackend]], Callable[[], AttentionBackend]]:
    def wrap(factory: Callable[[], AttentionBackend]) -> Callable[[], AttentionBackend]:
        _BACKENDS[name] = factory
        return factory

    return wrap


def _register_builtin_backends() -> None:
    """Importing a backend's module registers it; "cpu" needs numba (a missing or broken numba
    leaves only "torch")."""
    from llmserve.layers.attention import torch_ref  # noqa: F401

    with contextlib.suppress(ImportError):
        from llmserve.layers.attention import cpu_paged  # noqa: F401


def get_attention_backend(name: str = "torch", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend registered as `name`; "auto" is "cpu" (the numba paged kernel) for a CPU
    `device` when numba imports, else "torch"."""
    _register_builtin_backends()
    if name == "auto":
        name = "cpu" if torch.device(device).type == "cpu" and "cpu" in _BACKENDS else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()

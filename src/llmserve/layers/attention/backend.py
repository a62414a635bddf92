"""The attention backend interface and its registry.

A backend turns (q, k, v) for a flat batch into attention outputs, writing the new K/V into the
paged cache and reading each sequence's context through its block table. The torch reference
backend runs anywhere; faster CPU and CUDA backends register under their own names.
"""

from __future__ import annotations

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
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(
    name: str,
) -> Callable[[Callable[[], AttentionBackend]], Callable[[], AttentionBackend]]:
    def wrap(factory: Callable[[], AttentionBackend]) -> Callable[[], AttentionBackend]:
        _BACKENDS[name] = factory
        return factory

    return wrap


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    # Importing the module registers the built-in backends.
    from llmserve.layers.attention import torch_ref  # noqa: F401

    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()

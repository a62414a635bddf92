"""The attention backend interface and its registry.

A backend turns (q, k, v) for a flat batch into attention outputs, writing the new K/V into the
paged cache and reading each sequence's context through its block table. The cache may hold K/V
in a narrower dtype than the model computes in (`kv_cache_dtype`): writes round, reads widen. The torch reference
backend runs anywhere; faster CPU and CUDA backends register under their own names, and "auto"
picks the fastest one available for a device.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmserve.layers.attention.metadata import AttentionMetadata, KVCacheSpec, KVDtypes, LayerKVCache


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """The per-layer constants a backend needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    """Attend only to the last `sliding_window` positions (the current one included)."""
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """[num_heads] learned sink logits (gpt-oss): one more term exp(sink) in each query's softmax
    denominator, a key with no value, so a head can attend to nothing. Not part of the geometry:
    layers that differ only in their sinks share their per-forward metadata."""
    softcap: float | None = None
    """Gemma 2's attention logit soft cap c: scores become c * tanh(scale * q.k / c) (None: none)."""


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        params: AttentionParams,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: LayerKVCache,  # [2, num_kv_heads, num_blocks, block_size, head_dim] or a KVPair
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...

    def prepare(self, kv_cache_dtype: torch.dtype | KVDtypes) -> None:
        """Called once the KV cache exists (its dtype may differ from the model's, and V's from
        K's): compile or set up whatever the first forward would otherwise pay for; raise
        ValueError for a cache this backend cannot take."""
        ...

    def build_metadata(
        self, metadata: AttentionMetadata, layers: Sequence[AttentionParams], spec: KVCacheSpec
    ) -> None:
        """Called by the runner before each forward with every distinct layer geometry: compute
        the values all layers share (indices, masks, work splits) into `metadata.derived` now,
        so that no layer builds them lazily inside the forward."""
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
    leaves only "torch"); "triton" registers without triton and imports it when created."""
    from llmserve.layers.attention import torch_ref, triton_backend  # noqa: F401

    with contextlib.suppress(ImportError):
        from llmserve.layers.attention import cpu_paged  # noqa: F401


def _auto_backend(device: torch.device) -> str:
    """The fastest backend for `device`: "cpu" (the numba paged kernel) on the CPU, "triton" on
    CUDA where triton is installed (every CUDA build of torch brings it), else "torch"."""
    if device.type == "cpu" and "cpu" in _BACKENDS:
        return "cpu"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def get_attention_backend(name: str = "torch", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend registered as `name`, or for "auto" the fastest one for `device`."""
    _register_builtin_backends()
    if name == "auto":
        name = _auto_backend(torch.device(device))
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()

"""How many KV blocks an engine gets: the user's bytes or blocks, else on the CPU a default that
follows the model's context and `max_num_seqs` (config/cache.py), else on a GPU what is left after a
profiling forward; an encoder's blocks are bookkeeping only. `KVCacheInfo` is what start-up found
and the load report prints."""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmserve.config import CacheConfig
from llmserve.config.cache import default_kv_cache_memory
from llmserve.layers.attention import KVCacheSpec, KVDtypes
from llmserve.model_executor.model_loader import LoadedModel


@dataclass(frozen=True, slots=True)
class KVCacheInfo:
    """What start-up found out about the KV cache (discovered values, not configuration)."""

    bytes_per_token: int
    num_blocks: int
    block_size: int
    max_model_len: int
    dtype: str = "float32"
    sized_by: str = ""
    """Why the cache has this size (the option given, or the default's reasoning)."""
    draft_bytes_per_token: int = 0
    """A draft model's KV bytes per token: its cache holds as many blocks, from the same budget."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests that fit at once if each used the full context."""
        return self.num_tokens / self.max_model_len

    def summary(self) -> str:
        if self.bytes_per_token == 0:
            return f"no KV cache ({self.sized_by}); max_model_len {self.max_model_len}"
        draft = (
            f" + {self.draft_bytes_per_token / 1024:.1f} KiB for the draft model"
            if self.draft_bytes_per_token
            else ""
        )
        total = self.bytes_per_token + self.draft_bytes_per_token
        return (
            f"KV cache ({self.dtype}): {self.bytes_per_token / 1024:.1f} KiB per token{draft}, {self.num_blocks} "
            f"blocks of {self.block_size} tokens = {self.num_tokens} tokens "
            f"({self.num_tokens * total / 2**30:.2f} GiB); "
            f"max concurrency at full context ({self.max_model_len} tokens): {self.max_concurrency:.2f}x"
            + (f" ({self.sized_by})" if self.sized_by else "")
        )


def size_kv_cache(
    loaded: LoadedModel, cache: CacheConfig, max_num_seqs: int, max_model_len: int, kv_dtype: KVDtypes,
    max_num_tokens: int, draft: LoadedModel | None = None,
) -> KVCacheInfo:  # fmt: skip
    """The KV cache's blocks: the user's bytes or blocks, else the CPU default or what the GPU has
    left after a profiling forward of `max_num_tokens` tokens. A `draft` model keeps as many blocks
    of its own: a budget in bytes pays for both caches."""
    bytes_per_token = kv_bytes_per_token(loaded, kv_dtype)
    draft_bytes = 0 if draft is None else kv_bytes_per_token(draft, kv_dtype)
    both = bytes_per_token + draft_bytes
    if cache.sized_by_user:  # the user's bytes or blocks
        budget, why = None, "num_kv_blocks" if cache.num_kv_blocks else "kv_cache_memory"
    elif loaded.profile.is_cpu:
        budget, why = default_kv_cache_memory(
            both, max_num_seqs, max_model_len, cache.block_size, physical_memory()
        )
    else:
        from llmserve.model_executor.gpu_memory import measure_kv_budget

        budget = measure_kv_budget(
            loaded.model,
            kv_dtype,
            cache.block_size,
            max_num_tokens,
            max_num_seqs,
            cache.gpu_memory_utilization,
        )
        why = f"gpu_memory_utilization {cache.gpu_memory_utilization}"
    return KVCacheInfo(
        bytes_per_token,
        cache.num_blocks(both, budget),
        cache.block_size,
        max_model_len,
        kv_dtype.name,  # "int8,float16" when K and V differ
        why,
        draft_bytes,
    )


def kv_bytes_per_token(loaded: LoadedModel, kv_dtype: KVDtypes) -> int:
    """A model's KV cache bytes per token, all layers."""
    shape = loaded.model.kv_cache_shape()
    return (
        shape.num_layers
        * KVCacheSpec.build(1, 1, shape.num_kv_heads, shape.head_dim, kv_dtype).bytes_per_token()
    )


def encoder_blocks(cache: CacheConfig, max_num_seqs: int, max_model_len: int) -> KVCacheInfo:
    """An encoder keeps no cache: the scheduler's blocks are bookkeeping only, enough for
    `max_num_seqs` sequences at full length, so only `max_num_seqs` and the step's token budget
    limit a batch (encoder_runner.py)."""
    num_blocks = max_num_seqs * -(-max_model_len // cache.block_size)
    return KVCacheInfo(0, num_blocks, cache.block_size, max_model_len, "none", "an encoder-only model")


def physical_memory() -> int:
    """Bytes of RAM on this machine (the KV default's cap); 16 GiB where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30

"""Attention over a paged KV cache, behind one interface.

The model hands each attention layer a flat batch of tokens from many sequences plus an
`AttentionMetadata`; the backend writes the new K/V into the cache at `slot_mapping` and reads
each sequence's context back through its `block_table`. Backends are chosen from a registry.
"""

from llmserve.layers.attention.backend import (
    AttentionBackend,
    get_attention_backend,
    register_attention_backend,
)
from llmserve.layers.attention.layer import Attention
from llmserve.layers.attention.metadata import AttentionMetadata, KVCacheSpec, KVDtypes, KVPair, LayerKVCache

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCacheSpec",
    "KVDtypes",
    "KVPair",
    "LayerKVCache",
    "get_attention_backend",
    "register_attention_backend",
]

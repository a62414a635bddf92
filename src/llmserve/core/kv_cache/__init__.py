"""Paged KV-cache bookkeeping: blocks, their reference counts, prefix-cache hashes, per-request block tables."""

from llmserve.core.kv_cache.block_hash import BlockHash, hash_block_tokens, request_block_hashes
from llmserve.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from llmserve.core.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
    "request_block_hashes",
]

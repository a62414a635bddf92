"""`BlockPool`: every KV block of the cache, its reference count, the free queue and the prefix-cache map.

A block is in exactly one of three states:

    in use           ref_cnt > 0                      held by one or more requests' block tables
    free, cached     ref_cnt == 0, block_hash set     in the free queue AND findable by hash
    free, empty      ref_cnt == 0, block_hash None    in the free queue only

Free blocks (cached or not) sit in one doubly linked queue, least recently freed at the head:

    head <-> [b7] <-> [b2] <-> [b9] <-> ... <-> [b4] <-> tail      (head/tail are sentinels)
             ^ evicted first by get_new_blocks     ^ freed last, evicted last

A prefix-cache hit on a free cached block pulls it out of the middle of the queue (`touch`), which is
why the queue is a linked list with O(1) removal rather than a deque. Taking a block for new tokens
pops the head and evicts whatever hash it still carried.

Invariant kept by every method: `block.block_hash is not None` <=> `cached[block.block_hash] is block`.

This module knows nothing of requests or tokens; `KVCacheManager` maps requests to blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from llmserve.core.kv_cache.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of `block_size` KV slots. Compared by identity (`eq=False`)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    """Hash of the full block this holds, while it is registered in the prefix cache."""
    # Free-queue links; both None while the block is not in the queue. Left out of repr so that
    # printing a block does not walk (and recurse through) the whole list.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked queue of free blocks with O(1) append, popleft and removal from the middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels spare every operation the empty / first / last special cases.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail: it will be evicted after every block already in the queue."""
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} queued twice"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail (eviction order). For tests and debugging: O(free blocks)."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): all of them can be handed out by get_new_blocks."""
        return self.free_block_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as unused)."""
        return (self.num_blocks - self.get_num_free_blocks()) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue (LRU), evicting their hashes; ref_cnt = 1."""
        assert 0 <= n <= self.get_num_free_blocks(), (
            f"asked for {n} blocks, {self.get_num_free_blocks()} free"
        )
        blocks = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under this hash (in use or free), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the queue tail in this order.

        Callers pass the order they want blocks evicted in (earliest evicted first). A free block
        keeps its hash, so a later request can still hit it until it is evicted.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, in-use block under its hash so later requests can share it.

        If another block already holds this hash (two requests computed the same tokens at once),
        the first one stays registered and this duplicate simply stays uncached: overwriting the
        entry would orphan the first block's hash, and both hold identical K/V anyway.
        """
        if not self.enable_caching:
            return
        assert block.ref_cnt > 0, "only a block some request holds can be registered"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"block {block.block_id} re-registered under another hash"
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, since requests
        then still hold blocks registered under hashes. O(pool): an admin operation, not a hot path."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a block's hash before its slots are reused for other tokens."""
        if block.block_hash is None:
            return
        removed = self.cached_block_hash_to_block.pop(block.block_hash, None)
        assert removed is block, f"hash map entry of block {block.block_id} points elsewhere"
        block.block_hash = None

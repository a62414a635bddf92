"""`KVCacheManager`: each request's block table, prefix-cache lookups, and the accounting the scheduler needs.

A request's tokens live in its block table, `block_size` slots per block:

    tokens     | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  . |
    table      |  block 12   |  block 3    |  block 40  |      (block_size = 4)
               full, hashed   full, hashed   partial: not shareable yet

Full blocks are registered in the prefix cache under their chained hash (`block_hash.py`), so a later
request with the same prefix (or a sibling sample of an n > 1 prompt) reuses them instead of
recomputing. The manager owns the request -> blocks mapping; `BlockPool` owns the blocks themselves
(ref counts, free queue, hash map). It knows nothing of scheduling policy, devices or the model.

Contract with the scheduler and runner: full blocks are registered at `allocate_slots` time, before
the forward pass writes them. This is safe because (1) a request is not freed in the step it was
allocated in, and (2) the runner writes every scheduled token's K/V of a layer before that layer's
attention reads, so a request sharing a block in the same step sees it written.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.core.kv_cache.block_hash import request_block_hashes
from llmserve.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmserve.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the manager was created, in tokens (requests: lookups made)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class _BlockTable:
    request: Request
    blocks: list[KVCacheBlock]
    num_registered_blocks: int = 0
    """Leading full blocks already offered to the prefix cache (registered, or found there)."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0; got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._tables: dict[str, _BlockTable] = {}

    # ---- prefix cache -------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached run of the request's full blocks, as (block ids, tokens they hold).

        For a request scheduled from scratch (a new one, or a preempted one resumed with its outputs).
        The hit stops one token short of the whole sequence: the last token must still run through
        the model to produce logits. No references are taken: pass the ids to `allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        assert request.num_computed_tokens == 0 and request.request_id not in self._tables, (
            f"request {request.request_id} already has KV; prefix lookup is for first scheduling only"
        )
        hashes = request_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # chained hashes: nothing after a miss can hit
            block_ids.append(block.block_id)
        # Stats are recorded by allocate_slots when the request is admitted: a request that waits
        # is looked up again every step and must not count as a new query each time.
        return block_ids, len(block_ids) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (nothing done) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ---------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: list[int] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to hold computed + new computed (cached) + `num_new_tokens` tokens.

        1. Check that the pool can provide the missing blocks; if not, return None, changing nothing.
        2. Take references on the prefix-cache hits and append them (first scheduling only).
        3. Take fresh blocks from the free queue for the rest.
        4. Register every block that is full after this step in the prefix cache.
        Returns the ids of the blocks added to the table, cached hits first.
        """
        assert num_new_tokens >= 0
        table = self._tables.get(request.request_id)
        if table is not None and not new_computed_block_ids:
            # the common decode step: the held blocks already have room
            num_total_tokens = request.num_computed_tokens + num_new_tokens
            if num_total_tokens <= len(table.blocks) * self.block_size:
                if self.enable_caching:
                    self._register_full_blocks(table, min(num_total_tokens, request.num_tokens))
                return []
        computed_ids = new_computed_block_ids or []
        assert num_new_computed_tokens == len(computed_ids) * self.block_size
        num_held = len(table.blocks) if table is not None else 0
        assert table is not None or request.num_computed_tokens == 0, (
            f"request {request.request_id} has computed tokens but no blocks (not reset on preemption?)"
        )
        assert not computed_ids or num_held == 0, "cached prefix blocks only at first scheduling"
        computed = [self.block_pool.blocks[i] for i in computed_ids]
        if computed:
            # The ids came from get_computed_blocks; nothing may have evicted them since.
            hashes = request.block_hashes[: len(computed)]
            assert len(hashes) == len(computed), "prefix hit ids not from get_computed_blocks"
            assert all(b.block_hash == h for b, h in zip(computed, hashes, strict=True)), "stale prefix hit"

        # 1. Capacity. Hits that sit free in the queue are counted as free blocks but stop being
        #    free once touched, so they cannot also serve as fresh blocks.
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(0, num_required - num_held - len(computed))
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if table is None:
            table = self._tables[request.request_id] = _BlockTable(request, [])
            if self.enable_caching:  # first scheduling: one prefix-cache query
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_new_computed_tokens
        # 2-3. Touch hits before popping new blocks, so a free hit cannot be evicted and reused here.
        self.block_pool.touch(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        table.blocks.extend(computed)
        table.blocks.extend(new_blocks)

        # 4. Only tokens that exist can be hashed (a lookahead slot past num_tokens has none yet).
        if self.enable_caching:
            self._register_full_blocks(table, min(num_total_tokens, request.num_tokens))
        return [b.block_id for b in computed] + [b.block_id for b in new_blocks]

    def _register_full_blocks(self, table: _BlockTable, num_tokens: int) -> None:
        """Offer the table's blocks that `num_tokens` fills, and that were not offered yet, to the cache."""
        num_full = num_tokens // self.block_size
        if num_full <= table.num_registered_blocks:
            return
        hashes = request_block_hashes(table.request, self.block_size)
        for i in range(table.num_registered_blocks, num_full):
            # A prefix hit already carries this hash; cache_full_block checks and keeps it.
            self.block_pool.cache_full_block(table.blocks[i], hashes[i])
        table.num_registered_blocks = num_full

    def free(self, request: Request) -> None:
        """Release all the request's blocks and forget its table (finish, abort or preemption).

        Blocks are released tail first, so the request's last blocks are evicted before its prefix
        blocks: the prefix is the part other requests are likeliest to share. Freeing a request that
        holds no table (never allocated, or already freed) does nothing; the table is popped before
        any reference is dropped, so a block can never be released twice on its behalf.
        """
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        assert table.request is request, f"two live requests share the id {request.request_id}"
        self.block_pool.free_blocks(reversed(table.blocks))

    # ---- queries ------------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids ([] if it holds none)."""
        table = self._tables.get(request_id)
        return [b.block_id for b in table.blocks] if table is not None else []

    def num_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks the request needs to hold `num_tokens` tokens in total (prefix hits ignored)."""
        table = self._tables.get(request.request_id)
        num_held = len(table.blocks) if table is not None else 0
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.block_pool.usage()

    def waste(self) -> tuple[int, int]:
        """(KV slots in live requests' tables, tokens they store = sum of num_computed_tokens).

        Per request: a block shared by two requests counts for each, as do its tokens, so
        `1 - stored / allocated` measures the unfilled tail slots (internal fragmentation).
        O(live requests): for periodic stats, not per token.
        """
        allocated = sum(len(t.blocks) for t in self._tables.values()) * self.block_size
        stored = sum(t.request.num_computed_tokens for t in self._tables.values())
        return allocated, stored

"""KV-cache bookkeeping: block hashes, the free queue, BlockPool and KVCacheManager, case by case.

The random-operation property test lives in test_kv_cache_property.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmserve.core.kv_cache import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    hash_block_tokens,
    request_block_hashes,
)
from llmserve.core.request import Request
from llmserve.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(request_id: str, prompt: list[int], output: list[int] | None = None) -> Request:
    return Request(request_id, list(prompt), SamplingParams(), output_token_ids=list(output or []))


def schedule(mgr: KVCacheManager, req: Request) -> list[int] | None:
    """Schedule a request from scratch like the scheduler: prefix lookup, then its whole remainder."""
    ids, num_cached = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_cached, ids, num_cached)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return new


# ---- block hashes ----------------------------------------------------------------------------


def test_hash_chains_in_the_prefix():
    a0 = hash_block_tokens(None, [1, 2, 3, 4])
    b0 = hash_block_tokens(None, [9, 2, 3, 4])
    # Same tokens in block 1, different block 0 -> different block-1 hash.
    assert hash_block_tokens(a0, [5, 6, 7, 8]) != hash_block_tokens(b0, [5, 6, 7, 8])
    assert hash_block_tokens(a0, [5, 6, 7, 8]) == hash_block_tokens(a0, [5, 6, 7, 8])
    # No parent is not the same as parent 0; extra keys separate otherwise equal blocks.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(0, [1, 2])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], ("lora-a",))
    assert 0 <= a0 < 2**64


def test_hash_is_the_same_in_another_process():
    code = (
        "from llmserve.core.kv_cache import hash_block_tokens as h; print(h(h(None, [1, 2]), [3], ('x', 1)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3], ("x", 1))


def test_request_block_hashes_covers_full_blocks_incrementally():
    req = make_request("r", list(range(10)))  # 2 full blocks + 2 tokens
    hashes = request_block_hashes(req, BS)
    assert hashes is req.block_hashes and len(hashes) == 2
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    req.output_token_ids += [10, 11]  # the third block fills across prompt and output
    assert request_block_hashes(req, BS)[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])
    assert len(req.block_hashes) == 3


# ---- free queue and pool ---------------------------------------------------------------------


def test_free_queue_removes_from_the_middle_and_pops_in_order():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 2]
    assert q.popleft() is blocks[0] and len(q) == 3
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    with pytest.raises(AssertionError):
        q.remove(blocks[0])  # not queued


def test_pool_evicts_hash_when_a_cached_free_block_is_reused():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 111)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(111) is a and pool.get_num_free_blocks() == 2
    (c,) = pool.get_new_blocks(1)  # LRU: a was freed first
    assert c is a and a.block_hash is None and pool.get_cached_block(111) is None
    with pytest.raises(AssertionError):
        pool.free_blocks([b])  # b is already free: double free


def test_duplicate_registration_keeps_the_first_block():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 7)
    pool.cache_full_block(b, 7)  # same tokens computed concurrently by another request
    assert pool.get_cached_block(7) is a and b.block_hash is None
    pool.free_blocks([a, b])
    pool.get_new_blocks(1)  # evicts a
    assert pool.get_cached_block(7) is None and pool.cached_block_hash_to_block == {}


# ---- manager ---------------------------------------------------------------------------------


def test_allocate_and_free_counts():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("r", list(range(9)))  # 3 blocks
    assert mgr.num_blocks_needed(req, 9) == 3
    assert schedule(mgr, req) == [0, 1, 2]
    assert mgr.get_num_free_blocks() == 7 and mgr.usage() == pytest.approx(0.3)
    # Decode within the last block needs nothing new; the 13th token needs a 4th block.
    req.output_token_ids += [100, 101, 102]
    assert mgr.allocate_slots(req, 3) == []
    req.num_computed_tokens = 12
    req.output_token_ids.append(103)
    assert mgr.num_blocks_needed(req, 13) == 1
    assert mgr.allocate_slots(req, 1) == [3]
    assert mgr.get_block_ids("r") == [0, 1, 2, 3]
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 10 and mgr.get_block_ids("r") == []


def test_prefix_hit_reuses_exactly_the_shared_full_blocks():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    schedule(mgr, a)
    mgr.free(a)
    # Shares the first block and a half; only the first (full) block can be reused.
    b = make_request("b", [1, 2, 3, 4, 5, 6, 0, 0, 0])
    ids, num_cached = mgr.get_computed_blocks(b)
    assert (ids, num_cached) == ([0], 4)
    assert mgr.get_computed_blocks(b) == (ids, num_cached)  # looking again (still waiting) ...
    assert mgr.prefix_cache_stats.queries == 10  # ... counts nothing until b is admitted
    # The hit comes first; fresh blocks come from the never-used head of the queue, not a's tail.
    assert mgr.allocate_slots(b, 5, ids, num_cached) == [0, 3, 4]
    assert mgr.prefix_cache_stats.queries == 10 + 9 and mgr.prefix_cache_stats.hits == 4
    assert mgr.prefix_cache_stats.requests == 2
    assert mgr.block_pool.blocks[0].ref_cnt == 1


def test_hit_never_covers_the_whole_sequence():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(8)))  # exactly two full blocks
    schedule(mgr, a)
    mgr.free(a)
    b = make_request("b", list(range(8)))
    assert mgr.get_computed_blocks(b) == ([0], 4)  # the last token must still be computed
    c = make_request("c", list(range(9)))
    assert mgr.get_computed_blocks(c) == ([0, 1], 8)


def test_resumed_preempted_request_hits_its_own_output_blocks():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("r", [1, 2, 3, 4, 5, 6])
    schedule(mgr, req)
    req.output_token_ids += [7, 8, 9]  # decoded; block 1 [5, 6, 7, 8] filled by outputs
    mgr.allocate_slots(req, 3)
    req.num_computed_tokens = 9
    table = mgr.get_block_ids("r")
    mgr.free(req)  # preempted
    req.num_computed_tokens = 0
    assert mgr.get_computed_blocks(req) == (table[:2], 8)


def test_lru_eviction_order_tail_blocks_first():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(12)))  # blocks 0, 1, 2, all full and cached
    b = make_request("b", list(range(100, 108)))  # blocks 3, 4
    schedule(mgr, a)
    schedule(mgr, b)
    mgr.free(a)  # queue: 5 | 2 1 0   (never-used block first, then a's tail first)
    mgr.free(b)  # queue: 5 2 1 0 | 4 3
    assert [blk.block_id for blk in mgr.block_pool.free_block_queue] == [5, 2, 1, 0, 4, 3]
    c = make_request("c", list(range(200, 211)))  # needs 3 blocks: takes 5, then a's tail 2 and 1
    assert schedule(mgr, c) == [5, 2, 1]
    # a's prefix block 0 survives (and b's blocks); a's evicted blocks are no longer findable.
    again = make_request("a2", list(range(12)))
    assert mgr.get_computed_blocks(again) == ([0], 4)
    assert mgr.get_computed_blocks(make_request("b2", list(range(100, 109)))) == ([3, 4], 8)


def test_failed_allocation_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    mgr.free(a)  # blocks 1, 0 free and cached; 2, 3 never used
    b = make_request("b", [*range(8), 50, 51, 52, 53, 54, 55, 56, 57, 58])
    ids, num_cached = mgr.get_computed_blocks(b)
    assert (ids, num_cached) == ([0, 1], 8)
    # b needs 5 blocks: 2 hits + 3 fresh, but only 2 free blocks are left once the hits are touched.
    before = [(blk.ref_cnt, blk.block_hash) for blk in mgr.block_pool.blocks]
    queue = [blk.block_id for blk in mgr.block_pool.free_block_queue]
    assert mgr.allocate_slots(b, 9, ids, num_cached) is None
    assert [(blk.ref_cnt, blk.block_hash) for blk in mgr.block_pool.blocks] == before
    assert [blk.block_id for blk in mgr.block_pool.free_block_queue] == queue
    assert mgr.get_block_ids("b") == [] and mgr.get_num_free_blocks() == 4
    # With one token fewer it fits exactly (2 hits + 2 fresh blocks).
    c = make_request("c", b.prompt_token_ids[:-1])
    ids, num_cached = mgr.get_computed_blocks(c)
    assert mgr.allocate_slots(c, 8, ids, num_cached) == [0, 1, 2, 3]


def test_same_prompt_shares_full_blocks_n_greater_than_one():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    first = make_request("p-0", prompt)
    schedule(mgr, first)
    second = make_request("p-1", prompt)  # a sibling sample scheduled in a later step
    new = schedule(mgr, second)
    assert new is not None
    shared = mgr.get_block_ids("p-0")[:2]
    assert mgr.get_block_ids("p-1")[:2] == shared
    assert [mgr.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    # The partial last block is private: each sample writes its own continuation there.
    assert mgr.get_block_ids("p-0")[2] != mgr.get_block_ids("p-1")[2]
    mgr.free(first)
    assert [mgr.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert mgr.get_num_free_blocks() == 10 - 3
    mgr.free(second)
    assert mgr.get_num_free_blocks() == 10


def test_concurrent_identical_blocks_do_not_corrupt_the_map():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = make_request("a", list(range(6))), make_request("b", list(range(6)))
    # Both looked up before either allocated (same step): neither hits, both compute block 0.
    lookups = [mgr.get_computed_blocks(a), mgr.get_computed_blocks(b)]
    assert lookups == [([], 0), ([], 0)]
    mgr.allocate_slots(a, 6)
    mgr.allocate_slots(b, 6)
    a0, b0 = mgr.get_block_ids("a")[0], mgr.get_block_ids("b")[0]
    assert mgr.block_pool.get_cached_block(a.block_hashes[0]).block_id == a0
    assert mgr.block_pool.blocks[b0].block_hash is None


def test_free_unknown_or_twice_is_a_no_op():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    req = make_request("r", list(range(5)))
    mgr.free(req)  # never allocated (aborted while waiting)
    schedule(mgr, req)
    mgr.free(req)
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 4
    assert all(blk.ref_cnt == 0 for blk in mgr.block_pool.blocks)


def test_caching_disabled():
    mgr = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    assert schedule(mgr, a) == [0, 1, 2]
    mgr.free(a)
    b = make_request("b", list(range(9)))
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert a.block_hashes == [] and mgr.prefix_cache_stats.queries == 0


def test_waste_counts_allocated_slots_against_stored_tokens():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(50, 59)))
    schedule(mgr, a)  # 2 blocks, 5 tokens
    schedule(mgr, b)  # 3 blocks, 9 tokens
    assert mgr.waste() == (20, 14)
    mgr.free(a)
    assert mgr.waste() == (12, 9)


def test_reset_prefix_cache_only_when_idle():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=4)


def test_hit_stops_at_the_first_miss():
    """A later block can outlive its parent in the cache; it must not be hit without it."""
    mgr = KVCacheManager(num_blocks=5, block_size=BS)
    x = make_request("x", [0, 1, 2, 3])
    schedule(mgr, x)  # block 0 registered under h0
    y = make_request("y", [0, 1, 2, 3])
    schedule(mgr, y)  # the cap forbids the hit: y computes a duplicate of block 0, not registered
    y.output_token_ids += [5, 6, 7, 8]
    mgr.allocate_slots(y, 4)  # y's block 1 registered under h1 = H(h0, ...)
    y.num_computed_tokens = 8
    mgr.free(x)
    schedule(mgr, make_request("w", list(range(100, 112))))  # takes every free block: evicts h0
    assert mgr.block_pool.get_cached_block(y.block_hashes[0]) is None
    assert mgr.block_pool.get_cached_block(y.block_hashes[1]) is not None
    assert mgr.get_computed_blocks(make_request("z", [0, 1, 2, 3, 5, 6, 7, 8, 9])) == ([], 0)


def test_slots_past_the_known_tokens_are_not_hashed():
    mgr = KVCacheManager(num_blocks=5, block_size=BS)
    req = make_request("r", list(range(6)))
    # Reserve room for 4 tokens not sampled yet (lookahead): only the one full known block is cached.
    assert mgr.allocate_slots(req, 10) == [0, 1, 2]
    assert [blk.block_hash is not None for blk in mgr.block_pool.blocks[:3]] == [True, False, False]


def test_free_hit_at_the_queue_head_is_not_handed_out_as_a_fresh_block():
    mgr = KVCacheManager(num_blocks=2, block_size=BS)
    a, c = make_request("a", [0, 1, 2, 3]), make_request("c", [7, 7, 7, 7])
    schedule(mgr, a)
    schedule(mgr, c)
    mgr.free(a)
    mgr.free(c)  # queue: 0 (a's cached block, evicted next) | 1
    b = make_request("b", [0, 1, 2, 3, 9])
    ids, num_cached = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 1, ids, num_cached) == [0, 1]
    assert mgr.block_pool.blocks[0].ref_cnt == 1 and mgr.get_num_free_blocks() == 0

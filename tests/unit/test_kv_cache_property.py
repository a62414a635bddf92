"""KVCacheManager under random add / schedule / decode / finish / abort / preempt sequences.

A toy scheduler drives the manager, and a fake KV store stands in for the runner: writing position p
of a request stores the whole token prefix [0, p] in that slot (K/V depend on every earlier token).
After every step the bookkeeping invariants are checked, and every running request reads its
computed prefix back through its block table: a wrong prefix hit, a block shared by mistake or a
block reused while still held would all show up as a wrong slot.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmserve.core.kv_cache import KVCacheManager, hash_block_tokens
from llmserve.core.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams

TOKENS = st.integers(0, 2)  # a tiny alphabet, so prompts and their prefixes collide often
# Prompts start with one of a few shared "system prompts" (or none), so that prefix hits are common.
PROMPTS = st.builds(
    lambda prefix, suffix: prefix + suffix,
    st.sampled_from([[], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0]]),
    st.lists(TOKENS, max_size=8),
).filter(bool)
MAX_TOKENS = 20  # a request stops decoding here, so the pool stays under pressure without growing


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 12),
        block_size=st.integers(1, 4),
        enable_caching=st.sampled_from([True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, enable_caching)
        self.bs = block_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block id, slot) -> token prefix
        self.next_id = 0

    # ---- the toy scheduler --------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        pool = self.mgr.block_pool
        return (
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            dict(pool.cached_block_hash_to_block),
            {r.request_id: self.mgr.get_block_ids(r.request_id) for r in self.running + self.waiting},
        )

    def _run(self, req: Request, start: int, num_new: int, token: int) -> None:
        """The forward pass: write positions [start, start + num_new), sample when the end is reached."""
        table = self.mgr.get_block_ids(req.request_id)
        tokens = req.all_token_ids
        for pos in range(start, start + num_new):
            block_id = table[pos // self.bs]
            # Writing into a block another request also holds would change that request's K/V.
            assert self.mgr.block_pool.blocks[block_id].ref_cnt == 1, "write into a shared block"
            self.kv[(block_id, pos % self.bs)] = tuple(tokens[: pos + 1])
        req.num_computed_tokens = start + num_new
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(token)

    def _preempt(self, req: Request) -> None:
        self.mgr.free(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.append(req)

    @rule(prompt=PROMPTS, n=st.integers(1, 2))
    def add(self, prompt: list[int], n: int) -> None:
        for _ in range(n):  # n > 1: sibling samples of one prompt
            self.waiting.append(Request(f"r{self.next_id}", list(prompt), SamplingParams()))
            self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 8), token=TOKENS)
    def schedule_waiting(self, i: int, chunk: int, token: int) -> None:
        req = self.waiting[i % len(self.waiting)]
        ids, num_cached = self.mgr.get_computed_blocks(req)
        assert num_cached < req.num_tokens and num_cached == len(ids) * self.bs
        if num_cached:
            event("prefix hit" + (" (resumed request)" if req.num_preemptions else ""))
        before = self._snapshot()
        num_new = min(chunk, req.num_tokens - num_cached)
        if self.mgr.allocate_slots(req, num_new, ids, num_cached) is None:
            assert self._snapshot() == before, "a failed allocation changed state"
            return
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        self._run(req, num_cached, num_new, token)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 8), token=TOKENS)
    def step_running(self, i: int, chunk: int, token: int) -> None:
        """A prefill chunk or a decode step; a request that cannot get blocks is preempted."""
        req = self.running[i % len(self.running)]
        if req.num_tokens >= MAX_TOKENS:
            return self.finish_running(i)
        start = req.num_computed_tokens
        num_new = min(chunk, req.num_tokens - start)
        before = self._snapshot()
        if self.mgr.allocate_slots(req, num_new) is None:
            assert self._snapshot() == before, "a failed allocation changed state"
            event("out of blocks: preempted")
            return self._preempt(req)
        self._run(req, start, num_new, token)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def finish_running(self, i: int) -> None:
        req = self.running.pop(i % len(self.running))
        self.mgr.free(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.finished.append(req)

    @precondition(lambda self: self.running or self.waiting)
    @rule(i=st.integers(0, 99))
    def abort(self, i: int) -> None:
        queue = self.running + self.waiting
        req = queue[i % len(queue)]
        (self.running if req in self.running else self.waiting).remove(req)
        self.mgr.free(req)  # a waiting request holds nothing: a no-op
        req.status = RequestStatus.FINISHED_ABORTED
        self.finished.append(req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def preempt(self, i: int) -> None:
        self._preempt(self.running[i % len(self.running)])

    @precondition(lambda self: self.finished)
    @rule(i=st.integers(0, 99))
    def free_finished_again(self, i: int) -> None:
        self.mgr.free(self.finished[i % len(self.finished)])  # must be a no-op

    @rule()
    def reset_prefix_cache(self) -> None:
        # Running requests always hold at least one block; waiting ones hold none.
        assert self.mgr.reset_prefix_cache() == (not self.running)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        holders: Counter[int] = Counter()
        for req in self.running:
            table = self.mgr.get_block_ids(req.request_id)
            assert len(table) == len(set(table)), "a request holds a block twice"
            assert len(table) == -(-req.num_computed_tokens // self.bs)
            holders.update(table)
        for req in self.waiting:
            assert self.mgr.get_block_ids(req.request_id) == []
        for block in self.mgr.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self) -> None:
        pool = self.mgr.block_pool
        queued = [b.block_id for b in pool.free_block_queue]
        assert len(queued) == len(set(queued)) == pool.get_num_free_blocks()
        assert set(queued) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used == pool.num_blocks
        assert self.mgr.usage() == used / pool.num_blocks

    @invariant()
    def hash_map_points_at_blocks_holding_those_tokens(self) -> None:
        pool = self.mgr.block_pool
        hashed = {b.block_hash: b for b in pool.blocks if b.block_hash is not None}
        assert hashed == pool.cached_block_hash_to_block
        if not self.mgr.enable_caching:
            assert not hashed
        for block_hash, block in hashed.items():
            # The block's last slot holds the whole prefix it ends; re-derive the chained hash from it.
            prefix = self.kv[(block.block_id, self.bs - 1)]
            parent = None
            for start in range(0, len(prefix), self.bs):
                parent = hash_block_tokens(parent, prefix[start : start + self.bs])
            assert parent == block_hash

    @invariant()
    def every_running_request_reads_back_its_prefix(self) -> None:
        for req in self.running:
            table = self.mgr.get_block_ids(req.request_id)
            tokens = req.all_token_ids
            for pos in range(req.num_computed_tokens):
                assert self.kv.get((table[pos // self.bs], pos % self.bs)) == tuple(tokens[: pos + 1])

    @invariant()
    def stats_are_consistent(self) -> None:
        stats = self.mgr.prefix_cache_stats
        assert 0 <= stats.hits <= stats.queries

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for req in self.running:
            self.mgr.free(req)
        assert self.mgr.get_num_free_blocks() == self.mgr.num_blocks
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks)
        assert self.mgr.waste() == (0, 0)
        assert self.mgr.reset_prefix_cache()


KVCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase

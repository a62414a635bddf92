"""LoRA in core/: a step mixes at most `max_loras` adapters, and block hashes keep adapters apart."""

from __future__ import annotations

import dataclasses

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.kv_cache.block_hash import request_block_hashes
from llmserve.core.scheduler import make_scheduler
from tests.unit.test_scheduler import make_request, step


def test_a_third_adapter_waits_until_one_of_two_ends():
    sched = make_scheduler(SchedulerConfig(), CacheConfig(block_size=4), 64, 256, max_loras=2)
    a, b, c, base = (make_request(n, 3, max_tokens=2) for n in "abcd")
    for req, lora_id in ((a, 1), (b, 2), (c, 3), (base, 0)):
        req.lora_id = lora_id
        sched.add_request(req)
    so, _ = step(sched)
    # FCFS: c (a third adapter) waits at the head of the queue, and the base request behind it
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert [n.lora_id for n in so.scheduled_new_reqs] == [1, 2]
    so, _ = step(sched)  # a and b decode their second (last) token and finish
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"c", "d"}


def test_block_hashes_depend_on_the_adapter():
    plain = make_request("p", 8)
    hashes = {
        lora_id: request_block_hashes(dataclasses.replace(plain, lora_id=lora_id, block_hashes=[]), 4)
        for lora_id in (0, 1, 2)
    }
    assert len(hashes[0]) == 2
    assert len({h for hs in hashes.values() for h in hs}) == 6  # no block shared across adapters
    assert request_block_hashes(dataclasses.replace(plain, lora_id=1, block_hashes=[]), 4) == hashes[1]

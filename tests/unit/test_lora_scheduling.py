"""LoRA in core/: a step mixes at most `max_loras` adapters, and block hashes keep adapters apart."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.kv_cache.block_hash import request_block_hashes
from llmserve.core.scheduler import make_scheduler
from tests.unit.test_scheduler import make_request, step


def test_a_third_adapter_waits_until_one_of_two_ends():
    sched = make_scheduler(SchedulerConfig(), CacheConfig(block_size=4), 64, 256, max_loras=2)
    a, b, c, d = (make_request(n, 3, max_tokens=2) for n in "abcd")
    for req, lora_id in ((a, 1), (b, 2), (c, 3), (d, 1)):
        req.lora_id = lora_id
        sched.add_request(req)
    so, _ = step(sched)
    # c (a third adapter) keeps its place; d, behind it, runs adapter 1, which is in the step
    assert set(so.num_scheduled_tokens) == {"a", "b", "d"}
    assert [n.lora_id for n in so.scheduled_new_reqs] == [1, 2, 1]
    assert [r.request_id for r in sched.waiting] == ["c"]
    so, _ = step(sched)  # a, b and d decode their second (last) token and finish
    assert set(so.num_scheduled_tokens) == {"a", "b", "d"}
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"c"}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_blocked_adapter_does_not_hold_up_the_queue(policy):
    """Head-of-line blocking: the base model's requests and those of adapters already running go
    ahead of a request whose adapter has no slot; the blocked ones keep their order."""
    sched = make_scheduler(SchedulerConfig(policy=policy), CacheConfig(block_size=4), 64, 256, max_loras=1)
    reqs = [make_request(n, 3, max_tokens=4) for n in "abcde"]
    for req, lora_id in zip(reqs, (1, 2, 3, 0, 1), strict=True):
        req.lora_id = lora_id
        sched.add_request(req)
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a", "d", "e"}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    late = make_request("f", 3, max_tokens=1)
    sched.add_request(late)
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a", "d", "e", "f"}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_block_hashes_depend_on_the_adapter():
    plain = make_request("p", 8)
    hashes = {
        lora_id: request_block_hashes(dataclasses.replace(plain, lora_id=lora_id, block_hashes=[]), 4)
        for lora_id in (0, 1, 2)
    }
    assert len(hashes[0]) == 2
    assert len({h for hs in hashes.values() for h in hs}) == 6  # no block shared across adapters
    assert request_block_hashes(dataclasses.replace(plain, lora_id=1, block_hashes=[]), 4) == hashes[1]


def test_stats_name_the_running_and_waiting_adapters():
    sched = make_scheduler(SchedulerConfig(), CacheConfig(block_size=4), 64, 256, max_loras=1)
    for name, lora_id in (("a", 1), ("b", 2), ("c", 0), ("d", 2)):
        req = make_request(name, 3, max_tokens=4)
        req.lora_id = lora_id
        sched.add_request(req)
    step(sched)
    lora = sched.stats(lora_names={1: "sql"}).lora
    assert (lora.max_lora, lora.running, lora.waiting) == (1, ("sql",), ("2",))
    assert make_scheduler(SchedulerConfig(), CacheConfig(block_size=4), 64, 256).stats().lora is None

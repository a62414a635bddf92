"""The KV cache's memory on the CPU: a default budget that follows the model (room for
`max_num_seqs` full contexts, at most 2 GiB and a quarter of the machine), and pages committed as
blocks are written, so resident memory follows use rather than the budget."""

from __future__ import annotations

import sys

import pytest
import torch

from llmserve.config.cache import DEFAULT_KV_CACHE_MEMORY, default_kv_cache_memory
from llmserve.layers.attention import KVCacheSpec
from llmserve.model_executor.forward_runner import _allocate_kv_caches

GiB = 2**30


def test_default_budget_is_room_for_every_sequence_at_full_context() -> None:
    # 64 sequences of 2,048 tokens at 16 KiB a token need 2 GiB: all of it fits under the caps
    assert default_kv_cache_memory(16 * 1024, 64, 2048, 16, 64 * GiB)[0] == 2 * GiB
    small, why = default_kv_cache_memory(1024, 8, 1000, 16, 64 * GiB)
    assert small == 1024 * 8 * 1008 and why == "room for 8 sequences of 1000 tokens"  # whole blocks
    big, why = default_kv_cache_memory(23040, 64, 8192, 16, 64 * GiB)
    assert big == DEFAULT_KV_CACHE_MEMORY and "capped at 2 GiB" in why
    tight, why = default_kv_cache_memory(23040, 64, 8192, 16, 4 * GiB)
    assert tight == GiB and "a quarter of this machine's memory" in why


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_cpu_cache_is_committed_as_it_is_written() -> None:
    spec = KVCacheSpec(num_blocks=8192, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float16)
    before = _rss()
    caches = _allocate_kv_caches(spec, 8, torch.device("cpu"))  # 8 layers x 128 MiB
    assert sum(c.numel() * c.element_size() for c in caches) == GiB
    assert _rss() - before < 32 * 2**20  # reserved, not resident
    for c in caches:  # one block of one sequence: every layer, K and V, every head
        c[:, :, 5].fill_(1.0)
    assert _rss() - before < 64 * 2**20
    assert float(caches[3][:, :, 5].float().mean()) == 1.0 and float(caches[3][:, :, 6].abs().sum()) == 0.0

"""How much GPU memory the KV cache gets: `--gpu-memory-utilization` in vLLM's meaning.

The engine may use `utilization` x the GPU's total memory. What the weights, the CUDA context and
other processes already hold is read from the driver; what a step's activations need at most is
measured by one profiling forward pass of the largest step the scheduler can send (its whole
token budget, spread over `max_num_seqs` sequences, logits for each). The KV cache takes the rest:

    budget = utilization x total - (in use after loading) - (peak activations of the profile run)

CUDA graphs are captured after the cache is allocated; their memory (reported at capture, a few
hundred MiB at most with a shared pool) comes out of the margin that `utilization` < 1 leaves.
"""

from __future__ import annotations

import logging

import torch

from llmserve.layers.attention import KVDtypes
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry, kv_cache_nbytes
from llmserve.models import CausalLM

logger = logging.getLogger("llmserve")


def kv_cache_budget(total: int, in_use: int, activation_peak: int, utilization: float) -> int:
    """Bytes left for the KV cache (ValueError when nothing is left, naming the setting)."""
    budget = int(utilization * total) - in_use - activation_peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} allows {utilization * total / 2**30:.2f} GiB, but the "
            f"model and other processes already use {in_use / 2**30:.2f} GiB and a step's activations "
            f"need {activation_peak / 2**30:.2f} GiB: raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or free the GPU"
        )
    return budget


def profile_step(
    model: CausalLM,
    kv_cache_dtype: torch.dtype | KVDtypes,
    block_size: int,
    max_num_tokens: int,
    max_num_seqs: int,
) -> int:
    """Peak bytes allocated by one forward of the largest step (beyond what was allocated
    before it), with a throwaway KV cache just large enough for it."""
    device = next(model.parameters()).device
    S = max(1, min(max_num_seqs, max_num_tokens))
    per_seq = max_num_tokens // S
    blocks_per_seq = -(-per_seq // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner = ForwardRunner(
        model, S * blocks_per_seq, block_size, kv_cache_dtype, max_num_tokens=S * per_seq, max_num_seqs=S,
        max_model_len=per_seq,
    )  # fmt: skip
    kv_bytes = sum(kv_cache_nbytes(c) for c in runner.kv_caches)
    batch = [
        SequenceBatchEntry([1] * per_seq, per_seq, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
        for i in range(S)
    ]
    runner.execute(batch)  # logits for each sequence, as a step that samples all of them
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - kv_bytes
    del runner
    torch.cuda.empty_cache()
    return max(peak, 0)


def measure_kv_budget(
    model: CausalLM,
    kv_cache_dtype: torch.dtype | KVDtypes,
    block_size: int,
    max_num_tokens: int,
    max_num_seqs: int,
    utilization: float,
) -> int:
    """The KV cache's bytes on this GPU (see the module docstring)."""
    device = next(model.parameters()).device
    peak = profile_step(model, kv_cache_dtype, block_size, max_num_tokens, max_num_seqs)
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_cache_budget(total, total - free, peak, utilization)
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB peak activations; "
        "KV cache %.2f GiB (gpu_memory_utilization %.2f)",
        total / 2**30, (total - free) / 2**30, peak / 2**30, budget / 2**30, utilization,
    )  # fmt: skip
    return budget

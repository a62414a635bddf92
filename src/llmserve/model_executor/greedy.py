"""Batched greedy generation over a contiguous KV cache: each sequence gets its own run of blocks
for prompt + max_tokens. This is the simplest client of `ForwardRunner` - used by `llmserve
generate`, the benchmarks and the parity tests until the engine's scheduler takes over."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def generate_greedy(
    runner: ForwardRunner,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """Greedy continuations (at most `max_tokens`, ending early at a stop token, which is kept)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    bs = runner.block_size
    tables: list[list[int]] = []
    next_block = 0
    for p in prompts:
        n = blocks_needed(len(p) + max_tokens, bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    if next_block > runner.num_blocks:
        raise ValueError(
            f"the batch needs {next_block} KV blocks of {bs} tokens but the cache has {runner.num_blocks}"
        )

    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    # Step 1: prefill every prompt in one forward pass.
    batch = [SequenceBatchEntry(list(p), len(p), tables[i]) for i, p in enumerate(prompts)]
    while active:
        next_ids = torch.argmax(runner.execute(batch), dim=-1).tolist()  # the one sync per step
        still = []
        for i, tok in zip(active, next_ids, strict=True):
            outputs[i].append(tok)
            if tok not in stop_token_ids and len(outputs[i]) < max_tokens:
                still.append(i)
        active = still
        # Step 2..: one decode token per active sequence.
        batch = [
            SequenceBatchEntry([outputs[i][-1]], len(prompts[i]) + len(outputs[i]), tables[i]) for i in active
        ]
    return outputs

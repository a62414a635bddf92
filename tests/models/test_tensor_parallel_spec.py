"""Speculative decoding under tensor parallelism (TP=2, one thread per rank) on the tiny Llama:
a verification forward (each request's last token and its proposals) is broadcast like any other
forward, so the greedy tokens are plain decoding's at TP=1 and at TP=2, n-gram proposals are
accepted and rejected exactly as at TP=1 (float weights on the layer path, and int8 in the fused
C++ decoder over shared memory), with chunked prefill, prefix caching and preemption at work; a
draft model runs whole on the driver."""

from __future__ import annotations

import numpy as np
import pytest

from llmserve import LLM
from llmserve.metrics.stats import SpecDecodingStats
from tests.models.test_tensor_parallel import SHARED, _run
from tests.models.tiny import make_tiny_model

# Prompts that repeat themselves, whose greedy continuations (seed 0's tiny Llama) fall into
# loops such as 11 11 11 ... or 54 54 54 ...: the n-gram proposer finds matches, some of them
# accepted and some rejected. Two share SHARED's 18 tokens (a prefix-cache hit); with the 8-token
# step budget and 5 blocks of 16 of test_tensor_parallel's ENGINE, prompts are chunked and the
# newest requests preempted.
PROMPTS = [
    [300, 301] * 3,
    [325, 326] * 3,
    [*SHARED, *[225, 226] * 3],
    [*SHARED, *[100, 101] * 3],
]
MAX_TOKENS = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}  # never trimmed by timing
TP2 = dict(tensor_parallel_size=2, threads_per_rank=1)


def _spec_run(
    model: str, fused: bool, **options
) -> tuple[list[list[int]], list[list[float]], int, SpecDecodingStats | None, LLM]:
    """`_run`'s (tokens, logprobs, preemptions) of PROMPTS, then the scheduler's speculation
    counts and the (closed) LLM."""
    seen: list[LLM] = []
    tokens, logprobs, preemptions = _run(
        model, fused=fused, inspect=seen.append, prompts=PROMPTS, max_tokens=MAX_TOKENS, **options
    )
    return tokens, logprobs, preemptions, seen[0].engine.scheduler.spec_stats, seen[0]


@pytest.mark.parametrize("quantization", ["none", "int8"], ids=["float-layers", "int8-fused"])
def test_tp2_ngram_matches_plain_decoding(quantization, tmp_path):
    """TP=2 with n-gram speculation: TP=1's and TP=2's plain greedy tokens, and TP=1's
    speculation counts (the same proposals accepted and rejected; rejected ones' KV slots rolled
    back on every rank alike, or the next steps' tokens would differ)."""
    make_tiny_model("llama", tmp_path)
    model, fused = str(tmp_path), quantization == "int8"
    plain1, lp_plain1, _, _, _ = _spec_run(model, fused, quantization=quantization)
    plain2, _, _, _, _ = _spec_run(model, fused, quantization=quantization, **TP2)
    _, _, _, stats1, _ = _spec_run(model, fused, quantization=quantization, speculative_config=NGRAM)
    spec2, lp_spec2, preempt2, stats2, _ = _spec_run(
        model, fused, quantization=quantization, speculative_config=NGRAM, **TP2
    )
    assert spec2 == plain1 == plain2
    assert stats2 is not None and stats2 == stats1
    assert 0 < stats2.num_accepted_tokens < stats2.num_draft_tokens  # accepted, and rejected
    assert preempt2 > 0
    # a verified position is scored in a batch of k + 1 rows, its all-reduces summed in another
    # order; int8 rounds each shard's activations with a scale of its own (test_tensor_parallel)
    atol = 2e-3 if fused else 1e-4
    np.testing.assert_allclose(np.array(lp_spec2), np.array(lp_plain1), rtol=0, atol=atol)


@pytest.mark.parametrize("quantization", ["none", "int8"], ids=["float-layers", "int8-fused"])
def test_tp2_draft_model_runs_whole_on_the_driver(quantization, tmp_path):
    """A draft model under TP=2 is loaded unsharded in the engine's process (no group, all its
    KV heads; quantized alike, in its own fused C++ decoder beside the target shard's) and
    proposes from there: the target as its own draft has every proposal accepted, k tokens at a
    time, and the tokens and counts are TP=1's."""
    make_tiny_model("llama", tmp_path)
    model, fused = str(tmp_path), quantization == "int8"
    draft = {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": 3,
        "adaptive": False,
        "quantization": quantization,
    }
    plain1, _, _, _, _ = _spec_run(model, fused, quantization=quantization)
    spec1, _, _, stats1, _ = _spec_run(model, fused, quantization=quantization, speculative_config=draft)
    spec2, _, _, stats2, llm = _spec_run(
        model, fused, quantization=quantization, speculative_config=draft, **TP2
    )
    assert spec2 == spec1 == plain1
    runner = llm.engine.proposer.runner
    assert runner.group is None and runner.model.config.num_key_value_heads == 2  # not a shard
    assert llm.engine.runner.runner.model.config.num_key_value_heads == 1  # the target's shard
    assert (runner.fused is not None) == fused
    assert stats2 is not None and stats2 == stats1
    assert 0 < stats2.num_draft_tokens == stats2.num_accepted_tokens and stats2.accepted_per_pos[-1] > 0

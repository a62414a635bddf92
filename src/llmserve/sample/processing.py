"""The logits processing that changes even a greedy choice: min_tokens ban, logit bias, penalties.

Applied in this order, in place, to a float32 copy of the model's logits [B, V] (the raw logits stay
untouched for logprobs):

    banned tokens -> -inf        while len(output) < min_tokens: stop ids, and EOS unless ignore_eos
    logits += logit_bias         OpenAI `logit_bias`
    repetition penalty           HF/vLLM: for tokens in the prompt OR the output,
                                 logit / penalty if logit > 0 else logit * penalty
    frequency, presence          OpenAI: logit -= frequency * count + presence * (count > 0),
                                 counting output tokens only

This module knows nothing of temperature or sampling; see `random_sampling.py`.
"""

from __future__ import annotations

import torch

from llmserve.sample.metadata import PenaltyTensors, SamplingMetadata


def apply_logits_processing(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Steps 2-4 of the sampler, in place on `logits` [B, V] fp32."""
    if metadata.banned is not None:
        # a 0-dim fill on the device: torch.tensor(-inf, device=...) would be a synchronous copy
        logits.index_put_(metadata.banned, logits.new_full((), float("-inf")))
    if metadata.logit_bias is not None:
        rows, token_ids, biases = metadata.logit_bias
        logits.index_put_((rows, token_ids), biases, accumulate=True)
    if metadata.penalties is not None:
        apply_penalties(logits, metadata.penalties)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Repetition, then frequency and presence penalties on the penalized rows, in place."""
    x = logits[penalties.rows]  # [P, V] (a copy: advanced indexing)
    counts = penalties.output_counts  # [P, V]
    seen = penalties.prompt_mask | (counts > 0)  # [P, V]
    rep = penalties.repetition.unsqueeze(1)  # [P, 1]
    # `where` keeps -inf (banned tokens) at -inf: -inf * rep and -inf / rep are both -inf for rep > 0.
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= penalties.frequency.unsqueeze(1) * counts + penalties.presence.unsqueeze(1) * (counts > 0)
    logits[penalties.rows] = x

"""Verifying proposed tokens: the model scored the last real token and the k proposals in one
forward pass (rows 0..k of `logits`); keep the longest prefix of proposals the model would have
produced, then one token of the model's own.

Each row is processed exactly as the sampler processes a decode row (min_tokens ban, logit bias,
penalties with the proposals before it counted as output; then, for sampled requests,
temperature, top-k, top-p, min-p), and row j's token is chosen exactly as plain decoding would
choose it at that position:

    greedy:  the argmax;
    random:  the exponential race argmax(p / q) with q ~ Exp(1) drawn from the request's own
             generator (or the global RNG), row j taking the draw plain decoding's j-th next
             step would take.

Proposal j is kept when it is row j's token; the first that is not is replaced by row j's token,
which ends the step; with every proposal kept, row k's token is added. So the emitted tokens are
the ones plain decoding emits from the same state - identical, for greedy and for seeded
requests, whatever was proposed and however many proposals were verified - and a proposal d is
kept with probability p(d), as speculative sampling's min(1, p/q) rule gives for a proposal that
is a single token. A seeded request's generator is advanced by exactly the draws of the tokens
emitted (the draws of rows past a rejection are taken again from the same state next step).
"""

from __future__ import annotations

import torch

from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.processing import apply_logits_processing
from llmserve.sample.random_sampling import sample_random


def verify_proposals(
    logits: torch.Tensor, metadata: SamplingMetadata, drafts: list[int], generator: torch.Generator | None
) -> list[int]:
    """The tokens one request keeps: accepted proposals, then the model's own (1 to k+1 tokens).
    `logits` [k+1, V]; `metadata` has one row per position, all of the same request, whose
    seeded rows draw from `generator`."""
    k = len(drafts)
    x = logits.to(torch.float32, copy=True)
    apply_logits_processing(x, metadata)
    if metadata.all_greedy:
        targets = x.argmax(dim=-1).tolist()
    else:
        assert metadata.all_random, "one request's rows share a sampling type"
        state = generator.get_state() if generator is not None else None
        targets = sample_random(x, metadata).tolist()  # row j draws what plain step j would
    out: list[int] = []
    for j in range(k):
        out.append(targets[j])
        if targets[j] != drafts[j]:
            break
    else:
        out.append(targets[k])
    if generator is not None and state is not None:
        # rewind, then take exactly the draws of the emitted tokens, as plain decoding would have
        generator.set_state(state)
        scratch = torch.empty(x.shape[1], dtype=torch.float32, device=x.device)
        for _ in out:
            scratch.exponential_(generator=generator)
    return out

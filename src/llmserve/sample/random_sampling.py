"""Sampling of the random (temperature > 0) rows: temperature, top-k / top-p / min-p, then a draw.

    x = logits / temperature                     [B, V]
    sort x ascending once (stable)               [B, V] sorted logits + their vocab ids
    top-k:  drop sorted positions < V - k        exactly k survive (ties broken by vocab id)
    top-p:  p = softmax(sorted x); drop tokens whose ascending cumulative mass <= 1 - top_p,
            i.e. keep the smallest set of most likely tokens whose mass reaches top_p (the most
            likely token always survives)
    min-p:  drop p < min_p * p_max               (a ratio, so unaffected by top-p's renormalization)
    scatter the filtered sorted logits back to vocab order, probs = softmax(x)
    token = argmax(probs / q), q ~ Exp(1) iid    the exponential race: P(token = i) = probs[i]

Every random row draws exactly V exponentials per step. A seeded row draws them from its own
generator, so its tokens depend only on its own seed and logits, not on the batch around it;
unseeded rows share the global RNG. This module owns these steps and knows nothing of penalties.
"""

from __future__ import annotations

import torch

from llmserve.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")


def sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Sampled token ids [B] int64 for every row as if random; `logits` [B, V] fp32 is overwritten."""
    assert metadata.temperature is not None, "a batch with random rows has temperatures"
    x = logits.div_(metadata.temperature.unsqueeze(1))  # [B, V]
    if metadata.top_k is not None or metadata.top_p is not None or metadata.min_p is not None:
        x = apply_top_k_top_p_min_p(x, metadata.top_k, metadata.top_p, metadata.min_p)
    probs = x.softmax(dim=-1)  # [B, V]
    q = _draw_exponentials(probs, metadata)  # [B, V]
    return probs.div_(q).argmax(dim=-1)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set filtered-out tokens of `logits` [B, V] to -inf, in place; a None filter is off for all rows.

    `top_k` [B] int64 in [1, V] (V = off), `top_p` [B] in (0, 1] (1 = off), `min_p` [B] in [0, 1] (0 = off).
    """
    vocab_size = logits.shape[-1]
    sorted_x, order = logits.sort(dim=-1, stable=True)  # [B, V] ascending: the most likely token is last
    if top_k is not None:
        position = torch.arange(vocab_size, device=logits.device)  # [V]
        sorted_x.masked_fill_(position < (vocab_size - top_k).unsqueeze(1), _NEG_INF)
    if top_p is not None or min_p is not None:
        probs = sorted_x.softmax(dim=-1)  # [B, V], after top-k
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if top_p is not None:
            tail_mass = probs.cumsum(dim=-1)  # [B, V] mass of this token and every less likely one
            drop |= tail_mass <= (1.0 - top_p).unsqueeze(1)
            drop[:, -1] = False  # float error must never empty a row
        if min_p is not None:
            drop |= probs < min_p.unsqueeze(1) * probs[:, -1:]
        sorted_x.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(-1, order, sorted_x)


def _draw_exponentials(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """q [B, V] ~ Exp(1): seeded rows from their own generator, the others from the global RNG."""
    q = torch.empty_like(probs)
    if metadata.has_unseeded_random:
        q.exponential_()
    elif not metadata.all_random:
        q.fill_(1.0)  # greedy rows' draws are discarded; keep them finite
    # The one per-row Python loop of the sampler: a generator cannot fill a batch of rows.
    for row, generator in metadata.generators.items():
        q[row].exponential_(generator=generator)
    # Exp(1) can return exactly 0; 0 / 0 would be NaN and argmax would pick a filtered-out token.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)

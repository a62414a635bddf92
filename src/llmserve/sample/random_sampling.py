"""Sampling of the random (temperature > 0) rows: temperature, top-k / top-p / min-p, then a draw.

    x = logits / temperature                     [B, V]
    top-k, top-p, min-p                          filtered tokens -> -inf      (filters.py)
    probs = softmax(x)
    token = argmax(probs / q), q ~ Exp(1) iid    the exponential race: P(token = i) = probs[i]

Every random row draws exactly V exponentials per step. Unseeded rows share the global RNG (one
call for the batch). A seeded row's draws depend only on its own seed and position, never on the
batch around it, in one of two modes (metadata.py's `SamplingDevicePolicy`):

    "generator" (the CPU)  its own torch.Generator, one call per row: the streams seeded CPU
                           outputs have always come from
    "counter"   (CUDA)     Philox keyed by (seed, output position), every seeded row in one launch
                           (philox.py): nothing to rewind or replay, the position is the state

This module owns these steps and knows nothing of penalties.
"""

from __future__ import annotations

import torch

from llmserve.sample.filters import apply_filters
from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.philox import philox_exponentials_


def sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Sampled token ids [B] int64 for every row as if random; `logits` [B, V] fp32 is overwritten."""
    assert metadata.temperature is not None, "a batch with random rows has temperatures"
    x = logits.div_(metadata.temperature.unsqueeze(1))  # [B, V]
    if metadata.top_k is not None or metadata.top_p is not None or metadata.min_p is not None:
        md = metadata
        x = apply_filters(x, md.top_k, md.top_p, md.min_p, md.filter_width, md.sort_rows, md.host_checks)
    probs = x.softmax(dim=-1)  # [B, V]
    q = _draw_exponentials(probs, metadata)  # [B, V]
    return probs.div_(q).argmax(dim=-1)


def _draw_exponentials(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """q [B, V] ~ Exp(1): seeded rows from their own stream, the others from the global RNG."""
    q = torch.empty_like(probs)
    if metadata.has_unseeded_random:
        q.exponential_()
    elif not metadata.all_random:
        q.fill_(1.0)  # greedy rows' draws are discarded; keep them finite
    if metadata.seeded is not None:
        seeded = metadata.seeded
        philox_exponentials_(q, seeded.rows, seeded.seeds, seeded.positions)
    # "generator" mode: a generator cannot fill a batch of rows, so one call per seeded row.
    for row, generator in metadata.generators.items():
        q[row].exponential_(generator=generator)
    # Exp(1) can return exactly 0; 0 / 0 would be NaN and argmax would pick a filtered-out token.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)

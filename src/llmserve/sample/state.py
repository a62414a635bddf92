"""Per-request sampling state that lives across steps.

The model runner keeps one `RequestSamplingState` per live request and appends every sampled token to
its `output_token_ids`; `SamplingMetadata.build` reads these states once per step. This module owns
only the state and the seeded generator; it does not know about batches or logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.structured_output import GrammarState


@dataclass(slots=True)
class RequestSamplingState:
    """What the sampler needs of one request across steps (the runner keeps one per live request)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """The runner appends each sampled token to this same list."""
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    """Created from `params.seed` on the model's device when seeded, else None (global RNG)."""
    grammar: GrammarState | None = None
    """The request's structured-output matcher (`params.structured_outputs`), else None."""


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator for one seeded request on `device`, or None for an unseeded one."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator

"""The data that crosses the scheduler <-> model-runner boundary, one step at a time.

    Scheduler.schedule() -> SchedulerOutput -> ForwardRunner.execute_model() -> ModelRunnerOutput
                                             -> Scheduler.update_from_output()

Requests are sent whole the first time they are scheduled (`NewRequestData`) and afterwards only
as what changed (`CachedRequestData`), so the runner keeps its own per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.core.multimodal import MultiModalInput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Non-empty when a preempted request is resumed: those tokens are recomputed as prompt."""
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose K/V are already in the cache (a prefix-cache hit), not to be recomputed."""
    pooling_params: PoolingParams | None = None
    """An embedding request: pool its prompt's hidden states instead of sampling."""
    lora_id: int = 0
    """The LoRA adapter it runs with (0: the base model)."""
    mm_inputs: tuple[MultiModalInput, ...] = ()
    """Its images: the runner encodes each when a chunk first reaches its tokens."""


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: its new blocks and how far it has been computed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Tokens each scheduled request runs this step (a prefill chunk, or 1 for a decode)."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that finished or were aborted since the last step: the runner drops all their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the runner drops their blocks but keeps their sampling state
    (a seeded generator continues where it was, so outputs do not change because of preemption)."""
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: the proposed tokens each decoding request verifies this step; its
    `num_scheduled_tokens` is 1 + their number (the last real token first)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class Logprobs:
    """Top-k logprobs of some positions: row i holds the chosen token first, then alternatives."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    """Rank of the chosen token in the full distribution (1 = most likely)."""


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    """Requests of this step in order; only those that reached a sampling position have tokens."""
    sampled_token_ids: list[list[int]]
    """One list per request: [token] after a decode or the last prefill chunk, [] mid-prefill; with
    speculation, the accepted proposed tokens and then the model's own."""
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    """Per request that asked for logprobs and sampled this step."""
    prompt_logprobs: dict[str, Logprobs | None] = field(default_factory=dict)
    """Per request that asked for prompt logprobs: the logprobs of the prompt tokens this chunk
    covered (the first prompt token has none)."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """Per embedding request whose prefill ended this step: its pooled (cut, normalised) vector."""

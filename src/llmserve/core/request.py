"""`Request`: one sequence being generated, as the scheduler and the KV-cache manager see it.

A prompt with `n > 1` is fanned out by the engine into n requests that share the prompt's cached
blocks through the prefix cache. Token ids only: text lives in the engine's output processing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmserve.core.multimodal import MultiModalInput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    """Lower runs first under the priority policy; ties go to the earlier arrival."""
    arrival_time: float = field(default_factory=time.monotonic)
    max_tokens: int = 16
    """Resolved output budget (max_tokens, or what is left of the context)."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (cached prefix + computed so far)."""
    num_cached_tokens: int = -1
    """Prompt tokens found in the prefix cache at first scheduling (-1: not scheduled yet)."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of this request's full blocks, filled by the KV-cache manager."""
    padding: bool = False
    """Static batching: computed for the batch's shape only, nobody's output (a member finished for
    its user, or a prompt-padding sequence)."""
    prompt_padding: bool = False
    """Static batching: the pad positions of a member whose prompt is shorter than its batch's
    longest. Prefilled like a prompt, never decodes, leaves once its prefill is done."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: tokens proposed to follow this request's last one, verified next step."""
    spec_accepted: float = 0.0
    spec_rejected: float = 0.0
    """Speculative decoding: accepted proposed tokens and rejections so far, decayed (recent
    verifications weigh most); their ratio estimates the chance the next proposal is kept."""
    spec_idle: int = 0
    """Speculative decoding: steps since this request last verified a proposal."""
    pooling_params: PoolingParams | None = None
    """An embedding request: its prompt is pooled into one vector and it ends when its prefill
    does (nothing sampled, `max_tokens` 0)."""
    lora_id: int = 0
    """The LoRA adapter it runs with (`LoRARequest.lora_int_id`; 0: the base model). Part of its
    block hashes: the same tokens under two adapters have different K/V."""
    mm_inputs: tuple[MultiModalInput, ...] = ()
    """Its images, in prompt order (core/multimodal.py): part of the hashes of the blocks that hold
    their tokens; a prefill chunk never ends inside one."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id(self, i: int) -> int:
        """Token i of prompt + output without building the concatenated list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

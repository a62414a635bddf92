"""`SchedulerConfig`: how requests share each engine step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]
AdmissionPolicy = Literal["optimistic", "reserve"]
BatchingMode = Literal["continuous", "static", "static-ragged"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 1024
    """Token budget of one step: decodes first, then prefill chunks of waiting requests."""

    max_num_seqs: int = 64
    """Most requests running at once."""

    policy: SchedulingPolicy = "fcfs"
    """`fcfs`: arrival order. `priority`: lower `priority` value first, then arrival."""

    admission: AdmissionPolicy = "optimistic"
    """`optimistic`: admit when the prompt's blocks fit; when blocks run out, preempt the newest
    running request and recompute it later. `reserve`: admit only when blocks for prompt +
    max_tokens are free, so nothing is ever preempted."""

    mode: BatchingMode = "continuous"
    """`continuous`: in-flight batching, waiting requests join every step. `static`: fixed batches, for
    comparison, the request-level batching that continuous batching replaced: each batch's prompts
    are padded to its longest prompt, the batch runs until its longest member finishes (finished
    members are computed as padding), and the next is admitted only then. `static-ragged`: the
    same without the prompt padding (prompts of different lengths batched as they are)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority'; got {self.policy!r}")
        if self.admission not in ("optimistic", "reserve"):
            raise ValueError(f"admission must be 'optimistic' or 'reserve'; got {self.admission!r}")
        if self.mode not in ("continuous", "static", "static-ragged"):
            raise ValueError(f"mode must be 'continuous', 'static' or 'static-ragged'; got {self.mode!r}")

    @property
    def is_static(self) -> bool:
        return self.mode != "continuous"

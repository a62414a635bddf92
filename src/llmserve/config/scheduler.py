"""`SchedulerConfig`: how requests share each engine step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]
AdmissionPolicy = Literal["optimistic", "reserve"]
BatchingMode = Literal["continuous", "static", "static-ragged"]

DEFAULT_TOKEN_BUDGET = 1024
"""The step's token budget where nothing smaller is known to be as fast (GPUs: a bigger step costs
little more than a smaller one; the float CPU path, not measured smaller)."""

FUSED_CPU_TOKEN_BUDGET = 256
"""The budget where the fused CPU decoder runs the model. Its prefill is compute-bound: a step
costs the same per token from 256 tokens up to 1,024 (the weights already stream once per 64 or
16 tokens inside a matmul), so smaller steps give a burst's first tokens sooner and stall running
requests less at no cost in throughput (docs/benchmarks.md, the burst TTFT section)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = None
    """Token budget of one step: decodes first, then prefill chunks of waiting requests (default:
    256 where the fused CPU decoder runs the model, else 1024)."""

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

    stream_interval: int = 1
    """A streamed request's output goes out every this many tokens (vLLM's and SGLang's option):
    its first token at once, then whenever this many more have come, and its end. 1: every step.
    Larger values change no token or text, only how they are grouped into deltas (SSE events), and
    cut the per-token work of building outputs and events at large batches."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority'; got {self.policy!r}")
        if self.admission not in ("optimistic", "reserve"):
            raise ValueError(f"admission must be 'optimistic' or 'reserve'; got {self.admission!r}")
        if self.mode not in ("continuous", "static", "static-ragged"):
            raise ValueError(f"mode must be 'continuous', 'static' or 'static-ragged'; got {self.mode!r}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1; got {self.stream_interval}")

    @property
    def token_budget(self) -> int:
        """`max_num_batched_tokens`, or the default where the engine has not resolved it for the
        model (`for_model`)."""
        return self.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET

    def for_model(self, fused_cpu_decoder: bool) -> SchedulerConfig:
        """This config with the token budget decided: the one given, else the default of the path
        the model runs on."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = FUSED_CPU_TOKEN_BUDGET if fused_cpu_decoder else DEFAULT_TOKEN_BUDGET
        return dataclasses.replace(self, max_num_batched_tokens=budget)

    @property
    def is_static(self) -> bool:
        return self.mode != "continuous"

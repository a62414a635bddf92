"""Engine statistics as plain data: what happened in one engine step, gathered while the step's
outputs are processed and handed to the stat loggers (Prometheus, the periodic log line) once.

A "request" here is one sequence: a prompt with `n > 1` counts as n requests, each with its own
timings and finish reason, as vLLM counts them. Times are `time.monotonic()` seconds, all taken in
the engine thread.

Intervals of one sequence (queue -> first scheduled -> first token -> last token):

    queue time      first scheduled - arrival
    prefill time    first token - first scheduled
    decode time     last token - first token
    inference time  last token - first scheduled
    TTFT            first token - arrival
    e2e latency     finish - arrival
    TPOT            decode time / (generated tokens - 1)

A preempted sequence keeps its first-scheduled and first-token times: recomputation after a
preemption is part of its prefill or decode time. Phases a sequence never reached (aborted while
waiting, say) are not observed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SpecDecodingStats:
    """Speculative decoding since the engine started, vLLM's counters: a draft is one request's
    proposal in one step; position i counts the drafts whose (i+1)-th token was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft yields on average: the accepted ones plus the model's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """The LoRA adapters of unfinished requests (vLLM's lora_requests_info): names, sorted."""

    max_lora: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    """Adapters with waiting requests and none running."""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The engine's state after a step (or after aborts that left it idle): the one record the
    stat loggers, the server's /stats and its queue check all read. Counters are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    """Blocks held by requests (free blocks that still cache a prefix count as unused)."""
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache, and found there."""
    prefix_cache_hits: int = 0
    num_steps: int = 0
    """Engine steps run so far."""
    step_tokens: int = 0
    """Tokens the step computed (0 for a record taken outside a step)."""
    spec: SpecDecodingStats | None = None
    """Speculative decoding's cumulative counts (None when it is off)."""
    lora: LoRAStats | None = None
    """The adapters running and waiting (None when LoRA is off)."""

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache's blocks held by requests (1.0: full)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(slots=True)
class SequenceTimes:
    """Timestamps of one sequence, kept by the output processor while it runs."""

    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    n: int
    """The `n` of the prompt this sequence belongs to (the request_params_n histogram)."""
    lora_name: str | None = None
    """Its LoRA adapter (None: the base model)."""
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    finish_reason: str
    """"stop", "length" or "abort"."""
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int
    n: int
    queue_time: float | None
    prefill_time: float | None
    decode_time: float | None
    inference_time: float | None
    lora_name: str | None = None

    @property
    def time_per_output_token(self) -> float | None:
        if self.decode_time is None or self.num_generation_tokens < 2:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)


@dataclass(slots=True)
class IterationStats:
    """Everything the loggers need from one engine step (and the aborts since the last one)."""

    timestamp: float
    scheduler: SchedulerStats | None = None
    """Gauges and cumulative scheduler counters after the step (None: no step ran)."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the sequences whose prefill completed (first token) in this step."""
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    step_seconds: float = 0.0
    """How long the step took, scheduling to outputs (0: no step, or not measured)."""

    @property
    def is_empty(self) -> bool:
        return self.scheduler is None and not self.finished

    def observe_pooled(self, seq: SequenceTimes, now: float) -> None:
        """An embedding request's prompt was pooled at `now`: its prompt tokens count, and its
        prefill ended then (no token: no time to first token)."""
        seq.first_token = seq.last_token = now
        self.num_prompt_tokens += seq.num_prompt_tokens

    def observe_tokens(self, seq: SequenceTimes, num_new: int, now: float) -> None:
        """A step gave `seq` `num_new` tokens at time `now`."""
        if num_new <= 0:
            return
        if seq.first_token is None:
            seq.first_token = now
            self.num_prompt_tokens += seq.num_prompt_tokens
            self.time_to_first_tokens.append(now - seq.arrival)
        else:
            assert seq.last_token is not None
            self.inter_token_latencies.append(now - seq.last_token)
        seq.last_token = now
        seq.num_generation_tokens += num_new
        self.num_generation_tokens += num_new

    def observe_finished(self, seq: SequenceTimes, finish_reason: str, now: float) -> None:
        scheduled, first, last = seq.first_scheduled, seq.first_token, seq.last_token
        self.finished.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - seq.arrival,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_generation_tokens=seq.num_generation_tokens,
                max_tokens=seq.max_tokens,
                n=seq.n,
                queue_time=None if scheduled is None else scheduled - seq.arrival,
                prefill_time=None if scheduled is None or first is None else first - scheduled,
                decode_time=None if first is None or last is None else last - first,
                inference_time=None if scheduled is None or last is None else last - scheduled,
                lora_name=seq.lora_name,
            )
        )

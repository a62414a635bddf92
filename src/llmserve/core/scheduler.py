"""`Scheduler`: decides, each step, which requests run and how many of their tokens.

One step of continuous (in-flight) batching with chunked prefill:

  1. Running requests first, oldest first: each gets its next token (a decode), or the next chunk
     of its prompt when it is still prefilling, within the step's token budget. When the KV pool
     cannot hold a request's new tokens, the newest running request is preempted: it gives back
     all of its blocks at once, returns to the front of the waiting queue and is recomputed later
     (its prefix may still be in the prefix cache).
  2. If nothing was preempted, waiting requests are admitted in queue order while the budget,
     `max_num_seqs` and the KV pool allow: the longest cached prefix is reused, the rest of the
     prompt is scheduled, split into chunks when it does not fit the remaining budget.

Admission `reserve` admits a request only when blocks for its whole prompt + max_tokens are free
after every running request's own reservation, so step 1 never runs out of blocks.

The static (request-level) batching modes, for comparison, are a subclass in
`static_scheduler.py`; `make_scheduler` picks the class from `SchedulerConfig.mode`.

The scheduler owns the request objects and the KV-cache manager; it never touches tensors.
`update_from_output` consumes the runner's sampled tokens as data and decides who finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.kv_cache.manager import KVCacheManager
from llmserve.core.multimodal import cut_chunk
from llmserve.core.request import Request, RequestStatus
from llmserve.core.request_queue import QUEUES, RequestQueue
from llmserve.core.sched_output import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from llmserve.metrics.stats import LoRAStats, SchedulerStats, SpecDecodingStats

SPEC_DECAY = 0.8
"""Weight of a request's earlier verifications against its latest one (speculative decoding)."""


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request produced in one step."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None
    """An embedding request's pooled vector (it finishes in the same output)."""


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` call decided (filled by the two passes)."""

    budget: int
    num_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)


class Scheduler:
    """Continuous (in-flight) batching. Subclasses change who runs through the hooks marked below
    (`StaticBatchScheduler`: request-level batches with padding)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        max_loras: int | None = None,
        chunked_prefill: bool = True,
    ) -> None:
        """`num_speculative_tokens`: the most tokens a request may verify per step beyond its own
        (speculative decoding; 0: off). `max_loras`: the most LoRA adapters running requests may
        use at once (None: LoRA is off, no cap). `chunked_prefill=False`: a prompt is admitted
        only when all of it fits the step's budget (an encoder's bidirectional attention needs
        the whole sequence in one forward pass; the caller makes sure the budget holds the longest)."""
        if scheduler_config.is_static and type(self) is Scheduler:
            raise ValueError(
                f"mode {scheduler_config.mode!r} is run by StaticBatchScheduler (make_scheduler)"
            )
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, cache_config.block_size, enable_caching=cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = QUEUES[scheduler_config.policy]()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_steps = 0  # steps whose outputs came back (update_from_output calls)
        self.max_spec_tokens = num_speculative_tokens
        self.max_loras = max_loras
        self.chunked_prefill = chunked_prefill
        # speculative decoding's cumulative counts (the record is built by `spec_stats`)
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * num_speculative_tokens
        # Requests that left since the last step; the runner drops their state.
        self._finished_req_ids: set[str] = set()

    # -- requests in and out ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(
        self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finish requests now (abort, or a stop string found by output processing); frees their blocks."""
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if status != RequestStatus.FINISHED_ABORTED and request.status == RequestStatus.RUNNING:
                self._end(request, status)  # done for its user (static mode may keep it as padding)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
        self._after_step()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # -- hooks (continuous batching's choices; StaticBatchScheduler overrides them) ----------------

    def _end(self, request: Request, status: RequestStatus) -> None:
        """A running request is done for its user."""
        self.running.remove(request)
        self._finish(request, status)

    def _after_step(self) -> None:
        """Called after outputs are processed and after finish_requests."""

    def _running_order(self) -> list[Request]:
        """Running requests in the order they get the step's budget and blocks."""
        return list(self.running)

    def _num_members(self) -> int:
        """Running requests that count against max_num_seqs."""
        return len(self.running)

    def _make_room(self, request: Request, plan: _StepPlan) -> Request:
        """Free blocks for `request` by preempting the newest running request (it may be `request`
        itself). Returns who gave way; the newest has not been scheduled in this step yet."""
        assert self.config.admission == "optimistic", "reserve admission must never run out of blocks"
        victim = self.running.pop()  # the most recently admitted request
        self._preempt(victim, plan)
        return victim

    def _open_admission(self) -> None:
        """Before waiting requests are considered in a step."""

    def _admit_pending(self, plan: _StepPlan) -> bool | None:
        """Admit something of the subclass's own before the next waiting request: True when it
        did (try again), False when it could not (stop admitting), None when it has nothing."""
        return None

    def _may_admit(self, request: Request) -> bool:
        return True

    def _admitted(self, request: Request) -> None:
        """A waiting request has just been admitted."""

    def _consume_extra(self, request: Request, sampled: list[int]) -> bool:
        """Take the sampled tokens of a running request that is not a user's (True: handled)."""
        return False

    # -- one step -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.config.token_budget)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        # The scheduled tokens will be computed by this step: count them now, so the next
        # schedule() sees the right progress even before update_from_output runs.
        for req_id, n in plan.num_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_tokens,
            total_num_scheduled_tokens=sum(plan.num_tokens.values()),
            finished_req_ids=finished,
            preempted_req_ids={r.request_id for r in plan.preempted},
            scheduled_spec_tokens=plan.spec_tokens,
        )

    def _schedule_running(self, plan: _StepPlan) -> None:
        for request in self._running_order():
            if plan.budget <= 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted or dropped to make room earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            if request.mm_inputs:  # an image's tokens in one chunk (core/multimodal.py)
                num_new = cut_chunk(request.mm_inputs, request.num_computed_tokens, num_new)
                if num_new == 0:
                    continue  # the rest of an image waits for a step with the budget for it
            drafts = self._drafts(request, num_new, plan.budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new + len(drafts))
            if new_blocks is None and drafts:  # no room to verify: decode plainly instead
                drafts = []
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self._make_room(request, plan)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                continue
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
                num_new += len(drafts)
            plan.cached_reqs.append(
                CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
            )
            plan.num_tokens[request.request_id] = num_new
            plan.budget -= num_new

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposed tokens a decoding request verifies this step: within the step's budget,
        the context length and its max_tokens (a token past them could never be kept)."""
        if not request.spec_token_ids or num_new != 1:
            return []
        room = min(
            budget - 1,
            self.max_model_len - request.num_tokens,
            request.max_tokens - request.num_output_tokens - 1,
        )
        return request.spec_token_ids[: max(0, room)]

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        request.spec_token_ids = []
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        plan.preempted.append(request)
        # Victims come from the tail of `running`, which this step has not reached yet (or is the
        # request being scheduled itself), so no already-scheduled work is undone.
        assert request.request_id not in plan.num_tokens

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        self._open_admission()
        kv = self.kv_cache_manager
        # Requests whose adapter cannot join this step's (all `max_loras` slots taken) step aside
        # for the ones behind them, as vLLM's do, and go back to their places afterwards: a
        # request for a busy adapter must not hold up the base model's or a running adapter's.
        skipped: list[Request] = []
        while plan.budget > 0:
            pending = self._admit_pending(plan)
            if pending is not None:
                if not pending:
                    break
                continue
            if len(self.waiting) == 0 or self._num_members() >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if not self._adapter_fits(request):
                skipped.append(self.waiting.pop())
                continue
            if not self._may_admit(request):
                break
            # Prompt logprobs, mean and cls pooling need every prompt position computed: no
            # prefix-cache hit then (`last` pooling reads the last token, which a hit never covers).
            pooling = request.pooling_params
            every_token = request.sampling_params.prompt_logprobs is not None or (
                pooling is not None and pooling.needs_every_token
            )
            computed_blocks, num_computed = ([], 0) if every_token else kv.get_computed_blocks(request)
            if not self._admit(request, plan, computed_blocks, num_computed):
                break
            self.waiting.pop()
            self._admitted(request)
        for request in reversed(skipped):  # back at the head, in their order
            self.waiting.prepend(request)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether `request`'s LoRA adapter may join the running ones: every step runs all
        running requests, so their distinct adapters are the step's. One that does not fit keeps
        its place in the queue until an adapter's requests end; the requests behind it may go."""
        if not request.lora_id or self.max_loras is None:
            return True
        in_use = {r.lora_id for r in self.running if r.lora_id}
        return request.lora_id in in_use or len(in_use) < self.max_loras

    def _admit(self, request: Request, plan: _StepPlan, computed_blocks: list, num_computed: int) -> bool:
        """Start running a request (its first chunk in this step) if the KV pool allows."""
        kv = self.kv_cache_manager
        if self.config.admission == "reserve" and not self._fits_reservation(request):
            return False
        num_new = min(request.num_tokens - num_computed, plan.budget)
        if request.mm_inputs:  # an image's tokens in one chunk (core/multimodal.py)
            num_new = cut_chunk(request.mm_inputs, num_computed, num_new)
            if num_new == 0:
                return False
        if not self.chunked_prefill and num_new < request.num_tokens - num_computed:
            return False  # waits for a step whose budget holds its whole prompt
        new_blocks = kv.allocate_slots(request, num_new, computed_blocks, num_computed)
        if new_blocks is None:
            return False
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        plan.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                eos_token_ids=request.eos_token_ids,
                block_ids=kv.get_block_ids(request.request_id),
                num_computed_tokens=num_computed,
                pooling_params=request.pooling_params,
                lora_id=request.lora_id,
                mm_inputs=request.mm_inputs,
            )
        )
        plan.num_tokens[request.request_id] = num_new
        plan.budget -= num_new
        return True

    def _total_len(self, request: Request) -> int:
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def _fits_reservation(self, request: Request) -> bool:
        """Reserve admission: blocks for this request's whole length must be free after every
        running request is guaranteed its own."""
        kv = self.kv_cache_manager
        reserved = sum(kv.num_blocks_needed(r, self._total_len(r)) for r in self.running)
        return kv.num_blocks_needed(request, self._total_len(request)) <= kv.get_num_free_blocks() - reserved

    # -- after the forward pass --------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        self.num_steps += 1
        outputs: list[EngineCoreOutput] = []
        for req_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            if self._consume_extra(request, sampled):
                continue
            drafts = scheduler_output.scheduled_spec_tokens.get(req_id)
            if drafts is not None:
                self._verified(request, len(drafts), len(sampled) - 1)
            embedding = runner_output.pooled.get(req_id)
            if embedding is not None:  # an embedding request's prefill is done: so is the request
                self._end(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(
                    EngineCoreOutput(req_id, [], "stop", num_cached_tokens=request.num_cached_tokens,
                                     embedding=embedding)
                )  # fmt: skip
                continue
            prompt_lp = runner_output.prompt_logprobs.get(req_id)
            if not sampled and prompt_lp is None:
                continue
            out = EngineCoreOutput(
                req_id, [], prompt_logprobs=prompt_lp, num_cached_tokens=request.num_cached_tokens
            )
            for token in sampled:
                request.output_token_ids.append(token)
                out.new_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self._end(request, status)
                    out.finish_reason = status.finish_reason()
                    out.stop_reason = request.stop_reason
                    break
            if sampled:
                lp = runner_output.logprobs.get(req_id)
                kept = len(out.new_token_ids)
                if lp is not None and len(lp.ranks) > kept:  # a stop among verified tokens: drop the rest
                    lp = Logprobs(lp.token_ids[:kept], lp.logprobs[:kept], lp.ranks[:kept])
                out.logprobs = lp
            outputs.append(out)
        self._after_step()
        return outputs

    def _verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A request verified `num_drafts` proposed tokens and kept `num_accepted`: the rejected
        ones' KV slots are given back (overwritten by the next tokens), and the counts are
        recorded, engine-wide and in the request's decayed acceptance (spec_decode/controller.py)."""
        request.num_computed_tokens -= num_drafts - num_accepted
        request.spec_token_ids = []
        request.spec_accepted = SPEC_DECAY * request.spec_accepted + num_accepted
        request.spec_rejected = SPEC_DECAY * request.spec_rejected + (num_accepted < num_drafts)
        request.spec_idle = 0
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.spec_accepted_per_pos[i] += 1

    @property
    def spec_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's counts so far (None when it is off)."""
        if not self.max_spec_tokens:
            return None
        return SpecDecodingStats(
            self.spec_num_drafts, self.spec_num_draft_tokens, self.spec_num_accepted_tokens,
            tuple(self.spec_accepted_per_pos),
        )  # fmt: skip

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def stats(self, step_tokens: int = 0, lora_names: Mapping[int, str] | None = None) -> SchedulerStats:
        """`lora_names`: adapter id -> name, for the LoRA record (ids when absent)."""
        kv = self.kv_cache_manager
        pc = kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_blocks - kv.get_num_free_blocks(),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_steps=self.num_steps,
            step_tokens=step_tokens,
            spec=self.spec_stats,
            lora=None if self.max_loras is None else self._lora_stats(lora_names or {}),
        )

    def _lora_stats(self, names: Mapping[int, str]) -> LoRAStats:
        assert self.max_loras is not None
        running = {r.lora_id for r in self.running if r.lora_id}
        waiting = {r.lora_id for r in self.waiting if r.lora_id} - running
        return LoRAStats(
            self.max_loras,
            tuple(sorted(names.get(i, str(i)) for i in running)),
            tuple(sorted(names.get(i, str(i)) for i in waiting)),
        )


def make_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    num_kv_blocks: int,
    max_model_len: int,
    num_speculative_tokens: int = 0,
    max_loras: int | None = None,
    chunked_prefill: bool = True,
) -> Scheduler:
    """The scheduler for `scheduler_config.mode`: continuous batching (with speculative decoding
    when `num_speculative_tokens` > 0), or a static mode (never speculative)."""
    if scheduler_config.is_static:
        from llmserve.core.static_scheduler import StaticBatchScheduler

        if max_loras is not None:
            raise ValueError(
                f"LoRA adapters need continuous batching; batching mode is {scheduler_config.mode!r}"
            )
        return StaticBatchScheduler(scheduler_config, cache_config, num_kv_blocks, max_model_len)
    return Scheduler(
        scheduler_config,
        cache_config,
        num_kv_blocks,
        max_model_len,
        num_speculative_tokens,
        max_loras,
        chunked_prefill,
    )

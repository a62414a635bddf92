"""`StaticBatchScheduler`: the request-level batching that continuous batching replaced (HF
`generate`, FasterTransformer; Orca's baseline), run by this engine for comparison
(`SchedulerConfig.mode` `static` or `static-ragged`).

A batch of the next `max_num_seqs` waiting requests runs until its longest member finishes, and no
other request joins meanwhile. A fixed-shape batch is padded in both directions, and so is this one:
  - prompts (`static` only): a member shorter than the batch's longest prompt brings a
    prompt-padding sequence of the missing length (pad tokens, prefilled beside it, never
    decoding, its K/V dropped when its prefill is done), so the batch computes as many prompt rows
    as a left-padded [B, longest] batch. The pad positions are not attended to by the member, so
    its tokens do not change; a padded batch would also attend over them, so this is a lower bound
    of a padded batch's cost.
  - outputs: a member that finishes early is reported finished at once but keeps its slot and its
    blocks as padding: it is still computed every step (its tokens are discarded), as a
    fixed-shape batch computes finished rows, until the whole batch is done.
`static-ragged` pads outputs only: prompts of different lengths share a batch as they are, which
needs what continuous batching brought (ragged batches, paged K/V); it isolates what admitting
requests every step is worth on its own.

Everything else (chunked prefill, the KV pool, preemption when blocks run out, stop conditions) is
the base `Scheduler`'s; this class only overrides its hooks.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler, _StepPlan
from llmserve.sampling_params import SamplingParams

# A prompt-padding sequence's tokens and sampling: its values do not change what it costs.
_PAD_TOKEN = 0
_PAD_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class StaticBatchScheduler(Scheduler):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
    ) -> None:
        if not scheduler_config.is_static:
            raise ValueError(
                f"StaticBatchScheduler runs the static modes; got mode {scheduler_config.mode!r}"
            )
        super().__init__(scheduler_config, cache_config, num_kv_blocks, max_model_len)
        # The unfinished members of the batch being run (empty when a new batch may form), and
        # the finished members still computed as padding until the batch is done.
        self._static_batch: set[str] = set()
        self._padding: list[Request] = []
        # Each member's prompt-padding sequence, made when its batch forms, queued when the member
        # is admitted, admitted right after it.
        self._prompt_pads: dict[str, Request] = {}
        self._pending_pads: deque[Request] = deque()

    # -- requests in and out ----------------------------------------------------------------------

    def finish_requests(
        self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        # a padding row is already finished for its user; the batch frees it
        members = [i for i in req_ids if (r := self.requests.get(i)) is None or not r.padding]
        super().finish_requests(members, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._static_batch.discard(request.request_id)
        self._prompt_pads.pop(request.request_id, None)  # a member aborted before admission
        super()._finish(request, status)

    def _end(self, request: Request, status: RequestStatus) -> None:
        """Done for its user: kept as padding while other members of its batch still run."""
        if len(self._static_batch) > 1:
            request.padding = True
            self._static_batch.discard(request.request_id)
            self._padding.append(request)
            return
        super()._end(request, status)

    def _after_step(self) -> None:
        """Free the padding rows once their batch has no unfinished member left."""
        if self._static_batch or not (self._padding or self._pending_pads or self._prompt_pads):
            return
        self._prompt_pads.clear()
        self._pending_pads.clear()
        for request in self._padding:
            self.running.remove(request)
            self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
        self._padding = []

    def _drop_padding(self, request: Request) -> None:
        """A padding row leaves before its batch ends (a prompt pad done, or room needed)."""
        self._padding.remove(request)
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)

    # -- one step ---------------------------------------------------------------------------------

    def _running_order(self) -> list[Request]:
        # Members in admission order, then padding: padding never takes a block or budget a
        # member needs, and can give its blocks back without undoing scheduled work.
        return [r for r in self.running if not r.padding] + self._padding

    def _num_members(self) -> int:
        # padding rows are not members: they do not count against max_num_seqs
        return len(self.running) - len(self._padding)

    def _make_room(self, request: Request, plan: _StepPlan) -> Request:
        """Drop the newest padding row first (padding has no user left, so it is not recomputed);
        else preempt as the base does. Padding comes after every member, so none of it has been
        scheduled in this step yet."""
        if self._padding:
            victim = request if request.padding else self._padding[-1]
            self._drop_padding(victim)
            return victim
        return super()._make_room(request, plan)

    def _open_admission(self) -> None:
        if not self._static_batch:
            self._form_batch()

    def _admit_pending(self, plan: _StepPlan) -> bool | None:
        """The prompt padding of the member admitted last goes in right after it."""
        if not self._pending_pads:
            return None
        pad = self._pending_pads[0]
        if not self._admit(pad, plan, [], 0):
            return False
        self._pending_pads.popleft()
        self.requests[pad.request_id] = pad
        self._padding.append(pad)
        return True

    def _may_admit(self, request: Request) -> bool:
        return request.request_id in self._static_batch

    def _admitted(self, request: Request) -> None:
        if (pad := self._prompt_pads.pop(request.request_id, None)) is not None:
            self._pending_pads.append(pad)

    def _consume_extra(self, request: Request, sampled: list[int]) -> bool:
        if not request.padding:
            return False
        # computed like the rest of the batch; its tokens go nowhere
        request.output_token_ids.extend(sampled)
        if sampled and (request.prompt_padding or request.num_tokens >= self.max_model_len):
            self._drop_padding(request)
        return True

    def _form_batch(self) -> None:
        """The next `max_num_seqs` waiting requests become a batch; in `static` mode, each member
        shorter than the longest prompt gets its prompt-padding sequence."""
        members = list(itertools.islice(self.waiting, self.config.max_num_seqs))
        self._static_batch = {r.request_id for r in members}
        if self.config.mode != "static" or not members:
            return
        width = max(r.num_tokens for r in members)
        for r in members:
            if r.num_tokens < width:
                self._prompt_pads[r.request_id] = Request(
                    request_id=f"{r.request_id}#prompt-padding",
                    prompt_token_ids=[_PAD_TOKEN] * (width - r.num_tokens),
                    sampling_params=_PAD_PARAMS,
                    max_tokens=1,
                    padding=True,
                    prompt_padding=True,
                )

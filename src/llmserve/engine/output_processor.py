"""Output processing: engine-core outputs (token ids per request per step) -> `RequestOutput`s.

Owns, per user request: the `n` child sequences the engine fanned it out into, their incremental
detokenizers (stop strings are found here, and the engine then aborts that child in the
scheduler), their logprobs in the user-facing shape, and the prompt logprobs (first entry None).
Runs once per step over the requests that produced something; no work for idle requests. The
same pass keeps each sequence's timestamps and feeds the step's `IterationStats` (metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmserve.core.sched_output import Logprobs
from llmserve.core.scheduler import EngineCoreOutput
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.metrics.stats import IterationStats, SequenceTimes
from llmserve.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import Tokenizer


def _positions(lp: Logprobs) -> list[PositionLogprobs]:
    """Rows of (chosen token first, then top-k) -> {token: (logprob, rank)} per position."""
    out: list[PositionLogprobs] = []
    for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True):
        position = {ids[0]: (lps[0], rank)}
        for j in range(1, len(ids)):
            position.setdefault(ids[j], (lps[j], j))
        out.append(position)
    return out


@dataclass(slots=True)
class _Child:
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    times: SequenceTimes
    num_sent_tokens: int = 0
    """Delta mode: output tokens already handed out."""
    finish_sent: bool = False
    """Delta mode: its finish went out."""

    def delta(self) -> CompletionOutput:
        """A new `CompletionOutput` holding only what changed since the last delta (delta mode)."""
        c, sent = self.completion, self.num_sent_tokens
        self.num_sent_tokens = len(c.token_ids)
        self.finish_sent = c.finished
        text = "" if self.detokenizer is None else self.detokenizer.get_next_output_text(c.finished, True)
        return CompletionOutput(
            index=c.index,
            text=text,
            token_ids=c.token_ids[sent:],
            cumulative_logprob=c.cumulative_logprob,
            logprobs=None if c.logprobs is None else c.logprobs[sent:],
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    child_order: list[str] = field(default_factory=list)
    delta: bool = False
    """Each output carries only what is new (fresh objects, safe to hand to another thread);
    otherwise the same accumulating `CompletionOutput`s are returned every step."""
    final_only: bool = False
    """No output until the request finishes (the offline `LLM`, which keeps only finished ones):
    a step builds no `RequestOutput` and joins no text for it."""
    prompt_logprobs_sent: bool = False
    embedding: list[float] | None = None

    def due(self, interval: int) -> bool:
        """Whether a delta goes out this step under a stream interval of `interval` tokens: a
        sample's first tokens, `interval` new ones, or its finish."""
        for child in self.children.values():
            c, sent = child.completion, child.num_sent_tokens
            new = len(c.token_ids) - sent
            if (new and (sent == 0 or new >= interval)) or (c.finished and not child.finish_sent):
                return True
        return False

    def to_output(self, finished: bool) -> RequestOutput:
        prompt_logprobs = self.prompt_logprobs
        if self.delta:
            outputs = [self.children[c].delta() for c in self.child_order]
            # prompt logprobs go out once, with the first output after the whole prompt ran
            prompt_done = any(o.token_ids or o.finished for o in outputs)
            if self.prompt_logprobs_sent or not prompt_done:
                prompt_logprobs = None
            self.prompt_logprobs_sent |= prompt_done
        else:
            for child in self.children.values():
                if child.detokenizer is not None:
                    child.completion.text = child.detokenizer.get_next_output_text(
                        child.completion.finished, False
                    )
            outputs = [self.children[c].completion for c in self.child_order]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            embedding=self.embedding,
            metrics=self.metrics,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1) -> None:
        """`stream_interval`: a delta request's output every this many tokens (SchedulerConfig)."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._requests: dict[str, _RequestState] = {}
        self._parent_of: dict[str, str] = {}  # child id -> request id

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        arrival_time: float,
        delta: bool = False,
        max_tokens: int = 0,
        lora_name: str | None = None,
        final_only: bool = False,
    ) -> None:
        children = {
            cid: _Child(
                CompletionOutput(
                    index=i,
                    text="",
                    token_ids=[],
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                ),
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                SequenceTimes(arrival_time, len(prompt_token_ids), max_tokens, params.n, lora_name),
            )
            for i, cid in enumerate(child_ids)
        }
        self._requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, children, RequestMetrics(arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            num_unfinished=len(child_ids), child_order=list(child_ids), delta=delta, final_only=final_only,
        )  # fmt: skip
        for cid in child_ids:
            self._parent_of[cid] = request_id

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def child_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        return list(state.child_order) if state else []

    def mark_scheduled(self, child_ids: list[str], now: float) -> None:
        """These sequences were scheduled for the first time (or again, after a preemption)."""
        for cid in child_ids:
            request_id = self._parent_of.get(cid)
            if request_id is None:
                continue
            state = self._requests[request_id]
            times = state.children[cid].times
            if times.first_scheduled is None:
                times.first_scheduled = now
                if state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = now

    def abort_request(self, request_id: str, stats: IterationStats) -> RequestOutput | None:
        """Mark every unfinished child aborted; returns the final output."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        now = time.monotonic()
        for cid, child in state.children.items():
            self._parent_of.pop(cid, None)
            if not child.completion.finished:
                child.completion.finish_reason = "abort"
                stats.observe_finished(child.times, "abort", now)
        state.metrics.finished_time = now
        return state.to_output(finished=True)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], stats: IterationStats
    ) -> tuple[list[RequestOutput], list[str]]:
        """(outputs of requests that changed this step, child ids to abort because of a stop string)."""
        now = stats.timestamp
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            request_id = self._parent_of.get(out.req_id)
            if request_id is None:
                continue
            state = self._requests[request_id]
            child = state.children[out.req_id]
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.embedding is not None:
                state.embedding = out.embedding
                stats.observe_pooled(child.times, now)
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(_positions(out.prompt_logprobs))
            stopped = self._update_child(child, out)  # may cut new_token_ids at a stop string
            if out.new_token_ids:
                stats.observe_tokens(child.times, len(out.new_token_ids), now)
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
                state.metrics.num_generation_tokens += len(out.new_token_ids)
            if stopped:
                to_abort.append(out.req_id)
            if child.completion.finished:
                state.num_unfinished -= 1
                stats.observe_finished(child.times, child.completion.finish_reason, now)
            changed[request_id] = state
        results = []
        for request_id, state in changed.items():
            finished = state.num_unfinished == 0
            if finished:
                state.metrics.finished_time = now
                del self._requests[request_id]
                for cid in state.child_order:
                    self._parent_of.pop(cid, None)
            elif state.final_only or (
                self.stream_interval > 1 and state.delta and not state.due(self.stream_interval)
            ):
                continue  # no output this step: only the final one, or the stream interval's next
            results.append(state.to_output(finished))
        return results, to_abort

    def _update_child(self, child: _Child, out: EngineCoreOutput) -> bool:
        """Apply one step to a child; True when a stop string finished it (the engine must abort it).

        A step may bring several tokens (speculative decoding): when a stop string ends at an
        earlier one, the tokens after it are dropped, as if they had come one per step."""
        c = child.completion
        stop_string = None
        if child.detokenizer is not None and out.new_token_ids:
            stop_terminated = out.finish_reason == "stop"
            before = child.detokenizer.num_tokens
            stop_string = child.detokenizer.update(out.new_token_ids, stop_terminated)
            taken = child.detokenizer.num_tokens - before
            # (a terminating EOS is never taken as text, and stays when nothing came after the stop)
            if stop_string is not None and taken < len(out.new_token_ids) - stop_terminated:
                del out.new_token_ids[taken:]
                if out.logprobs is not None:
                    out.logprobs = Logprobs(
                        out.logprobs.token_ids[:taken],
                        out.logprobs.logprobs[:taken],
                        out.logprobs.ranks[:taken],
                    )
        c.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None and c.logprobs is not None:
            positions = _positions(out.logprobs)
            c.logprobs.extend(positions)
            c.cumulative_logprob = (c.cumulative_logprob or 0.0) + sum(
                p[t][0] for p, t in zip(positions, out.new_token_ids, strict=True)
            )
        if stop_string is not None:  # a stop string wins over a length cap in the same step
            c.finish_reason, c.stop_reason = "stop", stop_string
            return out.finish_reason is None  # still running in the scheduler: abort it there
        if out.finish_reason is not None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return False

"""`AsyncEngine`: the engine behind an asyncio server.

    engine thread:  loop { apply queued adds/aborts; step(); hand each step's outputs to the loop }
    event loop:     add_request() -> RequestStream (an async iterator of per-step deltas)

The step loop runs in one background thread, the only thread that touches the scheduler, the
runner and the output processor; torch releases the GIL inside its kernels, so the event loop stays
responsive while a step computes. Requests and aborts reach the thread through a command queue and
are applied between steps; outputs come back once per step in one `call_soon_threadsafe`.

Input checks (tokenization, context length, parameters against the vocabulary) run before a
request is queued, so a bad request fails with a `ValueError` before any byte is streamed. The
waiting queue is bounded: `QueueFullError` (the server's 429) when `max_queued_requests` sequences
already wait for a slot.

Statistics: the engine thread takes each step's `IterationStats` (plain numbers gathered while the
outputs were processed) and hands them over with the outputs; the stat loggers (Prometheus, the
periodic log line) record them on the event loop, so metrics add no work to the step loop itself.
Traces likewise: with a `tracer` (metrics/tracing.py), each request keeps its caller's trace
context from `add_request`, and its span is made on the event loop from its last output.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from llmserve.engine.llm_engine import LLMEngine, ProcessedPrompt
from llmserve.lora import LoRARequest
from llmserve.metrics.loggers import StatLogger
from llmserve.metrics.stats import IterationStats, SchedulerStats
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.metrics.tracing import RequestTracer

logger = logging.getLogger("llmserve")
T = TypeVar("T")


class QueueFullError(Exception):
    """The waiting queue is at `max_queued_requests`; retry after `retry_after` seconds."""

    def __init__(self, num_waiting: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {num_waiting} requests are waiting; retry in {retry_after} s")
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The step loop failed; no request can complete any more."""


class RequestAbortedError(RuntimeError):
    """The engine side aborted a request someone was still reading (shutdown)."""


class RequestStream:
    """The outputs of one request, one delta per engine step, until `finished`.

    Use as an async iterator inside `async with`: leaving the block early (a client that
    disconnected, a cancelled task) aborts the request, and its KV blocks are freed by the next step.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompt: ProcessedPrompt) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.trace_context: Any = None
        """The caller's OpenTelemetry context when the engine traces requests (its span's parent)."""

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        pending: RequestOutput | BaseException | None = None
        while not self.finished:
            item = pending if pending is not None else await self._queue.get()
            pending = None
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            # a reader that fell behind (a busy event loop) gets the steps that wait as one delta,
            # so its per-delta work (an SSE event, a JSON body) shrinks as the load grows
            while not item.finished and not self._queue.empty():
                following = self._queue.get_nowait()
                if isinstance(following, BaseException):
                    pending = following
                    break
                item = merge_deltas(item, following)
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one: each sample's new tokens, text and
    logprobs joined; finish, cumulative logprob and metrics from the later one."""
    outputs = [
        CompletionOutput(
            b.index,
            a.text + b.text,
            a.token_ids + b.token_ids,
            b.cumulative_logprob,
            None if a.logprobs is None else a.logprobs + (b.logprobs or []),
            b.finish_reason,
            b.stop_reason,
        )
        for a, b in zip(first.outputs, then.outputs, strict=True)
    ]
    return RequestOutput(
        then.request_id, then.prompt, then.prompt_token_ids, outputs, then.finished,
        first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
        max(first.num_cached_tokens, then.num_cached_tokens),
        then.embedding if then.embedding is not None else first.embedding, then.metrics,
    )  # fmt: skip


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int | None = None,
        stat_loggers: Sequence[StatLogger] = (),
    ) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.stat_loggers = list(stat_loggers)
        engine.log_stats = bool(self.stat_loggers)
        self.snapshot: SchedulerStats = engine.scheduler.stats()
        """What the engine thread publishes after each step and after aborts (read by the event
        loop, never locked: one frozen record replaced whole)."""
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._pending_adds = 0  # sequences queued for the engine thread, not yet in the scheduler
        self._num_added = 0  # engine thread: sequences added since the last snapshot
        self._pending_lock = threading.Lock()
        self._mean_latency = 0.0  # seconds, moving average over finished requests (Retry-After)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self.on_dead: Callable[[BaseException], None] | None = None
        """Called on the event loop once the step loop has died and every stream has failed (the
        server uses it to exit non-zero, so that a supervisor restarts it)."""
        self.tracer: RequestTracer | None = None
        """Makes each finished request's span (`--otlp-traces-endpoint`); None: no tracing."""

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Record every step's statistics with `stat_logger` from now on (call on the event loop)."""
        self.stat_loggers.append(stat_logger)
        self.engine.log_stats = True

    # -- life cycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop for an engine built elsewhere; call from the event loop the
        streams will be consumed on. Prefer `launch`, which builds the engine in the step thread."""
        assert self._thread is None, "already started"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def launch(
        cls,
        factory: Callable[[], LLMEngine],
        max_queued_requests: int | None = None,
        stat_loggers: Sequence[StatLogger] = (),
    ) -> AsyncEngine:
        """Build the engine with `factory` in a new thread, which then runs the step loop.

        Loading and stepping happen in the same thread on purpose: torch's OpenMP thread team
        belongs to the thread that runs the ops, and a team left behind by a loading thread that
        stays alive competes with the stepping thread's team for the cores (steps were ~30%
        slower on 2 cores when the model was loaded in another live thread).
        """
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[AsyncEngine] = loop.create_future()

        def resolve(result: AsyncEngine | BaseException) -> None:
            if ready.done():
                return
            if isinstance(result, BaseException):
                ready.set_exception(result)
            else:
                ready.set_result(result)

        def main() -> None:
            try:
                engine = cls(factory(), max_queued_requests, stat_loggers)
            except BaseException as e:
                loop.call_soon_threadsafe(resolve, e)
                return
            engine._loop = loop
            engine._thread = threading.current_thread()
            loop.call_soon_threadsafe(resolve, engine)
            engine._run()

        threading.Thread(target=main, name="llmserve-engine", daemon=True).start()
        return await ready

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Abort everything still running (telling its readers `reason`) and stop the step loop."""
        self.abort_all(reason)
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.engine.close()  # tensor-parallel workers, once no step runs

    def abort_all(self, reason: str) -> None:
        """Abort every accepted request; their readers get `RequestAbortedError(reason)`."""
        for request_id in list(self._streams):
            self.abort(request_id, reason)

    @property
    def num_active(self) -> int:
        """Requests accepted and not finished."""
        return len(self._streams)

    # -- requests (event loop side) -------------------------------------------------------------

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def check_queue(self, num_sequences: int = 1) -> None:
        """Raise `QueueFullError` when `num_sequences` more would overflow the waiting queue."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        limit = self.max_queued_requests
        if limit is None:
            return
        waiting = self.snapshot.num_waiting + self._pending_adds
        if waiting + num_sequences > limit:
            num_slots = max(1, self.engine.scheduler_config.max_num_seqs)
            estimate = (waiting / num_slots + 1) * (self._mean_latency or 1.0)
            raise QueueFullError(waiting, retry_after=min(60, max(1, math.ceil(estimate))))

    async def process_inputs(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        images: Sequence[Any] = (),
        add_special_tokens: bool = True,
        videos: Sequence[Any] = (),
    ) -> ProcessedPrompt:
        """Tokenize and check a prompt (and decode and preprocess its images and videos) off the
        event loop (long prompts take milliseconds, images more)."""
        return await asyncio.to_thread(
            self.engine.process_inputs, prompt, params, images, add_special_tokens, videos
        )

    @property
    def takes_images(self) -> bool:
        """Whether the model takes images (`process_inputs(..., images)`)."""
        return self.engine.images is not None

    @property
    def takes_videos(self) -> bool:
        """Whether the model takes videos (`process_inputs(..., videos=...)`: Qwen2-VL, Qwen2.5-VL)."""
        return self.engine.media.takes_videos

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """Queue a checked prompt (under `lora_request`'s adapter, if any); raises
        `QueueFullError` when the waiting queue is full. `final_only`: the stream yields one
        output, when the request finishes, holding all of it (a reader that wants no deltas: the
        engine then builds no output for it per step)."""
        n = prompt.params.n
        self.check_queue(n)
        stream = RequestStream(self, request_id, prompt)
        if self.tracer is not None:
            stream.trace_context = self.tracer.current_context()
        self._streams[request_id] = stream
        with self._pending_lock:
            self._pending_adds += n

        def add() -> None:
            # still counted as pending until a snapshot counts it as waiting (see _publish)
            self._num_added += n
            try:
                self.engine.add_request(
                    request_id,
                    prompt,
                    priority=priority,
                    delta=True,
                    lora_request=lora_request,
                    final_only=final_only,
                )
            except ValueError as e:
                # A check only the engine makes (a derived per-sample seed, say) failed: fail this
                # request alone, undoing a partial add; the step loop must live on.
                self.engine.abort_request([request_id])
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._fail, request_id, e)

        self._commands.put(add)
        return stream

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Abort a request; its blocks are freed before the next step runs. A reader still
        waiting on its stream gets `RequestAbortedError(reason)`."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream._put(RequestAbortedError(reason))
        self._commands.put(lambda: self.engine.abort_request([request_id]))

    # -- LoRA adapters at run time ------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter in the engine thread, between steps (ValueError when bad)."""
        await self._call(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter between steps; its running and waiting requests finish with it."""
        return await self._call(lambda: self.engine.remove_lora(lora_id))

    async def _call(self, fn: Callable[[], T]) -> T:
        """`fn()` run by the engine thread between two steps; its result or exception."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        assert self._loop is not None, "not started"
        loop = self._loop
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def command() -> None:
            try:
                result = fn()
            except Exception as e:
                loop.call_soon_threadsafe(settle, None, e)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self._commands.put(command)
        return await done

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block for work when idle; otherwise take whatever arrived during the last step.
                applied = 0
                if not engine.has_unfinished_requests():
                    command = self._commands.get()
                    if command is None:
                        return
                    command()
                    applied += 1
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if command is None:
                        return
                    command()
                    applied += 1
                if applied:  # adds and aborts change the state a step may not follow to publish
                    self._publish(engine.scheduler.stats())
                outputs: list[RequestOutput] = []
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    assert engine.last_stats is not None
                    self._publish(engine.last_stats)  # the step's own record, taken after it
                # this step's statistics, or the aborts applied above when nothing runs any more
                stats = engine.take_stats() if self.stat_loggers else None
                if outputs or stats is not None:
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(self._deliver, outputs, stats)
        except BaseException as e:  # a bug or an OOM in a step: fail every request, loudly
            logger.exception("engine step loop failed")
            self.dead = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, e)

    def _publish(self, stats: SchedulerStats) -> None:
        self.snapshot = stats
        if self._num_added:
            # Only now do the new requests show in `num_waiting`; uncounting them as pending any
            # earlier would let `check_queue` see them nowhere and overfill the queue.
            with self._pending_lock:
                self._pending_adds -= self._num_added
            self._num_added = 0

    # -- back on the event loop ------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput], stats: IterationStats | None) -> None:
        if stats is not None:
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.record(stats)
                except Exception:  # a metrics bug must not take requests down with it
                    logger.exception("stat logger %r failed", stat_logger)
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
                if self.tracer is not None:
                    self._trace(stream, out)
                if out.metrics is not None:
                    latency = now - out.metrics.arrival_time
                    self._mean_latency = (
                        0.9 * self._mean_latency + 0.1 * latency if self._mean_latency else latency
                    )

    def _trace(self, stream: RequestStream, out: RequestOutput) -> None:
        assert self.tracer is not None
        try:
            self.tracer.record(out, stream.prompt, stream.trace_context)
        except Exception:  # a tracing bug must not take requests down with it
            logger.exception("tracing request %s failed", out.request_id)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream._put(EngineDeadError(f"the engine stopped: {error!r}"))
        self._streams.clear()
        if self.on_dead is not None:
            self.on_dead(error)

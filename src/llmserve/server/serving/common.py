"""What the completions and chat serving layers share: the model check, request caps, sampling
parameters, token strings for logprobs, usage and timings, running requests to the end or as SSE,
and aborting a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from llmserve.config import ServerConfig
from llmserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import APIError, error_sse
from llmserve.server.protocol import _SamplingFields
from llmserve.server.serving.structured import structured_outputs

logger = logging.getLogger("llmserve.server")

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class ServingContext:
    """The engine behind the server and the server's own settings."""

    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    _token_strs: dict[int, str] = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    def token_str(self, token_id: int) -> str:
        """A token's own text, as logprobs show it (special tokens spelled out)."""
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def top_logprobs(self, position: PositionLogprobs, k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of a position, most likely first."""
        ranked = sorted((rank, tid, lp) for tid, (lp, rank) in position.items() if rank <= k)
        return [(tid, lp) for _, tid, lp in ranked[:k]]


def check_caps(ctx: ServingContext, req: _SamplingFields, logprobs: int | None, logprobs_name: str) -> None:
    cfg = ctx.config
    if not 1 <= req.n <= cfg.max_n:
        raise APIError(400, f"n must be in [1, {cfg.max_n}]; got {req.n}", param="n")
    if logprobs is not None and not 0 <= logprobs <= cfg.max_logprobs:
        raise APIError(
            400, f"{logprobs_name} must be in [0, {cfg.max_logprobs}]; got {logprobs}", param=logprobs_name
        )
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > cfg.max_stop:
        raise APIError(400, f"stop has {len(stop)} strings; at most {cfg.max_stop} are allowed", param="stop")
    for s in stop:
        if not s or len(s) > cfg.max_stop_length:
            raise APIError(
                400, f"each stop string must have 1 to {cfg.max_stop_length} characters; got {len(s)}",
                param="stop",
            )  # fmt: skip


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids; got {key!r}", param="logit_bias"
            ) from None
        out[token] = value
    return out


def sampling_params(
    req: _SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    """The engine's parameters for a request; range errors become a 400 naming the parameter."""
    constraint, _ = structured_outputs(req)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=logit_bias(req.logit_bias),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=constraint,
        )
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


async def process_prompt(
    ctx: ServingContext,
    prompt: str | Sequence[int],
    params: SamplingParams,
    req: _SamplingFields | None = None,
) -> ProcessedPrompt:
    """Tokenize and check one prompt; a prompt that cannot fit is a 400 with both numbers, an
    invalid structured-output constraint a 400 naming the field it came in."""
    try:
        return await ctx.engine.process_inputs(prompt, params)
    except ValueError as e:
        param = getattr(e, "param", None)
        if param == "structured_outputs" and req is not None:
            param = structured_outputs(req)[1] or param
        raise APIError(400, str(e), param=param) from None


def start_requests(
    ctx: ServingContext, prompts: list[ProcessedPrompt], priority: int, prefix: str
) -> list[RequestStream]:
    """Queue every prompt of one API request, or none of them (429 when the queue is full)."""
    engine = ctx.engine
    num_sequences = sum(p.params.n for p in prompts)
    limit = ctx.config.max_queued_requests
    if limit is not None and num_sequences > max(limit, 1):
        # retrying could never help: the request alone is larger than the queue
        raise APIError(
            400, f"this request needs {num_sequences} sequences (prompts x n); the server queues at most {limit}",
            param="n",
        )  # fmt: skip
    try:
        engine.check_queue(num_sequences)
    except QueueFullError as e:
        raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None
    streams = [engine.add_request(engine.new_request_id(prefix), p, priority) for p in prompts]
    for stream in streams:
        p = stream.prompt
        logger.info(
            "request %s: %d prompt tokens, n=%d, max_tokens=%d%s",
            stream.request_id, len(p.token_ids), p.params.n, p.max_tokens,
            f", prompt={p.text if p.text is not None else p.token_ids!r}" if ctx.config.log_requests else "",
        )  # fmt: skip
    return streams


class _RequestLog:
    """One line per finished request: sizes and timing always, the output text only when asked."""

    def __init__(self, ctx: ServingContext, stream: RequestStream) -> None:
        self.log_text = ctx.config.log_requests
        self.request_id = stream.request_id
        self.texts: dict[int, str] = {}
        self.num_tokens = 0
        self.start = time.monotonic()

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.num_tokens += len(c.token_ids)
            if self.log_text:
                self.texts[c.index] = self.texts.get(c.index, "") + c.text
        if out.finished:
            reasons = ",".join(sorted({c.finish_reason or "?" for c in out.outputs}))
            logger.info(
                "request %s finished (%s): %d output tokens in %.2f s%s",
                self.request_id, reasons, self.num_tokens, time.monotonic() - self.start,
                f", output={[self.texts[i] for i in sorted(self.texts)]!r}" if self.log_text else "",
            )  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass
class Choice:
    """One choice (prompt index x sample) accumulated from deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Timings:
    """llama.cpp's per-response `timings`, from the engine's timestamps of the finished requests.

    prompt: the tokens computed for the prompts (cached tokens apart, as `cache_n`), from the first
    scheduling to the first token; predicted: every generated token, timed from the first token to
    the last, so the rate counts the tokens after each sequence's first. Several prompts (or n > 1)
    are timed as one span from the earliest start to the latest end.
    """

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []

    def add(self, out: RequestOutput) -> None:
        if out.finished and out.metrics is not None:
            self.outputs.append(out)

    def as_dict(self) -> dict[str, Any]:
        ms = [o.metrics for o in self.outputs if o.metrics is not None]
        cache_n = sum(o.num_cached_tokens for o in self.outputs)
        prompt_n = sum(len(o.prompt_token_ids) for o in self.outputs) - cache_n
        predicted_n = sum(m.num_generation_tokens for m in ms)
        scheduled = [m.first_scheduled_time for m in ms if m.first_scheduled_time is not None]
        firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
        lasts = [m.last_token_time for m in ms if m.last_token_time is not None]
        prompt_s = max(firsts) - min(scheduled) if scheduled and firsts else 0.0
        predicted_s = max(lasts) - min(firsts) if firsts else 0.0
        num_sequences = sum(
            len(o.outputs) for o, m in zip(self.outputs, ms, strict=True) if m.first_token_time
        )
        after_first = max(predicted_n - num_sequences, 0)
        queue_s = min(scheduled) - min(m.arrival_time for m in ms) if scheduled else 0.0

        def rate(n: float, seconds: float) -> float:
            return n / seconds if seconds > 0 else 0.0

        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": 1000 * prompt_s,
            "prompt_per_token_ms": rate(1000 * prompt_s, prompt_n),
            "prompt_per_second": rate(prompt_n, prompt_s),
            "predicted_n": predicted_n,
            "predicted_ms": 1000 * predicted_s,
            "predicted_per_token_ms": rate(1000 * predicted_s, after_first),
            "predicted_per_second": rate(after_first, predicted_s),
            "queue_ms": 1000 * queue_s,
        }


def closing_chunk(header: dict[str, Any], usage: Usage | None, timings: Timings | None) -> str | None:
    """The stream's last event before [DONE], when there is anything to close with: no choices,
    then `usage` (stream_options.include_usage) and/or `timings`."""
    if usage is None and timings is None:
        return None
    last: dict[str, Any] = {**header, "choices": []}
    if usage is not None:
        last["usage"] = usage.as_dict()
    if timings is not None:
        last["timings"] = timings.as_dict()
    return sse(last)


def wants_timings(ctx: ServingContext, req: _SamplingFields) -> bool:
    return ctx.config.enable_response_timings if req.return_timings is None else req.return_timings


async def merged(
    ctx: ServingContext, streams: list[RequestStream], timings: Timings | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta) from several streams as they come; aborts all of them when left early."""
    logs = [_RequestLog(ctx, s) for s in streams]
    if len(streams) == 1:
        async with streams[0] as s:
            async for out in s:
                logs[0].add(out)
                if timings is not None:
                    timings.add(out)
                yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                logs[i].add(item)
                if timings is not None:
                    timings.add(item)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(
    request: Request, work: Callable[[], Any], streams: list[RequestStream]
) -> Any:
    """Await `work()`; if the client disconnects first, abort `streams` and give up."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    for s in streams:
        s.abort()
    logger.info("client disconnected; aborted %d request(s)", len(streams))
    raise APIError(499, "client disconnected")


def engine_error(e: Exception) -> APIError:
    """An error raised while a request ran (the engine died)."""
    if isinstance(e, RequestAbortedError):
        return APIError(503, f"the request was aborted: {e}", code="aborted")
    if isinstance(e, ValueError):  # refused by a check only the engine thread makes
        return APIError(400, str(e), param=getattr(e, "param", None))
    # the engine died under an accepted request: the server's fault, a 500 (new requests get 503)
    return APIError(500, str(e), code="engine_error")


async def sse_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE body: chunks, then [DONE]; an error after the first byte is a data: {"error"} event."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as e:
        yield error_sse(e)
    except RequestAbortedError as e:  # the server is shutting down: expected, no traceback
        yield error_sse(engine_error(e))
    except Exception as e:
        logger.exception("error while streaming")
        yield error_sse(engine_error(e))
    yield SSE_DONE

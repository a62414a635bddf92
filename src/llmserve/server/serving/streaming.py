"""Running requests: the engine's outputs merged across a request's prompts, a log line per
finished request, aborting a request whose client went away, engine failures as 500s or SSE
error events, and `respond`, the one path that turns a request's outputs into a whole response or
an SSE stream for completions and chat alike (each endpoint supplies only its `ChoiceBuilder`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from llmserve.engine.async_engine import RequestAbortedError, RequestStream
from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.server.errors import APIError, error_sse
from llmserve.server.protocol import _SamplingFields
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.outputs import SSE_DONE, Choice, Envelope, Timings, Usage, new_id, wants_timings

logger = logging.getLogger("llmserve.server")


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
    """Await `work()`; if the client disconnects first, abort `streams` and give up. The server
    may notice the disconnect first and cancel this handler instead: the same abort then."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        _abort_for_disconnect(task, streams)
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    _abort_for_disconnect(task, streams)
    raise APIError(499, "client disconnected")


def _abort_for_disconnect(task: asyncio.Future[Any], streams: list[RequestStream]) -> None:
    task.cancel()
    for s in streams:
        s.abort()
    logger.info("client disconnected; aborted %d request(s)", len(streams))


def engine_error(e: Exception) -> APIError:
    """An error raised while a request ran (the engine died)."""
    if isinstance(e, RequestAbortedError):
        return APIError(503, f"the request was aborted: {e}", code="aborted")
    if isinstance(e, ValueError):  # refused by a check only the engine thread makes
        return APIError(400, str(e), param=getattr(e, "param", None))
    # the engine died under an accepted request: the server's fault, a 500 (new requests get 503)
    return APIError(500, str(e), code="engine_error")


async def sse_with_errors(
    chunks: AsyncIterator[str], error_event: Callable[[APIError], str] = error_sse, last: str = SSE_DONE
) -> AsyncIterator[str]:
    """The SSE body: chunks, then `last` ([DONE]); an error after the first byte is an
    `error_event` (OpenAI's: a data: {"error"} event)."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as e:
        yield error_event(e)
    except RequestAbortedError as e:  # the server is shutting down: expected, no traceback
        yield error_event(engine_error(e))
    except Exception as e:
        logger.exception("error while streaming")
        yield error_event(engine_error(e))
    if last:
        yield last


class ChoiceBuilder:
    """What one endpoint adds to `respond`: its objects' names and how its choices look, whole
    and streamed. Choice `i * n + j` is sample j of prompt i."""

    id_prefix = ""
    whole_object = ""
    chunk_object = ""

    def __init__(self, n: int) -> None:
        self.n = n

    def see(self, prompt_index: int, out: RequestOutput) -> None:
        """Each engine output, before its choices' deltas are taken (prompt logprobs come here)."""

    def delta(self, c: CompletionOutput) -> CompletionOutput:
        """A choice's delta as the endpoint counts and shows it (usage counts its tokens)."""
        return c

    def opening(self) -> list[dict[str, Any]]:
        """Chunk choices sent before any token is computed."""
        return []

    def whole(self, choice: Choice) -> dict[str, Any]:
        """A finished choice of the whole response."""
        raise NotImplementedError

    def chunks(self, index: int, c: CompletionOutput) -> list[dict[str, Any]]:
        """Chunk choices for one delta of choice `index` ([] holds it back); when the delta
        finishes the choice, the last one carries its finish_reason."""
        raise NotImplementedError


async def respond(
    ctx: ServingContext,
    raw: Request,
    req: _SamplingFields,
    prompts: Sequence[ProcessedPrompt],
    streams: list[RequestStream],
    builder: ChoiceBuilder,
) -> Any:
    """The response to a request whose `streams` (one per prompt) are running: an SSE stream when
    it asked for one, else the whole response once every choice is done."""
    options = req.stream_options
    envelope = Envelope(
        new_id(builder.id_prefix), ctx.model_name, builder.whole_object, builder.chunk_object,
        Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts)),
        Timings() if wants_timings(ctx, req) else None,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
    )  # fmt: skip
    if req.stream:
        body = sse_with_errors(_stream(ctx, streams, envelope, builder))
        return StreamingResponse(body, media_type="text/event-stream")
    return await run_unless_disconnected(raw, lambda: _whole(ctx, streams, envelope, builder), streams)


async def _whole(
    ctx: ServingContext, streams: list[RequestStream], envelope: Envelope, builder: ChoiceBuilder
) -> JSONResponse:
    n = builder.n
    choices = [Choice(i) for i in range(len(streams) * n)]
    cached = [0] * len(streams)
    try:
        async for i, out in merged(ctx, streams, envelope.timings):
            cached[i] = out.num_cached_tokens
            builder.see(i, out)
            for c in out.outputs:
                choices[i * n + c.index].add(builder.delta(c))
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from None
    envelope.usage.cached_tokens = sum(cached)
    envelope.usage.completion_tokens = sum(len(choice.token_ids) for choice in choices)
    return JSONResponse(envelope.response([builder.whole(choice) for choice in choices]))


async def _stream(
    ctx: ServingContext, streams: list[RequestStream], envelope: Envelope, builder: ChoiceBuilder
) -> AsyncIterator[str]:
    n = builder.n
    for choice in builder.opening():
        yield envelope.chunk([choice])
    finished = [False] * (len(streams) * n)
    cached = [0] * len(streams)
    async for i, out in merged(ctx, streams, envelope.timings):
        cached[i] = out.num_cached_tokens
        envelope.usage.cached_tokens = sum(cached)
        builder.see(i, out)
        for c in map(builder.delta, out.outputs):
            index = i * n + c.index
            if finished[index] or not (c.text or c.token_ids or c.finished):
                continue  # done, or still in its prompt
            # counted before its chunks go out, so a running usage includes the tokens it shows
            envelope.usage.completion_tokens += len(c.token_ids)
            finished[index] = c.finished
            for choice in builder.chunks(index, c):
                yield envelope.chunk([choice])
    last = envelope.closing()
    if last is not None:
        yield last

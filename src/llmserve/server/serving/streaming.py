"""Running requests: the engine's outputs merged across a request's prompts, a log line per
finished request, aborting a request whose client went away, and engine failures as 500s or SSE
error events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from llmserve.engine.async_engine import RequestAbortedError, RequestStream
from llmserve.outputs import RequestOutput
from llmserve.server.errors import APIError, error_sse
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.outputs import SSE_DONE, Timings

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

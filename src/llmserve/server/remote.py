"""The `openai` engine: a remote OpenAI-compatible server (vLLM, TGI, llama-server, another
llmserve) served under a local name.

    client -> llmserve (route by `model`) -> RemoteModel.proxy -> upstream /v1/...

The request body goes upstream as the client sent it, with `model` replaced by the upstream's name;
the answer comes back with `model` set to the local name. Streams are relayed event by event. The
upstream's own errors (4xx, 5xx with OpenAI's JSON) pass through unchanged; an upstream that cannot
be reached is a 502, one that does not answer in time a 504. A client that disconnects closes the
upstream connection, which aborts the request there.

Each request is counted in the same metrics as a native model's (`engine="openai"`): TTFT (the
first streamed content), end-to-end latency, finish reasons, and token counts from `usage` (a
stream is asked for its usage chunk, which a client that did not ask for it does not see; the
`stream_usage: false` option turns that off for an upstream that refuses `stream_options`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmserve.config.models import ModelSpec
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import FinishedRequestStats, IterationStats
from llmserve.server.errors import APIError, error_body
from llmserve.server.serving.streaming import until_disconnected

logger = logging.getLogger("llmserve.server")

DEFAULT_TIMEOUT = 600.0
_FINISH = {"length": "length", "abort": "abort"}  # anything else (stop, tool_calls, ...) is "stop"


class RemoteModel:
    """One upstream model behind a local name."""

    def __init__(self, spec: ModelSpec, metrics: PrometheusStatLogger | None = None) -> None:
        assert spec.source is not None
        self.spec = spec
        self.base_url = spec.source.rstrip("/")
        self.upstream_model = str(spec.options.get("model") or spec.name)
        key = spec.options.get("api_key")
        if key is None and spec.options.get("api_key_env"):
            key = os.environ.get(str(spec.options["api_key_env"]))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = float(spec.options.get("timeout", DEFAULT_TIMEOUT))
        self.stream_usage = bool(spec.options.get("stream_usage", True))
        """Ask a stream for its usage chunk (OpenAI's stream_options.include_usage) to count tokens."""
        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0)
        )
        self.metrics = metrics
        self.num_active = 0

    async def close(self) -> None:
        await self.client.aclose()

    async def models(self) -> dict[str, Any] | None:
        """The upstream's card for this model (None when it cannot be asked)."""
        try:
            r = await self.client.get("/models", timeout=5.0)
            r.raise_for_status()
            return next((m for m in r.json().get("data", []) if m.get("id") == self.upstream_model), None)
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def at_root(self, path: str) -> str:
        """`path` at the upstream server's root, not under its OpenAI base (`.../v1`): where vLLM
        serves the routes it keeps outside /v1, such as `/classify`."""
        return self.base_url.removesuffix("/v1") + path

    async def proxy(self, raw: Request, path: str) -> Response:
        """Send the client's request to the upstream's `path` (e.g. "/chat/completions", under the
        base URL; an absolute URL from `at_root` as it is)."""
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        body["model"] = self.upstream_model
        hide_usage = False
        if body.get("stream") is True and self.stream_usage:
            # ask for the usage chunk, to count tokens; a client that did not ask does not see it
            options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            hide_usage = not options.get("include_usage")
            body["stream_options"] = {**options, "include_usage": True}
        started = time.monotonic()
        request = self.client.build_request("POST", path, json=body)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.TimeoutException as e:
            raise APIError(504, f"the upstream {self.base_url} did not answer in time: {e!r}") from None
        except httpx.HTTPError as e:
            raise APIError(502, f"cannot reach the upstream {self.base_url}: {e!r}") from None
        if upstream.status_code != 200 or not upstream.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            return await self._whole(raw, upstream, started, body)
        self.num_active += 1
        return StreamingResponse(
            self._events(upstream, started, body, hide_usage), media_type="text/event-stream"
        )

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST `body` as a stream to the upstream's `path` and yield each event (a dict); the
        upstream's error answer raises it as an `APIError` with its status (another API, such as
        Ollama's, shapes the response). Counted in the metrics like a relayed request."""
        body = {**body, "model": self.upstream_model, "stream": True}
        if self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        started, first, usage, reason = time.monotonic(), None, None, "abort"
        try:
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    content = (await r.aread()).decode(errors="replace")
                    try:
                        message = json.loads(content)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        message = content[:500]
                    raise APIError(r.status_code, f"upstream error: {message}")
                async for line in r.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    event = json.loads(data)
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if first is None and (
                            choice.get("text") or delta.get("content") or delta.get("tool_calls")
                        ):
                            first = time.monotonic()
                        reason = choice.get("finish_reason") or reason
                    usage = event.get("usage") or usage
                    yield event
        except httpx.TimeoutException as e:
            raise APIError(504, f"the upstream {self.base_url} did not answer in time: {e!r}") from None
        except httpx.HTTPError as e:
            raise APIError(502, f"cannot reach the upstream {self.base_url}: {e!r}") from None
        finally:
            self._record(started, first, usage, reason, body)

    async def _whole(
        self, raw: Request, upstream: httpx.Response, started: float, body: dict[str, Any]
    ) -> Response:
        """A non-streamed answer (or an error): read it unless the client leaves first."""
        self.num_active += 1
        reader = asyncio.ensure_future(upstream.aread())
        watcher = asyncio.ensure_future(until_disconnected(raw))
        try:
            done, _ = await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if reader not in done:
                reader.cancel()
                self._record(started, None, None, "abort", body)
                raise APIError(499, "client disconnected")
            content = reader.result()
        except httpx.HTTPError as e:
            raise APIError(502, f"the upstream {self.base_url} failed mid-answer: {e!r}") from None
        finally:
            watcher.cancel()
            await upstream.aclose()
            self.num_active -= 1
        try:
            payload = json.loads(content)
        except ValueError:
            if upstream.status_code == 200:
                raise APIError(
                    502, f"the upstream {self.base_url} answered something that is not JSON"
                ) from None
            return JSONResponse(
                error_body(upstream.status_code, f"upstream error: {content[:500].decode(errors='replace')}"),
                status_code=upstream.status_code,
            )
        if upstream.status_code == 200 and isinstance(payload, dict):
            payload["model"] = self.spec.name
            choices = payload.get("choices") or [{}]
            self._record(started, None, payload.get("usage"), choices[0].get("finish_reason"), body)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"}
        return JSONResponse(payload, status_code=upstream.status_code, headers=headers)

    async def _events(
        self, upstream: httpx.Response, started: float, body: dict[str, Any], hide_usage: bool
    ) -> AsyncIterator[str]:
        """Relay SSE events, renaming the model (and dropping the usage the proxy asked for on its
        own); closing this generator closes the upstream."""
        first: float | None = None
        usage: dict[str, Any] | None = None
        reason: str | None = "abort"
        try:
            async for line in upstream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    yield "data: [DONE]\n\n"
                    continue
                try:
                    event = json.loads(data)
                except ValueError:
                    yield f"data: {data}\n\n"
                    continue
                if isinstance(event, dict):
                    if "model" in event:
                        event["model"] = self.spec.name
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if first is None and (
                            choice.get("text") or delta.get("content") or delta.get("tool_calls")
                        ):
                            first = time.monotonic()
                        if choice.get("finish_reason"):
                            reason = choice["finish_reason"]
                    usage = event.get("usage") or usage
                    if hide_usage:
                        if event.get("usage") and not event.get("choices"):
                            continue  # the usage-only chunk
                        event.pop("usage", None)
                yield f"data: {json.dumps(event)}\n\n"
        except httpx.HTTPError as e:
            yield f"data: {json.dumps(error_body(502, f'the upstream {self.base_url} failed mid-stream: {e!r}'))}\n\n"
        finally:
            # a disconnected client cancels this generator: close the upstream connection even
            # so (that is what aborts the request there)
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            self.num_active -= 1
            self._record(started, first, usage, reason, body)

    def _record(
        self, started: float, first: float | None, usage: dict[str, Any] | None, reason: str | None,
        body: dict[str, Any],
    ) -> None:  # fmt: skip
        if self.metrics is None:
            return
        now = time.monotonic()
        usage = usage or {}
        prompt, generated = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        stats = IterationStats(
            now,
            num_prompt_tokens=prompt,
            num_generation_tokens=generated,
            time_to_first_tokens=[] if first is None else [first - started],
            finished=[
                FinishedRequestStats(
                    finish_reason=_FINISH.get(reason or "", "stop"),
                    e2e_latency=now - started,
                    num_prompt_tokens=prompt,
                    num_generation_tokens=generated,
                    max_tokens=int(max_tokens) if isinstance(max_tokens, int) else 0,
                    n=int(body.get("n") or 1) if isinstance(body.get("n"), int) else 1,
                    queue_time=None,
                    prefill_time=None if first is None else first - started,
                    decode_time=None if first is None else now - first,
                    inference_time=now - started,
                )
            ],
        )
        self.metrics.record(stats)

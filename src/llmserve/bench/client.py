"""One streamed OpenAI request, timed on the client: `send_request(...) -> RequestRecord`.

Speaks the wire format every OpenAI-compatible server shares (llmserve, vLLM, llama.cpp's
llama-server): POST /v1/completions or /v1/chat/completions with `stream: true` and
`stream_options.include_usage`, answered by SSE `data: {...}` lines and `data: [DONE]`.

Timing (time.perf_counter, after any concurrency slot was won):
    TTFT  start -> the first chunk that carries generated text
    ITL   gaps between successive chunks that carry text
    E2E   start -> the end of the stream
A failure (connection error, non-200 status, an SSE `{"error": ...}` event) is recorded in the
record, never raised: a benchmark reports failed requests, it does not stop at the first one.

The stream is read with aiohttp (as vLLM's benchmark client reads it): its lines come from a
buffer filled by the event loop's protocol callback, a few microseconds each. httpx's
`aiter_lines` cost ~150 us of client CPU per SSE event here (a wait for readability and a
selector registration per read through anyio and httpcore), which capped one client process at
~7k events/s: a GPU server at c=64 and c=256 measured the client, not itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from llmserve.bench.datasets import BenchRequest
from llmserve.tokenizer import Tokenizer

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class RequestRecord:
    """What one request measured; times in seconds."""

    prompt_len: int = 0
    """Prompt tokens: the server's usage when it sent one, else the dataset's count."""
    expected_output_len: int = 0
    """The max_tokens asked for."""
    success: bool = False
    output_tokens: int = 0
    """From the server's usage when it sent one, else the generated text re-tokenized."""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    """When it was sent, relative to the benchmark's start."""
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        tpot = self.tpot
        return {
            "success": self.success,
            "prompt_len": self.prompt_len,
            "expected_output_len": self.expected_output_len,
            "output_tokens": self.output_tokens,
            "ttft_ms": self.ttft * 1e3,
            "tpot_ms": None if tpot is None else tpot * 1e3,
            "e2el_ms": self.latency * 1e3,
            "itl_ms": [x * 1e3 for x in self.itl],
            "start_time_s": self.start_time,
            "generated_text": self.generated_text,
            "error": self.error,
        }


def build_body(
    endpoint: Endpoint,
    model: str,
    request: BenchRequest,
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # a vLLM / llama.cpp extra; not sent when off, for strict servers' sake
        body["ignore_eos"] = True
    if endpoint == "completions":
        body["prompt"] = request.prompt
    elif endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {sorted(ENDPOINT_PATHS)}")
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: Endpoint) -> str:
    """The generated text a stream chunk carries ('' for role-only, usage-only or empty chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # reasoning models stream their thinking first; it is generated text all the same
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _error_message(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body[:300].decode(errors='replace')}"


POST_ATTEMPTS = 5
RETRY_DELAY_S = 0.05
"""Before the second attempt; doubled before each next one (0.05 .. 0.4 s)."""


async def _post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """POST, again (at most POST_ATTEMPTS in all, backing off) when the connection fails before
    any response: a pooled keep-alive connection the server had closed, or one it dropped in a
    burst of new ones (llama-server does both; aiohttp finds out writing the request, "Can not
    write request body", or reading the reply, "Server disconnected"). httpx's pool retries such
    connections too; a refused connection fails each time and is the request's error."""
    for attempt in range(POST_ATTEMPTS):
        try:
            return await client.post(url, json=body)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            if attempt == POST_ATTEMPTS - 1:
                raise
            await asyncio.sleep(RETRY_DELAY_S * 2**attempt)
    raise AssertionError("unreachable")


async def send_request(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    request: BenchRequest,
    endpoint: Endpoint,
    tokenizer: Tokenizer | None = None,
    benchmark_start: float = 0.0,
) -> RequestRecord:
    """Send one streamed request to `url` and time it; never raises for a failed request."""
    record = RequestRecord(prompt_len=request.prompt_len, expected_output_len=request.output_len)
    start = time.perf_counter()
    record.start_time = start - benchmark_start
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    last = start
    try:
        async with await _post(client, url, body) as resp:
            if resp.status != 200:
                record.error = _error_message(resp.status, await resp.read())
                return record
            async for raw in resp.content:
                line = raw.decode()
                kind, _, data = line.partition(":")
                data = data.strip()
                if kind == "error":  # llama-server's way of failing mid-stream
                    record.error = f"stream error: {data}"
                    return record
                if kind != "data" or not data:
                    continue  # blank separators, comments, `event:` lines
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    record.error = f"stream error: {err.get('message') if isinstance(err, dict) else err}"
                    return record
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _chunk_text(chunk, endpoint)
                if not text:
                    continue
                now = time.perf_counter()
                if not pieces:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
                pieces.append(text)
    except Exception as e:  # connection refused, reset, timeout, malformed JSON: a failed request
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.latency = time.perf_counter() - start
    if not pieces:
        record.ttft = record.latency  # nothing generated: the answer came at the end
    record.generated_text = "".join(pieces)
    record.success = True
    _count_tokens(record, usage, pieces, tokenizer)
    return record


def _count_tokens(
    record: RequestRecord, usage: dict[str, Any] | None, pieces: list[str], tokenizer: Tokenizer | None
) -> None:
    if usage is not None and usage.get("prompt_tokens") is not None:
        record.prompt_len = int(usage["prompt_tokens"])
    if usage is not None and usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
    elif tokenizer is not None:
        record.output_tokens = len(tokenizer.encode(record.generated_text, add_special_tokens=False))
    else:
        record.output_tokens = len(pieces)  # no usage, no tokenizer: one token per chunk

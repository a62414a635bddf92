"""The response side shared by completions and chat: ids and timestamps, choices accumulated from
deltas, usage, llama.cpp-style timings, and the envelope every response and SSE chunk comes in.
The loop that fills them is `streaming.respond`."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from llmserve.server.protocol import _SamplingFields
from llmserve.server.serving.context import ServingContext

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


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


@dataclass(slots=True)
class Envelope:
    """What every response and chunk of one request carries (id, object, created, model), and the
    usage and timings that accumulate while it runs.

    Streamed usage, as OpenAI and vLLM send it: `stream_options.include_usage` puts `usage: null`
    on every chunk and the final usage on a last chunk without choices; vLLM's
    `continuous_usage_stats` puts the running usage (completion tokens so far) on every chunk
    instead, so a client can count as it reads. vLLM heeds it only beside include_usage; here it
    works alone too (asking for it is asking for usage), just without the closing usage chunk.
    """

    id: str
    model: str
    whole_object: str
    """The whole response's `object`: "chat.completion", "text_completion"."""
    chunk_object: str
    """A streamed chunk's `object`: "chat.completion.chunk", "text_completion"."""
    usage: Usage
    timings: Timings | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    created: int = field(default_factory=now)

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response's body."""
        body = {**self._header(self.whole_object), "choices": choices, "usage": self.usage.as_dict()}
        if self.timings is not None:
            body["timings"] = self.timings.as_dict()
        return body

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        """One SSE event of the stream."""
        payload: dict[str, Any] = {**self._header(self.chunk_object), "choices": choices}
        if self.continuous_usage:
            payload["usage"] = self.usage.as_dict()
        elif self.include_usage:
            payload["usage"] = None
        return sse(payload)

    def closing(self) -> str | None:
        """The stream's last event before [DONE], when there is anything to close with: no
        choices, then the final `usage` (include_usage) and/or `timings`."""
        if not self.include_usage and self.timings is None:
            return None
        last: dict[str, Any] = {**self._header(self.chunk_object), "choices": []}
        if self.include_usage or self.continuous_usage:
            last["usage"] = self.usage.as_dict()
        if self.timings is not None:
            last["timings"] = self.timings.as_dict()
        return sse(last)


def wants_timings(ctx: ServingContext, req: _SamplingFields) -> bool:
    return ctx.config.enable_response_timings if req.return_timings is None else req.return_timings

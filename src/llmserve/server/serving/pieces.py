"""One answer, whichever engine gives it: the second APIs (Ollama's, Anthropic's, OpenAI's
Responses) see a reply as a stream of `Piece`s and render those in their own shapes.

    native model   engine outputs -> <think> split off, tool calls streamed as written (deltas) and
                   parsed at the end
    remote model   the OpenAI chat request the API's request means, sent upstream; its stream
                   events (content, reasoning_content, tool_call fragments) -> the same pieces

Each piece carries new text, new thinking, the tool calls (parsed, all at once, when the answer
ends), the calls' deltas as the model writes them (what the APIs' streams send; a remote model's
calls come whole at the end) and, on the last one, how the answer ended (`End`). The chat
template, the tool formats and the reasoning splitter are the ones /v1/chat/completions uses; this
module only routes their output.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmserve.engine.async_engine import RequestStream
from llmserve.sampling_params import SamplingParams
from llmserve.server.protocol import ChatMessage
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.harmony import ReplySplitter, reply_splitter
from llmserve.server.serving.inputs import process_prompt, start_requests
from llmserve.server.serving.reasoning import prompt_opens_thinking, uses_think_tags
from llmserve.server.serving.streaming import merged
from llmserve.server.serving.tool_stream import CallDelta
from llmserve.server.serving.tools import ToolCall, ToolFormat, whole_call_deltas

if TYPE_CHECKING:
    from llmserve.server.remote import RemoteModel


@dataclass(slots=True)
class End:
    """How an answer ended: the finish reason, what stopped it, the counts and durations (seconds)."""

    reason: str | None
    prompt_eval_count: int
    eval_count: int
    prompt_eval_seconds: float | None = None
    eval_seconds: float | None = None
    context: list[int] | None = None
    """The prompt and output tokens (native models, when asked: Ollama's /api/generate)."""
    stop_reason: int | str | None = None
    """The stop string (or stop token id) that ended it, as the engine reports it."""
    call_cut: bool = False
    """A stream sent part of a call that max_tokens then cut (the whole answer drops it): the
    stream ends as cut short, never as calling tools."""


@dataclass(slots=True)
class Piece:
    """One step of an answer: new text, new thinking, the tool calls (all at once, parsed, at the
    end), the calls' deltas as they are written (what a stream sends: tool_stream.py) and, on the
    last piece, how it ended."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    end: End | None = None
    call_deltas: list[CallDelta] = field(default_factory=list)


@dataclass(slots=True)
class Answer:
    """A native model's answer under way: its request streams (to abort), its pieces, and the
    prompt's size (known before the first piece)."""

    streams: list[RequestStream]
    pieces: AsyncIterator[Piece]
    num_prompt_tokens: int | None = None


async def gather(pieces: AsyncIterator[Piece]) -> Piece:
    """A whole answer as one piece."""
    answer = Piece()
    async for piece in pieces:
        answer.content += piece.content
        answer.thinking += piece.thinking
        answer.tool_calls += piece.tool_calls
        answer.end = piece.end or answer.end
    # whole, each parsed call is one delta (a call that a stream sent in part and max_tokens cut is
    # not among them)
    answer.call_deltas = whole_call_deltas(answer.tool_calls)
    if answer.end is not None and answer.end.call_cut:
        answer.end = dataclasses.replace(answer.end, call_cut=False)
    return answer


def thinks(ctx: ServingContext) -> bool:
    """Whether the model's replies are split into thinking and content (`--reasoning-parser`)."""
    mode = ctx.config.reasoning_parser
    return ctx.harmony or mode == "think" or (mode == "auto" and uses_think_tags(ctx.tokenizer.chat_template))


async def start_answer(ctx: ServingContext, prompt: str | list[int], params: SamplingParams, prefix: str,
                       split: bool, tools: ToolFormat | None = None, context: bool = False,
                       images: ImageInputs | None = None, final_only: bool = False) -> Answer:  # fmt: skip
    """Run one prompt on a native model; `split`: thinking apart from content; `tools`: the call
    format to read tool calls back in (`params` made `with_tools`); `context`: the tokens in the end
    (Ollama's /api/generate); `images`: the prompt's images (its text then holds their markers);
    `final_only`: an answer sent whole (the engine's output once, finished; `start_requests`)."""
    if images is None:
        processed = await process_prompt(ctx, prompt, params)
    else:
        processed = await process_prompt(ctx, prompt, params, None, images.data, images.add_special_tokens,
                                         images.fields)  # fmt: skip
    streams = start_requests(ctx, [processed], 0, prefix, final_only=final_only)
    opened = prompt_opens_thinking(ctx.tokenizer, processed.token_ids) if split else None
    splitter = reply_splitter(ctx.harmony, opened, tools)
    pieces = _engine_pieces(ctx, streams, processed.token_ids, splitter, context)
    return Answer(streams, pieces, len(processed.token_ids))


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """A prompt's images: their bytes, the request fields they came in (for errors), and whether
    the prompt text still needs the tokenizer's special tokens (a raw prompt) or not (a template's)."""

    data: list[bytes]
    fields: list[str]
    add_special_tokens: bool


async def _engine_pieces(ctx: ServingContext, streams: list[RequestStream], prompt_ids: list[int],
                         splitter: ReplySplitter, context: bool) -> AsyncIterator[Piece]:  # fmt: skip
    """A native model's answer as pieces: thinking split off and tool calls held back and parsed
    at the end (`splitter`, see `reply_splitter`), and the engine's timings; `context`: the tokens
    in the end (/api/generate)."""
    tokens: list[int] = []
    async for _, out in merged(ctx, streams):
        c = out.outputs[0]
        tokens.extend(c.token_ids)
        thinking, text = splitter.feed(c.text)
        calls: list[ToolCall] = []
        if out.finished:  # no cut call as text
            more_thinking, more_text, calls = splitter.finish(cut=c.finish_reason == "length")
            thinking, text = thinking + more_thinking, text + more_text
            deltas = splitter.final_call_deltas(calls)
        else:
            deltas = splitter.call_deltas()
        if text or thinking or calls or deltas:
            yield Piece(text, thinking, calls, call_deltas=deltas)
        if out.finished:
            now, m = time.monotonic(), out.metrics
            first = (m.first_token_time if m else None) or now
            scheduled = (m.first_scheduled_time or m.arrival_time) if m else first
            yield Piece(end=End(
                c.finish_reason, len(prompt_ids), len(tokens), max(0.0, first - scheduled), max(0.0, now - first),
                prompt_ids + tokens if context else None, c.stop_reason,
                splitter.streamed_unfinished and c.finish_reason == "length",
            ))  # fmt: skip


# -- a remote model: the OpenAI request an API's request means, and its stream read back as pieces --


def openai_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as an OpenAI request carries them upstream."""
    return [m.model_dump(exclude_none=True) for m in messages]


def openai_sampling(params: SamplingParams, fmt: Any = None) -> dict[str, Any]:
    """Sampling parameters as an OpenAI request's fields (with vLLM's extra fields top_k, min_p and
    repetition_penalty, which OpenAI-compatible servers commonly accept); `fmt`: Ollama's
    `format` ("json" or a schema) as response_format."""
    body: dict[str, Any] = {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }  # fmt: skip
    if params.seed is not None:
        body["seed"] = params.seed
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if params.stop:
        body["stop"] = list(params.stop)
    if fmt == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    return body


def upstream_chat_body(messages: list[ChatMessage], params: SamplingParams, fmt: Any = None,
                       tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                       parallel_tool_calls: bool | None = None, template_kwargs: dict[str, Any] | None = None,
                       ) -> dict[str, Any]:  # fmt: skip
    """The OpenAI chat request a second API's request means, for a remote model: tool calls'
    arguments as JSON text (OpenAI's wire form; templates get them as objects); `fmt` as in
    `openai_sampling`."""
    dicts = openai_messages(messages)
    for m in dicts:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    body: dict[str, Any] = {"messages": dicts, **openai_sampling(params, fmt)}
    if tools:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if parallel_tool_calls is not None:
        body["parallel_tool_calls"] = parallel_tool_calls
    if template_kwargs is not None:
        body["chat_template_kwargs"] = template_kwargs
    return body


async def relay_pieces(remote: RemoteModel, path: str, body: dict[str, Any]) -> AsyncIterator[Piece]:
    """A remote model's answer (OpenAI's stream events) as pieces: text from chat deltas or
    completion choices, thinking from vLLM's `reasoning_content` (or `reasoning`), tool calls
    gathered from their fragments and given whole at the end."""
    calls: dict[int, dict[str, str]] = {}
    usage: dict[str, Any] = {}
    reason = stop_reason = None
    async for event in remote.events(path, body):
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text") or ""
            thinking = delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
            reason = choice.get("finish_reason") or reason
            stop_reason = choice.get("stop_reason") or stop_reason  # vLLM's: the stop string that matched
            if text or thinking:
                yield Piece(text, thinking)
    if calls:
        found = [ToolCall(c["name"], c["arguments"]) for c in calls.values()]
        yield Piece(tool_calls=found, call_deltas=whole_call_deltas(found))
    n_prompt, n_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    yield Piece(end=End(reason, n_prompt, n_out, stop_reason=stop_reason))

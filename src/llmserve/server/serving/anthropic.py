"""Anthropic's Messages API on the same port as OpenAI's, for clients written against Anthropic
(its SDKs, and agents that speak only Messages):

    POST /v1/messages                 a conversation -> an assistant message (or its SSE events)
    POST /v1/messages/count_tokens    the prompt's size, as /v1/messages would render it

A request becomes the chat request it means, and runs down /v1/chat/completions' path: the same
chat template (`render_chat`), tool formats and grammars (`plan_tools`, `with_tools`), reasoning
split and engine; the answer comes back through the pieces Ollama's API uses too (pieces.py), in
Anthropic's shapes (anthropic_events.py). A remote (openai engine) model gets the OpenAI request
upstream. The conversion:

    system (string or text blocks)          -> a system message
    user text blocks                        -> a user message
    user image blocks (base64, url)         -> its image parts (a data URL, or the URL under the
                                               server's media rules), in place among the text
    user tool_result blocks                 -> tool messages (tool_call_id, the tool's name)
    assistant text, tool_use blocks         -> an assistant message with tool_calls
    assistant thinking blocks               -> its reasoning_content (the templates that show past
                                               reasoning read it: gpt-oss's before a tool call)
    a final assistant message               -> continued (Anthropic's prefill)
    tools, tool_choice auto/any/tool/none   -> tools, tool_choice auto/required/named/none
    stop_sequences, temperature, top_p, top_k, max_tokens, output_config.format -> SamplingParams

Errors on these routes come in Anthropic's shape (server/errors.py chooses it by path).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import APIError, anthropic_error_sse
from llmserve.server.protocol import ChatMessage, ImageURL, ImageURLPart, TextPart, parse
from llmserve.server.protocol_anthropic import (
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    ToolResultBlock,
    parse_block,
)
from llmserve.server.serving.anthropic_events import MessageEvents, message, new_message_id
from llmserve.server.serving.chat_bridge import json_body, renamed, render_prompt, start_chat, whole
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.inputs import check_stop, process_prompt
from llmserve.server.serving.pieces import ImageInputs, Piece, relay_pieces, upstream_chat_body
from llmserve.server.serving.streaming import run_unless_disconnected, sse_with_errors
from llmserve.server.serving.tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from llmserve.engine.async_engine import RequestStream
    from llmserve.server.models import ModelManager
    from llmserve.server.remote import RemoteModel

_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def _text(blocks: str | list[dict[str, Any]], where: str) -> str:
    """A system prompt: a string, or its text blocks joined by newlines."""
    if isinstance(blocks, str):
        return blocks
    return "\n".join(parse_block(b, f"{where}.{i}", ("text",)).text for i, b in enumerate(blocks))


def chat_messages(req: CountTokensRequest) -> tuple[list[ChatMessage], list[str]]:
    """The conversation as the chat messages /v1/chat/completions takes (see the module's table),
    and each image block's field (`messages.0.content.1.source`) in the order they render."""
    out = [ChatMessage(role="system", content=_text(req.system, "system"))] if req.system else []
    fields: list[str] = []
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the tool_result answering it
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        if not m.content and i < len(req.messages) - 1:
            raise APIError(400, f"{where}: all messages but a final assistant one need content", param=where)
        allowed = _USER_BLOCKS if m.role == "user" else _ASSISTANT_BLOCKS
        blocks = [parse_block(b, f"{where}.{j}", allowed) for j, b in enumerate(m.content)]
        fields += [f"{where}.{j}.source" for j, b in enumerate(blocks) if isinstance(b, ImageBlock)]
        out += _assistant(blocks, names) if m.role == "assistant" else _user(blocks, names, where)
    return out, fields


def _assistant(blocks: list[Any], names: dict[str, str]) -> list[ChatMessage]:
    """One assistant message: its text, its tool_use blocks as tool_calls (arguments as objects,
    as templates read them), its thinking as reasoning_content. Records each call's name in `names`."""
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if b.type == "tool_use"]  # fmt: skip
    names.update((c["id"], c["function"]["name"]) for c in calls)
    text = "".join(b.text for b in blocks if b.type == "text")
    thinking = "".join(b.thinking for b in blocks if b.type == "thinking") or None
    return [ChatMessage(role="assistant", content=text, tool_calls=calls or None, reasoning_content=thinking)]


def _user(blocks: list[Any], names: dict[str, str], where: str) -> list[ChatMessage]:
    """A tool message per tool_result (which must answer a tool_use of an earlier assistant
    message), then the text blocks as one user message (with images: its parts, in order)."""
    out: list[ChatMessage] = []
    parts: list[TextPart | ImageURLPart] = []
    for j, b in enumerate(blocks):
        if isinstance(b, ImageBlock):
            parts.append(ImageURLPart(type="image_url", image_url=ImageURL(url=b.url)))
            continue
        if not isinstance(b, ToolResultBlock):
            parts.append(TextPart(type="text", text=b.text))
            continue
        if b.tool_use_id not in names:
            raise APIError(400, f"{where}.{j}.tool_use_id: {b.tool_use_id!r} answers no tool_use block of an "
                           "earlier assistant message", param=where)  # fmt: skip
        result = b.text(f"{where}.{j}")
        content = f"Error: {result}" if b.is_error else result  # templates have no error flag
        out.append(
            ChatMessage(role="tool", content=content, tool_call_id=b.tool_use_id, name=names[b.tool_use_id])
        )
    if any(isinstance(p, ImageURLPart) for p in parts):
        return [*out, ChatMessage(role="user", content=parts)]
    texts = [p.text for p in parts if isinstance(p, TextPart)]
    return out + ([ChatMessage(role="user", content="\n".join(texts))] if texts else [])


def tool_plan(ctx: ServingContext, req: CountTokensRequest) -> ToolPlan:
    choice, parallel = req.tool_choice.as_openai() if req.tool_choice else (None, None)
    tools = [t.as_openai() for t in req.tools or []]
    return plan_tools(tools, choice, parallel, ctx.tool_format)


def template_kwargs(req: CountTokensRequest) -> dict[str, Any] | None:
    """`thinking` as the chat template's switch (`enable_thinking`); None: the template's default."""
    return None if req.thinking is None else {"enable_thinking": req.thinking.type != "disabled"}


async def render(
    ctx: ServingContext,
    req: CountTokensRequest,
    messages: list[ChatMessage],
    fields: list[str],
    plan: ToolPlan,
) -> tuple[list[int] | str, ImageInputs | None]:
    """The prompt (`render_prompt`'s: token ids, or text and images); a final assistant message
    with text is continued (prefill), an empty one left out (the answer starts afresh)."""
    last = messages[-1]
    if last.role == "assistant" and not last.content and not last.tool_calls:
        messages = messages[:-1]
    if not any(m.role != "system" for m in messages):
        raise APIError(400, "messages: the conversation has no content", param="messages")
    prefill = messages[-1].role == "assistant" and bool(messages[-1].content)
    return await render_prompt(ctx, messages, fields, "messages", add_generation_prompt=not prefill,
                               continue_final_message=prefill, extra=template_kwargs(req), tools=plan.tools,
                               fmt=plan.fmt)  # fmt: skip


def sampling_params(req: MessagesRequest) -> SamplingParams:
    """Anthropic's defaults: temperature 1, no top_p or top_k cut; `output_config.format` as the
    output's JSON schema."""
    fmt = req.output_config.format if req.output_config is not None else None
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=req.top_k or 0,
            max_tokens=req.max_tokens,
            stop=list(req.stop_sequences or []),
            structured_outputs=StructuredOutputsParams(json=fmt.schema_) if fmt is not None else None,
        )
    except ValueError as e:  # the engine's own checks, in Anthropic's field names
        raise renamed(e, {"stop": "stop_sequences", "structured_outputs": "output_config.format"}) from None


class AnthropicServing:
    def __init__(self, models: ModelManager) -> None:
        self.models = models

    async def count_tokens(self, raw: Request) -> Any:
        req: CountTokensRequest = parse(CountTokensRequest, await json_body(raw))
        messages, fields = chat_messages(req)
        async with self.models.lease(req.model) as slot:
            if slot.ctx is None:
                raise APIError(400, f"the model {slot.name!r} is served by the {slot.engine} engine; "
                               "count_tokens needs a native model", param="model")  # fmt: skip
            prompt, images = await render(slot.ctx, req, messages, fields, tool_plan(slot.ctx, req))
            if images is not None:  # each image's marker expanded to its tokens, as the engine runs it
                processed = await process_prompt(slot.ctx, prompt, SamplingParams(max_tokens=1), None,
                                                 images.data, False, images.fields)  # fmt: skip
                prompt = processed.token_ids
            return {"input_tokens": len(prompt)}

    async def create(self, raw: Request) -> Any:
        req: MessagesRequest = parse(MessagesRequest, await json_body(raw))
        budget = req.thinking.budget_tokens if req.thinking is not None else None
        if budget is not None and budget >= req.max_tokens:
            raise APIError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                           f"({req.max_tokens})", param="thinking")  # fmt: skip
        (messages, fields), params = chat_messages(req), sampling_params(req)

        async def native(ctx: ServingContext) -> Any:
            check_stop(ctx, params.stop, "stop_sequences")
            plan = tool_plan(ctx, req)
            prompt, images = await render(ctx, req, messages, fields, plan)
            answer = await start_chat(
                ctx,
                prompt,
                params,
                plan,
                "msg",
                template_kwargs(req),
                "output_config.format",
                images,
                final_only=not req.stream,
            )
            return await _respond(req, raw, answer.pieces, answer.streams, answer.num_prompt_tokens)

        def remote(up: RemoteModel) -> Awaitable[Any]:
            return _respond(
                req, raw, relay_pieces(up, "/chat/completions", _upstream_body(req, messages, params))
            )

        return await self.models.serve(req.model, remote=remote, native=native)


def _upstream_body(
    req: MessagesRequest, messages: list[ChatMessage], params: SamplingParams
) -> dict[str, Any]:
    """The OpenAI chat request `req` means, for a remote model."""
    fmt = req.output_config.format if req.output_config is not None else None
    choice, parallel = req.tool_choice.as_openai() if req.tool_choice is not None else (None, None)
    tools = [t.as_openai() for t in req.tools or []]
    return upstream_chat_body(messages, params, fmt.schema_ if fmt else None, tools, choice, parallel,
                              template_kwargs(req))  # fmt: skip


async def _respond(req: MessagesRequest, raw: Request, pieces: AsyncIterator[Piece],
                   streams: list[RequestStream] | None = None, num_prompt_tokens: int | None = None) -> Any:  # fmt: skip
    """The answer as Anthropic's SSE events (`stream`) or one message; a client that leaves
    aborts `streams` (streamed: when the response is cancelled or closed)."""
    message_id, stop_sequences, streams = new_message_id(), list(req.stop_sequences or []), streams or []
    if req.stream:
        events = MessageEvents(message_id, req.model, stop_sequences, num_prompt_tokens)

        async def lines() -> AsyncIterator[str]:
            try:
                for line in events.opening():
                    yield line
                async for piece in pieces:
                    for line in events.piece(piece):
                        yield line
            finally:
                for stream in streams:
                    stream.abort()

        body = sse_with_errors(lines(), error_event=anthropic_error_sse, last="")
        return StreamingResponse(body, media_type="text/event-stream")

    async def reply() -> JSONResponse:
        return JSONResponse(message(message_id, req.model, await whole(pieces), stop_sequences))

    return await run_unless_disconnected(raw, reply, streams)

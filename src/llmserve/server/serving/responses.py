"""OpenAI's Responses API on the same port as chat completions:

    POST   /v1/responses                    input items -> a response (or its semantic SSE events)
    GET    /v1/responses/{id}               a stored response (a background one: as it stands)
    DELETE /v1/responses/{id}               forget it
    GET    /v1/responses/{id}/input_items   its input items, OpenAI's cursor list
    POST   /v1/responses/{id}/cancel        stop a background response

`background: true` answers at once with the response `queued` and runs it in a task (the model
leased by the task, as a request would lease it); GET shows `in_progress`, then `completed`,
`incomplete` or `failed`; cancel aborts its engine requests and leaves it `cancelled`. It needs
`store` (the response is only reachable through the store) and is not streamed.

A request becomes the chat request it means, and runs down /v1/chat/completions' path: the same
chat template (`render_chat`), tool formats and grammars (`plan_tools`, `with_tools`), reasoning
split and engine; the answer comes back through the pieces Anthropic's and Ollama's APIs use
(pieces.py), in the Responses shapes (responses_events.py). A remote (openai engine) model gets
the chat request upstream. The conversion:

    previous_response_id                   -> the stored conversation first (response_store.py)
    instructions                           -> a system message (this request's only: not carried over)
    message items (user/system/developer)  -> messages (developer as system; text parts joined)
    input_image parts (user)               -> image parts (a data URL, or a path or URL under the
                                              server's media rules), in place among the text
    assistant message items                -> assistant messages
    function_call items                    -> tool_calls of the assistant message before them
    function_call_output items             -> tool messages (tool_call_id, the function's name)
    reasoning items                        -> reasoning_content of the assistant turn they precede (the
                                              templates that show past reasoning read it: gpt-oss's
                                              before a tool call)
    tools, tool_choice, parallel_tool_calls -> the chat path's tool plan
    max_output_tokens, temperature, top_p, text.format -> SamplingParams
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatMessage, ImageURL, ImageURLPart, parse
from llmserve.server.protocol import TextPart as ChatTextPart
from llmserve.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ImagePart,
    Item,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
    parse_item,
)
from llmserve.server.serving.chat_bridge import json_body, renamed, render_prompt, start_chat, whole
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.pieces import Piece, relay_pieces, upstream_chat_body
from llmserve.server.serving.response_store import ResponseStore, StoredResponse, listed_input_items, page
from llmserve.server.serving.responses_events import ResponseEvents, sse
from llmserve.server.serving.streaming import engine_error, run_unless_disconnected, sse_with_errors
from llmserve.server.serving.tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from llmserve.engine.async_engine import RequestStream
    from llmserve.server.models import ModelManager
    from llmserve.server.remote import RemoteModel


def chat_messages(instructions: str | None, items: list[Item]) -> tuple[list[ChatMessage], list[str]]:
    """The conversation as the chat messages /v1/chat/completions takes (see the module's table),
    and each image's field (`input.0.content.1.image_url`) in the order they render."""
    out = [ChatMessage(role="system", content=instructions)] if instructions else []
    fields: list[str] = []
    names: dict[str, str] = {}  # call_id -> the function's name, for the output answering it
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            parts = item.parts(where)
            if parts is None:
                thinking, reasoning = (reasoning if role == "assistant" else None), None
                out.append(ChatMessage(role=role, content=item.text(where), reasoning_content=thinking))
                continue
            fields += [
                f"{where}.content.{j}.image_url" for j, p in enumerate(parts) if isinstance(p, ImagePart)
            ]
            out.append(ChatMessage(role=role, content=[_chat_part(p) for p in parts]))
        elif isinstance(item, FunctionCallItem):
            try:
                arguments = json.loads(item.arguments)
            except ValueError:
                raise APIError(400, f"{where}.arguments: not valid JSON", param=where) from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": arguments},
            }
            names[item.call_id] = item.name
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # calls join the turn that made them
                update = {"tool_calls": [*(last.tool_calls or []), call]}
                if reasoning is not None and last.reasoning_content is None:
                    update["reasoning_content"] = reasoning
                out[-1] = last.model_copy(update=update)
            else:
                out.append(
                    ChatMessage(role="assistant", content="", tool_calls=[call], reasoning_content=reasoning)
                )
            reasoning = None
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise APIError(400, f"{where}.call_id: {item.call_id!r} answers no function_call item before it",
                               param=where)  # fmt: skip
            out.append(ChatMessage(role="tool", content=item.text(where), tool_call_id=item.call_id,
                                   name=names[item.call_id]))  # fmt: skip
    if not any(m.role != "system" for m in out):
        raise APIError(400, "input: the conversation has no content", param="input")
    return out, fields


def _chat_part(part: TextPart | ImagePart) -> ChatTextPart | ImageURLPart:
    if isinstance(part, ImagePart):
        assert part.image_url is not None  # MessageItem.parts checked it
        return ImageURLPart(type="image_url", image_url=ImageURL(url=part.image_url))
    return ChatTextPart(type="text", text=part.text)


def sampling_params(req: ResponsesRequest) -> SamplingParams:
    """OpenAI's defaults: temperature 1, top_p 1; `text.format` as the output's constraint."""
    fmt = req.text_constraint()
    structured = None
    if fmt is not None:
        structured = (
            StructuredOutputsParams(json_object=True) if fmt == "json" else StructuredOutputsParams(json=fmt)
        )
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            max_tokens=req.max_output_tokens,
            structured_outputs=structured,
        )
    except ValueError as e:  # the engine's own checks, in the Responses field names
        raise renamed(e, {"structured_outputs": "text.format", "max_tokens": "max_output_tokens"}) from None


def tool_plan(ctx: ServingContext, req: ResponsesRequest) -> ToolPlan:
    tools = [t.as_openai() for t in req.tools or []]
    return plan_tools(tools, req.choice(), req.parallel_tool_calls, ctx.tool_format)


def template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """`reasoning.effort` as the template's switch (`enable_thinking`): "none" and "minimal" off,
    the others on; no effort: the template's default."""
    effort = req.reasoning.effort if req.reasoning else None
    return None if effort is None else {"enable_thinking": effort not in ("none", "minimal")}


def _shell(req: ResponsesRequest) -> dict[str, Any]:
    """The response object's request-side fields."""
    fmt = req.text.format if req.text and req.text.format else None
    return {
        "background": bool(req.background),
        "model": req.model, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else (req.tool_choice or "auto"),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
    }  # fmt: skip


class ResponsesServing:
    def __init__(self, models: ModelManager, store: ResponseStore) -> None:
        self.models, self.store = models, store

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id).response

    def input_items(self, response_id: str, after: str | None, limit: int, order: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}/input_items`: the input items the request gave (not those of
        the responses it continued), newest first unless `order` is asc."""
        return page(self._stored(response_id).input_items, after, limit, order)

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """`POST /v1/responses/{id}/cancel`: a background response still running stops (its
        engine requests aborted) and is `cancelled`; one that already ended is answered as it is."""
        stored = self._stored(response_id)
        if not stored.response.get("background"):
            raise APIError(400, "Only responses created with background: true can be cancelled.",
                           param="response_id")  # fmt: skip
        task = self.store.running.get(response_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        self._stored(response_id)
        task = self.store.running.get(response_id)
        if task is not None:  # a background response still running stops (and is not stored again)
            task.cancel()
        self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _stored(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", param=param,
                           code="previous_response_not_found" if param != "response_id" else None)  # fmt: skip
        return stored

    async def create(self, raw: Request) -> Any:
        req: ResponsesRequest = parse(ResponsesRequest, await json_body(raw))
        if req.background and (req.stream or not req.store):
            raise APIError(400, "background responses need store: true and are not streamed here "
                           "(poll GET /v1/responses/{id})", param="background")  # fmt: skip
        before = self._stored(req.previous_response_id, "previous_response_id").conversation if (
            req.previous_response_id) else []  # fmt: skip
        given = (
            [{"type": "message", "role": "user", "content": req.input}]
            if isinstance(req.input, str)
            else req.input
        )
        items = [parse_item(item, f"previous_response_id.{i}") for i, item in enumerate(before)] + req.items()
        (messages, fields), params = chat_messages(req.instructions, items), sampling_params(req)
        conversation = [*before, *(given if req.input else [])]
        events = ResponseEvents(_shell(req), None)
        kept = StoredResponse(events.response, conversation, listed_input_items(given if req.input else []))

        async def native(ctx: ServingContext) -> Any:
            plan = tool_plan(ctx, req)
            prompt, images = await render_prompt(ctx, messages, fields, "input", add_generation_prompt=True,
                                                 extra=template_kwargs(req), tools=plan.tools, fmt=plan.fmt)  # fmt: skip
            answer = await start_chat(  # (a background response shows its output as it stands)
                ctx,
                prompt,
                params,
                plan,
                "resp",
                template_kwargs(req),
                "text.format",
                images,
                final_only=not req.stream and not req.background,
            )
            return await self._respond(
                req, raw, events, kept, answer.pieces, answer.streams, answer.num_prompt_tokens
            )

        def remote(up: RemoteModel) -> Awaitable[Any]:
            tools = [t.as_openai() for t in req.tools or []]
            body = upstream_chat_body(messages, params, req.text_constraint(), tools, req.choice(),
                                      req.parallel_tool_calls, template_kwargs(req))  # fmt: skip
            return self._respond(req, raw, events, kept, relay_pieces(up, "/chat/completions", body))

        if req.background:
            return self._start_background(
                req.model, events, kept, lambda: self.models.serve(req.model, remote=remote, native=native)
            )
        return await self.models.serve(req.model, remote=remote, native=native)

    def _start_background(
        self, model: str, events: ResponseEvents, kept: StoredResponse, run: Callable[[], Awaitable[Any]]
    ) -> JSONResponse:
        """Store the response `queued`, run it in a task, answer it now. The task's end (failure
        and cancel included) is written into the stored object, which GET reads."""
        if model not in self.models.adapters:  # an unknown model is a 404 now, not a failed response later
            self.models.resolve(model)
        response, response_id = kept.response, kept.response["id"]
        response["status"] = "queued"
        self.store.put(kept)

        async def go() -> None:
            try:
                await run()
            except asyncio.CancelledError:
                response["status"] = "cancelled"
            except APIError as e:
                events.error(e)  # failed, with the error
            except Exception as e:  # the engine failed under the request
                events.error(engine_error(e))
            finally:
                self.store.running.pop(response_id, None)

        self.store.running[response_id] = asyncio.create_task(go())
        return JSONResponse(response)

    async def _respond(self, req: ResponsesRequest, raw: Request, events: ResponseEvents, kept: StoredResponse,
                       pieces: AsyncIterator[Piece], streams: list[RequestStream] | None = None,
                       num_prompt_tokens: int | None = None) -> Any:  # fmt: skip
        """The answer as the Responses SSE events (`stream`) or one response object, stored
        (unless `store: false`) once it has ended; a client that leaves aborts `streams`. A
        background response is gathered into its stored object (its task is cancelled to stop it)."""
        events.num_prompt_tokens, streams = num_prompt_tokens, streams or []

        def keep() -> None:
            if req.store and events.response["status"] in ("completed", "incomplete"):
                self.store.put(StoredResponse(events.response, [*kept.conversation, *events.output],
                                              kept.input_items))  # fmt: skip

        if req.background:
            events.response["status"] = "in_progress"
            try:
                events.piece(await whole(pieces))
            finally:
                for stream in streams:
                    stream.abort()
            keep()
            return None

        if req.stream:

            async def lines() -> AsyncIterator[str]:
                try:
                    for e in events.opening():
                        yield sse(e)
                    async for piece in pieces:
                        for e in events.piece(piece):
                            yield sse(e)
                    keep()
                finally:
                    for stream in streams:
                        stream.abort()

            def error(e: APIError) -> str:
                return "".join(sse(event) for event in events.error(e))

            return StreamingResponse(sse_with_errors(lines(), error_event=error, last=""),
                                     media_type="text/event-stream")  # fmt: skip

        async def reply() -> JSONResponse:
            events.piece(await whole(pieces))
            keep()
            return JSONResponse(events.response)

        return await run_unless_disconnected(raw, reply, streams)

"""Ollama's API on the same port as OpenAI's, for clients written against Ollama (its Python and
JS libraries, Open WebUI, editors' plugins); the model listings are in `ollama_models.py`:

    POST /api/generate   a prompt (raw, or through the chat template with `system`), NDJSON stream
    POST /api/chat       messages through the chat template, NDJSON stream; `tools` as on
                         /v1/chat/completions (tool_choice auto), calls back as `tool_calls`

One path for every answer: a native model's engine output and a remote (openai engine) model's
stream (the OpenAI request the Ollama one means, sent upstream) both become `Piece`s (pieces.py), and
`_respond` turns pieces into NDJSON lines or one JSON object. `keep_alive` works as in Ollama: a
request's value is how long its model stays loaded once idle; a request without a prompt loads
the model, and with `keep_alive: 0` unloads it.

`think` is the chat template's thinking switch (`enable_thinking`, as `chat_template_kwargs` on
/v1/chat/completions); as in Ollama, a model whose template thinks (`<think>`) returns its
thinking apart, in `thinking` (message.thinking on /api/chat), unless the request says `think:
false`, and `think: true` for a model that does not think is a 400.

Streaming is Ollama's default (`"stream": true`): one JSON object per line, `done: false` with
the new text, then a last object with `done: true`, `done_reason` and the counts and durations (in
nanoseconds) Ollama reports. Ollama's option names map to sampling parameters:

    num_predict -> max_tokens (-1, -2: until the context is full)   temperature, top_p, top_k,
    repeat_penalty -> repetition_penalty                            min_p, seed, stop,
    presence_penalty, frequency_penalty                             `format`: "json" or a schema

Options that tune Ollama's own runtime (num_ctx, num_thread, num_gpu, mirostat, tfs_z, ...) have
no meaning here and are ignored, as Ollama ignores options it does not know; a known option of
the wrong type is a 400. Errors are Ollama's `{"error": "..."}` with the HTTP status.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.requests import Request

from llmserve.config.models import parse_duration
from llmserve.engine.async_engine import RequestStream
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import APIError
from llmserve.server.media import decode_base64
from llmserve.server.protocol import ChatMessage, ImageURL, ImageURLPart, TextPart, parse
from llmserve.server.serving.chat import render_chat, render_chat_text
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.pieces import (
    ImageInputs,
    Piece,
    gather,
    openai_messages,
    openai_sampling,
    relay_pieces,
    start_answer,
    thinks,
)
from llmserve.server.serving.streaming import run_unless_disconnected
from llmserve.server.serving.tools import ToolCall, ToolFormat, plan_tools, with_tools

if TYPE_CHECKING:
    from llmserve.server.models import ModelManager
    from llmserve.server.remote import RemoteModel


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OllamaOptions(Lenient):
    num_predict: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: list[StrictStr] | StrictStr | None = None
    repeat_penalty: StrictFloat | StrictInt | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None


class _OllamaRequest(Lenient):
    model: StrictStr
    stream: StrictBool = True
    options: OllamaOptions | None = None
    format: Literal["", "json"] | dict[str, Any] | None = None
    keep_alive: StrictStr | StrictInt | StrictFloat | None = None
    """How long the model stays loaded once idle ("5m", seconds, -1: forever, 0: unload now)."""
    think: StrictBool | Literal["low", "medium", "high"] | None = None
    """The template's thinking switch; None: the template's default."""


class OllamaGenerateRequest(_OllamaRequest):
    prompt: StrictStr = ""
    system: StrictStr | None = None
    raw: StrictBool = False
    images: list[Any] | None = None


class OllamaFunctionCall(Lenient):
    name: StrictStr
    arguments: dict[str, Any] = {}


class OllamaToolCall(Lenient):
    function: OllamaFunctionCall


class OllamaMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: StrictStr | None = None
    """A tool message: the tool whose result `content` is."""


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = []
    tools: list[Any] | None = None


def ollama_error(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def timestamp(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat().replace("+00:00", "Z")


def _chat_message(m: OllamaMessage) -> ChatMessage:
    """An Ollama message as the chat template sees it (calls in OpenAI's shape, as templates expect)."""
    calls = None
    if m.tool_calls:
        calls = [
            {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls
        ]
    message = ChatMessage(role=m.role, content=m.content, tool_calls=calls, name=m.tool_name)
    return _with_images(message, len(m.images or []))


def _with_images(message: ChatMessage, num_images: int) -> ChatMessage:
    """`message` with image parts before its text (the template writes each image's marker)."""
    if not num_images:
        return message
    parts: list[Any] = [
        ImageURLPart(type="image_url", image_url=ImageURL(url="data:")) for _ in range(num_images)
    ]
    return message.model_copy(update={"content": [*parts, TextPart(type="text", text=message.content or "")]})


def _decode_images(
    ctx: ServingContext, images: list[Any], fields: list[str], add_special_tokens: bool
) -> ImageInputs | None:
    """Ollama's base64 `images` -> their bytes (None for none); 400s naming the field of a bad one,
    or `fields[0]`'s when the model takes no images."""
    if not images:
        return None
    if not ctx.engine.takes_images:
        raise APIError(
            400, f"{fields[0]}: model {ctx.model_name!r} takes no images (text only)", param=fields[0]
        )
    data = []
    for field, image in zip(fields, images, strict=True):
        if not isinstance(image, str):
            raise APIError(400, f"{field}: an image must be a base64 string", param=field)
        data.append(decode_base64(image, ctx.config, field))
    return ImageInputs(data, fields, add_special_tokens)


def _ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls in Ollama's shape: `{"function": {"name", "arguments": {...}}}`."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            arguments = {}
        out.append(
            {"function": {"name": call.name, "arguments": arguments if isinstance(arguments, dict) else {}}}
        )
    return out


def _keep_alive(req: _OllamaRequest) -> float | None:
    try:
        return parse_duration(req.keep_alive)
    except ValueError as e:
        raise APIError(400, f"keep_alive: {e}", param="keep_alive") from None


def _template_kwargs(req: _OllamaRequest) -> dict[str, Any] | None:
    """`think` as the chat template's switch (Qwen3's `enable_thinking`, what vLLM's
    `chat_template_kwargs` set); a level ("low", ...) means on, and reaches templates that take
    one (gpt-oss) as `reasoning_effort`. None: the template's own default."""
    if req.think is None:
        return None
    kwargs: dict[str, Any] = {"enable_thinking": req.think is not False}
    if isinstance(req.think, str):
        kwargs["reasoning_effort"] = req.think
    return kwargs


# -- one answer (serving/pieces.py) -> NDJSON lines or one JSON object ---------------------------------


def _object(req: _OllamaRequest, piece: Piece, start: float) -> dict[str, Any]:
    """A piece as Ollama's object: `message` (/api/chat) or `response` (/api/generate), with the
    counts and durations (nanoseconds) when it is the last."""
    body: dict[str, Any] = {"model": req.model, "created_at": timestamp()}
    if isinstance(req, OllamaChatRequest):
        message: dict[str, Any] = {"role": "assistant", "content": piece.content}
        if piece.thinking:
            message["thinking"] = piece.thinking
        if piece.tool_calls:
            message["tool_calls"] = _ollama_calls(piece.tool_calls)
        body["message"] = message
    else:
        body["response"] = piece.content
        if piece.thinking:
            body["thinking"] = piece.thinking
    body["done"] = piece.end is not None
    if piece.end is None:
        return body
    end = piece.end
    body.update(
        done_reason={"length": "length", "abort": "abort"}.get(end.reason or "", "stop"),
        total_duration=int(1e9 * (time.monotonic() - start)), load_duration=0,
        prompt_eval_count=end.prompt_eval_count, eval_count=end.eval_count,
    )  # fmt: skip
    durations = {"prompt_eval_duration": end.prompt_eval_seconds, "eval_duration": end.eval_seconds}
    body.update({key: int(1e9 * seconds) for key, seconds in durations.items() if seconds is not None})
    if end.context is not None:
        body["context"] = end.context
    return body


async def _respond(req: _OllamaRequest, raw: Request, pieces: AsyncIterator[Piece],
                   streams: list[RequestStream]) -> Any:  # fmt: skip
    """The answer as NDJSON, one object per piece (`stream`, Ollama's default), or as one object
    holding all of it; a client that leaves a whole answer early aborts `streams`."""
    start = time.monotonic()
    if req.stream:

        async def lines() -> AsyncIterator[str]:
            try:
                async for piece in pieces:
                    yield json.dumps(_object(req, piece, start)) + "\n"
            except APIError as e:  # after the first byte: Ollama's error line
                yield json.dumps({"error": e.message}) + "\n"
            except Exception as e:
                yield json.dumps({"error": f"the engine failed: {e}"}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def whole() -> JSONResponse:
        return JSONResponse(_object(req, await gather(pieces), start))

    return await run_unless_disconnected(raw, whole, streams)


class OllamaServing:
    def __init__(self, models: ModelManager) -> None:
        self.models = models

    async def _serve(self, req: _OllamaRequest, remote: Callable[[RemoteModel], Awaitable[Any]],
                     native: Callable[[ServingContext], Awaitable[Any]]) -> Any:  # fmt: skip
        """`req` on its model (kept loaded for the request's keep_alive), remote or native."""
        return await self.models.serve(req.model, remote=remote, native=native, keep_alive=_keep_alive(req))

    async def _load_or_unload(self, req: _OllamaRequest) -> Any:
        """Ollama's way of loading a model (no prompt) or unloading it (no prompt, keep_alive 0)."""
        if _keep_alive(req) == 0:  # an adapter's name unloads its base model
            slot = self.models.resolve_base(req.model)
            if not slot.is_remote:
                await self.models.unload(slot.name)
            return self._empty(req, "unload")

        async def loaded(_: Any) -> Any:
            return self._empty(req, "load")

        return await self._serve(req, loaded, loaded)

    def _params(self, req: _OllamaRequest) -> SamplingParams:
        o = req.options or OllamaOptions()
        constraint = None
        if req.format == "json":
            constraint = StructuredOutputsParams(json_object=True)
        elif isinstance(req.format, dict):
            constraint = StructuredOutputsParams(json=req.format)
        max_tokens = None if o.num_predict is None or o.num_predict < 0 else o.num_predict
        if max_tokens == 0:
            raise APIError(
                400, "options.num_predict must be positive, or -1 for no limit", param="options.num_predict"
            )
        try:
            return SamplingParams(
                temperature=0.8 if o.temperature is None else float(o.temperature),  # Ollama's defaults
                top_p=0.9 if o.top_p is None else float(o.top_p),
                top_k=40 if o.top_k is None else o.top_k,
                min_p=0.0 if o.min_p is None else float(o.min_p),
                repetition_penalty=1.1 if o.repeat_penalty is None else float(o.repeat_penalty),
                presence_penalty=float(o.presence_penalty or 0.0),
                frequency_penalty=float(o.frequency_penalty or 0.0),
                seed=o.seed,
                max_tokens=max_tokens,
                stop=[o.stop] if isinstance(o.stop, str) else list(o.stop or []),
                structured_outputs=constraint,
            )
        except ValueError as e:
            raise APIError(400, f"options: {e}", param="options") from None

    @staticmethod
    def _relay(req: _OllamaRequest, raw: Request, params: SamplingParams, remote: RemoteModel, path: str,
               body: dict[str, Any]) -> Awaitable[Any]:  # fmt: skip
        """`req` sent to a remote model as the OpenAI request it means."""
        body = {**body, **openai_sampling(params, req.format)}
        kwargs = _template_kwargs(req)
        if kwargs is not None and path == "/chat/completions":  # vLLM's (and llmserve's) field
            body["chat_template_kwargs"] = kwargs
        return _respond(req, raw, relay_pieces(remote, path, body), [])

    async def generate(self, raw: Request) -> Any:
        req: OllamaGenerateRequest = parse(OllamaGenerateRequest, await raw.json())
        params = self._params(req)  # bad options are a 400 before anything loads
        if not req.prompt:
            return await self._load_or_unload(req)
        image_fields = [f"images[{j}]" for j in range(len(req.images or []))]
        # the images go before the text, as Ollama puts them
        messages = [_with_images(ChatMessage(role="user", content=req.prompt), len(image_fields))]
        if req.system:
            messages.insert(0, ChatMessage(role="system", content=req.system))

        def remote(up: RemoteModel) -> Awaitable[Any]:
            if image_fields:
                raise APIError(400, "images go to native models only", param="images")
            if req.raw:
                return self._relay(req, raw, params, up, "/completions", {"prompt": req.prompt})
            return self._relay(
                req, raw, params, up, "/chat/completions", {"messages": openai_messages(messages)}
            )

        async def native(ctx: ServingContext) -> Any:
            images = _decode_images(ctx, req.images or [], image_fields, add_special_tokens=req.raw)
            if req.raw:  # the prompt as it is: no template, so no thinking to switch or split
                return await self._run(ctx, req, raw, req.prompt, params, split=False, images=images)
            if images is not None:
                text = render_chat_text(
                    ctx, messages, add_generation_prompt=True, extra=_template_kwargs(req)
                )
                return await self._run(ctx, req, raw, text, params, self._split(ctx, req), images=images)
            ids = render_chat(ctx, messages, add_generation_prompt=True, extra=_template_kwargs(req))
            return await self._run(ctx, req, raw, ids, params, split=self._split(ctx, req))

        return await self._serve(req, remote, native)

    async def chat(self, raw: Request) -> Any:
        req: OllamaChatRequest = parse(OllamaChatRequest, await raw.json())
        params = self._params(req)
        if not req.messages:
            return await self._load_or_unload(req)
        messages = [_chat_message(m) for m in req.messages]
        image_fields = [f"messages[{i}].images[{j}]" for i, m in enumerate(req.messages) for j in range(len(m.images or []))]  # fmt: skip

        def remote(up: RemoteModel) -> Awaitable[Any]:
            if image_fields:
                raise APIError(400, "images go to native models only", param="messages")
            body: dict[str, Any] = {"messages": openai_messages(messages)}
            if req.tools:
                body["tools"] = req.tools
            return self._relay(req, raw, params, up, "/chat/completions", body)

        async def native(ctx: ServingContext) -> Any:
            # tools as on /v1/chat/completions with tool_choice "auto": the model's own call format,
            # read back into Ollama's `tool_calls` (arguments as objects)
            plan = plan_tools(req.tools, None, None, ctx.tool_format) if req.tools else None
            images = _decode_images(
                ctx, [b for m in req.messages for b in m.images or []], image_fields, False
            )
            last = messages[-1].role
            text = render_chat_text(ctx, messages, add_generation_prompt=last != "assistant",
                                    continue_final_message=last == "assistant", extra=_template_kwargs(req),
                                    tools=plan.tools if plan else None, fmt=plan.fmt if plan else None)  # fmt: skip
            # without images, the ids render_chat would give (the template holds its special tokens)
            prompt = text if images is not None else ctx.tokenizer.encode(text, add_special_tokens=False)
            return await self._run(
                ctx,
                req,
                raw,
                prompt,
                with_tools(params, plan) if plan else params,
                self._split(ctx, req),
                plan.fmt if plan else None,
                images,
            )

        return await self._serve(req, remote, native)

    @staticmethod
    def _split(ctx: ServingContext, req: _OllamaRequest) -> bool:
        """Whether the reply's thinking goes to `thinking`: as in Ollama, a model that thinks
        does unless the request says `think: false`; `think` for a model that does not is a 400."""
        if req.think not in (None, False) and not thinks(ctx):
            raise APIError(400, f'"{req.model}" does not support thinking', param="think")
        return req.think is not False and thinks(ctx)

    @staticmethod
    async def _run(ctx: ServingContext, req: _OllamaRequest, raw: Request, prompt: str | list[int],
                   params: SamplingParams, split: bool, tools: ToolFormat | None = None,
                   images: ImageInputs | None = None) -> Any:  # fmt: skip
        """Run one prompt on a native model; `split`: thinking apart from content; `tools`: the
        call format to read tool calls back in (chat with tools); `images`: the prompt's images."""
        chat = isinstance(req, OllamaChatRequest)
        answer = await start_answer(ctx, prompt, params, "ollama-chat" if chat else "ollama-gen", split, tools,
                                    context=not chat, images=images, final_only=not req.stream)  # fmt: skip
        return await _respond(req, raw, answer.pieces, answer.streams)

    @staticmethod
    def _empty(req: _OllamaRequest, reason: str) -> JSONResponse:
        """The answer to a request that only loads or unloads the model."""
        return JSONResponse({**_object(req, Piece(), 0.0), "done": True, "done_reason": reason})

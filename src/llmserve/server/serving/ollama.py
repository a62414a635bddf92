"""Ollama's API on the same port as OpenAI's, for clients written against Ollama (its Python and
JS libraries, Open WebUI, editors' plugins):

    POST /api/generate   a prompt (raw, or through the chat template with `system`), NDJSON stream
    POST /api/chat       messages through the chat template, NDJSON stream; `tools` as on
                         /v1/chat/completions (tool_choice auto), calls back as `tool_calls`
    GET  /api/tags       the served models         GET /api/ps    the loaded ones, with expiry
    POST /api/show       a model's details         GET /api/version

A remote (openai engine) model is reached through the OpenAI request the Ollama one means, and
its answer is turned back into Ollama's objects. `keep_alive` works as in Ollama: a request's value is how long its model stays loaded once idle;
`/api/generate` or `/api/chat` without a prompt loads the model, and with `keep_alive: 0` unloads it.

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

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.requests import Request

from llmserve import __version__
from llmserve.config.models import parse_duration
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatMessage
from llmserve.server.serving.chat import render_chat
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.inputs import process_prompt, start_requests
from llmserve.server.serving.streaming import merged, run_unless_disconnected
from llmserve.server.serving.tools import ToolCall, ToolFormat, ToolStreamSplitter, plan_tools

if TYPE_CHECKING:
    from llmserve.server.models import ModelManager, ModelSlot
    from llmserve.server.remote import RemoteModel

LOADED = "loaded"  # llmserve.server.models.LOADED (that module imports this package)

OLLAMA_API_VERSION = "0.6.3"
"""The Ollama version whose API this follows (reported by /api/version with llmserve's own)."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OllamaOptions(_Lenient):
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


class _OllamaRequest(_Lenient):
    model: StrictStr
    stream: StrictBool = True
    options: OllamaOptions | None = None
    format: Literal["", "json"] | dict[str, Any] | None = None
    keep_alive: StrictStr | StrictInt | StrictFloat | None = None
    """How long the model stays loaded once idle ("5m", seconds, -1: forever, 0: unload now)."""


class OllamaGenerateRequest(_OllamaRequest):
    prompt: StrictStr = ""
    system: StrictStr | None = None
    raw: StrictBool = False
    images: list[Any] | None = None


class OllamaFunctionCall(_Lenient):
    name: StrictStr
    arguments: dict[str, Any] = {}


class OllamaToolCall(_Lenient):
    function: OllamaFunctionCall


class OllamaMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: StrictStr | None = None
    """A tool message: the tool whose result `content` is."""


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = []
    tools: list[Any] | None = None


class OllamaShowRequest(_Lenient):
    model: StrictStr | None = None
    name: StrictStr | None = None  # the older field name


def ollama_error(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def parse(model: type[BaseModel], body: Any) -> Any:
    """`body` as `model`; a 400 naming the first bad field when it is not one."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(400, f"{where}: {err['msg']}", param=where) from None


def _timestamp(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat().replace("+00:00", "Z")


def _chat_message(m: OllamaMessage) -> ChatMessage:
    """An Ollama message as the chat template sees it (calls in OpenAI's shape, as templates expect)."""
    calls = None
    if m.tool_calls:
        calls = [
            {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls
        ]
    return ChatMessage(role=m.role, content=m.content, tool_calls=calls, name=m.tool_name)


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


def _native(slot: ModelSlot) -> ServingContext:
    assert slot.ctx is not None, "a slot without a remote has a serving context once leased"
    return slot.ctx


def _openai_sampling(params: SamplingParams, fmt: Any) -> dict[str, Any]:
    """Ollama's options (as sampling parameters) in an OpenAI request (with vLLM's extra fields
    top_k, min_p and repetition_penalty, which OpenAI-compatible servers commonly accept)."""
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


def _keep_alive(req: _OllamaRequest) -> float | None:
    try:
        return parse_duration(req.keep_alive)
    except ValueError as e:
        raise APIError(400, f"keep_alive: {e}", param="keep_alive") from None


class OllamaServing:
    def __init__(self, models: ModelManager) -> None:
        self.models = models

    @contextlib.asynccontextmanager
    async def _serving(self, req: _OllamaRequest) -> AsyncIterator[ModelSlot]:
        """The loaded model `req` names, kept loaded for the request's keep_alive."""
        async with self.models.lease(req.model, _keep_alive(req)) as slot:
            yield slot

    async def _load_or_unload(self, req: _OllamaRequest) -> Any:
        """Ollama's way of loading a model (no prompt) or unloading it (no prompt, keep_alive 0)."""
        if _keep_alive(req) == 0:
            slot = self.models.resolve(req.model)
            if not slot.is_remote:
                await self.models.unload(req.model)
            return await self._empty(req, "unload")
        async with self._serving(req):
            return await self._empty(req, "load")

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

    async def generate(self, raw: Request) -> Any:
        req: OllamaGenerateRequest = parse(OllamaGenerateRequest, await raw.json())
        if req.images:
            raise APIError(400, "images are not supported (text only)", param="images")
        params = self._params(req)
        if not req.prompt:
            return await self._load_or_unload(req)
        async with self._serving(req) as slot:
            if slot.remote is not None:
                if req.raw:
                    return await self._relay(slot.remote, req, params, "/completions", {"prompt": req.prompt})
                messages = [{"role": "system", "content": req.system}] if req.system else []
                messages.append({"role": "user", "content": req.prompt})
                return await self._relay(
                    slot.remote, req, params, "/chat/completions", {"messages": messages}
                )
            ctx = _native(slot)
            if req.raw:
                prompt: str | list[int] = req.prompt
            else:
                messages = [ChatMessage(role="user", content=req.prompt)]
                if req.system:
                    messages.insert(0, ChatMessage(role="system", content=req.system))
                prompt = render_chat(ctx, messages, add_generation_prompt=True)
            return await self._run(ctx, req, prompt, params, raw, chat=False)

    async def chat(self, raw: Request) -> Any:
        req: OllamaChatRequest = parse(OllamaChatRequest, await raw.json())
        if any(m.images for m in req.messages):
            raise APIError(400, "images are not supported (text only)", param="messages")
        params = self._params(req)
        if not req.messages:
            return await self._load_or_unload(req)
        messages = [_chat_message(m) for m in req.messages]
        async with self._serving(req) as slot:
            if slot.remote is not None:
                body: dict[str, Any] = {"messages": [m.model_dump(exclude_none=True) for m in messages]}
                if req.tools:
                    body["tools"] = req.tools
                return await self._relay(slot.remote, req, params, "/chat/completions", body)
            ctx = _native(slot)
            # tools as on /v1/chat/completions with tool_choice "auto": the model's own call format,
            # read back into Ollama's `tool_calls` (arguments as objects)
            plan = plan_tools(req.tools, None, None, ctx.tool_format) if req.tools else None
            if plan is not None and plan.fmt.keeps_special_tokens:
                params = dataclasses.replace(params, skip_special_tokens=False)
            last = messages[-1].role
            prompt = render_chat(ctx, messages, add_generation_prompt=last != "assistant",
                                 continue_final_message=last == "assistant", tools=plan.tools if plan else None,
                                 fmt=plan.fmt if plan else None)  # fmt: skip
            return await self._run(ctx, req, prompt, params, raw, chat=True, tools=plan.fmt if plan else None)

    async def _relay(self, remote: RemoteModel, req: _OllamaRequest, params: SamplingParams, path: str,
                     body: dict[str, Any]) -> Any:  # fmt: skip
        """An Ollama request for a remote (openai engine) model: sent upstream as the OpenAI
        request it means, the answer turned back into Ollama's objects (NDJSON when streamed)."""
        chat = isinstance(req, OllamaChatRequest)
        body = {**body, **_openai_sampling(params, req.format)}
        start = time.monotonic()

        def piece(text: str) -> dict[str, Any]:
            head = {"model": req.model, "created_at": _timestamp()}
            return {**head, "message": {"role": "assistant", "content": text}, "done": False} if chat else {
                **head, "response": text, "done": False}  # fmt: skip

        async def objects() -> AsyncIterator[dict[str, Any]]:
            calls: dict[int, dict[str, str]] = {}
            usage: dict[str, Any] = {}
            reason = None
            async for event in remote.events(path, body):
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if chat else choice.get("text")
                    for call in delta.get("tool_calls") or []:
                        entry = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                        fn = call.get("function") or {}
                        entry["name"] += fn.get("name") or ""
                        entry["arguments"] += fn.get("arguments") or ""
                    reason = choice.get("finish_reason") or reason
                    if text:
                        yield piece(text)
            if calls:
                call_piece = piece("")
                call_piece["message"]["tool_calls"] = _ollama_calls(
                    [ToolCall(c["name"], c["arguments"]) for c in calls.values()]
                )
                yield call_piece
            final = piece("")
            final.update(
                done=True, done_reason="length" if reason == "length" else "stop",
                total_duration=int(1e9 * (time.monotonic() - start)), load_duration=0,
                prompt_eval_count=int(usage.get("prompt_tokens") or 0),
                eval_count=int(usage.get("completion_tokens") or 0),
            )  # fmt: skip
            yield final

        if req.stream:

            async def lines() -> AsyncIterator[str]:
                try:
                    async for obj in objects():
                        yield json.dumps(obj) + "\n"
                except APIError as e:
                    yield json.dumps({"error": e.message}) + "\n"

            return StreamingResponse(lines(), media_type="application/x-ndjson")
        text, tool_calls, whole = "", None, None
        async for obj in objects():
            if chat:
                text += obj["message"]["content"]
                tool_calls = obj["message"].get("tool_calls", tool_calls)
            else:
                text += obj["response"]
            whole = obj
        assert whole is not None
        if chat:
            whole["message"]["content"] = text
            if tool_calls:
                whole["message"]["tool_calls"] = tool_calls
        else:
            whole["response"] = text
        return JSONResponse(whole)

    async def _empty(self, req: _OllamaRequest, reason: str) -> Any:
        body = {"model": req.model, "created_at": _timestamp(), "done": True, "done_reason": reason}
        body.update({"message": {"role": "assistant", "content": ""}} if isinstance(req, OllamaChatRequest) else {"response": ""})  # fmt: skip
        return JSONResponse(body)

    async def _run(self, ctx: ServingContext, req: _OllamaRequest, prompt: str | list[int], params: SamplingParams,
                   raw: Request, chat: bool, tools: ToolFormat | None = None) -> Any:  # fmt: skip
        """Run one prompt; `tools`: the call format to read tool calls back in (chat with tools)."""
        processed = await process_prompt(ctx, prompt, params)
        streams = start_requests(ctx, [processed], 0, "ollama-chat" if chat else "ollama-gen")
        start = time.monotonic()
        n_prompt = len(processed.token_ids)

        def piece(text: str) -> dict[str, Any]:
            head = {"model": req.model, "created_at": _timestamp()}
            return {**head, "message": {"role": "assistant", "content": text}, "done": False} if chat else {
                **head, "response": text, "done": False}  # fmt: skip

        def final(text: str, out_tokens: list[int], reason: str | None, metrics: Any) -> dict[str, Any]:
            body = piece(text)
            now = time.monotonic()
            first = getattr(metrics, "first_token_time", None) or now
            scheduled = getattr(metrics, "first_scheduled_time", None) or start
            body.update(
                done=True,
                done_reason={"length": "length", "abort": "abort"}.get(reason or "", "stop"),
                total_duration=int(1e9 * (now - start)),
                load_duration=0,
                prompt_eval_count=n_prompt,
                prompt_eval_duration=int(1e9 * max(0.0, first - scheduled)),
                eval_count=len(out_tokens),
                eval_duration=int(1e9 * max(0.0, now - first)),
            )
            if not chat:
                body["context"] = processed.token_ids + out_tokens
            return body

        if req.stream:

            async def lines() -> AsyncIterator[str]:
                tokens: list[int] = []
                splitter = ToolStreamSplitter(tools) if tools is not None else None
                try:
                    async for _, out in merged(ctx, streams):
                        c = out.outputs[0]
                        tokens.extend(c.token_ids)
                        text = splitter.feed(c.text) if splitter is not None else c.text
                        if out.finished and splitter is not None:
                            held, calls = splitter.finish()
                            text += held or ""
                            if calls:  # as Ollama: the calls in a chunk of their own, then the end
                                call_piece = piece(text)
                                call_piece["message"]["tool_calls"] = _ollama_calls(calls)
                                yield json.dumps(call_piece) + "\n"
                                text = ""
                        if out.finished:
                            yield json.dumps(final(text, tokens, c.finish_reason, out.metrics)) + "\n"
                        elif text:
                            yield json.dumps(piece(text)) + "\n"
                except APIError as e:
                    yield json.dumps({"error": e.message}) + "\n"
                except Exception as e:  # the engine failed mid-stream: Ollama's error line
                    yield json.dumps({"error": f"the engine failed: {e}"}) + "\n"

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        async def whole() -> JSONResponse:
            text, tokens, reason, metrics = "", [], None, None
            async for _, out in merged(ctx, streams):
                c = out.outputs[0]
                text += c.text
                tokens.extend(c.token_ids)
                reason, metrics = c.finish_reason or reason, out.metrics
            calls: list[ToolCall] = []
            if tools is not None and text:
                content, calls = tools.parse(text)
                text = (content or "") if calls else text
            body = final(text, tokens, reason, metrics)
            if calls:
                body["message"]["tool_calls"] = _ollama_calls(calls)
            return JSONResponse(body)

        return await run_unless_disconnected(raw, whole, streams)

    # -- the models, as Ollama describes them --------------------------------------------------------

    @staticmethod
    def _details(slot: ModelSlot) -> dict[str, Any]:
        files = slot.files
        details: dict[str, Any] = {
            "parent_model": "",
            "format": "gguf" if files and files[0].suffix == ".gguf" else "safetensors" if files else slot.engine,
            "family": "",
            "families": [],
            "parameter_size": "",
            "quantization_level": "",
        }  # fmt: skip
        if slot.ctx is None:  # what is known without loading it
            return details
        loaded = slot.ctx.engine.engine.loaded
        fmt = loaded.checkpoint_format
        kinds = sorted({g.fmt for g in loaded.weight_groups if g.role != "other"})
        family = str(getattr(loaded.hf_config, "model_type", ""))
        details.update(
            family=family,
            families=[family],
            parameter_size=f"{loaded.num_params / 1e6:.0f}M" if loaded.num_params < 1e9 else f"{loaded.num_params / 1e9:.1f}B",
            quantization_level=fmt[fmt.find("(") + 1 : fmt.find(",")] if "(" in fmt else ",".join(kinds) or str(loaded.dtype).removeprefix("torch."),
        )  # fmt: skip
        return details

    def _entry(self, slot: ModelSlot) -> dict[str, Any]:
        files = [p for p in slot.files if p.exists()]
        return {
            "name": slot.name,
            "model": slot.name,
            "modified_at": _timestamp(max(p.stat().st_mtime for p in files)) if files else _timestamp(),
            "size": slot.size_bytes if slot.size_bytes is not None else slot.file_bytes,
            "digest": (slot.digest or "").removeprefix("sha256:"),
            "details": self._details(slot),
        }

    def tags(self) -> dict[str, Any]:
        return {"models": [self._entry(slot) for slot in self.models.slots]}

    def ps(self) -> dict[str, Any]:
        entries = []
        for slot in self.models.slots:
            if slot.state != LOADED or slot.is_remote:
                continue
            entry = self._entry(slot)
            entry.pop("modified_at")
            expires = slot.expires_at(self.models.config.keep_alive)
            entry.update(
                expires_at="9999-12-31T23:59:59Z" if expires is None else _timestamp(expires), size_vram=0
            )
            entries.append(entry)
        return {"models": entries}

    async def show(self, raw: Request) -> dict[str, Any]:
        req: OllamaShowRequest = parse(OllamaShowRequest, await raw.json())
        name = req.model or req.name
        if not name:
            raise APIError(400, "model is required", param="model")
        slot = self.models.resolve(name)
        details = self._details(slot)
        info: dict[str, Any] = {"general.architecture": details["family"]}
        template = ""
        if slot.ctx is not None:
            engine = slot.ctx.engine.engine
            info["general.parameter_count"] = engine.loaded.num_params
            info[f"{details['family'] or 'llama'}.context_length"] = engine.max_model_len
            template = engine.tokenizer.chat_template or ""
        return {
            "license": "",
            "modelfile": f"# served by llmserve {__version__}\nFROM {slot.spec.source or slot.name}\n",
            "parameters": "",
            "template": template,
            "details": details,
            "model_info": info,
            "capabilities": ["completion"],
            "modified_at": self._entry(slot)["modified_at"],
        }

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION, "llmserve_version": __version__}

"""Ollama's API on the same port as OpenAI's, for clients written against Ollama (its Python and
JS libraries, Open WebUI, editors' plugins):

    POST /api/generate   a prompt (raw, or through the chat template with `system`), NDJSON stream
    POST /api/chat       messages through the chat template, NDJSON stream
    GET  /api/tags       the served model          GET /api/ps    the loaded model
    POST /api/show       its details               GET /api/version

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
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.requests import Request

from llmserve import __version__
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatMessage
from llmserve.server.serving.chat import render_chat
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.inputs import process_prompt, start_requests
from llmserve.server.serving.streaming import merged, run_unless_disconnected

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
    """Accepted for compatibility; the one model stays loaded."""


class OllamaGenerateRequest(_OllamaRequest):
    prompt: StrictStr = ""
    system: StrictStr | None = None
    raw: StrictBool = False
    images: list[Any] | None = None


class OllamaMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr = ""
    images: list[Any] | None = None


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


class OllamaServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _check_model(self, name: str) -> None:
        """Ollama's names carry a tag (`smollm2:latest`); the served name with or without one is it."""
        ctx = self.ctx
        if name in (ctx.model_name, f"{ctx.model_name}:latest"):
            return
        raise APIError(404, f"model {name!r} not found; this server serves {ctx.model_name!r}", param="model")

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
        self._check_model(req.model)
        if req.images:
            raise APIError(400, "images are not supported (text only)", param="images")
        params = self._params(req)
        if not req.prompt:  # Ollama's way of loading a model: an empty response, done at once
            return await self._empty(req, "load")
        if req.raw:
            prompt: str | list[int] = req.prompt
        else:
            messages = [ChatMessage(role="user", content=req.prompt)]
            if req.system:
                messages.insert(0, ChatMessage(role="system", content=req.system))
            prompt = render_chat(self.ctx, messages, add_generation_prompt=True)
        return await self._run(req, prompt, params, raw, chat=False)

    async def chat(self, raw: Request) -> Any:
        req: OllamaChatRequest = parse(OllamaChatRequest, await raw.json())
        self._check_model(req.model)
        if req.tools:
            raise APIError(
                400, "tools are not supported on /api/chat yet; use /v1/chat/completions", param="tools"
            )
        if any(m.images for m in req.messages):
            raise APIError(400, "images are not supported (text only)", param="messages")
        params = self._params(req)
        if not req.messages:
            return await self._empty(req, "load")
        messages = [ChatMessage(role=m.role, content=m.content) for m in req.messages]
        prompt = render_chat(self.ctx, messages, add_generation_prompt=messages[-1].role != "assistant",
                             continue_final_message=messages[-1].role == "assistant")  # fmt: skip
        return await self._run(req, prompt, params, raw, chat=True)

    async def _empty(self, req: _OllamaRequest, reason: str) -> Any:
        body = {"model": req.model, "created_at": _timestamp(), "done": True, "done_reason": reason}
        body.update({"message": {"role": "assistant", "content": ""}} if isinstance(req, OllamaChatRequest) else {"response": ""})  # fmt: skip
        return JSONResponse(body)

    async def _run(self, req: _OllamaRequest, prompt: str | list[int], params: SamplingParams, raw: Request,
                   chat: bool) -> Any:  # fmt: skip
        ctx = self.ctx
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
                try:
                    async for _, out in merged(ctx, streams):
                        c = out.outputs[0]
                        tokens.extend(c.token_ids)
                        if out.finished:
                            yield json.dumps(final(c.text, tokens, c.finish_reason, out.metrics)) + "\n"
                        elif c.text:
                            yield json.dumps(piece(c.text)) + "\n"
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
            return JSONResponse(final(text, tokens, reason, metrics))

        return await run_unless_disconnected(raw, whole, streams)

    # -- the model, as Ollama describes it ----------------------------------------------------------

    def _details(self) -> dict[str, Any]:
        loaded = self.ctx.engine.engine.loaded
        fmt = loaded.checkpoint_format
        kinds = sorted({g.fmt for g in loaded.weight_groups if g.role != "other"})
        return {
            "parent_model": "",
            "format": "gguf" if fmt.startswith("gguf") else fmt,
            "family": str(getattr(loaded.hf_config, "model_type", "")),
            "families": [str(getattr(loaded.hf_config, "model_type", ""))],
            "parameter_size": f"{loaded.num_params / 1e6:.0f}M" if loaded.num_params < 1e9 else f"{loaded.num_params / 1e9:.1f}B",
            "quantization_level": fmt[fmt.find("(") + 1 : fmt.find(",")] if "(" in fmt else ",".join(kinds) or str(loaded.dtype).removeprefix("torch."),
        }  # fmt: skip

    def _entry(self) -> dict[str, Any]:
        loaded = self.ctx.engine.engine.loaded
        name = self.ctx.model_name
        return {
            "name": name,
            "model": name,
            "modified_at": _timestamp(loaded.source.path.stat().st_mtime) if loaded.source.path.exists() else _timestamp(),
            "size": int(loaded.weight_bytes),
            "digest": "",
            "details": self._details(),
        }  # fmt: skip

    def tags(self) -> dict[str, Any]:
        return {"models": [self._entry()]}

    def ps(self) -> dict[str, Any]:
        entry = self._entry()
        entry.pop("modified_at")
        entry.update(expires_at="9999-12-31T23:59:59Z", size_vram=0)  # loaded for the server's lifetime
        return {"models": [entry]}

    async def show(self, raw: Request) -> dict[str, Any]:
        req: OllamaShowRequest = parse(OllamaShowRequest, await raw.json())
        name = req.model or req.name
        if not name:
            raise APIError(400, "model is required", param="model")
        self._check_model(name)
        engine = self.ctx.engine.engine
        loaded = engine.loaded
        info = {f"general.{k}": v for k, v in (("architecture", self._details()["family"]),
                ("parameter_count", loaded.num_params))}  # fmt: skip
        info["llama.context_length"] = engine.max_model_len
        return {
            "license": "",
            "modelfile": f"# served by llmserve {__version__}\nFROM {loaded.source.path}\n",
            "parameters": "",
            "template": engine.tokenizer.chat_template or "",
            "details": self._details(),
            "model_info": info,
            "capabilities": ["completion"],
            "modified_at": self._entry()["modified_at"],
        }

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION, "llmserve_version": __version__}

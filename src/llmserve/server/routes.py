"""The HTTP routes, thin: each hands its parsed request to the serving layer (server/serving/).

    openai     /v1/models, /v1/models/{model}, /v1/completions, /v1/chat/completions
    tokenizer  /tokenize, /detokenize, /tokenizer_info                    (vLLM's extras)
    ops        /health, /version, /stats, and /metrics when enabled
    ollama     /api/generate, /api/chat, /api/tags, /api/ps, /api/show, /api/version (Ollama's API)

Routes reach the server through `ServerState` (app.state.server): the gate has already refused
requests while the model loads or the server drains, so the serving context is set here.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from llmserve import __version__
from llmserve.server.errors import APIError, error_body
from llmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmserve.server.serving import ChatServing, CompletionServing, ServingContext, TokenServing
from llmserve.server.serving.ollama import OllamaServing, ollama_error
from llmserve.server.state import ServerState, server_state, serving_context

State = Annotated[ServerState, Depends(server_state)]
Serving = Annotated[ServingContext, Depends(serving_context)]

openai = APIRouter()
tokenizer = APIRouter()
ops = APIRouter()
metrics = APIRouter()
ollama = APIRouter()


def _model_card(state: ServerState, ctx: ServingContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "llmserve",
        "max_model_len": ctx.max_model_len,
    }


@openai.get("/v1/models")
async def list_models(state: State, ctx: Serving) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state, ctx)]}


@openai.get("/v1/models/{model:path}")
async def get_model(model: str, state: State, ctx: Serving) -> dict[str, Any]:
    ctx.check_model(model)
    return _model_card(state, ctx)


@openai.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, ctx: Serving) -> Any:
    return await CompletionServing(ctx).create(req, raw)


@openai.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request, ctx: Serving) -> Any:
    return await ChatServing(ctx).create(req, raw)


@tokenizer.post("/tokenize")
async def tokenize(req: TokenizeRequest, ctx: Serving) -> Any:
    return TokenServing(ctx).tokenize(req)


@tokenizer.post("/detokenize")
async def detokenize(req: DetokenizeRequest, ctx: Serving) -> Any:
    return TokenServing(ctx).detokenize(req)


@tokenizer.get("/tokenizer_info")
async def tokenizer_info(ctx: Serving) -> Any:
    return TokenServing(ctx).info()


@ops.get("/health")
async def health(state: State) -> Any:
    """200 once requests can be served; 503 (OpenAI-shaped) while loading, draining, after a
    failed load or once the engine has died. The one route the gate leaves open."""
    if state.load_error is not None:
        return JSONResponse(error_body(503, f"loading the model failed: {state.load_error}"), status_code=503)
    if state.draining:
        return JSONResponse(error_body(503, "the server is shutting down"), status_code=503)
    if state.ctx is None:
        return JSONResponse(error_body(503, "the model is still loading"), status_code=503)
    if state.ctx.engine.dead is not None:
        return JSONResponse(error_body(503, f"the engine stopped: {state.ctx.engine.dead}"), status_code=503)
    return {"status": "ok"}


@ops.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@ops.get("/stats")
async def stats(ctx: Serving) -> dict[str, Any]:
    """The engine's state right now (requests, KV blocks): for operators and tests."""
    snapshot = dataclasses.asdict(ctx.engine.snapshot)
    del snapshot["step_tokens"]  # the last step's, not the server's state
    return {"num_active_requests": ctx.engine.num_active, **snapshot}


@metrics.get("/metrics")
async def prometheus_metrics(state: State, ctx: Serving) -> Response:
    """Prometheus exposition (docs/metrics.md lists every metric)."""
    assert state.metrics is not None
    body, content_type = state.metrics.exposition()
    return Response(body, media_type=content_type)


async def _ollama(call: Any) -> Any:
    """Ollama's error shape, `{"error": "..."}`, for anything a route refuses."""
    try:
        return await call
    except APIError as e:
        return ollama_error(e)
    except ValueError as e:  # a body that is not JSON
        return ollama_error(APIError(400, f"the request body is not valid JSON: {e}"))


@ollama.post("/api/generate")
async def ollama_generate(raw: Request, ctx: Serving) -> Any:
    return await _ollama(OllamaServing(ctx).generate(raw))


@ollama.post("/api/chat")
async def ollama_chat(raw: Request, ctx: Serving) -> Any:
    return await _ollama(OllamaServing(ctx).chat(raw))


@ollama.post("/api/show")
async def ollama_show(raw: Request, ctx: Serving) -> Any:
    return await _ollama(OllamaServing(ctx).show(raw))


@ollama.get("/api/tags")
async def ollama_tags(ctx: Serving) -> Any:
    return OllamaServing(ctx).tags()


@ollama.get("/api/ps")
async def ollama_ps(ctx: Serving) -> Any:
    return OllamaServing(ctx).ps()


@ollama.get("/api/version")
async def ollama_version() -> Any:
    return OllamaServing.version()

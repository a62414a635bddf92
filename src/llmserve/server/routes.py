"""The HTTP routes, thin: each hands its parsed request to the serving layer (server/serving/).

    openai     /v1/models, /v1/models/{model}, /v1/completions, /v1/chat/completions, /v1/embeddings,
               /v1/score and /v1/rerank (vLLM's; also /score, /rerank, /v2/rerank), /classify (vLLM's; also /v1/classify),
               /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's, with --allow-runtime-lora-updating)
    tokenizer  /tokenize, /detokenize, /tokenizer_info                    (vLLM's extras)
    ops        /health, /livez, /version, /stats, and /metrics when enabled
    ollama     /api/generate, /api/chat, /api/embed, /api/embeddings, /api/tags, /api/ps, /api/show, /api/version (Ollama's API)
    anthropic  /v1/messages, /v1/messages/count_tokens (Anthropic's API; its error shape, errors.py)
    responses  /v1/responses, GET and DELETE /v1/responses/{id}, its input_items and cancel (OpenAI's Responses API)
    admin      /admin/models/load, /admin/models/unload

Routes reach the server through `ServerState` (app.state.server); a route that serves a model
takes a lease on it from the `ModelManager` (server/models.py), which routes by `model` and loads
the model first when it is not loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr

from llmserve import __version__
from llmserve.config.models import parse_duration
from llmserve.metrics.stats import SchedulerStats
from llmserve.server.errors import APIError, error_body
from llmserve.server.lora_adapters import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from llmserve.server.models import LOADED, ModelManager, ModelSlot
from llmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    parse,
)
from llmserve.server.serving import ChatServing, CompletionServing, ServingContext, TokenServing
from llmserve.server.serving.anthropic import AnthropicServing
from llmserve.server.serving.embeddings import (
    OllamaEmbedRequest,
    OllamaLegacyEmbedRequest,
    create_embeddings,
    ollama_embed,
    ollama_legacy_embeddings,
    parse_ollama,
)
from llmserve.server.serving.ollama import OllamaServing, ollama_error
from llmserve.server.serving.ollama_models import OllamaModels
from llmserve.server.serving.responses import ResponsesServing
from llmserve.server.serving.scores import (
    ClassifyRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    create_classification,
    create_pooling,
    create_rerank,
    create_score,
)
from llmserve.server.state import ServerState, server_state

State = Annotated[ServerState, Depends(server_state)]

openai = APIRouter()
tokenizer = APIRouter()
ops = APIRouter()
metrics = APIRouter()
ollama = APIRouter()
anthropic = APIRouter()
responses = APIRouter()
admin = APIRouter()


def _models(request: Request) -> ModelManager:
    return server_state(request).models


Models = Annotated[ModelManager, Depends(_models)]


def _native(slot: ModelSlot) -> ServingContext:
    """The slot's serving context; a 400 for a remote model on a route only native models have."""
    if slot.ctx is None:
        raise APIError(
            400, f"the model {slot.name!r} is served by the {slot.engine} engine; this route needs a "
            "native model", param="model",
        )  # fmt: skip
    return slot.ctx


@openai.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    """Every configured model, loaded or not, with its state, size and weights digest; then the
    LoRA adapters, each with its base model as `parent` (vLLM's shape)."""
    models = state.models
    cards = [models.card(slot, state.started) for slot in models.slots]
    return {
        "object": "list",
        "data": cards + [models.adapter_card(n, state.started) for n in models.adapters],
    }


@openai.get("/v1/models/{model:path}")
async def get_model(model: str, state: State) -> dict[str, Any]:
    if model in state.models.adapters:
        return state.models.adapter_card(model, state.started)
    return state.models.card(state.models.resolve(model), state.started)


@openai.post("/v1/load_lora_adapter")
async def load_lora_adapter_route(raw: Request, models: Models) -> Any:
    """vLLM's runtime adapter loading (server/lora_adapters.py); its plain-text success reply."""
    req = parse(LoadLoRAAdapterRequest, await _json(raw))
    return PlainTextResponse(await load_lora_adapter(models, req))


@openai.post("/v1/unload_lora_adapter")
async def unload_lora_adapter_route(raw: Request, models: Models) -> Any:
    req = parse(UnloadLoRAAdapterRequest, await _json(raw))
    return PlainTextResponse(await unload_lora_adapter(models, req))


@openai.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, models: Models) -> Any:
    return await models.serve(
        req.model,
        remote=lambda remote: remote.proxy(raw, "/completions"),
        native=lambda ctx: CompletionServing(ctx).create(req, raw),
    )


@openai.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request, models: Models) -> Any:
    return await models.serve(
        req.model,
        remote=lambda remote: remote.proxy(raw, "/chat/completions"),
        native=lambda ctx: ChatServing(ctx).create(req, raw),
    )


@openai.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, raw: Request, models: Models) -> Any:
    return await models.serve(
        req.model,
        remote=lambda remote: remote.proxy(raw, "/embeddings"),
        native=lambda ctx: create_embeddings(ctx, req, raw),
    )


@openai.post("/v1/score")
@openai.post("/score")
async def score(req: ScoreRequest, raw: Request, models: Models) -> Any:
    return await models.serve(
        req.model,
        remote=lambda remote: remote.proxy(raw, "/score"),
        native=lambda ctx: create_score(ctx, req, raw),
    )


@openai.post("/v1/rerank")
@openai.post("/rerank")
@openai.post("/v2/rerank")
@openai.post("/reranking")  # llama-server's other spellings
@openai.post("/v1/reranking")
async def rerank(req: RerankRequest, raw: Request, models: Models) -> Any:
    return await models.serve(
        req.model,
        remote=lambda remote: remote.proxy(raw, "/rerank"),
        native=lambda ctx: create_rerank(ctx, req, raw),
    )


@openai.post("/pooling")
async def pooling(req: PoolingRequest, raw: Request, models: Models) -> Any:
    return await models.serve(
        req.model,
        remote=lambda remote: remote.proxy(raw, remote.at_root("/pooling")),  # vLLM's: not under /v1
        native=lambda ctx: create_pooling(ctx, req, raw),
    )


@openai.post("/classify")
@openai.post("/v1/classify")
async def classify(req: ClassifyRequest, raw: Request, models: Models) -> Any:
    return await models.serve(
        req.model,
        remote=lambda remote: remote.proxy(raw, remote.at_root("/classify")),  # vLLM's: not under /v1
        native=lambda ctx: create_classification(ctx, req, raw),
    )


@tokenizer.post("/tokenize")
async def tokenize(req: TokenizeRequest, models: Models) -> Any:
    async with models.lease(req.model) as slot:
        return TokenServing(_native(slot)).tokenize(req)


@tokenizer.post("/detokenize")
async def detokenize(req: DetokenizeRequest, models: Models) -> Any:
    async with models.lease(req.model) as slot:
        return TokenServing(_native(slot)).detokenize(req)


@tokenizer.get("/tokenizer_info")
async def tokenizer_info(models: Models, model: str | None = None) -> Any:
    async with models.lease(model) as slot:
        return TokenServing(_native(slot)).info()


@ops.get("/health")
async def health(state: State) -> Any:
    """200 once requests can be served; 503 (OpenAI-shaped) while the preloaded models load, while
    draining, after a one-model server's failed load or once its engine has died. The one route the
    gate leaves open. A server of several models stays healthy while one of them has failed
    (/v1/models shows which)."""
    if state.load_error is not None:
        return JSONResponse(error_body(503, f"loading the model failed: {state.load_error}"), status_code=503)
    if state.draining:
        return JSONResponse(error_body(503, "the server is shutting down"), status_code=503)
    if not state.models.started_up:
        return JSONResponse(error_body(503, "the model is still loading"), status_code=503)
    if len(state.models.slots) == 1 and state.models.default.error is not None:
        return JSONResponse(
            error_body(503, f"the engine stopped: {state.models.default.error}"), status_code=503
        )
    return {"status": "ok"}


@ops.get("/livez")
async def livez() -> Any:
    """200 whenever the server answers at all: while the models load and while it drains too.
    A liveness probe's route (deploy/kubernetes/deployment.yaml): /health is the readiness one,
    and its 503 while a large model loads must not get the process restarted. Open, like /health."""
    return {"status": "ok"}


@ops.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


def _engine_stats(slot: ModelSlot) -> dict[str, Any]:
    engine = slot.ctx.engine if slot.ctx is not None else None
    snapshot = dataclasses.asdict(engine.snapshot if engine is not None else SchedulerStats())
    del snapshot["step_tokens"]  # the last step's, not the server's state
    return {"state": slot.state, "num_active_requests": engine.num_active if engine else 0, **snapshot}


@ops.get("/stats")
async def stats(state: State, model: str | None = None) -> dict[str, Any]:
    """The engine's state right now (requests, KV blocks): for operators and tests. The top level
    is the default model's (or `?model=`'s); `models` has every native model's."""
    models = state.models
    return {
        **_engine_stats(models.resolve(model)),
        "models": {s.name: _engine_stats(s) for s in models.slots if not s.is_remote},
    }


@metrics.get("/metrics")
async def prometheus_metrics(state: State) -> Response:
    """Prometheus exposition (docs/metrics.md lists every metric)."""
    assert state.metrics is not None
    body, content_type = generate_latest(state.metrics.registry), CONTENT_TYPE_LATEST
    return Response(body, media_type=content_type)


# -- admin: load and unload models (behind the API key, like every route but the probes) --------


class _ModelAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    keep_alive: StrictStr | StrictInt | StrictFloat | None = None
    """load: how long the model stays loaded once idle (as Ollama's keep_alive)."""


async def _json(raw: Request) -> Any:
    try:
        return await raw.json()
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def _action(raw: Request) -> _ModelAction:
    return parse(_ModelAction, await _json(raw))


@admin.post("/admin/models/load")
async def admin_load(raw: Request, state: State) -> Any:
    """Load a model now (a failed one is tried again); answers its card once loaded."""
    action = await _action(raw)
    try:
        keep_alive = parse_duration(action.keep_alive)
    except ValueError as e:
        raise APIError(400, str(e), param="keep_alive") from None
    slot = await state.models.load(action.model)
    if keep_alive is not None:
        slot.keep_alive = keep_alive
    if slot.state != LOADED:
        raise APIError(503, f"loading the model {slot.name!r} failed: {slot.error}", code="model_load_failed")
    return state.models.card(slot, state.started)


@admin.post("/admin/models/unload")
async def admin_unload(raw: Request, state: State) -> Any:
    """Unload a model now; requests still running get --shutdown-timeout seconds, then are aborted."""
    action = await _action(raw)
    slot = await state.models.unload(action.model)
    return state.models.card(slot, state.started)


async def _ollama(call: Any) -> Any:
    """Ollama's error shape, `{"error": "..."}`, for anything a route refuses."""
    try:
        return await call
    except APIError as e:
        return ollama_error(e)
    except ValueError as e:  # a body that is not JSON
        return ollama_error(APIError(400, f"the request body is not valid JSON: {e}"))


@ollama.post("/api/generate")
async def ollama_generate(raw: Request, models: Models) -> Any:
    return await _ollama(OllamaServing(models).generate(raw))


@ollama.post("/api/chat")
async def ollama_chat(raw: Request, models: Models) -> Any:
    return await _ollama(OllamaServing(models).chat(raw))


async def _ollama_embed(raw: Request, models: ModelManager, legacy: bool) -> Any:
    req, keep_alive = await parse_ollama(raw, OllamaLegacyEmbedRequest if legacy else OllamaEmbedRequest)
    async with models.lease(req.model, keep_alive) as slot:
        ctx = _native(slot)
        return await (ollama_legacy_embeddings if legacy else ollama_embed)(ctx, req, raw)


@ollama.post("/api/embed")
async def ollama_embed_route(raw: Request, models: Models) -> Any:
    return await _ollama(_ollama_embed(raw, models, legacy=False))


@ollama.post("/api/embeddings")
async def ollama_embeddings_route(raw: Request, models: Models) -> Any:
    return await _ollama(_ollama_embed(raw, models, legacy=True))


@ollama.post("/api/show")
async def ollama_show(raw: Request, models: Models) -> Any:
    return await _ollama(OllamaModels(models).show(raw))


@ollama.get("/api/tags")
async def ollama_tags(models: Models) -> Any:
    return OllamaModels(models).tags()


@ollama.get("/api/ps")
async def ollama_ps(models: Models) -> Any:
    return OllamaModels(models).ps()


@ollama.post("/api/pull")
@ollama.post("/api/push")
@ollama.post("/api/create")
@ollama.post("/api/copy")
@ollama.delete("/api/delete")
async def ollama_unsupported(raw: Request) -> Any:
    """Ollama's model management has no counterpart: llmserve serves local files, named at start."""
    op = raw.url.path.rsplit("/", 1)[-1]
    return ollama_error(APIError(
        400, f"/api/{op} is not supported: llmserve does not download or manage model files; name local models "
        "when starting the server (llmserve serve NAME=PATH ..., or --config models.yaml)",
    ))  # fmt: skip


@ollama.get("/api/version")
async def ollama_version() -> Any:
    return OllamaModels.version()


@anthropic.post("/v1/messages")
async def anthropic_messages(raw: Request, models: Models) -> Any:
    return await AnthropicServing(models).create(raw)


@anthropic.post("/v1/messages/count_tokens")
async def anthropic_count_tokens(raw: Request, models: Models) -> Any:
    return await AnthropicServing(models).count_tokens(raw)


@responses.post("/v1/responses")
async def responses_create(raw: Request, state: State) -> Any:
    return await ResponsesServing(state.models, state.responses).create(raw)


@responses.get("/v1/responses/{response_id}")
async def responses_retrieve(response_id: str, state: State) -> Any:
    return ResponsesServing(state.models, state.responses).retrieve(response_id)


@responses.get("/v1/responses/{response_id}/input_items")
async def responses_input_items(
    response_id: str, state: State, after: str | None = None, limit: int = 20, order: str = "desc",
    include: Annotated[list[str] | None, Query()] = None,
) -> Any:  # fmt: skip
    """`include` (extra fields of some item types) changes nothing for text items: accepted."""
    return ResponsesServing(state.models, state.responses).input_items(response_id, after, limit, order)


@responses.post("/v1/responses/{response_id}/cancel")
async def responses_cancel(response_id: str, state: State) -> Any:
    return await ResponsesServing(state.models, state.responses).cancel(response_id)


@responses.delete("/v1/responses/{response_id}")
async def responses_delete(response_id: str, state: State) -> Any:
    return ResponsesServing(state.models, state.responses).delete(response_id)

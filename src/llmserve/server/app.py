"""The FastAPI application: routes (thin), the request gate, and the engine's life cycle.

    CORS (only when origins are given)
      -> gate: 503 while loading or draining, 401 without the API key, 413 for a large body;
       counts every refused request by reason (the request_rejected metric)
        -> routes -> serving layer -> AsyncEngine

The gate is deny-by-default: it runs before routing, so every route, including one added later and
unknown paths, needs the key; only /health is open. The key is compared in constant time.

The model loads in a background thread after the server starts listening, so /health can answer
503 while it loads and 200 once requests can be served.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve import __version__
from llmserve.config import ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.metrics.loggers import LoggingStatLogger
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.server.errors import error_body, install_error_handlers
from llmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmserve.server.serving import ChatServing, CompletionServing, ServingContext, TokenServing

logger = logging.getLogger("llmserve.server")

OPEN_PATHS = frozenset({"/health"})

# HTTP status of a refused request -> the `reason` label of llmserve:request_rejected
REJECT_REASONS = {
    400: "validation", 422: "validation", 401: "auth", 404: "not_found", 405: "not_found",
    413: "too_large", 429: "queue_full", 503: "unavailable",
}  # fmt: skip


@dataclass
class ServerState:
    """What the gate and the routes need to know about the server's life."""

    config: ServerConfig
    ctx: ServingContext | None = None
    load_error: BaseException | None = None
    draining: bool = False
    metrics: PrometheusStatLogger | None = None
    started: float = field(default_factory=time.time)
    on_load_error: Callable[[BaseException], None] | None = None
    on_engine_dead: Callable[[BaseException], None] | None = None
    """Called once the engine's step loop has died (after every in-flight request failed)."""

    @property
    def ready(self) -> bool:
        return self.ctx is not None and not self.draining


async def _send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(error_body(status, message), status_code=status, headers=headers)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class _Gate:
    """Pure ASGI middleware: availability, authentication and body size, before any route runs."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._counting(send)
        path: str = scope["path"]
        headers = dict(scope["headers"])
        if path not in OPEN_PATHS:
            if self._expected is not None:
                scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
                # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
                if not (hmac.compare_digest(given.strip(), self._expected) and scheme.lower() == b"bearer"):
                    await _send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      {"WWW-Authenticate": "Bearer"})  # fmt: skip
                    return
            state = self.state
            if state.draining:
                await _send_error(send, 503, "the server is shutting down")
                return
            if state.ctx is None:
                await _send_error(
                    send, 503, "the model is still loading; retry shortly", {"Retry-After": "5"}
                )
                return
        limit = self.state.config.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, 413, f"the request body has {int(length)} bytes; the limit is {limit}")
            return
        # Read the body here (chunked uploads have no content-length), then replay it to the app;
        # later receive() calls reach the client again (disconnect detection).
        chunks: list[bytes] = []
        received = 0
        more = scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > limit:
                await _send_error(send, 413, f"the request body is larger than the limit of {limit} bytes")
                return
            more = message.get("more_body", False)
        if chunks and not headers.get(b"content-type", b"").startswith(b"application/json"):
            # Every body here is JSON: read it as such whatever the client declared (`curl -d`
            # sends a form type), so the client gets JSON errors about its content, not its headers.
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _counting(self, send: Send) -> Send:
        """`send`, counting a refused request (by its status) in the metrics."""

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                reason = REJECT_REASONS.get(message["status"])
                metrics = self.state.metrics
                if reason is not None and metrics is not None:
                    metrics.record_rejected(reason)
            await send(message)

        return counting_send


def build_app(engine_factory: Callable[[], LLMEngine], config: ServerConfig, model_name: str) -> FastAPI:
    """The app for one model. `engine_factory` runs in a thread once the server listens."""
    state = ServerState(config)

    async def load() -> None:
        try:
            engine = await AsyncEngine.launch(engine_factory, max_queued_requests=config.max_queued_requests)
        except Exception as e:
            logger.error("loading the model failed: %s", e)
            state.load_error = e
            if state.on_load_error is not None:
                state.on_load_error(e)
            return
        core = engine.engine
        engine.on_dead = state.on_engine_dead
        if config.enable_metrics:
            state.metrics = PrometheusStatLogger(
                model_name,
                core.max_model_len,
                cache_info={
                    "block_size": str(core.kv_info.block_size),
                    "cache_dtype": core.kv_info.dtype,
                    "num_kv_blocks": str(core.kv_info.num_blocks),
                    "kv_bytes_per_token": str(core.kv_info.bytes_per_token),
                    "enable_prefix_caching": str(core.cache_config.enable_prefix_caching),
                },
            )
            engine.add_stat_logger(state.metrics)
        if config.stats_log_interval > 0:
            engine.add_stat_logger(LoggingStatLogger(config.stats_log_interval))
        state.ctx = ServingContext(engine, config, model_name)
        logger.info("ready: serving %r", model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(load())
        yield
        state.draining = True
        loader.cancel()
        if state.ctx is not None:
            active = state.ctx.engine.num_active
            if active:
                logger.info("shutdown: aborting %d unfinished request(s)", active)
            state.ctx.engine.shutdown()

    app = FastAPI(title="llmserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(_Gate, state=state)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )

    def ctx() -> ServingContext:
        assert state.ctx is not None  # the gate answers 503 until it is set
        return state.ctx

    @app.get("/health")
    async def health() -> Any:
        if state.load_error is not None:
            return JSONResponse(
                error_body(503, f"loading the model failed: {state.load_error}"), status_code=503
            )
        if state.draining:
            return JSONResponse(error_body(503, "the server is shutting down"), status_code=503)
        if state.ctx is None:
            return JSONResponse(error_body(503, "the model is still loading"), status_code=503)
        if state.ctx.engine.dead is not None:
            return JSONResponse(
                error_body(503, f"the engine stopped: {state.ctx.engine.dead}"), status_code=503
            )
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "llmserve",
            "max_model_len": ctx().max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        ctx().check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await CompletionServing(ctx()).create(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await ChatServing(ctx()).create(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        return TokenServing(ctx()).tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        return TokenServing(ctx()).detokenize(req)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        return TokenServing(ctx()).info()

    if config.enable_metrics:

        @app.get("/metrics")
        async def metrics() -> Response:
            """Prometheus exposition (docs/metrics.md lists every metric)."""
            ctx()
            assert state.metrics is not None
            body, content_type = state.metrics.exposition()
            return Response(body, media_type=content_type)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's state right now (requests, KV blocks): for operators and tests."""
        engine = ctx().engine
        s = engine.snapshot
        return {
            "num_active_requests": engine.num_active,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_blocks_used": s.kv_blocks_used,
            "num_preemptions": s.num_preemptions,
            "num_steps": s.num_steps,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
        }

    return app

"""The FastAPI application: the middleware (server/middleware.py), the routes (server/routes.py),
and the models' life cycle (server/models.py).

The preloaded models load in the background after the server starts listening, so /health can
answer 503 while they load and 200 once requests can be served; other models load on their first
request. On shutdown the server drains (the gate answers 503) and aborts what is still in flight.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from llmserve import __version__
from llmserve.config import ServerConfig
from llmserve.config.models import ModelSpec
from llmserve.metrics.prometheus import MetricFamilies, new_registry
from llmserve.metrics.tracing import make_tracer_provider
from llmserve.server import playground, routes
from llmserve.server.batches import routes as batch_routes
from llmserve.server.batches.runner import BatchRunner
from llmserve.server.batches.store import BatchStore, default_batch_dir
from llmserve.server.errors import install_error_handlers
from llmserve.server.middleware import Gate, TraceContext
from llmserve.server.models import ModelManager, ModelSlot
from llmserve.server.serving.response_store import ResponseStore
from llmserve.server.state import ServerState

logger = logging.getLogger("llmserve.server")

TOKEN_HISTOGRAM_MAX = 2**17
"""Where the token-count histograms end (they are shared by every model, so they are made before
any model loads; one model with --max-model-len: at its context)."""


def build_app(
    specs: list[ModelSpec], config: ServerConfig, engine_options: dict[str, Any] | None = None
) -> FastAPI:
    """The app for `specs` (the first is the default model). `engine_options`: the native
    engine's options for every model (each spec's own options win)."""
    families = None
    if config.enable_metrics:
        max_len = (engine_options or {}).get("max_model_len") if len(specs) == 1 else None
        families = MetricFamilies(new_registry(), max_len or TOKEN_HISTOGRAM_MAX)
    tracer_provider = None
    if config.otlp_traces_endpoint is not None:
        tracer_provider = make_tracer_provider(config.otlp_traces_endpoint)
    models = ModelManager(specs, config, engine_options, families, tracer_provider)
    store = BatchStore(Path(config.batch_dir) if config.batch_dir else default_batch_dir())
    batches = BatchRunner(store, models, config.batch_max_concurrency)
    state = ServerState(config, models, families, ResponseStore(config.responses_store_size), batches=batches)
    single = len(specs) == 1

    def preload_failed(slot: ModelSlot, e: BaseException) -> None:
        if single:  # a server of one model that cannot load it has nothing to serve: exit
            state.load_error = e
            if state.on_load_error is not None:
                state.on_load_error(e)

    def engine_died(slot: ModelSlot, e: BaseException) -> None:
        logger.error("the engine of %r stopped: %r", slot.name, e)
        if single and state.on_engine_dead is not None:
            state.on_engine_dead(e)

    models.on_preload_error = preload_failed
    models.on_engine_dead = engine_died

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        models.start()
        batches.start()
        grpc_server = None
        if config.grpc_port is not None:
            try:
                from llmserve.server.oip.service import start_grpc_server  # grpcio: an optional extra
            except ImportError as e:
                raise RuntimeError(f"--grpc-port needs grpcio: pip install 'llmserve[grpc]' ({e})") from e
            grpc_server = await start_grpc_server(state)
        yield
        state.draining = True
        if grpc_server is not None:
            # refuses new calls at once; the ones in flight finish or are aborted with the rest
            # at --shutdown-timeout (serve.py), so the grace only bounds the wait
            await grpc_server.stop(grace=config.shutdown_timeout + 1.0)
        await batches.close()  # lines in flight run again after a restart
        active = models.num_active
        if active:
            logger.info("shutdown: aborting %d unfinished request(s)", active)
        await models.close()
        if tracer_provider is not None:
            tracer_provider.shutdown()  # exports the spans still batched
        await asyncio.sleep(0)

    app = FastAPI(title="llmserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(Gate, state=state)
    if tracer_provider is not None:  # outermost: the routes run in the caller's trace context
        app.add_middleware(TraceContext)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )

    app.include_router(routes.ops)
    app.include_router(routes.openai)
    app.include_router(batch_routes.router)
    app.include_router(routes.tokenizer)
    app.include_router(routes.ollama)
    app.include_router(routes.anthropic)
    app.include_router(routes.responses)
    app.include_router(routes.admin)
    if config.enable_metrics:
        app.include_router(routes.metrics)
    if config.enable_playground:
        app.include_router(playground.router)
        app.mount(playground.STATIC_PREFIX, playground.static_files)
    return app

"""The FastAPI application for one model: the middleware (server/middleware.py), the routes
(server/routes.py), and the engine's life cycle.

The model loads in a background thread after the server starts listening, so /health can answer
503 while it loads and 200 once requests can be served; on shutdown the server drains (the gate
answers 503) and aborts what is still in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from llmserve import __version__
from llmserve.config import ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.metrics.loggers import LoggingStatLogger
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.server import routes
from llmserve.server.errors import install_error_handlers
from llmserve.server.middleware import Gate
from llmserve.server.serving import ServingContext
from llmserve.server.state import ServerState

logger = logging.getLogger("llmserve.server")


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
    app.add_middleware(Gate, state=state)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )

    app.include_router(routes.ops)
    app.include_router(routes.openai)
    app.include_router(routes.tokenizer)
    app.include_router(routes.ollama)
    if config.enable_metrics:
        app.include_router(routes.metrics)
    return app

"""`ServerState`: what the gate and the routes know about the server's life (loading, ready,
draining, a failed load or a dead engine), shared through `app.state.server`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from llmserve.config import ServerConfig
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.server.serving import ServingContext


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


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def serving_context(request: Request) -> ServingContext:
    """The serving context of a ready server (the gate answers 503 before it is set)."""
    ctx = server_state(request).ctx
    assert ctx is not None
    return ctx

"""`ServerState`: what the gate and the routes know about the server's life (starting, ready,
draining, a failed start) and its models (`ModelManager`), shared through `app.state.server`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from llmserve.config import ServerConfig
from llmserve.metrics.prometheus import MetricFamilies
from llmserve.server.models import ModelManager
from llmserve.server.serving.response_store import ResponseStore

if TYPE_CHECKING:
    from llmserve.server.batches.runner import BatchRunner


@dataclass
class ServerState:
    """What the gate and the routes need to know about the server's life."""

    config: ServerConfig
    models: ModelManager
    metrics: MetricFamilies | None = None
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))
    """The responses kept for `previous_response_id` (serving/response_store.py)."""
    batches: BatchRunner | None = None
    """Runs the Batches API's batches (server/batches/)."""
    load_error: BaseException | None = None
    """Set when a one-model server's model failed to load (the server then exits)."""
    draining: bool = False
    started: float = field(default_factory=time.time)
    on_load_error: Callable[[BaseException], None] | None = None
    on_engine_dead: Callable[[BaseException], None] | None = None
    """Called once a one-model server's engine has died (after every in-flight request failed)."""

    @property
    def ready(self) -> bool:
        """Every preloaded model is loaded (or failed, beside others) and the server is not draining."""
        return self.models.started_up and self.load_error is None and not self.draining

    def record_rejected(self, reason: str) -> None:
        """A request refused before it was routed, counted under the default model."""
        if self.metrics is not None:
            default = self.models.default
            self.metrics.rejected.labels(default.name, default.engine, reason).inc()


def server_state(request: Request) -> ServerState:
    return request.app.state.server

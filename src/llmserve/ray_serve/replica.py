"""`EngineReplica`: one Ray Serve replica running a whole llmserve server in-process.

The replica builds the same FastAPI app as `llmserve serve` (server/app.py: routes, validation,
the model manager, metrics) and runs its lifespan, but no HTTP listener: the ingress hands it
requests through a `DeploymentHandle`, and `forward` drives the app as an ASGI call (under the
direct front, direct.py's `DirectEngineReplica` serves the same app over HTTP instead):

    ingress --handle.forward(request)--> forward(): app(scope, receive, send)
            <--- {"status", "headers"}, then body chunks (a Ray streaming generator) ---

`receive` gives the body once, then waits for the ingress to go away: when the ingress stops
reading (its client disconnected), Ray cancels this generator, `receive` answers
`http.disconnect`, and the app aborts the request as it does for a plain HTTP client.

Every answer carries `x-llmserve-replica` (this replica's id) and `x-llmserve-node` (its Ray
node's id), which tell a client and the tests which replica, on which node, served it.
`metrics_text` gives the ingress this replica's /metrics (ray_serve/metrics.py).

An engine that dies inside the replica (its step raised: a tensor-parallel worker killed, a bug)
fails every request it held (a stream ends with an error event, a waiting request a 503), then the
app reports it (`on_engine_dead`). From then on:

    check_health   fails, so Ray stops this replica and starts a new one (health_check_period_s)
    forward        raises `ReplicaEngineStopped` before answering, which the ingress takes as "try
                   another replica" (its retry names this replica to the router to avoid), so new
                   requests reach a survivor in the seconds before Ray has replaced this one
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from llmserve.config import ServerConfig
from llmserve.config.models import ModelSpec
from llmserve.server.app import build_app

REPLICA_HEADER = "x-llmserve-replica"
NODE_HEADER = "x-llmserve-node"


class ReplicaEngineStopped(RuntimeError):
    """A request reached a replica whose engine has died (nothing was answered: retry elsewhere)."""

    def __init__(self, replica_id: str, reason: str) -> None:
        super().__init__(replica_id, reason)  # its args rebuild it where Ray unpickles it (the ingress)
        self.replica_id, self.reason = replica_id, reason

    def __str__(self) -> str:
        return f"replica {self.replica_id}: the engine has stopped: {self.reason}"


@dataclass(slots=True)
class ForwardedRequest:
    """What the ingress sends a replica: the HTTP request, already authenticated."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


class EngineReplica:
    """A Ray Serve deployment class (ray_serve/application.py applies `serve.deployment`)."""

    async def __init__(
        self, spec: ModelSpec, engine_options: dict[str, Any], server_options: dict[str, Any],
        torch_threads: int | None = None,
    ) -> None:  # fmt: skip
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        # Behind the ingress (which checked the key) server_options has no key; serving HTTP
        # itself (ray_serve/direct.py) it has the key, which the app's own gate checks.
        config = ServerConfig(**{"api_key": None, **server_options})
        self.server_app = build_app([spec], config, engine_options)
        self.state = self.server_app.state.server
        self.engine_error: BaseException | None = None
        self.state.on_engine_dead = self._engine_died  # the app calls it once every request has failed
        self._lifespan = self.server_app.router.lifespan_context(self.server_app)
        await self._lifespan.__aenter__()
        while not self.state.models.started_up:  # the preload runs in the background
            await asyncio.sleep(0.05)
        if self.state.load_error is not None:
            raise RuntimeError(f"cannot load {spec.name!r}: {self.state.load_error}")

    async def forward(
        self, request: ForwardedRequest, prefix_key: int | None = None, avoid_replica: str | None = None
    ) -> AsyncIterator[Any]:
        """Run `request` through the app: yields {"status", "headers"} first, then body chunks.
        `prefix_key` and `avoid_replica` are read by the router (ray_serve/router.py), not here.
        `ReplicaEngineStopped` before anything once the engine has died."""
        if self.engine_error is not None:
            raise ReplicaEngineStopped(self.replica_id, repr(self.engine_error))
        messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": request.query_string, "headers": request.headers,
            "client": ("ray-serve-ingress", 0), "server": ("llmserve-replica", 0),
        }  # fmt: skip
        call = asyncio.ensure_future(self.server_app(scope, receive, send))
        call.add_done_callback(lambda _: messages.put_nowait({"type": "llmserve.done"}))
        try:
            while True:
                message = await messages.get()
                kind = message["type"]
                if kind == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield {
                        "status": message["status"],
                        "headers": [*headers, (REPLICA_HEADER, self.replica_id), (NODE_HEADER, self.node_id)],
                    }
                elif kind == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
                elif kind == "llmserve.done":
                    call.result()  # the app raised before answering: let Ray report it
                    break
        finally:
            gone.set()  # the ingress left (or the answer is complete): the app sees a disconnect
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(call), timeout=5.0)

    async def forward_whole(
        self, request: ForwardedRequest, prefix_key: int | None = None, avoid_replica: str | None = None
    ) -> tuple[int, list, bytes]:
        """`forward`'s answer in one piece: (status, headers, body)."""
        head: dict[str, Any] = {}
        body = []
        async for item in self.forward(request):
            if isinstance(item, dict):
                head = item
            else:
                body.append(item)
        return head["status"], head["headers"], b"".join(body)

    async def metrics_text(self) -> tuple[str, str]:
        """(this replica's id, its Prometheus text: the app's own /metrics answer)."""
        if self.state.metrics is None:
            return self.replica_id, ""
        key = self.state.config.api_key
        auth = [(b"authorization", b"Bearer " + key.encode())] if key else []
        _, _, body = await self.forward_whole(ForwardedRequest("GET", "/metrics", headers=auth))
        return self.replica_id, body.decode()

    def _engine_died(self, e: BaseException) -> None:
        self.engine_error = e

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine died is unhealthy, and Ray replaces it."""
        if self.engine_error is not None:
            raise RuntimeError(f"the engine has stopped: {self.engine_error!r}")

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):
            await self._lifespan.__aexit__(None, None, None)

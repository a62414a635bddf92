"""The direct front: HAProxy sends each request straight to the engine replica that serves it.

    client -> HAProxy --(Lua: POST /internal/route, the request's body)--> PrefixRouter
                      <-- {"replica_id": ...}: the prefix's home, or the less loaded of two --
           -> HAProxy --(the request itself)--> DirectEngineReplica (the replica's own app)

Ray Serve 2.60's ingress request router (`Application._with_ingress_request_router`, an internal
hook its Serve LLM stack uses; needs HAProxy mode with body forwarding, env.py's `DIRECT_ENV`): the engine replicas are the
application's HTTP-facing deployment, each serving its llmserve app on its own port ("direct
ingress"), and HAProxy asks `PrefixRouter`, a small deployment of its own, which replica takes each
POST before proxying the request there. One Python hop (the replica) instead of the ingress's two
(the ingress, then a handle call); the router's answer is a second, small one (measured in
docs/benchmarks.md). GETs (/v1/models, /health) go to any replica (HAProxy's leastconn).

What moves from the ingress (ingress.py) into each replica, and what changes:

    API key, schemas  the replica's app checks them itself (the plain server's gate and routes)
    prefix routing    PrefixRouter: the prefix key of the body (prefix.py), then the replicas'
                      PrefixAwareRouter (router.py) in pick-only mode; load is the replicas'
                      own count of the requests they hold, fetched by Ray's controller every
                      `ROUTING_STATS_PERIOD_S` (the ingress's handle probed queue lengths)
    /metrics          any replica answers it, merged from every replica (metrics.py)
    Files / Batches   refused (501) by the replica, as by the ingress
    tracing           the replica's `llm_request` span (a child of the client's traceparent);
                      there is no ingress span
    a dead replica    HAProxy (through haproxy_wrapper.py, env.py) ends a stream it was answering
                      with the API's SSE error event, and a request it had not begun to answer
                      with the API's JSON 502 or, on a reused connection, a closed one (retried
                      elsewhere only with env.py's opt-in RETRY_IN_FLIGHT; the ingress retried
                      it). HAProxy's health checks and Ray's router stop choosing it, and new
                      requests go to the survivors (a request the router still sends it is
                      redispatched)
    a dead engine     the replica answers 503 in the API's error shape until Ray replaces it
                      (health check); the ingress retried those on another replica
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.config.models import ModelSpec
from llmserve.core.kv_cache.block_hash import BlockHash
from llmserve.model_executor.model_loader.source import resolve_model
from llmserve.ray_serve.ingress import UNSERVED_MESSAGE, UNSERVED_PREFIXES, KeyCheck
from llmserve.ray_serve.metrics import gather_metrics
from llmserve.ray_serve.prefix import PrefixKeyer
from llmserve.ray_serve.replica import NODE_HEADER, REPLICA_HEADER, EngineReplica
from llmserve.ray_serve.router import ONGOING_STAT, PREFIX_KEY
from llmserve.server.middleware import OPEN_PATHS, send_error
from llmserve.tokenizer import load_tokenizer

ROUTING_STATS_PERIOD_S = 0.5
"""How often Ray's controller fetches each replica's count of held requests for the router (Ray's
default: 10 s); a burst shorter than this is spread by the random two choices, not by load."""
ROUTE_PATH = "/internal/route"
"""Where HAProxy's Lua asks the router (Ray Serve's ingress request router contract)."""


@serve.ingress()
class DirectEngineReplica(EngineReplica):
    """An `EngineReplica` that serves HTTP itself (Ray Serve applies `serve.deployment` in
    application.py); `__serve_build_asgi_app__` gives Serve its app."""

    async def __init__(
        self, spec: ModelSpec, engine_options: dict[str, Any], server_options: dict[str, Any],
        torch_threads: int | None = None,
    ) -> None:  # fmt: skip
        await EngineReplica.__init__(self, spec, engine_options, server_options, torch_threads)
        self.num_ongoing = 0
        self._replicas: DeploymentHandle | None = None  # this deployment's handle, for /metrics

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # the two answers given here, not by the app, check the key first as the app's gate does
        key = self.state.config.api_key
        self._metrics_app: ASGIApp = KeyCheck(self._merged_metrics, key) if key else self._merged_metrics
        self._unserved_app: ASGIApp = KeyCheck(_refuse_unserved, key) if key else _refuse_unserved
        return _ASGI(self._serve_http)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray's controller fetches this every `ROUTING_STATS_PERIOD_S` for the routers."""
        return {ONGOING_STAT: self.num_ongoing}

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The replica's app, as Serve's HTTP server calls it: its lifespan is the replica's own
        (EngineReplica runs it), so Serve's is answered at once."""
        if scope["type"] == "lifespan":
            await _answer_lifespan(receive, send)
            return
        path = scope.get("path", "")
        if scope["type"] != "http":
            await self.server_app(scope, receive, send)
        elif path.startswith(UNSERVED_PREFIXES):
            await self._unserved_app(scope, receive, send)
        elif path == "/metrics":
            await self._metrics_app(scope, receive, send)
        elif self.engine_error is not None and path not in OPEN_PATHS:
            await send_error(send, path, 503, f"the engine has stopped: {self.engine_error!r}")
        else:
            await self._answer(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        named = [
            (REPLICA_HEADER.encode(), self.replica_id.encode()),
            (NODE_HEADER.encode(), self.node_id.encode()),
        ]

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *named]}
            await send(message)

        self.num_ongoing += 1
        try:
            await self.server_app(scope, receive, send_named)
        finally:
            self.num_ongoing -= 1

    async def _merged_metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST

        if self._replicas is None:
            context = serve.get_replica_context()
            self._replicas = serve.get_deployment_handle(context.deployment, context.app_name)
        response = Response(await gather_metrics(self._replicas), media_type=CONTENT_TYPE_LATEST)
        await response(scope, receive, send)


async def _refuse_unserved(scope: Scope, receive: Receive, send: Send) -> None:
    await send_error(send, scope["path"], 501, UNSERVED_MESSAGE)


class _ASGI:
    """An ASGI 3 app over a bound method (uvicorn, which serves it, takes a bound method for an
    ASGI 2 app)."""

    def __init__(self, call: ASGIApp) -> None:
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.call(scope, receive, send)


@serve.ingress()
class PrefixRouter:
    """The ingress request router HAProxy consults (a Ray Serve deployment class; application.py
    applies `serve.deployment` and attaches it with `_with_ingress_request_router`).

    Its one route, `POST /internal/route`, is a plain ASGI app, not FastAPI's: HAProxy's Lua waits
    for it on every POST, and FastAPI's routing, validation and response encoding cost more than
    the key of a short prompt (docs/benchmarks.md, "The direct front's router")."""

    def __init__(
        self, engine: DeploymentHandle, model_source: str | None, block_size: int, prefix_blocks: int
    ) -> None:
        self.engine = engine
        self.keyer = PrefixKeyer(load_tokenizer(resolve_model(model_source)), block_size, prefix_blocks)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return _ASGI(self._serve_http)

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _answer_lifespan(receive, send)
            return
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != ROUTE_PATH:
            await JSONResponse({"detail": "Not Found"}, 404)(scope, receive, send)
            return
        body = await StarletteRequest(scope, receive).body()
        try:
            replica_id = await self.pick(self.keyer.body_key(body))
        except DeploymentUnavailableError as e:  # HAProxy answers any non-200 with a 503
            await JSONResponse({"detail": str(e)}, 503)(scope, receive, send)
            return
        await JSONResponse({"replica_id": replica_id})(scope, receive, send)

    async def pick(self, key: BlockHash | None) -> str:
        """The chosen replica's actor name, as HAProxy's Lua maps it to a server. Pick-only: no
        slot is reserved (the request goes through HAProxy, not this handle), as in Ray's own
        LLMRouter, whose `_replica` access this follows (the selection has no public full id).

        The handle's router runs in this replica's event loop (Ray's default is a loop of its
        own, in another thread, for a handle that also sends requests): a pick is then a plain
        coroutine, not two hand-offs between threads, and this handle only ever picks."""
        if not self.engine.is_initialized:  # set up from the loop that serves the requests
            self.engine._init(_run_router_in_separate_loop=False)
        async with self.engine.choose_replica(**{PREFIX_KEY: key}, _reserve=False) as picked:
            return picked._replica.replica_id.to_full_id_str()


async def _answer_lifespan(receive: Receive, send: Send) -> None:
    """Complete Serve's lifespan events at once (what a replica holds is set up in __init__)."""
    while True:
        kind = (await receive())["type"]  # lifespan.startup, then lifespan.shutdown
        await send({"type": f"{kind}.complete"})
        if kind == "lifespan.shutdown":
            return

"""`Ingress`: the HTTP front of a Ray Serve application, before N engine replicas.

    client -> HAProxy (or Serve's Python proxy) -> Ingress (this: the key, the request schemas,
           the prefix key) -> DeploymentHandle.forward (PrefixAwareRouter picks the replica)
           -> EngineReplica

Under Ray Serve's HAProxy mode (application.py's HAPROXY_ENV) this replica serves HTTP itself and
HAProxy sends it each request; under Serve's proxy, the proxy calls it through Ray. The code here
is the same for both.

The ingress checks what the plain server's gate and routes check first, with the same code, so
its refusals are the same: the API key (`middleware.key_matches`, the 401 in the path's error
shape) and, on /v1/chat/completions and /v1/completions, the request schemas (server/protocol.py,
FastAPI's validation and server/errors.py's handlers: the same 400 naming the field). A valid
request's prefix key (ray_serve/prefix.py) goes along for the router; the replica's app then
answers it in full (its own later checks, the engine, the stream), and the ingress relays the
answer: a stream chunk by chunk, any other answer whole.

A replica that dies (killed, crashed) ends its requests: before the answer began, the request goes
once more to another replica (then a 503 in the API's error shape); mid-stream, an SSE error event
and [DONE], so no client waits forever. Ray's router stops sending to a dead replica and Ray
starts a new one. A replica whose engine died (ray_serve/replica.py) ends its own requests the
same way, and refuses new ones until Ray replaces it: those go once more, to another replica. The Files and Batches APIs are refused (501): each replica would keep its own.

/metrics merges every replica's metrics, labelled by replica (ray_serve/metrics.py). With
`otlp_traces_endpoint`, each forwarded request has a span here (metrics/tracing.IngressTracer), the
parent of the replica's `llm_request` span.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve.metrics.tracing import IngressTracer, make_tracer_provider
from llmserve.model_executor.model_loader.source import resolve_model
from llmserve.ray_serve.metrics import gather_metrics
from llmserve.ray_serve.prefix import PrefixKeyer
from llmserve.ray_serve.replica import REPLICA_HEADER, ForwardedRequest, ReplicaEngineStopped
from llmserve.ray_serve.router import AVOID_REPLICA, PREFIX_KEY
from llmserve.server.errors import APIError, error_sse, install_error_handlers
from llmserve.server.middleware import OPEN_PATHS, key_matches, send_error
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.server.serving.outputs import SSE_DONE
from llmserve.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from opentelemetry.trace import Span

FORWARD_ATTEMPTS = 2
"""Tries of a request whose replica died, or whose engine had died, before answering (Ray's router
has then dropped the dead replica; the retry names the other to avoid)."""

UNSERVED_PREFIXES = ("/v1/files", "/v1/batches")
UNSERVED_MESSAGE = "the Files and Batches APIs are not served on Ray Serve: run them on one llmserve serve"
"""Refused (501) on Ray Serve: each replica would keep its own files and batches."""

# headers of the replica's answer that the ingress's own response sets again
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})


@serve.ingress()
class Ingress:
    """A Ray Serve deployment class (ray_serve/application.py applies `serve.deployment`); the ASGI
    app is built per replica by `__serve_build_asgi_app__`, after the constructor."""

    def __init__(
        self, engine: DeploymentHandle, model_source: str | None, api_key: str | None,
        block_size: int, prefix_blocks: int, otlp_traces_endpoint: str | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.streams = engine.options(stream=True)
        self.api_key = api_key
        self.keyer = PrefixKeyer(load_tokenizer(resolve_model(model_source)), block_size, prefix_blocks)
        self.tracer = (
            IngressTracer(make_tracer_provider(otlp_traces_endpoint)) if otlp_traces_endpoint else None
        )

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return build_ingress_app(self)

    async def forward(self, raw: Request, prefix_key: int | None = None, stream: bool = True) -> Response:
        """`raw` answered by the replica the router picks for `prefix_key`. `stream`: the answer
        may be a stream (relayed chunk by chunk); False: one call returns it whole (a request
        that did not ask for a stream: a Ray streaming call costs about a millisecond more).
        With tracing, the request's span (metrics/tracing.py) covers the forwarding and the whole
        answer, and the replica gets it as its `traceparent`."""
        headers = list(raw.scope["headers"])
        span = None
        if self.tracer is not None:
            span, headers = self.tracer.start(raw.method, raw.url.path, headers)
        request = ForwardedRequest(
            raw.method, raw.url.path, raw.scope.get("query_string", b""), headers, await raw.body()
        )
        try:
            response = await self._answer(request, prefix_key, stream, span)
        except APIError as e:
            if span is not None:
                IngressTracer.finish(span, e.status, error=e.message)
            raise
        except BaseException as e:  # a bug, or the client gone while it waited (cancelled)
            if span is not None:
                IngressTracer.finish(span, 500, error=type(e).__name__)
            raise
        if span is not None and not isinstance(response, StreamingResponse):
            IngressTracer.finish(span, response.status_code, response.headers.get(REPLICA_HEADER))
        return response

    async def _answer(
        self, request: ForwardedRequest, prefix_key: int | None, stream: bool, span: Span | None
    ) -> Response:
        routing: dict[str, Any] = {PREFIX_KEY: prefix_key}
        for attempt in range(FORWARD_ATTEMPTS):
            last = attempt + 1 == FORWARD_ATTEMPTS
            try:
                if not stream:
                    status, headers, body = await self.engine.forward_whole.remote(request, **routing)
                    return Response(body, status_code=status, headers=_headers(headers))
                chunks: DeploymentResponseGenerator = self.streams.forward.remote(request, **routing)
                head = await chunks.__anext__()
                break
            except (ActorDiedError, ActorUnavailableError) as e:
                # nothing reached the client yet: another replica can answer it
                if last:
                    raise APIError(503, f"the engine replica failed before answering: {_reason(e)}") from None
            except RayError as e:
                stopped = _engine_stopped(e)
                if stopped is None:
                    raise APIError(500, f"the engine replica failed: {_reason(e)}") from None
                if last:
                    raise APIError(503, f"the engine replica cannot answer: {stopped}") from None
                # its engine died and Ray has not replaced it yet: the router sends the retry elsewhere
                routing[AVOID_REPLICA] = stopped.replica_id
        headers = _headers(head["headers"])
        if not headers.get("content-type", "").startswith("text/event-stream"):
            try:
                body = b"".join([chunk async for chunk in chunks])
            except RayError as e:
                raise APIError(503, f"the engine replica failed while answering: {_reason(e)}") from None
            return Response(body, status_code=head["status"], headers=headers)

        def finish(error: str | None) -> None:
            if span is not None:
                IngressTracer.finish(span, head["status"], headers.get(REPLICA_HEADER), error)

        return StreamingResponse(_relay(chunks, finish), status_code=head["status"], headers=headers)

    async def metrics(self) -> Response:
        """Every replica's metrics, labelled by replica (ray_serve/metrics.py)."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await gather_metrics(self.engine), media_type=CONTENT_TYPE_LATEST)


async def _relay(
    stream: DeploymentResponseGenerator, finish: Callable[[str | None], None]
) -> AsyncIterator[bytes | str]:
    """A replica's SSE answer; a replica that dies mid-stream ends it with an error event. A client
    that leaves closes this generator, which cancels the replica's call (its request aborts).
    `finish(error)` once the stream is over (error: why it ended early, else None)."""
    done = False
    error: str | None = "the client disconnected"
    try:
        async for chunk in stream:
            yield chunk
        done, error = True, None
    except RayError as e:
        done = True
        failure = APIError(503, f"the engine replica failed mid-stream: {_reason(e)}")
        error = failure.message
        yield error_sse(failure)
        yield SSE_DONE
    finally:
        if not done:
            stream.cancel()
        finish(error)


def _headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    """A replica's answer headers, less those the ingress's own response sets."""
    return {k: v for k, v in headers if k.lower() not in _HOP_HEADERS}


def _engine_stopped(e: RayError) -> ReplicaEngineStopped | None:
    """The replica's `ReplicaEngineStopped` that `e` carries (Ray wraps what a replica raised)."""
    cause = e if isinstance(e, ReplicaEngineStopped) else getattr(e, "cause", None)
    return cause if isinstance(cause, ReplicaEngineStopped) else None


def _reason(e: RayError) -> str:
    return type(e).__name__ + (f": {str(e).splitlines()[0]}" if str(e) else "")


class KeyCheck:
    """The API key, before routing (as the plain server's gate): every path but /health."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            if not key_matches(
                self.expected, headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            ):
                await send_error(send, scope["path"], 401, "missing or wrong API key: send 'Authorization: "
                                 "Bearer <key>' or 'x-api-key: <key>'", {"WWW-Authenticate": "Bearer"})  # fmt: skip
                return
        await self.app(scope, receive, send)


def build_ingress_app(ingress: Ingress) -> FastAPI:
    """The ingress's routes: the two prompt routes validated and keyed here, /metrics merged
    here, everything else forwarded as it is (the replica's app answers, or refuses, it)."""
    api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(api)
    if ingress.api_key:
        api.add_middleware(KeyCheck, api_key=ingress.api_key)

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await ingress.forward(raw, ingress.keyer.chat_key(req), stream=req.stream)

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await ingress.forward(raw, ingress.keyer.completion_key(req), stream=req.stream)

    @api.get("/metrics")
    async def metrics() -> Response:
        return await ingress.metrics()

    @api.api_route("/v1/files{rest:path}", methods=["GET", "POST", "DELETE"])
    @api.api_route("/v1/batches{rest:path}", methods=["GET", "POST", "DELETE"])
    async def batches(rest: str) -> Any:
        # each replica would keep its own files and batches, and a handle reaches a random one
        raise APIError(501, UNSERVED_MESSAGE)

    @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def other(raw: Request, path: str) -> Any:
        return await ingress.forward(raw)

    return api

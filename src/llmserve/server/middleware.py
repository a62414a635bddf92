"""The request gate: pure ASGI middleware that runs before routing.

    CORS (only when origins are given)
      -> Gate: 503 while the preloaded models load or the server drains, 401 without the API key, 413 for a large body;
       counts every refused request by reason (the request_rejected metric); refusals come in the
       error shape of the path's API (errors.py: Anthropic's under /v1/messages, else OpenAI's)
        -> routes (server/routes.py) -> serving layer -> AsyncEngine

The gate is deny-by-default: it runs before routing, so every route, including one added later and
unknown paths, needs the key; only the probes (/health and /livez) and the playground's pages
(server/playground.py: static files whose API calls carry the key) are open. The key comes as `Authorization: Bearer <key>`
(OpenAI's clients) or `x-api-key: <key>` (Anthropic's), and is compared in constant time.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.metrics.tracing import extract_context
from llmserve.server.errors import APIError, error_response
from llmserve.server.playground import is_playground_path
from llmserve.server.state import ServerState

OPEN_PATHS = frozenset({"/health", "/livez"})
"""Probes' routes: no key (a kubelet sends none), and answered while loading or draining."""

# HTTP status of a refused request -> the `reason` label of llmserve:request_rejected
REJECT_REASONS = {
    400: "validation", 422: "validation", 401: "auth", 404: "not_found", 405: "not_found",
    413: "too_large", 429: "queue_full", 529: "queue_full", 503: "unavailable",
}  # fmt: skip


async def send_error(
    send: Send, path: str, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    """A refusal before any route runs, in the error shape of `path`'s API."""
    response = error_response(APIError(status, message, headers=headers), path)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class Gate:
    """Pure ASGI middleware: availability, authentication and body size, before any route runs."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = key.encode() if key else None
        self._playground = state.config.enable_playground

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        is_open = path in OPEN_PATHS or (self._playground and is_playground_path(path))
        if not is_open:  # a health probe's 503 is an answer, not a refused request
            send = self._counting(send)
        headers = dict(scope["headers"])
        if not is_open:
            if self._expected is not None and not self._authorized(headers):
                await send_error(send, path, 401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                 "or 'x-api-key: <key>'", {"WWW-Authenticate": "Bearer"})  # fmt: skip
                return
            state = self.state
            if state.draining:
                await send_error(send, path, 503, "the server is shutting down")
                return
            if not state.models.started_up:
                await send_error(
                    send, path, 503, "the model is still loading; retry shortly", {"Retry-After": "5"}
                )
                return
        limit = self.state.config.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await send_error(
                send, path, 413, f"the request body has {int(length)} bytes; the limit is {limit}"
            )
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
                await send_error(
                    send, path, 413, f"the request body is larger than the limit of {limit} bytes"
                )
                return
            more = message.get("more_body", False)
        content_type = headers.get(b"content-type", b"")
        if chunks and not content_type.startswith(b"application/json") and not _upload(path, content_type):
            # Every other body is JSON: read it as such whatever the client declared (`curl -d`
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

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        """The key as a bearer token or in `x-api-key`; both compared in constant time (the scheme
        is case-insensitive, RFC 9110)."""
        assert self._expected is not None
        return key_matches(self._expected, headers.get(b"authorization", b""), headers.get(b"x-api-key", b""))

    def _counting(self, send: Send) -> Send:
        """`send`, counting a refused request (by its status) in the metrics."""

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                reason = REJECT_REASONS.get(message["status"])
                if reason is not None:
                    self.state.record_rejected(reason)
            await send(message)

        return counting_send


class TraceContext:
    """Pure ASGI middleware, installed only with `--otlp-traces-endpoint`: an HTTP request's W3C
    `traceparent` becomes the OpenTelemetry context its route runs in, so the engine's span for
    the request (metrics/tracing.py) is a child of the caller's (a Ray Serve ingress, a gateway)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from opentelemetry import context

        token = context.attach(extract_context(scope["headers"]))
        try:
            await self.app(scope, receive, send)
        finally:
            context.detach(token)


def key_matches(expected: bytes, authorization: bytes, api_key: bytes) -> bool:
    """Whether a request carries the key, as `Bearer <key>` in `authorization` or bare in
    `api_key`: the one check HTTP (this gate) and gRPC (server/oip/) make."""
    scheme, _, given = authorization.partition(b" ")
    bearer = hmac.compare_digest(given.strip(), expected) and scheme.lower() == b"bearer"
    return hmac.compare_digest(api_key.strip(), expected) or bearer


def _upload(path: str, content_type: bytes) -> bool:
    """A file upload (`POST /v1/files`), the one body that is a multipart form, not JSON."""
    return path == "/v1/files" and content_type.startswith(b"multipart/form-data")

"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, and on Anthropic's
routes (/v1/messages...) in Anthropic's: `{"type": "error", "error": {"type", "message"}}`.

Every error the server returns goes through `error_response`; handlers registered by
`install_error_handlers` turn FastAPI's and our own exceptions into it, so a bad request is always a
4xx with a readable message and never a 5xx. The shape follows the path, so the gate's refusals
(401, 413, 503) and an unknown path under /v1/messages answer Anthropic's clients in their shape too.
Ollama's routes answer in theirs themselves (server/routes.py).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("llmserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


# Anthropic's error types by status. A full queue is Anthropic's 529 `overloaded_error` (the server
# is busy; the client retries) rather than 429 `rate_limit_error` (a caller over its quota).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
    529: "overloaded_error",
}  # fmt: skip
_ANTHROPIC_STATUS = {429: 529, 405: 404, 415: 400, 422: 400}
ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes, whose errors come in Anthropic's shape."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """An error to answer with: HTTP status, message, and the request parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def anthropic_error_body(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of an error in Anthropic's shape."""
    status = _ANTHROPIC_STATUS.get(status, status)
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The response to `error` on `path`: Anthropic's shape on its routes, else OpenAI's."""
    if speaks_anthropic(path):
        status, body = anthropic_error_body(error.status, error.message)
        return JSONResponse(body, status_code=status, headers=error.headers)
    return JSONResponse(
        error_body(error.status, error.message, error.param, error.code),
        status_code=error.status,
        headers=error.headers,
    )


def error_sse(error: APIError) -> str:
    """An error after streaming began: one `data:` event (the stream then ends with [DONE])."""
    return f"data: {json.dumps(error_body(error.status, error.message, error.param, error.code))}\n\n"


def anthropic_error_sse(error: APIError) -> str:
    """An error after an Anthropic stream began: its `error` event (the stream ends there)."""
    return f"event: error\ndata: {json.dumps(anthropic_error_body(error.status, error.message)[1])}\n\n"


def _path(loc: tuple[Any, ...]) -> list[str]:
    return [str(p) for p in loc if p != "body"]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(
            ": "
        ), None
    path = _path(tuple(first.get("loc", ())))
    if not path and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    # the top-level field is the parameter; the full path (list index, union member) helps a human
    param = path[0] if path else None
    message = f"{'.'.join(path)}: {first.get('msg')}" if path else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else phrase
        error = APIError(exc.status_code, message, headers=getattr(exc, "headers", None))
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"), request.url.path)

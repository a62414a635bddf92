"""One batch line: read (`parse_lines`), run through the online endpoint's own serving code
(`run_line`), and written in OpenAI's batch output format (`result_line`). The server's batch
runner and the offline `llmserve run-batch` share these, so a line's body is exactly what
`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/score` or `/v1/rerank`
answers for the same request.

An input line:  {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
An output line: {"id": "batch_req_...", "custom_id": "...",
                 "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.types import Message

from llmserve.server.batches.store import new_id
from llmserve.server.errors import APIError, error_body
from llmserve.server.models import ModelManager
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, parse
from llmserve.server.serving import ChatServing, CompletionServing, ServingContext
from llmserve.server.serving.embeddings import create_embeddings
from llmserve.server.serving.scores import RerankRequest, ScoreRequest, create_rerank, create_score

logger = logging.getLogger("llmserve.server")

BATCH_PRIORITY = 1_000_000
"""A batch line's `priority`: after every online request (default 0) under
`--scheduling-policy priority`. Under FCFS it changes nothing; the runner's bound on lines in
flight is what keeps online requests first there (runner.py)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What a batch line's `url` runs: the online route's request schema and serving call."""

    schema: type[BaseModel]
    serve: Callable[[ServingContext, Any, Request], Awaitable[Any]]


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(
        ChatCompletionRequest, lambda ctx, req, raw: ChatServing(ctx).create(req, raw)
    ),
    "/v1/completions": Endpoint(
        CompletionRequest, lambda ctx, req, raw: CompletionServing(ctx).create(req, raw)
    ),
    "/v1/embeddings": Endpoint(EmbeddingRequest, create_embeddings),
    "/v1/score": Endpoint(ScoreRequest, create_score),
    "/v1/rerank": Endpoint(RerankRequest, create_rerank),
}
RETRY_STATUSES = frozenset({429, 503})
"""A line refused for now (full queue, model loading) is tried again, not written as failed."""


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    url: str
    body: Any


def parse_lines(data: bytes, endpoints: Collection[str]) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The input file's lines, and OpenAI-shaped errors (`{code, message, line}`) for lines that
    cannot run at all: not JSON, no custom_id, a repeated custom_id, another method, a url not in
    `endpoints` (a server batch has one endpoint; `run-batch` takes both). Any such error fails the
    whole batch (as OpenAI's validation does); a bad `body` is the line's own 400."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, text in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except ValueError as e:
            errors.append(_invalid(number, "invalid_json_line", f"line {number} is not JSON: {e}"))
            continue
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        if not isinstance(custom_id, str) or not custom_id:
            errors.append(_invalid(number, "missing_required_parameter", f"line {number} has no custom_id"))
        elif custom_id in seen:
            errors.append(
                _invalid(number, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} repeats")
            )
        elif obj.get("method", "POST") != "POST":
            errors.append(_invalid(number, "invalid_method", f"line {number}: method must be POST"))
        elif obj.get("url") not in endpoints:
            errors.append(
                _invalid(number, "invalid_url", f"line {number}: url must be one of {sorted(endpoints)}")
            )
        else:
            seen.add(custom_id)
            lines.append(BatchLine(custom_id, obj["url"], obj.get("body")))
    if not lines and not errors:
        errors.append(_invalid(None, "empty_file", "the input file has no lines"))
    return lines, errors


def _invalid(line: int | None, code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


async def _never_disconnect() -> Message:
    await asyncio.Event().wait()  # no client to go away; a cancelled line is cancelled instead
    raise AssertionError("unreachable")


def _request_stub(endpoint: str) -> Request:
    """The `Request` the serving code takes: it only watches it for a disconnect, which never comes."""
    scope = {"type": "http", "method": "POST", "path": endpoint, "headers": [], "query_string": b""}
    return Request(scope, _never_disconnect)


async def run_line(models: ModelManager, line: BatchLine) -> tuple[int, dict[str, Any]]:
    """(status, body) of one line, as the online endpoint would answer it."""
    endpoint, body = line.url, line.body
    try:
        if not isinstance(body, dict):
            raise APIError(400, "body must be a JSON object", param="body")
        if body.get("stream"):
            raise APIError(400, "stream is not supported in a batch", param="stream")
        route = ENDPOINTS[endpoint]
        req = parse(route.schema, body)
        if "priority" in route.schema.model_fields:  # generation requests; embeddings have none
            req = req.model_copy(update={"priority": BATCH_PRIORITY})
        response = await models.serve(
            req.model, remote=_no_remote, native=lambda ctx: route.serve(ctx, req, _request_stub(endpoint))
        )
        return response.status_code, json.loads(response.body)
    except APIError as e:
        return e.status, error_body(e.status, e.message, e.param, e.code)
    except Exception as e:  # what the online route's error handler answers with a 500
        logger.exception("batch line %s failed", line.custom_id)
        return 500, error_body(500, f"internal error: {e!r}")


async def _no_remote(_: Any) -> Any:
    raise APIError(
        400, "batch lines run on native models only; this model is served by an upstream", param="model"
    )


def result_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": new_id("batch_req"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": body.get("id") or new_id("req"), "body": body},
        "error": None,
    }


def expired_line(custom_id: str) -> dict[str, Any]:
    """A line its batch's completion window ended before: no response, OpenAI's `batch_expired`."""
    message = "this line was not run before the batch's completion window ended"
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": {"code": "batch_expired", "message": message}}  # fmt: skip

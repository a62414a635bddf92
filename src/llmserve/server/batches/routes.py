"""The Files and Batches routes (OpenAI's), thin: the store (store.py) keeps the objects, the runner
(runner.py) runs the batches.

    files    POST /v1/files (multipart: file, purpose=batch), GET /v1/files, GET /v1/files/{id},
             GET /v1/files/{id}/content, DELETE /v1/files/{id}
    batches  POST /v1/batches, GET /v1/batches (after, limit), GET /v1/batches/{id},
             POST /v1/batches/{id}/cancel
"""

from __future__ import annotations

from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import HTTP
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictStr

from llmserve.server.batches.lines import ENDPOINTS
from llmserve.server.batches.runner import COMPLETION_WINDOW_SECONDS, BatchRunner
from llmserve.server.batches.store import public
from llmserve.server.errors import APIError
from llmserve.server.protocol import parse
from llmserve.server.state import server_state

router = APIRouter()
MAX_METADATA_KEYS = 16


def _runner(request: Request) -> BatchRunner:
    runner = server_state(request).batches
    assert runner is not None, "build_app makes the batch runner"
    runner.check_owner()
    return runner


Runner = Annotated[BatchRunner, Depends(_runner)]


def parse_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body -> {field name: (filename, bytes)}, with the standard library's
    MIME parser (the form has two fields; python-multipart would be a dependency for this alone)."""
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, "upload a file as multipart/form-data (fields: file, purpose)")
    head = f"Content-Type: {content_type}\r\n\r\n".encode()
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    assert isinstance(message, EmailMessage)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


@router.post("/v1/files")
async def upload_file(raw: Request, runner: Runner) -> Any:
    fields = parse_form(raw.headers.get("content-type", ""), await raw.body())
    purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", errors="replace")
    if purpose != "batch":
        raise APIError(
            400, f"purpose must be 'batch' (the only purpose served); got {purpose!r}", param="purpose"
        )
    if "file" not in fields:
        raise APIError(400, "the form has no 'file' field", param="file")
    filename, data = fields["file"]
    return public(runner.store.add_file(filename or "upload.jsonl", purpose, data))


@router.get("/v1/files")
async def list_files(runner: Runner, purpose: str | None = None) -> Any:
    files = [public(f) for f in runner.store.files() if purpose is None or f["purpose"] == purpose]
    return {"object": "list", "data": files, "has_more": False}


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, runner: Runner) -> Any:
    return public(runner.store.file(file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, runner: Runner) -> Response:
    return Response(runner.store.file_bytes(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, runner: Runner) -> Any:
    runner.store.delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


class _CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: StrictStr
    endpoint: StrictStr
    completion_window: StrictStr
    metadata: dict[StrictStr, StrictStr] | None = None


@router.post("/v1/batches")
async def create_batch(raw: Request, runner: Runner) -> Any:
    try:
        body = await raw.json()
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    req: _CreateBatch = parse(_CreateBatch, body)
    if req.endpoint not in ENDPOINTS:
        raise APIError(
            400, f"endpoint must be one of {sorted(ENDPOINTS)}; got {req.endpoint!r}", param="endpoint"
        )
    if req.completion_window not in COMPLETION_WINDOW_SECONDS:
        raise APIError(
            400, f"completion_window must be '24h'; got {req.completion_window!r}", param="completion_window"
        )
    if req.metadata is not None and len(req.metadata) > MAX_METADATA_KEYS:
        raise APIError(400, f"metadata has at most {MAX_METADATA_KEYS} keys", param="metadata")
    file = runner.store.file(req.input_file_id)
    if file["purpose"] != "batch":
        raise APIError(
            400,
            f"the file {req.input_file_id!r} has purpose {file['purpose']!r}, not 'batch'",
            param="input_file_id",
        )
    return runner.create(req.input_file_id, req.endpoint, req.completion_window, req.metadata)


@router.get("/v1/batches")
async def list_batches(
    runner: Runner, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
) -> Any:
    return runner.list(after, limit)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, runner: Runner) -> Any:
    return runner.get(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, runner: Runner) -> Any:
    return runner.cancel(batch_id)

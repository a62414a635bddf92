"""Where a remote (OpenAI-compatible) model's requests go upstream: the OpenAI routes under the
configured base URL, vLLM's `/classify` at the upstream's root (vLLM serves no `/v1/classify`)."""

from __future__ import annotations

import asyncio
import json

import httpx
from starlette.requests import Request

from llmserve.config.models import ModelSpec
from llmserve.server.remote import RemoteModel


def _request(body: dict) -> Request:
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # a client that stays connected
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/classify", "headers": [], "query_string": b""}
    return Request(scope, receive)


def _relay(source: str, path_of) -> list[str]:
    """The URLs the upstream was asked for when a request is relayed to `path_of(remote)`."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        assert json.loads(request.content)["model"] == "up-model"
        return httpx.Response(200, json={"data": []})

    async def run() -> None:
        remote = RemoteModel(
            ModelSpec(name="c", source=source, engine="openai", options={"model": "up-model"})
        )
        await remote.client.aclose()
        remote.client = httpx.AsyncClient(base_url=remote.base_url, transport=httpx.MockTransport(handler))
        response = await remote.proxy(_request({"model": "c", "input": "hi"}), path_of(remote))
        assert response.status_code == 200
        await remote.close()

    asyncio.run(run())
    return seen


def test_classify_goes_to_the_upstream_root() -> None:
    assert _relay("http://up:8000/v1", lambda r: r.at_root("/classify")) == ["http://up:8000/classify"]
    assert _relay("http://up:8000/v1/", lambda r: r.at_root("/classify")) == ["http://up:8000/classify"]
    assert _relay("http://gw/llm/v1", lambda r: r.at_root("/classify")) == ["http://gw/llm/classify"]


def test_openai_routes_stay_under_the_base_url() -> None:
    assert _relay("http://up:8000/v1", lambda r: "/score") == ["http://up:8000/v1/score"]

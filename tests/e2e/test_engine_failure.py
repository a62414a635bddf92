"""The engine thread dies mid-request (a fault injected into its step): every in-flight request
ends with an OpenAI-shaped error — a 500 for a plain request, an SSE error event for a stream
already under way — /health stops answering 200, and the process exits with status 3 so that a
supervisor restarts it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e


def test_engine_death_fails_requests_and_exits_non_zero(tiny_model_dir: Path) -> None:
    server = ServerProcess(
        tiny_model_dir, module="tests.e2e.faulty_server", env={"LLMSERVE_TEST_FAULT_AFTER_STEPS": "6"}
    ).start()
    try:

        async def scenario() -> tuple[httpx.Response, list[dict]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                body = {"model": MODEL_NAME, "prompt": [5, 17, 99], "max_tokens": 100, "ignore_eos": True}

                async def streamed() -> list[dict]:
                    events = []
                    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                events.append(json.loads(line[6:]))
                    return events

                stream_task = asyncio.create_task(streamed())
                plain = await client.post("/v1/completions", json=body)
                return plain, await stream_task

        plain, events = asyncio.run(scenario())
        assert plain.status_code == 500, plain.text
        error = plain.json()["error"]
        assert "injected fault" in error["message"] and error["type"] and "param" in error
        assert "error" in events[-1] and "injected fault" in events[-1]["error"]["message"], events[-1]
        try:
            health = httpx.get(f"{server.url}/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None  # already gone
        assert health in (503, None)
        assert server.proc.wait(60) == 3
        assert "the engine stopped" in server.log()
    finally:
        server.stop()

"""The direct front's router work per request, in one process (no Ray cluster): the prefix key of a
raw body through the request's pydantic model (the ingress's path: `completion_key`/`chat_key` of
the validated request) against `PrefixKeyer.body_key`, and the `/internal/route` answer through a
FastAPI route (the router before) against `PrefixRouter`'s plain ASGI app, the pick stubbed.

    python benchmarks/bench_ray_router_key.py [--model M] [--calls 3000]

Bodies: the latency probe of bench_ray_serve.py (a one-token completion of "Hi"), one of its
shared-prefix chat requests (a 120-word system prompt) and a completion of that prompt. The two
sides of each pair alternate call by call; the head cache is off for the keys (a fresh head every
call: the bench's chat heads differ by their question), so they measure encoding, not the cache.
Medians in microseconds. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from bench_ray_serve import WORDS  # benchmarks/ is the script's folder, on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()
    from llmserve.model_executor.model_loader.source import resolve_model
    from llmserve.ray_serve.direct import PrefixRouter
    from llmserve.ray_serve.prefix import PrefixKeyer
    from llmserve.tokenizer import load_tokenizer

    keyer = PrefixKeyer(load_tokenizer(resolve_model(args.model)), block_size=16, num_blocks=4)
    keyer._head_key = keyer._encoded_key  # no head cache: encoding every call
    prefix = " ".join(WORDS[(3 * 7 + i * 4) % len(WORDS)] for i in range(120))
    bodies = {
        "probe": {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0},
        "chat": {"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": prefix}, {"role": "user", "content": "Question 3 about group 3?"}]},
        "long_completion": {"model": "m", "prompt": prefix, "max_tokens": 1},
    }  # fmt: skip
    report: dict[str, Any] = {}
    for name, data in bodies.items():
        body = json.dumps(data).encode()
        assert validated_key(keyer, body) == keyer.body_key(body)
        report[f"{name}_key_us"] = alternate(
            {
                "validated": lambda b=body: validated_key(keyer, b),
                "body_key": lambda b=body: keyer.body_key(b),
            },
            args.calls,
        )

    async def pick(key: Any) -> str:
        return "SERVE_REPLICA::llmserve#EngineReplica#abcdefgh"

    router = PrefixRouter.__new__(PrefixRouter)  # no Ray: the keyer and a stand-in pick
    router.keyer, router.pick = keyer, pick
    api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @api.post("/internal/route")
    async def route(request: Request) -> dict[str, str]:  # the router's route before
        return {"replica_id": await router.pick(keyer.body_key(await request.body()))}

    probe = json.dumps(bodies["probe"]).encode()
    apps = {"fastapi": api, "plain_asgi": router.__serve_build_asgi_app__()}
    report["route_us"] = asyncio.run(alternate_calls(apps, probe, args.calls))
    print(json.dumps(report, indent=2))


def validated_key(keyer: Any, body: bytes) -> int | None:
    """The key through the request's pydantic model (the ingress's path, the router's before)."""
    from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest

    try:
        data = json.loads(body)
        if "messages" in data:
            return keyer.chat_key(ChatCompletionRequest.model_validate(data))
        return keyer.completion_key(CompletionRequest.model_validate(data))
    except (ValueError, ValidationError):
        return None


async def call(app: Any, body: bytes) -> None:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.0",
             "method": "POST", "scheme": "http", "path": "/internal/route", "raw_path": b"/internal/route",
             "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2), "state": {}}  # fmt: skip
    await app(scope, receive, send)
    assert sent[0]["status"] == 200, sent


async def alternate_calls(apps: dict[str, Any], body: bytes, calls: int) -> dict[str, float]:
    """`alternate` for ASGI apps, in one event loop."""
    times: dict[str, list[int]] = {name: [] for name in apps}
    for i in range(calls + 100):
        for name, app in apps.items():
            started = time.perf_counter_ns()
            await call(app, body)
            if i >= 100:
                times[name].append(time.perf_counter_ns() - started)
    return {name: round(statistics.median(t) / 1e3, 2) for name, t in times.items()}


def alternate(sides: dict[str, Callable[[], Any]], calls: int) -> dict[str, Any]:
    """Median microseconds of each side, the sides called in turn (after 100 warm-up rounds)."""
    times: dict[str, list[int]] = {name: [] for name in sides}
    for i in range(calls + 100):
        for name, fn in sides.items():
            started = time.perf_counter_ns()
            fn()
            if i >= 100:
                times[name].append(time.perf_counter_ns() - started)
    return {name: round(statistics.median(t) / 1e3, 2) for name, t in times.items()}


if __name__ == "__main__":
    main()

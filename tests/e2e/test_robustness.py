"""The server under stress and misuse: clients that vanish, a full queue, signals, missing keys,
oversized bodies, cross-origin requests, and what reaches the log.

Five servers are launched together at the start of the module (their loading overlaps), each with
the flags its tests need; the two signal servers are shut down by their tests. Generation on the tiny
model takes about 1 ms per step, so anything meant to be long is long in steps (n=16, a queue).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmserve.server.middleware import OPEN_PATHS
from llmserve.server.playground import is_playground_path
from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

KEY = "sk-robustness-0123456789abcdef"
ENV_KEY = "env-key-fedcba9876543210"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://example.com"
SHUTDOWN_TIMEOUT = 3.0
LONG = 200  # max_tokens of a long request: with the prompt, within the context of 256
QUEUE_OF_ONE = ("--max-num-seqs", "1", "--max-queued-requests", "1")  # one running, one waiting
SIGNALLED = ("--max-num-seqs", "1", "--scheduling-policy", "priority")  # a backlog is long; priority jumps it
SERVERS: dict[str, tuple[str, ...]] = {
    "plain": ("--max-body-size", "2KiB"),
    "secured": ("--api-key", KEY, "--allowed-origins", ORIGIN, "--log-requests", *QUEUE_OF_ONE),
    "env_key": (),  # LLMSERVE_API_KEY=ENV_KEY
    "sigterm": (*SIGNALLED, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)),
    "sigint": (*SIGNALLED, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)),
}


@dataclass
class Fleet:
    servers: dict[str, ServerProcess]
    loading: list[tuple[httpx.Response, httpx.Response]]
    """(GET /v1/models, GET /health) pairs the plain server answered while its model loaded."""


def watch_loading(
    server: ServerProcess, timeout: float = 120.0
) -> list[tuple[httpx.Response, httpx.Response]]:
    """Poll from launch until /health is 200. A /v1/models answer counts as "while loading" only
    when the /health asked after it is still 503 (loading only ever ends)."""
    pairs = []
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.url, timeout=10) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
            try:
                models, health = client.get("/v1/models"), client.get("/health")
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            if health.status_code == 200:
                return pairs
            pairs.append((models, health))
            time.sleep(0.02)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()}")


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path) -> Iterator[Fleet]:
    servers = {
        name: ServerProcess(
            tiny_model_dir, *args, env={"LLMSERVE_API_KEY": ENV_KEY} if name == "env_key" else None
        )
        for name, args in SERVERS.items()
    }
    try:
        yield Fleet(servers, watch_loading(servers["plain"]))
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def plain(fleet: Fleet) -> ServerProcess:
    return fleet.servers["plain"].start()


@pytest.fixture(scope="module")
def secured(fleet: Fleet) -> ServerProcess:
    return fleet.servers["secured"].start()


def assert_error(r: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == error_type and error["message"], error
    return error


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "ignore_eos": True, **fields}


async def sse_events(r: httpx.Response) -> AsyncIterator[Any]:
    """The `data:` payloads of an SSE response: JSON objects, then the string "[DONE]"."""
    async for line in r.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


async def consume(
    client: httpx.AsyncClient, body: dict[str, Any], first: asyncio.Event | None = None
) -> tuple[list[Any], str]:
    """Stream a completion to its end: (payloads, "done" after [DONE] or "closed" when the
    connection dropped). `first` is set when the first payload arrives."""
    events: list[Any] = []
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for event in sse_events(r):
                events.append(event)
                if first is not None:
                    first.set()
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return events, "closed"
    return events, "done" if events[-1:] == ["[DONE]"] else "closed"


def stats(server: ServerProcess, headers: dict[str, str] | None = None) -> dict[str, int]:
    r = httpx.get(f"{server.url}/stats", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(
    server: ServerProcess, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> dict[str, int]:
    """/stats once no request runs, waits or holds a KV block; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server, headers)
        idle = s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == s["num_active_requests"] == 0
        if idle:
            return s
        assert time.monotonic() < deadline, f"engine still busy after {timeout} s: {s}"
        time.sleep(0.05)


def assert_serves(server: ServerProcess, headers: dict[str, str] | None = None) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=completion(max_tokens=8), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


# -- disconnects ---------------------------------------------------------------------------------

NUM_CLIENTS, MAX_NUM_SEQS = 32, 8  # MAX_NUM_SEQS: conftest's --max-num-seqs
# If no request were aborted, the 32 x 200 tokens would take at least this many steps.
STEPS_IF_NONE_ABORTED = NUM_CLIENTS * LONG // MAX_NUM_SEQS


def test_disconnect_storm_streaming_frees_everything(plain: ServerProcess) -> None:
    async def storm() -> None:
        async with httpx.AsyncClient(base_url=plain.url, timeout=60) as client:

            async def read_a_few_chunks() -> None:
                body = completion(max_tokens=LONG, stream=True)
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for _ in sse_events(r):
                        seen += 1
                        if seen == 3:
                            return  # leaving the block closes the connection mid-stream
                raise AssertionError("the stream ended before 3 chunks")

            await asyncio.gather(*(read_a_few_chunks() for _ in range(NUM_CLIENTS)))

    before = wait_idle(plain)
    asyncio.run(storm())
    after = wait_idle(plain)
    # the requests were cut short, not run to their end
    assert after["num_steps"] - before["num_steps"] < STEPS_IF_NONE_ABORTED, (before, after)
    assert_serves(plain)


def test_disconnect_storm_non_streaming_frees_everything(plain: ServerProcess) -> None:
    # A client gives up after as long as one request alone takes; 32 of them in 8 slots take longer.
    t = time.monotonic()
    alone = httpx.post(f"{plain.url}/v1/completions", json=completion(max_tokens=LONG), timeout=60)
    assert alone.status_code == 200
    read_timeout = time.monotonic() - t

    async def storm() -> int:
        timeout = httpx.Timeout(60, read=read_timeout)
        async with httpx.AsyncClient(base_url=plain.url, timeout=timeout) as client:

            async def give_up() -> bool:
                try:
                    await client.post("/v1/completions", json=completion(max_tokens=LONG))
                except httpx.ReadTimeout:
                    return True
                return False

            return sum(await asyncio.gather(*(give_up() for _ in range(NUM_CLIENTS))))

    before = wait_idle(plain)
    num_gave_up = asyncio.run(storm())
    after = wait_idle(plain)
    assert num_gave_up >= NUM_CLIENTS - MAX_NUM_SEQS, num_gave_up
    assert after["num_steps"] - before["num_steps"] < STEPS_IF_NONE_ABORTED, (before, after)
    # the handler logs each abort beside the engine's step loop: the log may trail /stats a little.
    # A client whose read timeout ends while its answer is on the way counts as gone, though its
    # request finished: at most one batch of slots finishes at that edge (a CI run saw more than 2).
    deadline = time.monotonic() + 10
    while plain.log().count("client disconnected; aborted 1 request(s)") < num_gave_up - MAX_NUM_SEQS:
        assert time.monotonic() < deadline, plain.log()[-2000:]
        time.sleep(0.1)
    assert_serves(plain)


# -- the waiting queue ---------------------------------------------------------------------------


def test_full_queue_answers_429_with_retry_after(secured: ServerProcess) -> None:
    """--max-num-seqs 1 --max-queued-requests 1: one running, one waiting, the next is refused.
    A long request runs for only ~0.25 s, so a try where it ended too soon is repeated."""

    async def attempt(client: httpx.AsyncClient) -> httpx.Response:
        first = asyncio.Event()
        running = asyncio.create_task(consume(client, completion(max_tokens=LONG), first))
        await asyncio.wait_for(first.wait(), 30)
        waiting = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=LONG)))
        deadline = time.monotonic() + 2
        while (await client.get("/stats")).json()["num_waiting"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        refused = await client.post("/v1/completions", json=completion(max_tokens=4))
        events, end = await running
        assert end == "done" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert (await waiting).status_code == 200
        return refused

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=secured.url, headers=AUTH, timeout=60) as client:
            for _ in range(3):
                r = await attempt(client)
                if r.status_code == 429:
                    return r
                assert r.status_code == 200, r.text  # the running request ended first: try again
            raise AssertionError("no request was refused with one running and one waiting")

    refused = asyncio.run(run())
    error = assert_error(refused, 429, "rate_limit_error")
    assert error["code"] == "queue_full"
    assert int(refused.headers["Retry-After"]) >= 1
    wait_idle(secured, AUTH)
    assert_serves(secured, AUTH)


# -- signals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_in_flight_requests_then_aborts_the_rest(fleet: Fleet, sig: signal.Signals) -> None:
    """A request running when the signal arrives completes in full; new connections are refused
    (or answered 503); a backlog far longer than --shutdown-timeout is aborted at the timeout (its
    streams end with an error event) and the process exits 0 soon after."""
    server = fleet.servers[sig.name.lower()].start()
    body = completion(prompt="The drain test", max_tokens=LONG, temperature=0)
    reference = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    backlog = {**body, "n": 16}  # 6 x 16 x 200 steps, one sequence at a time: tens of seconds

    async def scenario() -> tuple[tuple[list[Any], str], list[tuple[list[Any], str]], list[Any], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            backlog_tasks = [asyncio.create_task(consume(client, backlog)) for _ in range(6)]
            deadline = time.monotonic() + 30
            while (await client.get("/stats")).json()["num_active_requests"] < 6:
                assert time.monotonic() < deadline, "the backlog was not accepted"
                await asyncio.sleep(0.02)
            first = asyncio.Event()
            in_flight_body = {**body, "priority": -1, "stream_options": {"include_usage": True}}
            in_flight = asyncio.create_task(consume(client, in_flight_body, first))
            await asyncio.wait_for(first.wait(), 30)  # it runs (ahead of the backlog)

            server.proc.send_signal(sig)
            signalled = time.monotonic()
            probes = []
            for delay in (0.0, 0.5):  # before and after uvicorn closes its socket
                await asyncio.sleep(delay)
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:
                    try:
                        probes.append(await fresh.get("/v1/models"))
                    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError) as e:
                        # refused, or reset: a connection still in the kernel's backlog when
                        # uvicorn closes its listening socket is dropped without an answer
                        probes.append(e)
            done = await in_flight
            cut = await asyncio.gather(*backlog_tasks)
            await asyncio.to_thread(server.proc.wait, 60)
            return done, cut, probes, time.monotonic() - signalled

    (events, end), cut, probes, exit_after = asyncio.run(scenario())
    assert server.proc.returncode == 0, server.log()
    assert exit_after < SHUTDOWN_TIMEOUT + 10, exit_after
    # the in-flight request: every token, the same text as before the signal, a proper end
    assert end == "done", events
    chunks, usage = events[:-2], events[-2]["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == LONG
    for probe in probes:
        if isinstance(probe, httpx.Response):
            assert_error(probe, 503, "service_unavailable_error")
    # the backlog: aborted at the timeout; each stream ends with an error event and [DONE]
    finished = 0
    for payloads, how in cut:
        assert how == "done", payloads[-3:]
        reasons = [c["finish_reason"] for p in payloads[:-1] for c in p.get("choices", [])]
        if sum(r is not None for r in reasons) == 16:
            finished += 1
            continue
        error = payloads[-2]["error"]
        assert error["type"] == "service_unavailable_error" and error["code"] == "aborted", error
    assert finished < len(cut), "the backlog ran to its end instead of being aborted at the timeout"
    assert "Exception in ASGI application" not in server.log()  # aborted, not cancelled by uvicorn


# -- authentication ------------------------------------------------------------------------------


def registered_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app registers, path parameters filled in: a route added
    later is covered without editing this test."""
    from starlette.routing import Route

    from llmserve.config import ServerConfig
    from llmserve.config.models import ModelSpec
    from llmserve.server.app import build_app

    app = build_app([ModelSpec(MODEL_NAME)], ServerConfig())

    def walk(entries):  # routers included without a prefix show up as one entry each
        for route in entries:
            included = getattr(route, "original_router", None)
            if included is not None:
                yield from walk(included.routes)
            elif isinstance(route, Route) and route.methods:
                yield route

    routes = []
    for route in walk(app.routes):
        path = re.sub(r"\{[^}]*\}", MODEL_NAME, route.path)
        routes += [(method, path) for method in sorted(route.methods - {"HEAD"})]
    return routes


ROUTES = registered_routes()


def test_route_table_is_found() -> None:
    paths = {path for _, path in ROUTES}
    assert {
        "/health",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/stats",
        "/metrics",
        "/tokenize",
    } <= paths


def bad_credentials(key: str) -> dict[str, dict[str, str]]:
    return {
        "none": {},
        "wrong key": {"Authorization": f"Bearer {'x' * len(key)}"},
        "shorter key": {"Authorization": f"Bearer {key[:-1]}"},
        "longer key": {"Authorization": f"Bearer {key}x"},
        "Basic scheme": {"Authorization": f"Basic {key}"},
        "wrong x-api-key": {"x-api-key": "x" * len(key)},
        "bearer in x-api-key": {"x-api-key": f"Bearer {key}"},
    }


def assert_auth(server: ServerProcess, key: str, method: str, path: str) -> None:
    body = {} if method in ("POST", "PUT", "PATCH") else None
    with httpx.Client(base_url=server.url, timeout=30) as client:
        if path in OPEN_PATHS or is_playground_path(path):  # open: the probes, the playground's pages
            assert client.get(path).status_code == 200
            return
        for name, headers in bad_credentials(key).items():
            r = client.request(method, path, headers=headers, json=body)
            assert_error(r, 401, "authentication_error")
            assert r.headers["WWW-Authenticate"] == "Bearer", name
        for good in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):  # OpenAI's and Anthropic's
            r = client.request(method, path, headers=good, json=body)
            assert r.status_code != 401, r.text


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_api_key_guards_every_route(secured: ServerProcess, method: str, path: str) -> None:
    assert_auth(secured, KEY, method, path)


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_api_key_from_environment(fleet: Fleet, method: str, path: str) -> None:
    assert_auth(fleet.servers["env_key"].start(), ENV_KEY, method, path)


def test_unknown_paths_are_denied_by_default(secured: ServerProcess) -> None:
    assert_error(httpx.get(f"{secured.url}/no/such/route"), 401, "authentication_error")
    assert_error(httpx.post(f"{secured.url}/v2/whatever", json={}), 401, "authentication_error")
    assert_error(httpx.get(f"{secured.url}/no/such/route", headers=AUTH), 404, "not_found_error")


# -- loading, body size, CORS, logging -----------------------------------------------------------


def test_health_is_503_while_loading_then_200(fleet: Fleet, plain: ServerProcess) -> None:
    assert fleet.loading, "the plain server never answered before its model was loaded"
    for models, health in fleet.loading:
        assert_error(health, 503, "service_unavailable_error")
        assert_error(models, 503, "service_unavailable_error")
        assert int(models.headers["Retry-After"]) >= 1
    r = httpx.get(f"{plain.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_oversized_body_is_413(plain: ServerProcess) -> None:
    data = json.dumps(completion(prompt="x" * 4096, max_tokens=1)).encode()  # --max-body-size 2KiB
    url, headers = f"{plain.url}/v1/completions", {"Content-Type": "application/json"}
    sized = httpx.post(url, content=data, headers=headers)
    chunked = httpx.post(url, content=iter([data[:1500], data[1500:3000], data[3000:]]), headers=headers)
    assert sized.request.headers["Content-Length"] == str(len(data))
    assert chunked.request.headers["Transfer-Encoding"] == "chunked"
    for r in (sized, chunked):
        assert_error(r, 413, "invalid_request_error")
    assert_serves(plain)


PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_cors_is_off_without_allowed_origins(plain: ServerProcess) -> None:
    simple = httpx.get(f"{plain.url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.status_code == 200
    preflight = httpx.options(f"{plain.url}/v1/chat/completions", headers=PREFLIGHT)
    for r in (simple, preflight):
        assert "access-control-allow-origin" not in r.headers


def test_cors_allows_the_given_origins(secured: ServerProcess) -> None:
    preflight = httpx.options(f"{secured.url}/v1/chat/completions", headers=PREFLIGHT)  # no key needed
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(f"{secured.url}/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{secured.url}/v1/models", headers={"Origin": "http://evil.example", **AUTH})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("logged", [False, True], ids=["default", "log-requests"])
def test_prompts_and_outputs_are_logged_only_when_asked(request: pytest.FixtureRequest, logged: bool) -> None:
    server: ServerProcess = request.getfixturevalue("secured" if logged else "plain")
    prompt = f"my secret passphrase is {uuid.uuid4().hex}"
    r = httpx.post(
        f"{server.url}/v1/completions",
        json=completion(prompt=prompt, max_tokens=16, temperature=0),
        headers=AUTH if logged else None,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    output = r.json()["choices"][0]["text"]
    log = server.log()
    assert re.search(r"request cmpl-\d+ finished", log)  # the request itself is logged either way
    assert (prompt in log) is logged
    if logged:
        assert repr(output) in log  # the log shows texts as repr()
    elif len(output) >= 8:  # a shorter text could be in the log by chance
        assert output not in log and repr(output) not in log

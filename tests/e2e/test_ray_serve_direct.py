"""llmserve on Ray Serve's direct front (ray_serve/direct.py): HAProxy asks the `PrefixRouter`
deployment which replica takes each request and sends it straight there; two replicas of a tiny
real model serve HTTP themselves. Driven over HTTP by httpx and OpenAI's client.

The application is deployed as a user would, with Ray's `serve run llmserve.ray_serve:app ...`
(a process of its own with env.py's DIRECT_ENV set: Ray reads it once, when first imported, and
this process imported Ray long before), onto a module-scoped local cluster whose processes have
DIRECT_ENV too. Requests spread over both replicas, a shared prefix goes to the replica that
cached it, /metrics (any replica) merges both, streams, the replica's span under the caller's,
the plain server's 401 / 400 / 404 and the 501 of Files/Batches, one replica killed mid-stream
(its stream ends with the API's SSE error event, which llmserve's HAProxy wrapper adds; new
requests go to the survivor, Ray replaces it), one killed under a whole answer not yet sent
(HAProxy retries it on the survivor) and, last, the application redeployed with autoscaling,
where a queue of streams adds a replica."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

import psutil
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from ray import serve

from llmserve.ray_serve import haproxy_wrapper
from llmserve.ray_serve.env import DIRECT_ENV
from tests.e2e.conftest import new_traceparent, span_attrs
from tests.e2e.test_ray_serve import (  # the ingress front's module: the model, helpers, and
    APP,  # the tests whose every assertion holds on this front too (run here on its `url`)
    AUTH,
    BLOCK,
    KEY,
    MODEL,
    PREFIX_BLOCKS,
    complete,
    kill_replica,
    local_serve,
    metric,
    metric_replicas,
    model_dir,  # noqa: F401 (a fixture)
    one_replica_then_two_for_a_queue,
    scaled_args,
    survivor_then_replacement,
    test_auth_and_bad_requests_answer_as_the_plain_server,  # noqa: F401
    test_client_disconnect_aborts_the_request_on_its_replica,  # noqa: F401
    test_replica_killed_mid_stream,  # noqa: F401 (an SSE error event on this front too: the wrapper's)
    test_requests_spread_over_both_replicas,  # noqa: F401
    test_shared_prefix_goes_to_the_replica_that_cached_it,  # noqa: F401
    test_stream_through_the_ingress_with_openai_client,  # noqa: F401
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def app_args(model_dir: Path, collector) -> dict[str, str]:  # noqa: F811
    """`serve run`'s arguments (2 cores: the replicas reserve half a Ray CPU each and run torch
    on one thread)."""
    return {
        "front": "direct", "model": str(model_dir), "served_model_name": MODEL, "num_replicas": "2",
        "replica_cpus": "0.5", "ingress_cpus": "0.25", "torch_threads": "1", "api_key": KEY,
        "prefix_blocks": str(PREFIX_BLOCKS), "block_size": str(BLOCK), "num_kv_blocks": "512",
        "max_num_seqs": "8", "otlp_traces_endpoint": f"127.0.0.1:{collector[1]}",
    }  # fmt: skip


def deploy(app_args: dict[str, str]) -> None:
    """`serve run --non-blocking llmserve.ray_serve:app ...` onto the running cluster (it returns
    once the application is running)."""
    cmd = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", "--address", "auto",
           "--non-blocking", "--name", APP, "--route-prefix", "/", "llmserve.ray_serve:app",
           *(f"{k}={v}" for k, v in app_args.items())]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, **DIRECT_ENV}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def url(app_args: dict[str, str]) -> Iterator[str]:
    with local_serve(DIRECT_ENV) as url:
        deploy(app_args)
        yield url


def test_haproxy_sends_requests_to_the_replicas_by_the_router(url: str) -> None:
    """HAProxy listens; the application is the replicas and the router, no ingress deployment."""
    port = int(url.rsplit(":", 1)[1])
    listening = {
        c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }  # fmt: skip
    assert listening and {psutil.Process(pid).name() for pid in listening} == {"haproxy"}
    assert set(serve.status().applications[APP].deployments) == {"EngineReplica", "PrefixRouter"}
    complete(url, "through HAProxy " * 4)


def test_metrics_from_any_replica_are_every_replicas(url: str) -> None:
    """HAProxy sends each GET to either replica; each answers with both replicas' metrics."""
    for _ in range(4):
        r = httpx.get(f"{url}/metrics", headers=AUTH)
        assert r.status_code == 200
        assert len(metric_replicas(r.text)) == 2
        assert r.text.count("# TYPE llmserve:prompt_tokens_total counter") == 1
    # the key first, as on every other path (these two are answered before the replica's app)
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/v1/batches").status_code == 401


def test_the_replicas_span_is_the_callers_child(url: str, collector) -> None:
    """No ingress span on this front: the replica's `llm_request` span is the caller's child."""
    receiver, _ = collector
    for stream in (False, True):
        trace_id, caller_span, header = new_traceparent()
        body = {"model": MODEL, "prompt": "Trace me please", "max_tokens": 3, "stream": stream}
        r = httpx.post(
            f"{url}/v1/completions", json=body, headers={**AUTH, "traceparent": header}, timeout=60
        )
        assert r.status_code == 200, r.text
        spans = {s.name: s for s in receiver.wait_for(trace_id, 4)}
        assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
        request = spans["llm_request"]
        assert request.parent_span_id == caller_span and request.kind == Span.SPAN_KIND_SERVER
        assert span_attrs(request)["gen_ai.usage.completion_tokens"] == 3


def test_a_body_the_router_cannot_key_goes_by_load(url: str) -> None:
    """Not JSON: the router has no key and picks by load; the replica answers the plain 400."""
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["x-llmserve-replica"]


def test_a_request_in_flight_on_a_killed_replica_ends_not_hangs(url: str) -> None:
    """A whole (not streamed) answer under way on a replica that is killed: no byte of it had left.
    It is not retried by default (env.py's RETRY_IN_FLIGHT): HAProxy closes the client's connection
    without an answer where its connection to the replica was a reused one (as a keep-alive race
    looks to a client), else answers its own 502, which the wrapper makes the API's JSON error.
    Requests the router still sends to the dead replica (the prefix's home) are retried on the
    survivor (connection refused). Then Ray replaces it."""
    prompt = "A story about a lighthouse keeper and the sea. " * 6  # > PREFIX_BLOCKS blocks
    victim = complete(url, prompt).headers["x-llmserve-replica"]  # the prefix's home
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not answer.done():  # until the home runs it
            text = httpx.get(f"{url}/metrics", headers=AUTH).text
            if metric(text, "llmserve:num_requests_running", victim):
                break
            time.sleep(0.05)
        assert not answer.done(), answer.result().text
        kill_replica(victim)
        try:
            r = answer.result()
        except httpx.RemoteProtocolError as e:
            assert "without sending a response" in str(e)
        else:
            assert r.status_code == 502, r.text
            assert r.json() == haproxy_wrapper.error_body(502, haproxy_wrapper.ERRORS[502][1])
    for _ in range(3):
        assert complete(url, prompt).headers["x-llmserve-replica"] != victim
    survivor_then_replacement(url, victim)


def test_haproxy_runs_through_llmserves_wrapper(url: str) -> None:
    """Ray started HAProxy as llmserve's wrapper (env.py), which found every line it rewrites in
    the config Ray wrote (tests/unit/test_ray_serve_haproxy.py checks what they do)."""
    port = int(url.rsplit(":", 1)[1])
    # the listener's command lines; Ray reloads HAProxy when replicas change (the kill tests above),
    # so a process seen listening may have exited by the time it is read: look again until one answers
    cmdlines: list[list[str]] = []
    deadline = time.monotonic() + 30
    while not cmdlines and time.monotonic() < deadline:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    cmdlines.append(psutil.Process(c.pid).cmdline())
        if not cmdlines:
            time.sleep(0.5)
    assert cmdlines, f"nothing listens on port {port}"
    for cmdline in cmdlines:
        config = Path(cmdline[cmdline.index("-f") + 1])
        assert config.name.startswith("llmserve-")
        text = config.read_text()
        assert f"filter lua.{haproxy_wrapper.GUARD}" in text and "lua-load-per-thread" in text
        errorfiles = [line.split() for line in text.splitlines() if line.strip().startswith("errorfile")]
        assert {status for _, status, _ in errorfiles} == {"502", "503", "504"}
        assert all(Path(path).name == f"llmserve-{status}.http" for _, status, path in errorfiles)
        # the router's failure answered in JSON (Ray's health and routes pages stay Ray's)
        assert "Ingress request router failed" not in text and "no engine replica could be chosen" in text


def test_autoscaling_adds_a_replica_for_a_queue(url: str, app_args: dict[str, str]) -> None:
    """Last (it redeploys): autoscaled between 1 and 2 replicas with a target of 1 ongoing
    request, the idle application goes down to 1 replica and four streams raise it to 2: Ray
    counts the requests HAProxy sends a replica directly."""
    deploy(scaled_args(app_args))
    one_replica_then_two_for_a_queue(url)

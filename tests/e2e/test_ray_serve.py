"""llmserve on Ray Serve (llmserve.ray_serve): a local Ray cluster, HAProxy before the ingress (Ray
Serve's HAProxy mode, as `llmserve serve --replicas` runs it) before two replicas of a tiny real
model, driven over HTTP by httpx and OpenAI's client.

One module-scoped cluster (Ray starts in tens of seconds): requests spread over both replicas, a
shared-prefix workload cached on the replica the router chose (usage and the replica-labelled
metrics), streaming through the ingress, the ingress's trace span as the parent of the replica's,
the plain server's 401 and 400, one replica killed mid-stream (its stream ends with an error
event, new requests succeed on the survivor, Ray starts a replacement) and, last, the application
redeployed with autoscaling, where a queue of streams adds a replica."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

import openai
import psutil
import ray
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from tests.e2e.conftest import CHAT_TEMPLATE, free_port, new_traceparent, span_attrs
from tests.models.tiny import make_tiny_model_eos0
from tests.ray_start import start_ray

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

APP = "llm"
MODEL = "tiny-ray"
KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 16
PREFIX_BLOCKS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-ray")
    make_tiny_model_eos0(folder)  # a 2048-token context: room for a long stream to kill
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def app_args(model_dir: Path, collector) -> dict[str, str]:
    """`serve run`'s arguments of the application under test (2 cores: the replicas reserve half
    a Ray CPU each and run torch on one thread)."""
    return {
        "front": "ingress", "model": str(model_dir), "served_model_name": MODEL, "num_replicas": "2", "replica_cpus": "0.5",
        "ingress_cpus": "0.5", "torch_threads": "1", "api_key": KEY, "prefix_blocks": str(PREFIX_BLOCKS),
        "block_size": str(BLOCK), "num_kv_blocks": "512", "max_num_seqs": "8",
        "otlp_traces_endpoint": f"127.0.0.1:{collector[1]}",
    }  # fmt: skip


@pytest.fixture(scope="module")
def url(app_args: dict[str, str]) -> Iterator[str]:
    from llmserve.ray_serve import app
    from llmserve.ray_serve.env import HAPROXY_ENV

    # HAProxy before the ingress (as `llmserve serve --replicas --ray-http-proxy haproxy` runs it)
    with local_serve(HAPROXY_ENV) as url:
        serve.run(app(app_args), name=APP, route_prefix="/")
        yield url


@contextlib.contextmanager
def local_serve(front_env: dict[str, str]) -> Iterator[str]:
    """A local Ray cluster whose every process inherits `front_env`, spans exported within 50 ms
    (the SDK's default: 5 s) and the load the autoscaler reads reported every half second (Ray's
    default: 10 s), with Serve started on a free port: its URL."""
    env = {
        **front_env,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        start_ray(lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False))
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, prompt: str, **params) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **params}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r


def metric(text: str, name: str, replica: str, **labels: str) -> float:
    """The sum of `name`'s samples labelled with `replica` (and `labels`) in a Prometheus text."""
    want = {"replica": replica, **labels}
    return sum(
        s.value for family in text_string_to_metric_families(text) for s in family.samples
        if s.name == name and want.items() <= s.labels.items()
    )  # fmt: skip


def metric_replicas(text: str) -> set[str]:
    """The replicas that /metrics has samples of."""
    return {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples}


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments["EngineReplica"]
    return status.replica_states.get("RUNNING", 0)


def test_haproxy_fronts_the_ingress(url: str) -> None:
    """HAProxy, not Serve's Python proxy, listens on Serve's HTTP port (HAPROXY_ENV)."""
    port = int(url.rsplit(":", 1)[1])
    listening = {
        c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }  # fmt: skip
    assert listening and {psutil.Process(pid).name() for pid in listening} == {"haproxy"}
    complete(url, "through HAProxy " * 4)


def test_requests_spread_over_both_replicas(url: str) -> None:
    # distinct first blocks: distinct keys, homes spread by rendezvous hashing
    served = [
        complete(url, f"{i}: {'abcdefgh'[i % 8] * 3} request {i} " * 4).headers["x-llmserve-replica"]
        for i in range(16)
    ]
    assert len(set(served)) == 2, served
    assert min(served.count(r) for r in set(served)) >= 2, served


def test_shared_prefix_goes_to_the_replica_that_cached_it(url: str) -> None:
    system = "You are a terse assistant. Answer in one word. " * 4  # > PREFIX_BLOCKS blocks of tokens
    before = httpx.get(f"{url}/metrics", headers=AUTH).text
    answers = []
    for question in ("What is red?", "Why?", "Name a fruit.", "How far is the moon?", "Say hi", "Count"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
            headers=AUTH, timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        answers.append((r.headers["x-llmserve-replica"], r.json()["usage"]))
    homes = {replica for replica, _ in answers}
    assert len(homes) == 1, answers  # every request went where the prefix is
    home = homes.pop()
    cached = [usage["prompt_tokens_details"]["cached_tokens"] for _, usage in answers]
    assert all(c >= PREFIX_BLOCKS * BLOCK for c in cached[1:]), cached
    # the home's own prefix-cache counters show the hits; the other replica's do not move
    time.sleep(0.2)
    after = httpx.get(f"{url}/metrics", headers=AUTH).text
    hits = "llmserve:prefix_cache_hits_total"
    assert metric(after, hits, home) - metric(before, hits, home) >= sum(cached[1:])
    others = metric_replicas(after) - {home}
    assert len(others) == 1
    other = others.pop()
    assert metric(after, hits, other) == metric(before, hits, other)


def test_metrics_are_labelled_by_replica(url: str) -> None:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    replicas = metric_replicas(text)
    assert len(replicas) == 2
    for replica in replicas:
        assert metric(text, "llmserve:prompt_tokens_total", replica) > 0
    assert text.count("# TYPE llmserve:prompt_tokens_total counter") == 1  # one family, both replicas


def test_stream_through_the_ingress_with_openai_client(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_the_ingress_span_is_the_parent_of_the_replicas_span(url: str, collector) -> None:
    receiver, _ = collector
    for stream in (False, True):
        trace_id, caller_span, header = new_traceparent()
        body = {"model": MODEL, "prompt": "Trace me please", "max_tokens": 3, "stream": stream}
        r = httpx.post(
            f"{url}/v1/completions", json=body, headers={**AUTH, "traceparent": header}, timeout=60
        )
        assert r.status_code == 200, r.text
        spans = {s.name: s for s in receiver.wait_for(trace_id, 5)}
        assert set(spans) == {"ray_serve_ingress", "llm_request", "queue", "prefill", "decode"}
        ingress, request = spans["ray_serve_ingress"], spans["llm_request"]
        assert ingress.parent_span_id == caller_span and ingress.kind == Span.SPAN_KIND_SERVER
        assert request.parent_span_id == ingress.span_id  # the replica's span, under the ingress's
        assert ingress.start_time_unix_nano <= request.start_time_unix_nano
        assert request.end_time_unix_nano <= ingress.end_time_unix_nano
        attrs = span_attrs(ingress)
        assert attrs["llmserve.replica"] == r.headers["x-llmserve-replica"]
        assert attrs["http.response.status_code"] == 200 and attrs["url.path"] == "/v1/completions"
        assert ingress.status.code != ingress.status.STATUS_CODE_ERROR


def test_auth_and_bad_requests_answer_as_the_plain_server(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    # a schema error, refused by the ingress itself
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, headers=AUTH)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    # a value the engine refuses, answered by the replica's app and relayed
    r = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, headers=AUTH
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=AUTH)
    assert r.status_code == 404
    r = httpx.get(f"{url}/v1/batches", headers=AUTH)
    assert r.status_code == 501 and "Ray Serve" in r.json()["error"]["message"]
    complete(url, "the server keeps serving " * 3)


def long_stream_body() -> dict:
    return {
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me everything"}], "max_tokens": 1800,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip


def test_client_disconnect_aborts_the_request_on_its_replica(url: str) -> None:
    aborted = {"name": "llmserve:request_success_total", "finished_reason": "abort"}
    before = httpx.get(f"{url}/metrics", headers=AUTH).text
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=long_stream_body(), headers=AUTH, timeout=30
    ) as r:
        replica = r.headers["x-llmserve-replica"]
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break
    deadline, count = time.monotonic() + 20, 0.0
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", headers=AUTH).text
        count = metric(text, replica=replica, **aborted) - metric(before, replica=replica, **aborted)
        if count:
            break
        time.sleep(0.3)
    assert count == 1


def test_replica_killed_mid_stream(url: str) -> None:
    """Its stream ends with an error event and [DONE]; new requests are all answered, by the
    survivor; Ray replaces the replica."""
    victim, events = kill_mid_stream(url)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error" and "mid-stream" in error["message"]
    assert len(events) < 1800  # it did not run to the end
    survivor_then_replacement(url, victim)


def kill_mid_stream(url: str) -> tuple[str, list[str]]:
    """Open a long stream, read three events, kill its replica and read the rest (within 30 s:
    never a hang): the killed replica and the stream's `data:` events."""
    events: list[str] = []
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=long_stream_body(), headers=AUTH, timeout=30
    ) as r:
        assert r.status_code == 200
        victim = r.headers["x-llmserve-replica"]
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                events.append(line[5:].strip())
            if len(events) == 3:
                break
        kill_replica(victim)
        started = time.monotonic()
        events += [line[5:].strip() for line in lines if line.startswith("data:")]  # a cut body raises
        assert time.monotonic() - started < 30
    return victim, events


def kill_replica(replica: str) -> None:
    ray.kill(
        ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{replica}", namespace="serve"), no_restart=True
    )


def survivor_then_replacement(url: str, victim: str) -> None:
    """After `victim` was killed: new requests are all answered, by the survivor; Ray replaces
    the victim, and the front reaches the new replica (it learns of it shortly after)."""
    served = {complete(url, f"after the kill {i} " * 4).headers["x-llmserve-replica"] for i in range(6)}
    assert victim not in served
    # Ray's status may count the victim RUNNING a moment after the kill: wait for a new replica
    # that the front reaches (the merged metrics name it) as well as for the count
    deadline, replicas = time.monotonic() + 120, set()
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/metrics", headers=AUTH)
        replicas = metric_replicas(r.text) if r.status_code == 200 else set()
        if len(replicas) == 2 and victim not in replicas and running_replicas() == 2:
            break
        time.sleep(0.5)
    assert running_replicas() == 2
    assert len(replicas) == 2 and victim not in replicas


def test_autoscaling_adds_a_replica_for_a_queue(url: str, app_args: dict[str, str]) -> None:
    """Last (it redeploys the application): autoscaled between 1 and 2 replicas with a target of 1
    ongoing request and no delays, the idle application goes down to 1 replica, and four streams
    kept going raise the count to 2 again, as serve.status() reports."""
    from llmserve.ray_serve import app

    serve.run(app(scaled_args(app_args)), name=APP, route_prefix="/")
    one_replica_then_two_for_a_queue(url)


def scaled_args(app_args: dict[str, str]) -> dict[str, str]:
    """`app_args` autoscaled between 1 and 2 replicas, a target of 1 ongoing request, no delays."""
    return {**app_args, "num_replicas": "1", "max_replicas": "2", "target_ongoing_requests": "1",
            "upscale_delay_s": "0", "downscale_delay_s": "0"}  # fmt: skip


def one_replica_then_two_for_a_queue(url: str) -> None:
    """The idle application goes down to 1 replica; four streams kept going raise it to 2."""
    deadline = time.monotonic() + 60
    while running_replicas() != 1 and time.monotonic() < deadline:  # idle: one replica goes
        time.sleep(0.5)
    assert running_replicas() == 1
    stop = threading.Event()

    def keep_streaming() -> None:
        while not stop.is_set():
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=long_stream_body(), headers=AUTH, timeout=60
            ) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(keep_streaming) for _ in range(4)]
        try:
            started = time.monotonic()
            while running_replicas() < 2 and time.monotonic() - started < 60:
                time.sleep(0.5)
            assert running_replicas() == 2
        finally:
            stop.set()
        for f in streams:
            f.result()

"""/metrics against a ledger of what the test sent: after a scripted mix of requests (completed by
length and by a stop token, n > 1, streamed chat, preempted, aborted while waiting, refused for
every reason), every counter and every histogram count equals what the ledger predicts, and the
engine-side counters (/stats: steps, preemptions, prefix-cache tokens) match their metrics.

Two servers, launched together:
  - "pressured": the tiny model with a KV pool of 10 blocks of 8 tokens and 2 slots, so two
    64-token sequences cannot both finish without a preemption;
  - "busy": the embedded SmolLM2 (~20 ms a step, so a 200-token request occupies its single slot
    for seconds: long enough to queue a request, be refused with 429 and abort the queued one
    before it could ever be scheduled), with an API key and response timings on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

KEY = "sk-metrics-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PRESSURED = (
    "--num-kv-blocks",
    "10",
    "--block-size",
    "8",
    "--max-num-seqs",
    "2",
    "--stats-log-interval",
    "0.2",
)
BUSY = (
    "--api-key", KEY, "--max-num-seqs", "1", "--max-queued-requests", "1", "--max-body-size", "16KiB",
    "--num-kv-blocks", "64", "--enable-response-timings",
)  # fmt: skip
HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_params_n", "request_params_max_tokens", "iteration_tokens_total",
)  # fmt: skip


@dataclass(frozen=True)
class Sent:
    """One sequence the server finished (n > 1: one entry per sample)."""

    reason: str
    prompt_len: int
    generated: int
    max_tokens: int
    n: int = 1
    scheduled: bool = True


@pytest.fixture(scope="module")
def servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    launched = {
        "pressured": ServerProcess(tiny_model_dir, *PRESSURED),
        "busy": ServerProcess("smollm2-135m-instruct", *BUSY, log_dir=tmp_path_factory.mktemp("busy")),
    }
    try:
        yield {name: s.start(timeout=300) for name, s in launched.items()}
    finally:
        for s in launched.values():
            s.stop()


def scrape(server: ServerProcess, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every llmserve: sample, keyed by its name plus its label other than model_name (if any)."""
    r = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if not sample.name.startswith("llmserve:") or sample.name.endswith("_created"):
                continue
            labels = dict(sample.labels)
            if sample.name != "llmserve:cache_config_info":
                assert labels.pop("model_name") == MODEL_NAME, sample
                assert labels.pop("engine") == "native", sample
            labels.pop("le", None) if sample.name.endswith("_bucket") else None
            key = sample.name + "".join(f"[{v}]" for _, v in sorted(labels.items()))
            if sample.name.endswith("_bucket"):
                samples[key] = max(samples.get(key, 0.0), sample.value)  # the +Inf bucket: the count
            else:
                samples[key] = sample.value
    return samples


def stats(server: ServerProcess, headers: dict[str, str] | None = None) -> dict[str, int]:
    r = httpx.get(f"{server.url}/stats", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(server: ServerProcess, headers: dict[str, str] | None = None) -> dict[str, int]:
    deadline = time.monotonic() + 30
    while True:
        s = stats(server, headers)
        if s["num_running"] == s["num_waiting"] == s["num_active_requests"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def expected_from(ledger: list[Sent]) -> dict[str, float]:
    got_token = [s for s in ledger if s.generated > 0]
    m = "llmserve:"
    out: dict[str, float] = {
        f"{m}request_success_total[{reason}]": sum(s.reason == reason for s in ledger)
        for reason in ("stop", "length", "abort")
    }
    out |= {
        f"{m}prompt_tokens_total": sum(s.prompt_len for s in got_token),
        f"{m}generation_tokens_total": sum(s.generated for s in ledger),
        f"{m}time_to_first_token_seconds_count": len(got_token),
        f"{m}inter_token_latency_seconds_count": sum(s.generated - 1 for s in got_token),
        f"{m}request_time_per_output_token_seconds_count": sum(s.generated >= 2 for s in ledger),
        f"{m}e2e_request_latency_seconds_count": len(ledger),
        f"{m}request_queue_time_seconds_count": sum(s.scheduled for s in ledger),
        f"{m}request_prefill_time_seconds_count": len(got_token),
        f"{m}request_decode_time_seconds_count": len(got_token),
        f"{m}request_inference_time_seconds_count": len(got_token),
        f"{m}request_prompt_tokens_count": len(ledger),
        f"{m}request_prompt_tokens_sum": sum(s.prompt_len for s in ledger),
        f"{m}request_generation_tokens_count": len(ledger),
        f"{m}request_generation_tokens_sum": sum(s.generated for s in ledger),
        f"{m}request_params_max_tokens_sum": sum(s.max_tokens for s in ledger),
        f"{m}request_params_n_sum": sum(s.n for s in ledger),
        f"{m}num_requests_running": 0,
        f"{m}num_requests_waiting": 0,
    }
    return out


def check(server: ServerProcess, ledger: list[Sent], rejected: dict[str, int], headers=None) -> dict:
    """Compare /metrics with the ledger and with the engine's own counters; returns the samples."""
    engine = wait_idle(server, headers)
    deadline = time.monotonic() + 10
    want = expected_from(ledger)
    while True:  # an abort's statistics reach the loggers with the engine's next turn
        got = scrape(server, headers)
        if got.get("llmserve:request_success_total[abort]") == want["llmserve:request_success_total[abort]"]:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    for name, value in want.items():
        assert got[name] == value, (name, got[name], value)
    for reason in ("validation", "auth", "not_found", "too_large", "queue_full", "unavailable"):
        assert got[f"llmserve:request_rejected_total[{reason}]"] == rejected.get(reason, 0), reason
    m = "llmserve:"
    assert got[f"{m}iteration_tokens_total_count"] == engine["num_steps"]
    assert got[f"{m}num_preemptions_total"] == engine["num_preemptions"]
    assert got[f"{m}prefix_cache_queries_total"] == engine["prefix_cache_queries"]
    assert got[f"{m}prefix_cache_hits_total"] == engine["prefix_cache_hits"]
    assert got[f"{m}kv_cache_usage_perc"] == 0.0
    for name in HISTOGRAMS:  # buckets are cumulative and end at the count
        assert got[f"{m}{name}_bucket"] == got[f"{m}{name}_count"], name
    # the token counters and the per-request histograms agree
    assert got[f"{m}request_generation_tokens_sum"] == got[f"{m}generation_tokens_total"]
    return got


def ids(start: int, length: int, vocab: int) -> list[int]:
    """`length` distinct-enough token ids (different `start`s give different prompts)."""
    return [(start * 7919 + i * 31) % (vocab - 10) + 5 for i in range(length)]


def test_metrics_account_for_completed_stopped_sampled_and_preempted_requests(
    servers: dict[str, ServerProcess],
) -> None:
    server = servers["pressured"]
    url = server.url
    ledger: list[Sent] = []

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(url + path, json={"model": MODEL_NAME, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    # two 24-token prompts x 40 tokens = 8 blocks each, in a pool of 10: one is preempted
    before = stats(server)
    r = post(
        "/v1/completions",
        {"prompt": [ids(1, 24, 512), ids(2, 24, 512)], "max_tokens": 40, "ignore_eos": True},
    )
    assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"]
    assert r["usage"]["completion_tokens"] == 80
    ledger += [Sent("length", 24, 40, 40), Sent("length", 24, 40, 40)]
    assert stats(server)["num_preemptions"] > before["num_preemptions"]

    # a forced token that is also a stop token: finished by "stop" after one token
    r = post("/v1/completions", {"prompt": ids(3, 10, 512), "max_tokens": 20, "logit_bias": {"77": 100},
                                 "stop_token_ids": [77]})  # fmt: skip
    assert r["choices"][0]["finish_reason"] == "stop"
    ledger.append(Sent("stop", 10, r["usage"]["completion_tokens"], 20))

    # n = 3: three sequences, each counted as a request (as vLLM counts them)
    r = post("/v1/completions", {"prompt": ids(4, 12, 512), "max_tokens": 5, "n": 3, "temperature": 1.0,
                                 "seed": 1, "ignore_eos": True})  # fmt: skip
    assert r["usage"]["completion_tokens"] == 15
    ledger += [Sent("length", 12, 5, 5, n=3)] * 3

    # a streamed chat request
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    ledger.append(Sent("length", usage["prompt_tokens"], 6, 6))

    got = check(server, ledger, rejected={})
    assert got["llmserve:num_preemptions_total"] > 0
    assert got["llmserve:prefix_cache_hits_total"] > 0  # the n = 3 samples share their prompt
    # labels in name order: block_size, cache_dtype, enable_prefix_caching, kv_bytes_per_token,
    # num_kv_blocks
    (info,) = (k for k in got if k.startswith("llmserve:cache_config_info"))
    assert info.startswith("llmserve:cache_config_info[8][float32][True][") and info.endswith("][10]"), info
    assert got[info] == 1
    # the periodic log line appeared while the engine was busy
    line = next(ln for ln in server.log().splitlines() if "engine: " in ln and "running" in ln)
    assert "waiting" in line and "KV cache" in line and "generation" in line, line


def test_metrics_account_for_aborted_and_rejected_requests(servers: dict[str, ServerProcess]) -> None:
    server = servers["busy"]
    vocab = 49152

    async def scenario() -> tuple[list[Any], dict[str, int]]:
        rejected: dict[str, int] = {}
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            first = asyncio.Event()

            async def blocker() -> list[Any]:
                body = {"model": MODEL_NAME, "prompt": ids(1, 8, vocab), "max_tokens": 200, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                events = []
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                            first.set()
                return events

            running = asyncio.create_task(blocker())
            await asyncio.wait_for(first.wait(), 60)
            # a second request waits for the only slot; a third finds the queue full
            body = {"model": MODEL_NAME, "prompt": ids(2, 9, vocab), "max_tokens": 5, "ignore_eos": True}
            waiting = asyncio.create_task(client.post("/v1/completions", json=body))
            while (await client.get("/stats")).json()["num_waiting"] < 1:
                await asyncio.sleep(0.01)
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 429, r.text
            rejected["queue_full"] = 1
            # the waiting client goes away: its request is aborted before it was ever scheduled
            waiting.cancel()
            while (await client.get("/stats")).json()["num_waiting"] > 0:
                await asyncio.sleep(0.01)
            assert not running.done(), "the blocker ended before the abort: the scenario lost its timing"
            # refused for every other reason
            bad = [
                ({"json": {**body, "temperature": -1}}, 400, "validation"),
                ({"content": b"{not json"}, 400, "validation"),
                ({"json": {**body, "model": "nope"}}, 404, "not_found"),
                ({"json": {**body, "prompt": "x" * 20000}}, 413, "too_large"),
                ({"json": body, "headers": {"Authorization": "Bearer wrong"}}, 401, "auth"),
            ]
            for kwargs, status, reason in bad:
                r = await client.post("/v1/completions", **kwargs)
                assert r.status_code == status, r.text
                rejected[reason] = rejected.get(reason, 0) + 1
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as anonymous:
                assert (await anonymous.get("/metrics")).status_code == 401  # the key guards it too
                rejected["auth"] += 1
            return await running, rejected

    events, rejected = asyncio.run(scenario())
    usage, timings = events[-1]["usage"], events[-1]["timings"]
    assert usage["completion_tokens"] == 200
    ledger = [
        Sent("length", 8, 200, 200),
        Sent("abort", 9, 0, 5, scheduled=False),
    ]
    check(server, ledger, rejected, AUTH)
    # --enable-response-timings: llama.cpp's timings in the last chunk
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"] == 8
    assert timings["predicted_n"] == 200
    assert timings["predicted_ms"] > 0 and timings["prompt_ms"] > 0
    assert timings["predicted_per_second"] == pytest.approx(199 / (timings["predicted_ms"] / 1000))


def test_response_timings_on_request(servers: dict[str, ServerProcess]) -> None:
    server = servers["pressured"]
    body = {"model": MODEL_NAME, "prompt": ids(9, 20, 512), "max_tokens": 7, "ignore_eos": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert "timings" not in plain  # off unless asked (or --enable-response-timings)
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "return_timings": True}, timeout=60).json()
    t, usage = r["timings"], r["usage"]
    assert t["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again
    assert t["prompt_n"] + t["cache_n"] == usage["prompt_tokens"] == 20
    assert t["predicted_n"] == usage["completion_tokens"] == 7
    assert t["predicted_ms"] >= 0 and t["prompt_ms"] >= 0 and t["queue_ms"] >= 0
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "ignore_eos": True, "stream": True, "return_timings": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and "usage" not in events[-1]
    assert events[-1]["timings"]["predicted_n"] == 3


def test_gauges_fall_to_zero_when_dropped_clients_leave_the_engine_idle(tiny_model_dir: Path) -> None:
    """Clients that drop their streams abort every request; with nothing left to step, the
    aborts themselves must publish fresh gauges (they kept the last step's values before)."""
    server = ServerProcess(tiny_model_dir, "--max-num-seqs", "4").start()
    try:

        async def drop_streams(n: int) -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

                async def one(i: int) -> None:
                    body = {"model": MODEL_NAME, "prompt": [5 + i, 17, 99], "max_tokens": 200,
                            "ignore_eos": True, "stream": True}  # fmt: skip
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                return  # the first token came: hang up mid-stream

                await asyncio.gather(*(one(i) for i in range(n)))

        asyncio.run(drop_streams(8))
        wait_idle(server)
        time.sleep(0.5)  # the loop records the aborts' stats right after /stats turns idle
        samples = scrape(server)
        assert samples["llmserve:num_requests_running"] == 0, samples
        assert samples["llmserve:num_requests_waiting"] == 0, samples
        assert samples["llmserve:kv_cache_usage_perc"] == 0, samples
        assert samples["llmserve:request_success_total[abort]"] >= 4  # at least every running one
    finally:
        server.stop()

"""`benchmark_serving`: an open-loop load generator for any OpenAI-compatible server.

    1. warm-ups: `num_warmups` requests (salted copies of the first prompts), not measured;
    2. each request is released at its arrival time (`arrival.send_times`), then waits for one of
       `max_concurrency` slots; TTFT and E2E are timed from when it got its slot;
    3. the summary (`stats.summarize`) covers the measured requests, from the first release to
       the last response.

One `aiohttp.ClientSession` carries every request, with as many connections as requests may be
in flight (client.py says why aiohttp). Does not know the server: only HTTP, so llmserve, vLLM and llama-server compare fairly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
from tqdm.auto import tqdm

from llmserve.bench.arrival import send_times
from llmserve.bench.client import ENDPOINT_PATHS, Endpoint, RequestRecord, build_body, send_request
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.stats import summarize
from llmserve.tokenizer import Tokenizer

logger = logging.getLogger("llmserve.bench")

DEFAULT_TIMEOUT_S = 6 * 3600.0  # a long generation at high load must not be cut by the client
KEEPALIVE_S = 4.0
READ_BUFSIZE = 2**20
"""Bytes aiohttp buffers per response; an SSE line (a chunk with many logprobs) may be twice this."""


@dataclass(slots=True)
class BenchmarkResult:
    """One run of `benchmark_serving`: its settings, summary metrics and per-request records."""

    base_url: str
    model: str
    endpoint: str
    max_concurrency: int | None
    request_rate: float
    burstiness: float
    num_warmups: int
    goodput: dict[str, float] | None
    metrics: dict[str, Any]
    """`stats.summarize` of the measured requests (completed, failed, throughputs, latencies)."""
    records: list[RequestRecord]
    date: str = field(default_factory=lambda: datetime.now().isoformat(timespec="seconds"))
    config: dict[str, Any] = field(default_factory=dict)
    """Free-form settings to keep with the result (the command line's arguments)."""

    def __getitem__(self, key: str) -> Any:
        return self.metrics[key]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, then the metrics at top level, then config and per-request records."""
        return {
            "date": self.date,
            "backend": "openai-" + self.endpoint,
            "base_url": self.base_url,
            "model": self.model,
            "endpoint": self.endpoint,
            "max_concurrency": self.max_concurrency,
            # JSON has no infinity; vLLM writes the string too
            "request_rate": self.request_rate if math.isfinite(self.request_rate) else "inf",
            "burstiness": self.burstiness,
            "num_prompts": len(self.records),
            "num_warmups": self.num_warmups,
            "goodput_slos_ms": self.goodput,
            **self.metrics,
            "config": self.config,
            "requests": [r.to_dict() for r in self.records],
        }


def _api_root(base_url: str) -> str:
    """`http://h:8000`, also when given `http://h:8000/v1` (the form OpenAI clients take)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _warmup_request(request: BenchRequest, i: int) -> BenchRequest:
    # a different first token, so a warm-up does not fill the prefix cache for the measured run
    if isinstance(request.prompt, str):
        return dataclasses.replace(request, prompt=f"warmup {i} {request.prompt}")
    return request


class _Sender:
    """Sends requests on one client, at most `max_concurrency` at a time."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        url: str,
        endpoint: Endpoint,
        tokenizer: Tokenizer | None,
        max_concurrency: int | None,
    ) -> None:
        self.client, self.url, self.endpoint, self.tokenizer = client, url, endpoint, tokenizer
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(self, request: BenchRequest, body: dict[str, Any], t0: float) -> RequestRecord:
        if self._slots is None:
            return await self._send(request, body, t0)
        async with self._slots:  # timing starts inside: waiting for a slot is not server latency
            return await self._send(request, body, t0)

    async def _send(self, request: BenchRequest, body: dict[str, Any], t0: float) -> RequestRecord:
        return await send_request(self.client, self.url, body, request, self.endpoint, self.tokenizer, t0)


async def _warm_up(sender: _Sender, requests: list[BenchRequest], bodies: list[dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    done = await asyncio.gather(*(sender.send(r, b, t0) for r, b in zip(requests, bodies, strict=True)))
    failed = [r.error for r in done if not r.success]
    if failed:
        logger.warning("%d of %d warm-up requests failed: %s", len(failed), len(requests), failed[0])


async def _timed_run(
    sender: _Sender,
    requests: Sequence[BenchRequest],
    bodies: list[dict[str, Any]],
    offsets: list[float],
    progress: bool,
) -> tuple[list[RequestRecord], float]:
    """Release each request at its offset from the start; (records in request order, duration)."""
    bar = tqdm(total=len(requests), desc="Benchmark", unit="req", disable=not progress)
    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []
    for request, body, offset in zip(requests, bodies, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(sender.send(request, body, start))
        task.add_done_callback(lambda _: bar.update(1))
        tasks.append(task)
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return records, duration


async def benchmark_serving(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    endpoint: str = "completions",
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
    goodput: dict[str, float] | None = None,
    num_warmups: int = 0,
    tokenizer: Tokenizer | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> BenchmarkResult:
    """Send `requests` to the server at `base_url` and measure them.

    `tokenizer` counts output tokens when the server sends no usage. Failed requests are counted in the result, not raised; bad arguments raise
    ValueError before anything is sent.
    """
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {sorted(ENDPOINT_PATHS)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if num_warmups < 0:
        raise ValueError(f"num_warmups must be >= 0, got {num_warmups}")
    if not requests:
        raise ValueError("no requests to send")
    ep: Endpoint = endpoint  # type: ignore[assignment]
    url = _api_root(base_url) + ENDPOINT_PATHS[ep]
    bodies = [build_body(ep, model, r, ignore_eos=ignore_eos, temperature=temperature) for r in requests]
    offsets = send_times(len(requests), request_rate, burstiness, seed)  # validates rate, burstiness

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = aiohttp.ClientSession(
        headers=headers,
        # 0: no limit; idle connections dropped before a server's own idle timeout drops them
        # (cpp-httplib's, llama-server's, is 5 s), client.py retries the rest
        connector=aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        read_bufsize=READ_BUFSIZE,
    )
    async with client:
        sender = _Sender(client, url, ep, tokenizer, max_concurrency)
        if num_warmups:
            warm = [_warmup_request(requests[i % len(requests)], i) for i in range(num_warmups)]
            warm_bodies = [
                build_body(ep, model, r, ignore_eos=ignore_eos, temperature=temperature) for r in warm
            ]
            await _warm_up(sender, warm, warm_bodies)
        records, duration = await _timed_run(sender, requests, bodies, offsets, progress)

    return BenchmarkResult(
        base_url=base_url,
        model=model,
        endpoint=endpoint,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        num_warmups=num_warmups,
        goodput=goodput,
        metrics=summarize(records, duration, goodput),
        records=records,
    )

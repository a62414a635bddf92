"""Serving overhead: the HTTP server against the offline engine, same workload, same machine.

    python benchmarks/bench_serving.py [--concurrency 1 4 16 32] [--prompt-len 128] [--output-len 128]

For each concurrency level c, a closed loop keeps c requests in flight until `--requests-per-level`
(default max(8, 2c)) have completed, twice on the embedded model:
  - offline: `LLMEngine` in this process (add_request / step), TTFT from the engine's own timestamps;
  - server:  `llmserve serve` in a subprocess, streaming /v1/completions over HTTP (httpx), TTFT =
             time to the first streamed token chunk as the client sees it.
Prompts are random token ids (distinct per request, so nothing hits the prefix cache); greedy,
EOS ignored, so both produce exactly `--output-len` tokens per request. Reported: output tokens/s
and median TTFT for each, and the serving overhead = 1 - server/offline throughput.
Writes benchmarks/results/bench_serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"


def make_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run_offline(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict[str, float]:
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pending = list(enumerate(prompts))
    ttft, produced, in_flight = [], 0, 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"off-{concurrency}-{i}", prompt, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                produced += len(out.outputs[0].token_ids)
                m = out.metrics
                ttft.append(m.first_token_time - m.arrival_time)
    elapsed = time.perf_counter() - start
    return {"output_tok_s": produced / elapsed, "ttft_median_s": statistics.median(ttft), "seconds": elapsed}


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int) -> tuple[float, int]:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    assert first is not None
    return first, tokens


async def run_server(
    base_url: str, prompts: list[list[int]], concurrency: int, output_len: int
) -> dict[str, float]:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttft: list[float] = []
    produced = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal produced
        while not queue.empty():
            prompt = queue.get_nowait()
            first, tokens = await _one(client, f"{base_url}/v1/completions", prompt, output_len)
            ttft.append(first)
            produced += tokens

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"output_tok_s": produced / elapsed, "ttft_median_s": statistics.median(ttft), "seconds": elapsed}


def start_server(port: int, max_num_seqs: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmserve.cli.main", "--log-level", "WARNING", "serve", "--port", str(port),
           "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs), "--max-queued-requests", "-1"]  # fmt: skip
    return wait_healthy(subprocess.Popen(cmd), port)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 300) -> subprocess.Popen:
    """`proc` once the server it runs answers /health with 200 (it is stopped if it never does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-level", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from llmserve.engine.llm import build_engine

    engine = build_engine(max_num_seqs=args.max_num_seqs, show_progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(port, args.max_num_seqs)
    base_url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for c in args.concurrency:
            n = args.requests_per_level or max(8, 2 * c)
            # distinct prompts per level and per side: no prefix-cache hit anywhere
            off = run_offline(engine, make_prompts(n, args.prompt_len, args.seed + 2 * c, engine.vocab_size), c,
                              args.output_len)  # fmt: skip
            srv = asyncio.run(run_server(base_url, make_prompts(n, args.prompt_len, args.seed + 2 * c + 1,
                                                                engine.vocab_size), c, args.output_len))  # fmt: skip
            row = {
                "concurrency": c,
                "requests": n,
                "offline": off,
                "server": srv,
                "overhead": 1 - srv["output_tok_s"] / off["output_tok_s"],
            }
            rows.append(row)
            print(
                f"c={c:3d}  offline {off['output_tok_s']:7.1f} tok/s  TTFT {off['ttft_median_s']:.3f} s | "
                f"server {srv['output_tok_s']:7.1f} tok/s  TTFT {srv['ttft_median_s']:.3f} s | "
                f"overhead {100 * row['overhead']:+.1f}%",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(60)
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "levels": rows}
    (RESULTS / "bench_serving.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

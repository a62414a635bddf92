"""Several models behind one server (issue 13): what routing costs a request, and what a model
swap costs, on the embedded model. Each figure comes with its baseline from the same run.

    python benchmarks/bench_models.py [--requests 200] [--swaps 6]

1. lease (in process): `ModelManager.lease()` on a loaded model - name resolution, the load
   check and the in-use count, i.e. all the routing a request gets - timed over many calls,
   against an empty `async with` as the baseline.
2. routing over HTTP: the same tiny requests (/tokenize, and a 1-token completion), interleaved,
   to a server of 1 model and a server of 16 (one loaded): the medians should not differ.
3. the openai engine: the same 8-token completion sent straight to an llmserve upstream and
   through a second llmserve that proxies it, interleaved: the median added latency.
4. swaps: two names for the model under --max-loaded-models 1; a request to the other name
   unloads one and loads the other. Its latency, against the same request to the loaded model;
   the server's own load time (llmserve:model_load_seconds) splits load from the rest.

Results go to benchmarks/results/models-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, server_process

RESULTS = Path(__file__).resolve().parent / "results"
LOGS = RESULTS / "logs"
ENGINE = ["--kv-cache-memory", "256MiB", "--max-num-seqs", "4", "--stats-log-interval", "0"]


def serve(models: list[str], *flags: str, name: str):
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve.cli.main", "serve", *models, "--port", str(port), *ENGINE, *flags]
    return server_process(cmd, port, LOGS / f"models-{name}.log")


def timed(client: httpx.Client, url: str, body: dict) -> float:
    start = time.perf_counter()
    r = client.post(url, json=body, timeout=600)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed


def lease_cost(calls: int) -> dict[str, float]:
    """Microseconds per lease on a loaded model, and per empty `async with` (the baseline)."""
    import contextlib

    from llmserve.config import ServerConfig
    from llmserve.config.models import ModelSpec
    from llmserve.server.models import ModelManager

    async def run() -> dict[str, float]:
        specs = [ModelSpec(f"m{i}:latest", preload=i == 0) for i in range(16)]
        manager = ModelManager(specs, ServerConfig(), {"kv_cache_memory": 64 * 2**20, "show_progress": False})
        await manager.ensure_loaded(manager.slots[0])

        @contextlib.asynccontextmanager
        async def nothing():
            yield None

        out = {}
        for label, make in (("empty", nothing), ("lease", lambda: manager.lease("m0"))):
            best = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(calls):
                    async with make():
                        pass
                best.append((time.perf_counter() - start) / calls * 1e6)
            out[label] = statistics.median(best)
        await manager.close()
        return out

    return asyncio.run(run())


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="requests per side for the HTTP comparisons")
    p.add_argument("--swaps", type=int, default=6)
    p.add_argument("--lease-calls", type=int, default=20000)
    args = p.parse_args()
    report: dict = {"command": " ".join(sys.argv)}

    lease = lease_cost(args.lease_calls)
    report["lease_us"] = lease
    print(f"lease: {lease['lease']:.1f} us per request (empty async with: {lease['empty']:.1f} us)")

    many = [f"m{i}=smollm2-135m-instruct" for i in range(16)]
    with (
        serve(["m0=smollm2-135m-instruct"], name="one") as (one, _),
        serve(many, name="sixteen") as (sixteen, _),
        httpx.Client() as client,
    ):
        for route, body in (
            ("/tokenize", {"model": "m0", "prompt": "Hello there, how are you?"}),
            ("/v1/completions", {"model": "m0", "prompt": "Hello there", "max_tokens": 1, "temperature": 0}),
        ):
            times: dict[str, list[float]] = {"1 model": [], "16 models": []}
            for _ in range(args.requests):
                for label, url in (("1 model", one), ("16 models", sixteen)):
                    times[label].append(timed(client, url + route, body))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            report[f"http {route}"] = {"median_ms": med, "ratio": med["16 models"] / med["1 model"]}
            print(
                f"{route}: median {med['1 model']:.2f} ms (1 model) vs {med['16 models']:.2f} ms (16 models)"
            )

    with serve(["up=smollm2-135m-instruct"], name="upstream") as (upstream, _):
        config = RESULTS / "logs" / "models-proxy.yaml"
        config.write_text(f"models:\n  - name: up\n    engine: openai\n    source: {upstream}/v1\n")
        with serve([], "--config", str(config), name="proxy") as (proxy, _), httpx.Client() as client:
            body = {
                "model": "up",
                "prompt": "Hello there",
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            }
            times = {"direct": [], "proxied": []}
            for _ in range(args.requests):
                for label, url in (("direct", upstream), ("proxied", proxy)):
                    times[label].append(timed(client, url + "/v1/completions", body))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            report["openai engine"] = {"median_ms": med, "added_ms": med["proxied"] - med["direct"]}
            print(f"openai engine: {med['direct']:.2f} ms direct, {med['proxied']:.2f} ms proxied")

    two = ["a=smollm2-135m-instruct", "b=smollm2-135m-instruct"]
    with serve(two, "--max-loaded-models", "1", name="swap") as (url, _), httpx.Client() as client:
        body = {"prompt": "Hello there", "max_tokens": 1, "temperature": 0}
        warm, swap = [], []
        current = "a"
        sum0 = metric_sum(url, "llmserve:model_load_seconds_sum")  # the preload's, left out
        count0 = metric_sum(url, "llmserve:model_load_seconds_count")
        for _ in range(args.swaps):
            for _ in range(3):
                warm.append(timed(client, url + "/v1/completions", {**body, "model": current}))
            current = "b" if current == "a" else "a"
            swap.append(timed(client, url + "/v1/completions", {**body, "model": current}))
        loads = metric_sum(url, "llmserve:model_load_seconds_sum") - sum0
        count = metric_sum(url, "llmserve:model_load_seconds_count") - count0
        med_warm, med_swap = statistics.median(warm), statistics.median(swap)
        report["swap"] = {
            "warm_request_s": med_warm,
            "swap_request_s": med_swap,
            "swap_minus_warm_s": med_swap - med_warm,
            "mean_load_s": loads / count,
            "swaps": swap,
        }
        print(
            f"swap: request {med_swap:.2f} s (warm {med_warm * 1e3:.1f} ms); the load itself {loads / count:.2f} s "
            f"(mean of {count:.0f})"
        )

    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"models-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

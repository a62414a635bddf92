"""Where Ray Serve's ingress spends a request: one configuration of the llmserve application on a
local Ray cluster, `--requests` one-token completions one at a time, the median wall time and the
CPU time each kind of process (Serve's proxy, HAProxy and its manager actor, the ingress, the
engine replicas, Ray's own daemons) spent per request.

    python benchmarks/bench_ray_ingress.py [--model M] [--replicas 2] [--requests 200]
        [--front direct|haproxy|serve] [--env NAME=VALUE ...]

CPU time per request is the figure to compare between configurations on a shared machine (other
jobs stretch wall times, not the CPU a request costs); the wall median is indicative. `--front`
(llmserve serve's --ray-http-proxy): `serve` (the default here) Serve's Python proxy before the
ingress, `haproxy` (or `--haproxy`) HAProxy before it (ray_serve/env.py's HAPROXY_ENV), `direct`
HAProxy asking the prefix router, then the replica (DIRECT_ENV, ray_serve/direct.py);
`--env` sets Ray Serve's environment flags for every Ray process (e.g.
RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0). Prints one JSON object, its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import httpx
import psutil

from compare import free_port  # benchmarks/ is the script's folder, on sys.path

KINDS = (
    "HAProxyManager",
    "ProxyActor",
    "haproxy",
    "Ingress",
    "PrefixRouter",
    "EngineReplica",
    "ServeController",
    "raylet",
    "gcs_server",
)


def _kind(proc: psutil.Process) -> str | None:
    try:
        text = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return None
    return next((k for k in KINDS if k in text), None)


def _cpu_by_pid() -> dict[int, tuple[str, float]]:
    """(kind, seconds of CPU used so far) of every process this script's Ray cluster runs (its
    descendants: the machine may run other Ray clusters)."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        kind = _kind(proc)
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        if kind is not None:
            out[proc.pid] = (kind, t.user + t.system)
    return out


def _cpu_per_request(before: dict, after: dict, n: int) -> dict[str, float]:
    """CPU ms per request by kind of process, from two `_cpu_by_pid` readings."""
    out: dict[str, float] = defaultdict(float)
    for pid, (kind, seconds) in after.items():
        out[kind] += 1e3 * (seconds - before.get(pid, (kind, 0.0))[1]) / n
    return {k: round(v, 3) for k, v in sorted(out.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--front", choices=("direct", "haproxy", "serve"), default="serve")
    p.add_argument("--haproxy", action="store_true", help="the same as --front haproxy")
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE flags for every Ray process")
    args = p.parse_args()
    for item in args.env:
        name, _, value = item.partition("=")
        os.environ[name] = value

    front = "haproxy" if args.haproxy else args.front
    from llmserve.ray_serve.env import DIRECT_ENV, HAPROXY_ENV

    os.environ.update({"direct": DIRECT_ENV, "haproxy": HAPROXY_ENV, "serve": {}}[front])  # before Ray
    import ray
    from ray import serve

    from llmserve.ray_serve import app

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    options = {"num_replicas": str(args.replicas), "replica_cpus": "1", "torch_threads": "1",
               "front": "direct" if front == "direct" else "ingress"}  # fmt: skip
    if args.model:
        options["model"] = args.model
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app({**options, "served_model_name": "m"}), name="bench", route_prefix="/")
        body = {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            for _ in range(20):  # warm-up (and HAProxy learning the ingress replica)
                client.post("/v1/completions", json=body).raise_for_status()
            before = _cpu_by_pid()
            times = []
            for _ in range(args.requests):
                started = time.perf_counter()
                client.post("/v1/completions", json=body).raise_for_status()
                times.append(time.perf_counter() - started)
            after = _cpu_by_pid()
    finally:
        serve.shutdown()
        ray.shutdown()
    cpu = _cpu_per_request(before, after, args.requests)
    report = {
        "front": front, "env": args.env, "requests": args.requests,
        "latency_median_ms": round(1e3 * statistics.median(times), 3),
        "latency_p10_ms": round(1e3 * statistics.quantiles(times, n=10)[0], 3),
        "cpu_ms_per_request": cpu, "cpu_ms_per_request_total": round(sum(cpu.values()), 3),
        "load_average": os.getloadavg(),
    }  # fmt: skip
    print(json.dumps(report))  # one line, the last (Ray logs to stdout too)


if __name__ == "__main__":
    main()

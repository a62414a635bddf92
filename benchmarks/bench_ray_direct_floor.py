"""The floor of Ray Serve's direct front: what HAProxy and Serve's direct ingress cost a request
before llmserve does anything, and what asking an ingress request router (the Lua call to
/internal/route, llmserve's `PrefixRouter` hop) adds.

    python benchmarks/bench_ray_direct_floor.py [--requests 300] [--replicas 2]

One local Ray cluster in HAProxy mode with body forwarding (ray_serve/env.py's DIRECT_ENV), two
applications of a trivial FastAPI deployment (it reads the body and names its replica), alternated
request by request: `direct` (HAProxy -> a replica, by HAProxy's leastconn) and `routed` (HAProxy
asks a trivial router deployment, which picks a replica with `choose_replica(_reserve=False)` as
llmserve's PrefixRouter does, then HAProxy -> that replica). Medians and p10 of the wall time of
one small POST each, and the router's own time per request (`time.perf_counter_ns` inside it, from
the body read to its answer). Prints one JSON object.
"""

import argparse
import json
import os
import statistics
import time

from fastapi import FastAPI, Request

from compare import free_port  # benchmarks/ is the script's folder, on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--replicas", type=int, default=2)
    args = p.parse_args()
    from llmserve.ray_serve.env import DIRECT_ENV

    os.environ.update(DIRECT_ENV)  # before Ray is imported: it reads them once
    import httpx
    import ray
    from ray import serve

    echo_api, router_api = FastAPI(), FastAPI()

    @serve.deployment(num_replicas=args.replicas, ray_actor_options={"num_cpus": 0.5})
    @serve.ingress(echo_api)
    class Echo:
        @echo_api.post("/v1/completions")
        async def complete(self, request: Request) -> dict[str, str]:
            await request.body()
            return {"replica": serve.get_replica_context().replica_id.unique_id}

    @serve.deployment(ray_actor_options={"num_cpus": 0.25})
    @serve.ingress(router_api)
    class Router:
        def __init__(self, echo) -> None:
            self.echo = echo
            self.times_ns: list[int] = []

        @router_api.post("/internal/route")
        async def route(self, request: Request) -> dict[str, str]:
            started = time.perf_counter_ns()
            await request.body()
            async with self.echo.choose_replica(_reserve=False) as picked:
                replica_id = picked._replica.replica_id.to_full_id_str()
            self.times_ns.append(time.perf_counter_ns() - started)
            return {"replica_id": replica_id}

        @router_api.get("/internal/times")
        async def times(self) -> list[int]:
            return self.times_ns

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Echo.options(name="Echo").bind(), name="direct", route_prefix="/direct")
        routed = Echo.options(name="Echo").bind()
        serve.run(
            routed._with_ingress_request_router(Router.bind(routed)), name="routed", route_prefix="/routed"
        )
        report = measure(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30), args.requests)
        router = serve.get_deployment_handle("Router", "routed")
        times = router.times.remote().result()
        report["router_own_median_us"] = statistics.median(times) / 1e3 if times else None
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(report, indent=2))


def measure(client, n: int) -> dict[str, object]:
    """`n` requests to each application, alternating; wall-time medians and p10 in ms."""
    body = {"prompt": "Hi", "max_tokens": 1}
    lat: dict[str, list[float]] = {"direct": [], "routed": []}
    replicas: dict[str, set[str]] = {"direct": set(), "routed": set()}
    for i in range(n + 20):
        for name in lat:
            started = time.perf_counter()
            r = client.post(f"/{name}/v1/completions", json=body)
            elapsed = time.perf_counter() - started
            r.raise_for_status()
            replicas[name].add(r.json()["replica"])
            if i >= 20:  # warm-up
                lat[name].append(elapsed)
    out: dict[str, object] = {}
    for name, times in lat.items():
        out[f"{name}_median_ms"] = 1e3 * statistics.median(times)
        out[f"{name}_p10_ms"] = 1e3 * statistics.quantiles(times, n=10)[0]
        out[f"{name}_replicas"] = len(replicas[name])
    out["router_hop_ms"] = out["routed_median_ms"] - out["direct_median_ms"]  # type: ignore[operator]
    return out


if __name__ == "__main__":
    main()

"""llmserve on Ray Serve against one plain server of the same model: the latency the ingress adds
per request (target: <= 3 ms) and the prefix-cache hit rate of a shared-prefix workload over the
replicas (target: >= 90% of one replica's).

    python benchmarks/bench_ray_serve.py [--model M] [--replicas 2] [--requests 200] [--groups 8]
        [--per-group 8] [--ray-http-proxy direct|haproxy|serve] [-- SERVER ARGS ...]

Both setups run at once, each in a subprocess: `llmserve serve` (the replica's app served directly
by uvicorn) and `llmserve serve --replicas N` (a local Ray cluster: the front `--ray-http-proxy`
names, then the replicas). Latency: `--requests` completions of one token from a short prompt, one at a time,
alternating between the two servers, so that a machine whose load drifts (a shared one) weighs on
both alike, each round in the next order of the servers (median and p90; the difference of the
medians is the ingress's cost; `latency_median_ms_after`: the medians by the server asked just
before). With the direct
front, the replica that front sends the probe to is also asked at its own port in the same rotation
(`replica_direct`, `ingress_added_vs_replica_ms`: the front's cost against that replica served
directly, the issue's baseline; the plain server is another process on the same cores). Then, on each
server in turn, the shared-prefix workload: `--groups` long prefixes, `--per-group` requests each with their own
question, sent round-robin over the groups, `--concurrency` at a time; hit rate = cached prompt tokens / prompt tokens (from
each answer's usage). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench_serving import wait_healthy  # benchmarks/ is the script's folder, on sys.path

WORDS = [
    "river",
    "stone",
    "lantern",
    "orchard",
    "copper",
    "meadow",
    "harbor",
    "violet",
    "thunder",
    "pepper",
    "canyon",
    "ember",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: argparse.Namespace, extra: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    """The server's process (not yet ready) and its port."""
    port = _free_port()
    cmd = [sys.executable, "-m", "llmserve.cli.main", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--served-model-name", "m", *extra, *args.server_args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=os.environ)  # noqa: SIM115
    return proc, port


def _latencies(clients: list[httpx.Client], n: int) -> tuple[list[list[float]], list[dict[int, list[float]]]]:
    """`n` one-token completions per client, sent in turn to each (one at a time), the order of
    each round the next of all the clients' orders: every server follows every other equally
    often. A fixed order (plain, Ray, replica) measured the Ray front right after the plain server,
    whose engine's OpenMP worker still spins on one of the 2 cores when the next request starts,
    and the replica right after the front had warmed that same replica. Also each client's times
    by the client that went before (its index)."""
    body = {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    for _ in range(5):  # warm-up
        for client in clients:
            client.post("/v1/completions", json=body).raise_for_status()
    out: list[list[float]] = [[] for _ in clients]
    after: list[dict[int, list[float]]] = [{} for _ in clients]
    orders = list(itertools.permutations(range(len(clients))))
    previous = -1
    for i in range(n):
        for c in orders[i % len(orders)]:
            started = time.perf_counter()
            clients[c].post("/v1/completions", json=body).raise_for_status()
            out[c].append(time.perf_counter() - started)
            after[c].setdefault(previous, []).append(out[c][-1])
            previous = c
    return out, after


def _replica_client(ray_client: httpx.Client) -> httpx.Client | None:
    """The direct front only: a client of the engine replica the Ray front sends the latency
    probe to, at the replica's own HTTP port (Ray Serve's direct-ingress target): "the replica
    served directly", the issue's baseline. Found through the Serve controller of the local
    cluster the Ray server started, matched by the replica header both answer with; None when no
    target answers."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    from llmserve.ray_serve.replica import REPLICA_HEADER

    body = {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    routed = ray_client.post("/v1/completions", json=body).headers.get(REPLICA_HEADER)
    ray.init(address="auto", namespace=SERVE_NAMESPACE, log_to_driver=False)
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        # the replicas' own ports (without the flag: the proxy's)
        groups = ray.get(controller.get_target_groups.remote(from_proxy_manager=True))
    finally:
        ray.shutdown()
    for target in (t for g in groups if str(g.protocol).endswith("HTTP") for t in g.targets):
        for host in (target.ip, "127.0.0.1"):  # a replica binds the server's --host
            client = httpx.Client(base_url=f"http://{host}:{target.port}", timeout=120)
            try:
                if client.post("/v1/completions", json=body).headers.get(REPLICA_HEADER) == routed:
                    return client
            except httpx.HTTPError:
                pass
            client.close()
    return None


def _prefix(group: int, num_words: int) -> str:
    return " ".join(WORDS[(group * 7 + i * (group + 1)) % len(WORDS)] for i in range(num_words))


def _hit_rate(client: httpx.Client, args: argparse.Namespace) -> dict[str, float]:
    def one(i: int, g: int) -> dict[str, int]:
        messages = [{"role": "system", "content": _prefix(g, args.prefix_words)},
                    {"role": "user", "content": f"Question {i} about group {g}?"}]  # fmt: skip
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 1})
        r.raise_for_status()
        return r.json()["usage"]

    # round-robin over the groups, `--concurrency` requests in flight (the router's busy rule can act)
    order = [(i, g) for i in range(args.per_group) for g in range(args.groups)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        usages = list(pool.map(lambda ig: one(*ig), order))
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt}


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(2)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _summary(lat: list[float]) -> dict[str, object]:
    return {
        "latency_median_ms": 1e3 * statistics.median(lat),
        "latency_p90_ms": 1e3 * statistics.quantiles(lat, n=10)[-1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=4, help="shared-prefix requests in flight at once")
    p.add_argument("--ray-http-proxy", choices=("direct", "haproxy", "serve"), default="direct",
                   help="the Ray server's front (llmserve serve's --ray-http-proxy)")  # fmt: skip
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: flags for both servers")
    args = p.parse_args()
    args.server_args = [a for a in args.server_args if a != "--"]
    logs = Path(tempfile.mkdtemp(prefix="bench-ray-serve-"))
    clients: list[httpx.Client] = []
    ray_flags = ["--replicas", str(args.replicas), "--replica-cpus", str(args.replica_cpus),
                 "--ray-http-proxy", args.ray_http_proxy]  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        for name, extra in (("plain", []), ("ray", ray_flags)):
            proc, port = _start(args, extra, logs / f"{name}.log")
            procs.append(proc)  # stopped below even if it never gets ready (or ^C meanwhile)
            wait_healthy(proc, port, timeout=600)
            clients.append(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120))
        replica = _replica_client(clients[1]) if args.ray_http_proxy == "direct" else None
        probes = clients if replica is None else [*clients, replica]
        latencies, after = _latencies(probes, args.requests)
        plain, ray, *direct = (_summary(lat) for lat in latencies)
        names = ["plain", "ray", "replica_direct"]
        for summary, by_previous in zip((plain, ray, *direct), after, strict=True):
            summary["latency_median_ms_after"] = {
                names[p]: 1e3 * statistics.median(t) for p, t in by_previous.items() if p >= 0
            }
        if replica is not None:
            replica.close()
        plain.update(_hit_rate(clients[0], args))
        ray.update(_hit_rate(clients[1], args))
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            _stop(proc)
    report = {
        "plain": plain,
        "ray": ray,
        "ray_http_proxy": args.ray_http_proxy,
        "ingress_added_ms": ray["latency_median_ms"] - plain["latency_median_ms"],  # type: ignore[operator]
        # the replica the front chose, served directly at its own port in the same rotation
        "replica_direct": direct[0] if direct else None,
        "ingress_added_vs_replica_ms": (
            ray["latency_median_ms"] - direct[0]["latency_median_ms"] if direct else None  # type: ignore[operator]
        ),
        # like with like: both just after the plain server (whose engine's spin both then share)
        "ingress_added_vs_replica_after_plain_ms": (
            ray["latency_median_ms_after"]["plain"] - direct[0]["latency_median_ms_after"]["plain"]  # type: ignore[index]
            if direct
            else None
        ),
        "hit_rate_ratio": ray["hit_rate"] / plain["hit_rate"] if plain["hit_rate"] else None,  # type: ignore[operator]
        "logs": str(logs),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

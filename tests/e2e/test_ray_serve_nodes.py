"""llmserve on Ray Serve over two Ray nodes, and an engine that dies inside a replica.

`ray.cluster_utils.Cluster` starts a head and a second node on this machine (separate raylets with
their own CPUs and node ids). Two replicas, at most one per node (`max_replicas_per_node=1`), each
a TP=2 engine whose worker rank is a Ray actor on the replica's own node (STRICT_PACK: the ranks
share memory). The replicas serve from both nodes; then one replica's TP worker process is killed
mid-stream: its engine dies, its stream ends with an error event and [DONE], the other replica's
stream goes on, new requests are answered (by the survivor, the ingress retrying any that reach the
dead engine's replica), its health check fails and Ray starts a new replica on the freed node,
which serves."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

pytest.importorskip("ray.serve")

import ray
from ray import serve
from ray._private import ray_constants
from ray.cluster_utils import Cluster

from tests.e2e.conftest import free_port
from tests.models.tiny import make_tiny_model_eos0
from tests.ray_start import start_two_nodes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

APP = "llm-nodes"
MODEL = "tiny-ray-nodes"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    """Two nodes of 2 Ray CPUs: a replica (0.5), its TP worker (1) and, on one of them, the
    ingress (0.25); a third replica fits on neither (one per node)."""
    folder = tmp_path_factory.mktemp("tiny-ray-nodes")
    make_tiny_model_eos0(folder)  # a 2048-token context: room for a long stream
    cluster = start_two_nodes(num_cpus=2, log_to_driver=False)
    port = free_port()
    args = {
        "front": "ingress", "model": str(folder), "served_model_name": MODEL, "num_replicas": "2",
        "max_replicas_per_node": "1",
        "replica_cpus": "0.5", "ingress_cpus": "0.25", "torch_threads": "1", "num_kv_blocks": "512",
        "max_num_seqs": "8", "tensor_parallel_size": "2", "threads_per_rank": "1",
        "distributed_executor_backend": "ray", "ray_placement_strategy": "STRICT_PACK",
    }  # fmt: skip
    try:
        from llmserve.ray_serve import app

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(args), name=APP, route_prefix="/")
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r


def served_by(r: httpx.Response) -> tuple[str, str]:
    """(replica id, node id) of an answer."""
    return r.headers["x-llmserve-replica"], r.headers["x-llmserve-node"]


def test_replicas_spread_over_two_nodes(cluster) -> None:
    _, url = cluster
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    # prompts shorter than a KV block carry no prefix key: the router spreads them by load
    seen = {served_by(complete(url, f"hi {i}")) for i in range(12)}
    assert len(seen) == 2, seen
    assert {node for _, node in seen} == nodes  # one replica on each node


def worker_pids(cluster: Cluster, node_id: str) -> list[int]:
    """The TP worker actors' processes that `node_id`'s raylet started (this test's cluster only)."""
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    return [
        p.pid for p in raylet.children(recursive=True) if any("TPWorkerActor" in part for part in p.cmdline())
    ]


def open_stream(client: httpx.Client, url: str, prompt: str) -> tuple[httpx.Response, Iterator[str]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    r = client.send(client.build_request("POST", f"{url}/v1/completions", json=body), stream=True)
    assert r.status_code == 200
    lines = (line[5:].strip() for line in r.iter_lines() if line.startswith("data:"))
    for _ in range(3):  # the engine is producing it
        assert "error" not in json.loads(next(lines))
    return r, lines


def test_an_engine_dying_inside_a_replica(cluster) -> None:
    cluster_, url = cluster
    with httpx.Client(timeout=60) as client:
        # 1. a running stream on each replica
        streams: dict[tuple[str, str], tuple[httpx.Response, Iterator[str]]] = {}
        for i in range(12):
            r, lines = open_stream(client, url, f"go {i}")
            if served_by(r) in streams:
                r.close()
            else:
                streams[served_by(r)] = (r, lines)
            if len(streams) == 2:
                break
        assert len(streams) == 2
        (victim, victim_node), (survivor, _) = sorted(streams)
        # 2. the victim's TP worker dies (as if the OOM killer took it)
        pids = worker_pids(cluster_, victim_node)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        started = time.monotonic()
        events = list(streams[victim, victim_node][1])
        assert time.monotonic() - started < 30
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "tensor-parallel worker rank 1" in error["message"] and "died" in error["message"], error
        assert len(events) < 1800
        # 3. the other replica's stream goes on; new requests are answered, none by the victim
        survivor_lines = streams[next(k for k in streams if k[0] == survivor)][1]
        for _ in range(5):
            assert "error" not in json.loads(next(survivor_lines))
        for response, _ in streams.values():
            response.close()
        answered = {served_by(complete(url, f"after {i}"))[0] for i in range(16)}
        assert victim not in answered
    # 4. its health check fails: Ray replaces it, on the node it freed, and the new replica serves
    deadline, replaced = time.monotonic() + 150, set()
    while not replaced and time.monotonic() < deadline:
        served = {served_by(complete(url, f"later {i}")) for i in range(4)}
        replaced = {(replica, node) for replica, node in served if replica not in (victim, survivor)}
        time.sleep(1)
    assert replaced and {node for _, node in replaced} == {victim_node}, replaced
    status = serve.status().applications[APP].deployments["EngineReplica"]
    assert status.replica_states.get("RUNNING", 0) == 2

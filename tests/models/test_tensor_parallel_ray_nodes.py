"""Tensor parallelism over Ray actors on several Ray nodes: `ray.cluster_utils.Cluster` starts a
head and a second node on this machine (separate raylets, each with its own CPU and node id), and
`ray_placement_strategy="STRICT_SPREAD"` puts the worker rank on the node the driver is not on.
Ranks on different nodes keep the group on gloo (the layer path, no fused decoder); greedy tokens
equal TP=1's. A cluster that cannot place the ranks is refused with a ValueError, at once when its
nodes are too few or too small, after the placement timeout when their CPUs are taken; a worker
actor killed on the other node stops the engine naming it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("ray")

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from llmserve import LLM
from llmserve.engine.llm import build_engine
from llmserve.model_executor import ray_workers
from tests.models.test_tensor_parallel import _run, check_killed_worker_stops_the_engine
from tests.models.tiny import make_tiny_model
from tests.ray_start import start_two_nodes

SPREAD = dict(
    tensor_parallel_size=2, threads_per_rank=1, distributed_executor_backend="ray",
    ray_placement_strategy="STRICT_SPREAD",
)  # fmt: skip


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    # one CPU per node: the driver (this process) on the head, the worker rank on the other
    cluster = start_two_nodes(num_cpus=1, log_to_driver=True)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def on_another_node(llm: LLM) -> None:
    executor = llm.engine.executor
    here = ray.get_runtime_context().get_node_id()
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2 and executor.workers.node_ids[0] in nodes - {here}
    assert executor.transport == "gloo" and not executor.workers.on_driver_node


def test_tp2_one_rank_per_node_matches_tp1(two_nodes, tmp_path) -> None:
    """int8: TP=1 runs the fused decoder; the ranks on two nodes run the layers over gloo (no
    shared segment between nodes) and give the same greedy tokens."""
    make_tiny_model("llama", tmp_path)
    ref_tokens, ref_lp, _ = _run(str(tmp_path), fused=True, quantization="int8")
    tp_tokens, tp_lp, _ = _run(
        str(tmp_path), fused=False, inspect=on_another_node, quantization="int8", **SPREAD
    )
    assert tp_tokens == ref_tokens
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=2e-3)


def test_a_cluster_that_cannot_place_the_ranks_is_refused(two_nodes, tmp_path, monkeypatch) -> None:
    make_tiny_model("llama", tmp_path)
    # too few nodes of 2 CPUs besides the driver's: refused before any placement is tried
    started = time.monotonic()
    with pytest.raises(
        ValueError, match=r"STRICT_SPREAD .* the Ray cluster has 0 such node\(s\) \(2 node\(s\)"
    ):
        build_engine(str(tmp_path), show_progress=False, **{**SPREAD, "threads_per_rank": 2})
    assert time.monotonic() - started < 10
    # the other node's CPU held by someone else: the placement times out with the same kind of error
    monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT_S", 3.0)
    here = ray.get_runtime_context().get_node_id()
    holder = placement_group([{"CPU": 1}], bundle_label_selector=[{"ray.io/node-id": f"!{here}"}])
    ray.get(holder.ready(), timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(
            ValueError,
            match=r"did not place 1 tensor-parallel worker\(s\) of 1 CPU\(s\) each \(STRICT_SPREAD\) within 3 s",
        ):
            build_engine(str(tmp_path), show_progress=False, **SPREAD)
        assert time.monotonic() - started < 15
    finally:
        remove_placement_group(holder)
    # the cluster is whole again: the refused engines left no placement group behind
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


def test_killed_worker_actor_on_another_node_stops_the_engine(two_nodes, tmp_path) -> None:
    def kill(workers) -> str:
        ray.kill(workers.actors[0])
        return rf"worker rank 1 \(Ray actor, pid {workers.pids[0]} on .*ActorDiedError"

    make_tiny_model("llama", tmp_path)
    check_killed_worker_stops_the_engine(
        str(tmp_path), kill, distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD"
    )

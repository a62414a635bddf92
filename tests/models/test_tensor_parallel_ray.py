"""Tensor parallelism over Ray actors (`distributed_executor_backend="ray"`) on a one-node Ray
cluster: the worker actor shares the driver's node, so the ranks use the shared-memory transport
and, on a quantized model, each runs the fused C++ decoder, as mp ranks do. TP=2 gives TP=1's greedy
tokens (logprobs within float tolerance) on a tiny Llama, float and int8; a killed worker actor
stops the engine with an error naming it, at once. Several nodes: test_tensor_parallel_ray_nodes.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("ray")

import ray

from llmserve import LLM
from tests.models.test_tensor_parallel import _run, check_killed_worker_stops_the_engine, compare_tp
from tests.models.tiny import make_tiny_model
from tests.ray_start import start_ray


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # one rank of one CPU besides the driver: the placement group fits a 2-core machine
    start_ray(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True))
    try:
        yield
    finally:
        ray.shutdown()


def on_driver_node(llm: LLM) -> None:
    executor = llm.engine.executor
    assert executor.workers.node_ids == [ray.get_runtime_context().get_node_id()]
    assert executor.transport == "shm"


def test_tp2_over_ray_actors_matches_tp1(local_ray, tmp_path) -> None:
    make_tiny_model("llama", tmp_path)
    compare_tp(str(tmp_path), backend="ray")
    # the engine's close ended its actors and removed their placement group (Ray frees it shortly)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


def test_ray_ranks_on_one_node_use_shared_memory_and_the_fused_decoder(local_ray, tmp_path) -> None:
    """int8: each rank's stack in the fused C++ decoder, summing over the shared segment, gives TP=1's
    greedy tokens (the mp backend's test_tp2_fused_decoder_matches_tp1, over Ray actors)."""
    make_tiny_model("llama", tmp_path)
    tp = dict(tensor_parallel_size=2, threads_per_rank=1, distributed_executor_backend="ray")
    ref_tokens, ref_lp, _ = _run(str(tmp_path), fused=True, quantization="int8")
    tp_tokens, tp_lp, _ = _run(str(tmp_path), fused=True, inspect=on_driver_node, quantization="int8", **tp)
    assert tp_tokens == ref_tokens
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=2e-3)


def test_killed_worker_actor_stops_the_engine(local_ray, tmp_path) -> None:
    def kill(workers) -> str:
        ray.kill(workers.actors[0])
        return rf"worker rank 1 \(Ray actor, pid {workers.pids[0]} on .*ActorDiedError"

    make_tiny_model("llama", tmp_path)
    check_killed_worker_stops_the_engine(str(tmp_path), kill, distributed_executor_backend="ray")

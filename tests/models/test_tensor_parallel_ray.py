"""Tensor parallelism over Ray actors (`distributed_executor_backend="ray"`) on a local Ray
cluster: TP=2 gives TP=1's greedy tokens (logprobs within float tolerance) on a tiny Llama, as the
mp backend does; a killed worker actor stops the engine with an error naming it, at once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("ray")

import ray

from tests.models.test_tensor_parallel import check_killed_worker_stops_the_engine, compare_tp
from tests.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # one rank of one CPU besides the driver: the placement group fits a 2-core machine
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()


def test_tp2_over_ray_actors_matches_tp1(local_ray, tmp_path) -> None:
    make_tiny_model("llama", tmp_path)
    compare_tp(str(tmp_path), backend="ray")
    # the engine's close ended its actors and removed their placement group (Ray frees it shortly)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


def test_killed_worker_actor_stops_the_engine(local_ray, tmp_path) -> None:
    def kill(workers) -> str:
        ray.kill(workers.actors[0])
        return rf"worker rank 1 \(Ray actor, pid {workers.pids[0]} on .*ActorDiedError"

    make_tiny_model("llama", tmp_path)
    check_killed_worker_stops_the_engine(str(tmp_path), kill, distributed_executor_backend="ray")

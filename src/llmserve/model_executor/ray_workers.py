"""`RayWorkers`: a tensor-parallel engine's ranks 1 .. N-1 as Ray actors (the `ray` executor
backend; `pip install 'llmserve[ray]'`).

    engine process (rank 0, the driver; a Ray driver or a Ray actor itself)
      placement group: N-1 bundles of `threads` CPUs (PACK: one node when it has room)
      actor per rank ──> TPWorkerActor.run(WorkerArgs) = tp_worker.serve_rank, as the mp backend
      every rank ──> the driver's TCP store (its node's address) ──> one gloo group

Only how the workers start and end differs from the mp backend (tp_executor.ProcessWorkers):
each rank runs `serve_rank` inside one long actor call, which returns when the driver says stop.
An actor that dies (killed, its node lost) closes its gloo sockets, which fails the driver's next
collective at once; its call's `ActorDiedError` then names it in the executor's error.

The driver joins the Ray cluster that is already up in its process (a Ray Serve replica, a
script's `ray.init`), else `ray.init()`, which joins the cluster in `RAY_ADDRESS` or starts a local
one. On several nodes every node needs llmserve installed, and gloo must find a reachable network
interface (`GLOO_SOCKET_IFNAME` names it when the default one is not).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from llmserve.config import ModelConfig
from llmserve.model_executor.tp_worker import WorkerArgs, serve_rank

PLACEMENT_TIMEOUT_S = 60.0
"""How long the placement group may wait for CPUs before start-up fails (Ray would wait forever)."""
EXIT_WAIT_S = 2.0
"""How long `dead` waits for a dying actor's call to end (its error names the cause)."""


class TPWorkerActor:
    """One worker rank (`ray.remote` is applied in `RayWorkers`, with the rank's CPUs)."""

    def describe(self) -> tuple[int, str]:
        """(this process's pid, its node's address)."""
        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, args: WorkerArgs) -> None:
        """The rank's whole life: returns once the driver says stop; RuntimeError when the rank
        failed (its error is in its log, which Ray forwards to the driver's)."""
        import logging

        logging.basicConfig(level=logging.WARNING, format=f"[tp rank {args.rank}] %(levelname)s %(message)s")
        if serve_rank(args) != 0:
            raise RuntimeError(f"tensor-parallel rank {args.rank} failed (its error is logged above)")


class RayWorkers:
    """The `Workers` of tp_executor.TPExecutor on Ray: one actor per rank in a placement group."""

    def __init__(self, port: int, size: int, model_config: ModelConfig, threads: int) -> None:
        if not ray.is_initialized():
            ray.init()
        num_workers = size - 1
        self.group: PlacementGroup = placement_group([{"CPU": threads}] * num_workers, strategy="PACK")
        self._finalizer = weakref.finalize(self, _end, [], self.group)
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            self._finalizer()
            raise ValueError(
                f"the Ray cluster has no room for {num_workers} tensor-parallel worker(s) of {threads} CPU(s) "
                f"each (cluster: {ray.cluster_resources().get('CPU', 0):g} CPUs); lower threads_per_rank or "
                "add nodes"
            ) from None
        actor = ray.remote(TPWorkerActor)
        self.actors = [
            actor.options(
                num_cpus=threads,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(num_workers)
        ]
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _end, self.actors, self.group)
        described = ray.get([a.describe.remote() for a in self.actors])
        self.pids = [pid for pid, _ in described]
        self.nodes = [node for _, node in described]
        # the store listens on every interface: workers on this node use loopback, others its address
        here = ray.util.get_node_ip_address()
        self.runs = [
            a.run.remote(
                WorkerArgs(
                    rank, size, port, model_config, threads, host="127.0.0.1" if node == here else here
                )
            )
            for rank, (a, node) in enumerate(zip(self.actors, self.nodes, strict=True), start=1)
        ]

    def exited(self) -> bool:
        ended, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        return bool(ended)

    def dead(self) -> list[str]:
        ended, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=EXIT_WAIT_S)
        out = []
        for rank, run in enumerate(self.runs, start=1):
            if run not in ended:
                continue
            try:
                ray.get(run)
                reason = "exited"
            except RayError as e:
                reason = _reason(e)
            out.append(
                f"rank {rank} (Ray actor, pid {self.pids[rank - 1]} on {self.nodes[rank - 1]}: {reason})"
            )
        return out

    def alive(self) -> bool:
        return not self.exited()

    def kill(self) -> None:
        self._finalizer()

    def close(self) -> None:
        # a rank told to stop returns from `run`; its process is ended with the rest either way
        ray.wait(self.runs, num_returns=len(self.runs), timeout=5.0)
        self._finalizer()


def _reason(e: RayError) -> str:
    text = str(e).strip().splitlines()
    return type(e).__name__ + (f": {text[0]}" if text else "")


def _end(actors: list[Any], group: PlacementGroup) -> None:
    if not ray.is_initialized():  # the cluster went first (interpreter exit): nothing left to end
        return
    for a in actors:
        with contextlib.suppress(RayError, ValueError):  # already gone
            ray.kill(a)
    with contextlib.suppress(RayError, ValueError):
        remove_placement_group(group)

"""`RayWorkers`: a tensor-parallel engine's ranks 1 .. N-1 as Ray actors (the `ray` executor
backend; `pip install 'llmserve[ray]'`).

    engine process (rank 0, the driver; a Ray driver or a Ray actor itself)
      placement group: N-1 bundles of `threads` CPUs (`ray_placement_strategy`, below)
      actor per rank ──> TPWorkerActor.run(WorkerArgs) = tp_worker.serve_rank, as the mp backend
      every rank ──> the driver's TCP store (its node's address) ──> one gloo group
      every rank on the driver's node ──> also the driver's shared-memory segment (distributed/shm.py)

Only how the workers start and end differs from the mp backend (tp_executor.ProcessWorkers):
the actors are placed first (`RayWorkers(...)`: their node ids known), then `start` runs
`serve_rank` in one long call per actor, which returns when the driver says stop. Where every
actor landed on the driver's Ray node (`on_driver_node`), the executor gives them the shared-memory
transport and each rank the fused C++ decoder, as with mp; a rank on another node keeps the group
on gloo. Ray's node id decides, not the address: several raylets on one host are separate nodes.

The placement strategy is Ray's (PACK by default). STRICT_SPREAD means one rank per node: the
workers' bundles are kept off the driver's node (a bundle label selector on `ray.io/node-id`).
STRICT_PACK puts them on one node, the driver's when it has room (Ray's soft target node). A
cluster that cannot hold the group is refused at once when its nodes' totals already say so (too
few nodes for STRICT_SPREAD, no node with `threads` CPUs), else after PLACEMENT_TIMEOUT_S of
waiting (the CPUs are taken): a ValueError either way, never a hang.

An actor that dies (killed, its node lost) closes its gloo sockets, or its pid vanishes for the
shared-memory waits, which fails the driver's next collective at once; its call's `ActorDiedError`
then names it in the executor's error.

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
from llmserve.config.parallel import RayPlacement
from llmserve.model_executor.tp_worker import WorkerArgs, serve_rank

PLACEMENT_TIMEOUT_S = 60.0
"""How long the placement group may wait for CPUs before start-up fails (Ray would wait forever)."""
NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node (its id), which a bundle label selector can exclude."""
EXIT_WAIT_S = 2.0
"""How long `dead` waits for a dying actor's call to end (its error names the cause)."""


class TPWorkerActor:
    """One worker rank (`ray.remote` is applied in `RayWorkers`, with the rank's CPUs)."""

    def describe(self) -> tuple[int, str, str]:
        """(this process's pid, its node's address, its Ray node id)."""
        return os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def run(self, args: WorkerArgs) -> None:
        """The rank's whole life: returns once the driver says stop; RuntimeError when the rank
        failed (its error is in its log, which Ray forwards to the driver's)."""
        import logging

        logging.basicConfig(level=logging.WARNING, format=f"[tp rank {args.rank}] %(levelname)s %(message)s")
        if serve_rank(args) != 0:
            raise RuntimeError(f"tensor-parallel rank {args.rank} failed (its error is logged above)")


class RayWorkers:
    """The `Workers` of tp_executor.TPExecutor on Ray: one actor per rank in a placement group,
    placed by the constructor, started by `start`."""

    def __init__(
        self, size: int, model_config: ModelConfig, threads: int, strategy: RayPlacement = "PACK"
    ) -> None:
        if not ray.is_initialized():
            ray.init()
        self.size, self.model_config, self.threads = size, model_config, threads
        num_workers = size - 1
        driver_node = ray.get_runtime_context().get_node_id()
        _check_room(num_workers, threads, strategy, driver_node)
        self.group: PlacementGroup = placement_group(
            [{"CPU": threads}] * num_workers,
            strategy=strategy,
            **_placement_options(strategy, num_workers, driver_node),
        )
        self._finalizer = weakref.finalize(self, _end, [], self.group)
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            self._finalizer()
            raise ValueError(
                f"the Ray cluster did not place {num_workers} tensor-parallel worker(s) of {threads} CPU(s) "
                f"each ({strategy}) within {PLACEMENT_TIMEOUT_S:g} s (cluster: {_nodes_text()}); lower "
                "threads_per_rank, free CPUs or add nodes"
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
        self.pids = [pid for pid, _, _ in described]
        self.nodes = [address for _, address, _ in described]
        self.node_ids = [node_id for _, _, node_id in described]
        # every worker on the driver's Ray node: they share its /dev/shm (the executor's transport)
        self.on_driver_node = all(node_id == driver_node for node_id in self.node_ids)
        self.runs: list[Any] = []

    def start(self, port: int, shm_path: str | None = None) -> None:
        """Run every rank (`serve_rank`) against the driver's store at `port`; `shm_path`: the
        driver's shared-memory segment (only when `on_driver_node`)."""
        assert shm_path is None or self.on_driver_node
        # the store listens on every interface: workers on this node use loopback, others its address
        here = ray.util.get_node_ip_address()
        args = [
            WorkerArgs(rank, self.size, port, self.model_config, self.threads, shm_path=shm_path,
                       host="127.0.0.1" if address == here else here)
            for rank, address in enumerate(self.nodes, start=1)
        ]  # fmt: skip
        self.runs = [a.run.remote(arg) for a, arg in zip(self.actors, args, strict=True)]

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


def _placement_options(strategy: RayPlacement, num_workers: int, driver_node: str) -> dict[str, Any]:
    """`placement_group`'s extra arguments for `strategy`: STRICT_SPREAD keeps every bundle off
    the driver's node (rank 0 is there); STRICT_PACK asks for the driver's node first."""
    if strategy == "STRICT_SPREAD":
        return {"bundle_label_selector": [{NODE_ID_LABEL: f"!{driver_node}"}] * num_workers}
    if strategy == "STRICT_PACK":
        return {"_soft_target_node_id": driver_node}
    return {}


def _check_room(num_workers: int, threads: int, strategy: RayPlacement, driver_node: str) -> None:
    """ValueError when the cluster's nodes, by their total CPUs, can never hold the group (Ray
    would wait for a node to join): no node with `threads` CPUs, or, for STRICT_SPREAD, fewer such
    nodes besides the driver's than workers, or for STRICT_PACK none with all of them."""
    cpus = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]}
    fits = [node for node, total in cpus.items() if total >= threads]
    if strategy == "STRICT_SPREAD":
        others = [node for node in fits if node != driver_node]
        if len(others) < num_workers:
            raise ValueError(
                f"ray_placement_strategy STRICT_SPREAD puts each of the {num_workers} tensor-parallel worker(s) "
                f"on its own node besides the engine's, with {threads} CPU(s) each; the Ray cluster has "
                f"{len(others)} such node(s) ({_nodes_text()})"
            )
    elif strategy == "STRICT_PACK" and not any(total >= threads * num_workers for total in cpus.values()):
        raise ValueError(
            f"ray_placement_strategy STRICT_PACK puts the {num_workers} tensor-parallel worker(s) of {threads} "
            f"CPU(s) each on one node; no node of the Ray cluster has {threads * num_workers} ({_nodes_text()})"
        )
    elif not fits:
        raise ValueError(
            f"no node of the Ray cluster has the {threads} CPU(s) of a tensor-parallel worker ({_nodes_text()}); "
            "lower threads_per_rank"
        )


def _nodes_text() -> str:
    totals = [f"{n['Resources'].get('CPU', 0.0):g}" for n in ray.nodes() if n["Alive"]]
    return f"{len(totals)} node(s) of {', '.join(totals)} CPUs"


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

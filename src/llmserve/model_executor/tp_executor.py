"""`TPExecutor`: a tensor-parallel engine's ranks, driven from the engine's process.

    engine process (rank 0, the driver)            worker processes (ranks 1 .. N-1)
    scheduler -> ModelRunner -> DriverForwardRunner       tp_worker.run_worker
                 | broadcast ("forward", batch, rows) ->  ForwardRunner.forward
                 | forward of its own shard  <- all-reduces after attention / MLP ->
                 | broadcast ("logits", hidden)       ->  LM head shard
                 | logits [N, vocab] <- gather of the vocabulary shards
    sampler (driver only)

The scheduler and the sampler run once, on the driver; a step's inputs reach the workers as one
pickled broadcast of the flat batch (`SequenceBatchEntry` list: new tokens, context length,
block ids per sequence), which is all a forward pass needs, so workers keep no request state.
Each rank loads only its shard (distributed/sharding.py) and holds the KV cache of its KV heads.
Speculative decoding adds nothing here: a verifying request's entry carries its last token and
the proposals (their positions and KV slots follow from its context length and block ids), the
rows to score travel with it, and rejected tokens are rolled back by the driver's scheduler alone
(their slots are simply written again by a later step, on every rank). Proposers run on the
driver only: n-gram lookup, or a draft model loaded whole (unsharded) in the engine's process.

The workers start one of two ways (`distributed_executor_backend`), and run the same code once
started (tp_worker.serve_rank): mp, processes spawned on this machine (`ProcessWorkers`, below);
ray, one Ray actor per rank in a placement group, on any node of the Ray cluster
(model_executor/ray_workers.py). Either way they join the driver's store and gloo group.

When every rank shares the driver's machine (mp; ray when every actor landed on the driver's Ray
node), the collectives go through a shared-memory segment (distributed/shm.py; gloo where
LLMSERVE_TP_TRANSPORT=gloo or the C++ extension is missing); ray ranks on other nodes use gloo. Each rank runs its shard of a quantized Llama-family stack in the fused C++
decoder, which sums the row-parallel outputs over that segment itself; over gloo the model's
layers run, their hooks summing.

A worker that dies fails the driver's next collective at once (gloo: its sockets close; shm: the
wait sees its pid gone); the
executor then names the dead rank (`TensorParallelError`) and refuses every later step, so the
engine stops with that error instead of hanging. A worker that hangs is bounded by the group's
timeout (group.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from llmserve.config import ModelConfig
from llmserve.config.lora import LoRAConfig
from llmserve.config.parallel import ParallelConfig
from llmserve.distributed import shm
from llmserve.distributed.group import TPGroup
from llmserve.distributed.sharding import TPShard
from llmserve.layers import numba_jit
from llmserve.lora.adapter import LoRAAdapter
from llmserve.lora.manager import LoRAManager
from llmserve.lora.request import LoRARequest
from llmserve.model_executor.forward_runner import ForwardOutput, ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import LoadedModel, load_model
from llmserve.model_executor.tp_placement import RankPlacement, place_ranks
from llmserve.model_executor.tp_worker import WorkerArgs, run_worker

logger = logging.getLogger("llmserve")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot continue."""


class Workers(Protocol):
    """Ranks 1 .. N-1 of one engine, however they were started."""

    def exited(self) -> bool:
        """Whether a worker has ended (it can no longer join or answer the group)."""
        ...

    def dead(self) -> list[str]:
        """The workers that ended, each described for an error message ("rank 1 (pid 12, ...)"),
        after a short wait for a dying worker's end to show."""
        ...

    def alive(self) -> bool:
        """Whether every worker still runs."""
        ...

    def kill(self) -> None:
        """End every worker now (they wait on a collective that will never come)."""
        ...

    def close(self) -> None:
        """End every worker, giving those told to stop a few seconds to exit by themselves."""
        ...


class TPExecutor:
    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        """Load the driver's shard (refusals of the model or size raise here, before any process
        starts), then start the workers (`parallel.distributed_executor_backend`) and wait until
        every rank has loaded its shard."""
        size = parallel.tensor_parallel_size
        placement = place_ranks(model_config.device, size, parallel.distributed_executor_backend)
        if placement.device_type == "cuda":
            torch.cuda.set_device(placement.device(0))  # NCCL's and the allocator's current device
        threads = parallel.resolved_threads_per_rank()
        torch.set_num_threads(threads)  # before loading: linear layers chunk their weights per thread
        if not numba_jit.limit_threads(threads):
            logger.warning(
                "numba's thread pool already runs in this process with more than %d threads per rank: its idle "
                "threads compete with the ranks for the cores (start tensor-parallel engines before others)",
                threads,
            )
        self.shard = TPShard(0, size)
        self.loaded: LoadedModel = load_model(placement.model_config(model_config, 0), self.shard)
        self._error: TensorParallelError | None = None
        store = TPGroup.create_store(size)
        if parallel.distributed_executor_backend == "ray":
            from llmserve.model_executor.ray_workers import RayWorkers

            # placed first: the transport depends on whether every actor shares this node
            ray_workers = RayWorkers(size, model_config, threads, parallel.ray_placement_strategy)
            self.transport = shm.transport() if ray_workers.on_driver_node else "gloo"
            shm_path = shm.create_segment(size) if self.transport == "shm" else None
            with shm.unlinked_on_error(shm_path):
                ray_workers.start(store.port, shm_path)
            self.workers: Workers = ray_workers
        else:
            self.transport = shm.transport()
            shm_path = shm.create_segment(size) if self.transport == "shm" else None
            with shm.unlinked_on_error(shm_path):
                self.workers = ProcessWorkers(store.port, placement, model_config, threads, shm_path)
        try:
            try:
                TPGroup.wait_for_workers(store, size, self.workers.exited)
                self.group = TPGroup(store, 0, size, shm_path=shm_path, device=placement.device(0))
            finally:  # every rank has mapped the segment by now (or never will): its name goes
                if shm_path is not None:
                    os.unlink(shm_path)
            self.shard.group = self.group
            ok = self.group.all_ok(True)
        except RuntimeError as e:
            raise self.failure(e) from e
        if not ok:
            self.close()
            raise TensorParallelError(
                "a tensor-parallel worker failed to load its shard (its error is logged above)"
            )

    def init_runner(self, **kwargs: Any) -> DriverForwardRunner:
        """Every rank's forward runner (and KV cache shard) with the same sizes; the driver's."""
        self.send(("init", kwargs))
        return DriverForwardRunner(
            self, self.loaded.model, profile=self.loaded.profile, group=self.group, **kwargs
        )

    def lora_manager(self, config: LoRAConfig) -> DriverLoRAManager:
        """The driver's LoRA adapters (after `init_runner`: the managers wrap the layers after the
        fused decoder is built from the bare ones); every rank's manager holds its slice of each."""
        self.send(("lora", config))
        return DriverLoRAManager(self, config)

    def check(self) -> None:
        """Raise the `TensorParallelError` of an earlier failure, if there was one."""
        if self._error is not None:
            raise self._error

    def send(self, command: tuple) -> None:
        """Broadcast a command to the workers (raises `TensorParallelError` once a rank is gone)."""
        self.check()
        try:
            self.group.broadcast_object(command)
        except RuntimeError as e:
            raise self.failure(e) from e

    def failure(self, cause: BaseException) -> TensorParallelError:
        """The error a failed collective means: which worker died, if one did. Every later
        `send` raises it again."""
        if self._error is not None:
            return self._error
        dead = self.workers.dead()
        if dead:
            self._error = TensorParallelError(
                f"tensor-parallel worker {', '.join(dead)} died; the engine cannot continue"
            )
        else:
            self._error = TensorParallelError(f"a tensor-parallel collective failed: {cause}")
        if (group := getattr(self, "group", None)) is not None:
            group.abort()  # the live ranks' shared-memory waits end now
        self.workers.kill()  # the others wait on a collective that never comes
        return self._error

    def close(self) -> None:
        """Stop the workers (politely when they still listen)."""
        if self._error is None and self.workers.alive():
            with contextlib.suppress(TensorParallelError):
                self.send(("stop",))
        self.workers.close()
        self.group.close()


class DriverForwardRunner(ForwardRunner):
    """The driver's forward runner: each forward pass and each LM-head call is first broadcast to
    the workers, whose shards run the same computation (their collectives pair with these)."""

    def __init__(self, executor: TPExecutor, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.executor = executor

    def forward(
        self, batch: list[SequenceBatchEntry], logits_rows: Sequence[int] | None = None
    ) -> ForwardOutput:
        self.executor.send(("forward", batch, None if logits_rows is None else list(logits_rows)))
        try:
            return super().forward(batch, logits_rows)
        except RuntimeError as e:
            raise self.executor.failure(e) from e

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # (a GPU's rows travel through the host: each worker moves them to its own GPU)
        self.executor.send(("logits", hidden.cpu() if hidden.is_cuda else hidden))
        try:
            return super().compute_logits(hidden)
        except RuntimeError as e:
            raise self.executor.failure(e) from e


class DriverLoRAManager(LoRAManager):
    """The driver's adapters. Each public change (`add`, `remove`, `trim`) is made here first (a bad
    adapter fails here, and reaches no worker), then broadcast, so every worker's manager loads,
    drops and orders the same adapters (each rank its slice); the step's adapter of each sequence
    travels in the broadcast batch (`SequenceBatchEntry.lora_id`)."""

    def __init__(self, executor: TPExecutor, config: LoRAConfig) -> None:
        super().__init__(executor.loaded.model, config, executor.shard)
        self.executor = executor

    def add(self, request: LoRARequest, in_use: AbstractSet[int] = frozenset()) -> LoRAAdapter:
        adapter = super().add(request, in_use)
        self.executor.send(("lora_call", "add", request, set(in_use)))
        return adapter

    def remove(self, lora_id: int, in_use: AbstractSet[int] = frozenset()) -> bool:
        removed = super().remove(lora_id, in_use)
        if removed:
            self.executor.send(("lora_call", "remove", lora_id, set(in_use)))
        return removed

    def trim(self, in_use: AbstractSet[int]) -> None:
        super().trim(in_use)
        self.executor.send(("lora_call", "trim", set(in_use)))


class ProcessWorkers:
    """The mp backend: ranks 1 .. N-1 as processes spawned on this machine, each pinned to its
    own CPUs when there are enough."""

    def __init__(
        self,
        port: int,
        placement: RankPlacement,
        model_config: ModelConfig,
        threads: int,
        shm_path: str | None = None,
    ) -> None:
        spawn = mp.get_context("spawn")
        size = placement.size
        cpus = _cpu_sets(size, threads)
        self.processes = [
            spawn.Process(
                target=run_worker,
                args=(
                    WorkerArgs(
                        rank,
                        size,
                        port,
                        placement.model_config(model_config, rank),
                        threads,
                        cpus[rank],
                        shm_path=shm_path,
                        device=str(placement.device(rank)),
                    ),
                ),
                name=f"llmserve-tp{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.processes:
            p.start()
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes)

    def exited(self) -> bool:
        return any(p.exitcode is not None for p in self.processes)

    def dead(self) -> list[str]:
        for p in self.processes:
            p.join(timeout=2.0 if p.exitcode is None else 0)  # a dying worker's exit code shows
        return [
            f"rank {rank} (pid {p.pid}, exit code {p.exitcode})"
            for rank, p in enumerate(self.processes, start=1)
            if p.exitcode is not None
        ]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def kill(self) -> None:
        _stop_processes(self.processes, grace=0.0)

    def close(self) -> None:
        self._finalizer()


def _cpu_sets(size: int, threads: int) -> list[tuple[int, ...]]:
    """Each rank's CPUs (`threads` consecutive ones of this process's), or none when there are
    too few to give every rank its own. The driver (rank 0) is not pinned: it shares the process
    with the server's event loop."""
    if not hasattr(os, "sched_getaffinity"):
        return [()] * size
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size * threads:
        return [()] * size
    return [tuple(cpus[r * threads : (r + 1) * threads]) for r in range(size)]


def _stop_processes(workers: list[Any], grace: float = 5.0) -> None:
    for w in workers:
        w.join(timeout=grace if w.is_alive() else 0)
        if w.is_alive():
            w.terminate()
            w.join(timeout=5.0)

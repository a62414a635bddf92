"""`ParallelConfig`: how many ranks run one model (tensor parallelism) and how they are started."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

ExecutorBackend = Literal["mp", "ray"]
RayPlacement = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]
RAY_PLACEMENTS: tuple[RayPlacement, ...] = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: the model's heads, MLP and vocabulary split over ranks, one process
    each (distributed/sharding.py, model_executor/tp_executor.py, model_executor/ray_workers.py)."""

    tensor_parallel_size: int = 1
    """Ranks that split the model (1: no tensor parallelism). Must divide the model's attention
    heads, KV heads and intermediate size; Llama, Mistral, Qwen2 and Qwen3 models."""
    distributed_executor_backend: ExecutorBackend = "mp"
    """How the ranks start (the engine's process is rank 0; the others join its gloo group): mp,
    worker processes spawned on this machine; ray, one Ray actor per rank in a placement group, on
    the nodes of a Ray cluster (pip install 'llmserve[ray]'; the cluster in RAY_ADDRESS or a local
    one)."""
    threads_per_rank: int | None = None
    """torch threads of each rank (default: this machine's CPUs / tensor_parallel_size)."""
    ray_placement_strategy: RayPlacement = "PACK"
    """With ray: the workers' placement group strategy (Ray's names). PACK: as few nodes as fit;
    STRICT_PACK: all on one node, the engine's own when it has room (ranks that share the engine's
    node use the shared-memory transport); SPREAD: over as many nodes as there are; STRICT_SPREAD:
    one rank per node, the engine's node holding rank 0 only (a cluster of fewer nodes is refused)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be 'mp' or 'ray'; got {self.distributed_executor_backend!r}"
            )
        if self.ray_placement_strategy not in RAY_PLACEMENTS:
            raise ValueError(
                f"ray_placement_strategy must be one of {', '.join(RAY_PLACEMENTS)}; "
                f"got {self.ray_placement_strategy!r}"
            )
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1; got {self.threads_per_rank}")

    @property
    def is_parallel(self) -> bool:
        return self.tensor_parallel_size > 1

    def resolved_threads_per_rank(self) -> int:
        return self.threads_per_rank or max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)

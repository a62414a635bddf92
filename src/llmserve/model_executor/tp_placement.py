"""`RankPlacement`: where each rank of a tensor-parallel engine runs, decided once, before any
shard loads or any worker starts.

    device cpu    every rank on the CPU; tensors summed over gloo or the shared-memory segment
    device cuda   rank r on cuda:r (the first N GPUs CUDA_VISIBLE_DEVICES shows); tensors summed
                  by NCCL, while commands and the step's batch still travel over the CPU group
                  (gloo or shared memory), as vLLM keeps its metadata on a CPU group; each rank
                  runs eagerly (no CUDA graphs: a graph replay would have to hold the
                  collectives, which only the layer path's hooks issue)

Refusals are ValueErrors naming what to change: fewer GPUs visible than ranks, a device index
(rank r picks cuda:r itself), a torch built without NCCL, or Ray-started ranks on CUDA (Ray gives
each actor its own CUDA_VISIBLE_DEVICES, which this placement does not read yet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from llmserve.config import ModelConfig
from llmserve.model_executor.device import resolve_device


@dataclass(frozen=True, slots=True)
class RankPlacement:
    device_type: Literal["cpu", "cuda"]
    size: int

    @property
    def backend(self) -> Literal["gloo", "nccl"]:
        """The process-group backend that sums the ranks' tensors."""
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")

    def model_config(self, config: ModelConfig, rank: int) -> ModelConfig:
        """Rank `rank`'s model options: the engine's, on its own device (eager on CUDA)."""
        if self.device_type == "cpu":
            return config
        return dataclasses.replace(config, device=str(self.device(rank)), enforce_eager=True)


def place_ranks(model_device: str, size: int, executor_backend: str = "mp") -> RankPlacement:
    """The placement of `size` ranks for `ModelConfig.device` `model_device` (module docstring);
    ValueError for what cannot run."""
    device = resolve_device(model_device)  # (names CUDA missing, when asked for)
    if device.type == "cpu":
        return RankPlacement("cpu", size)
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on the CPU or on CUDA GPUs; device is {model_device!r}")
    if device.index is not None:
        raise ValueError(
            f"tensor_parallel_size {size} places rank r on cuda:r itself; device {model_device!r} names "
            f"one GPU (use device 'cuda', and CUDA_VISIBLE_DEVICES to choose which GPUs)"
        )
    if executor_backend == "ray":
        raise ValueError(
            "tensor parallelism on CUDA starts its ranks as processes (executor backend 'mp'), not Ray"
        )
    visible = torch.cuda.device_count()
    if visible < size:
        raise ValueError(
            f"tensor_parallel_size {size} needs {size} GPUs (rank r on cuda:r); {visible} visible "
            f"(CUDA_VISIBLE_DEVICES); use a size of at most {visible}"
        )
    if not dist.is_nccl_available():
        raise ValueError(f"tensor_parallel_size {size} on CUDA needs NCCL; this torch build has none")
    return RankPlacement("cuda", size)

"""A tensor-parallel worker process (ranks 1 .. N-1): loads its shard of the model, then runs
whatever the driver broadcasts, in the driver's order, until told to stop.

    ("init", kwargs)      build the forward runner (its KV cache shard) once the driver has sized it
    ("forward", batch, rows)  the step's forward pass (the all-reduces inside pair with the driver's)
    ("logits", hidden)    the LM head over the driver's hidden rows (its logits shard is gathered)
    ("lora", config)      serve LoRA adapters: a manager over this rank's shard (after "init")
    ("lora_call", method, *args)  the driver manager's add / remove / trim, made here alike
    ("stop",)             exit

The worker keeps no request state: the driver's scheduler and sampler decide everything, and each
step's flat batch (tokens, context lengths, block ids) is all a forward pass needs. A worker that
fails logs the error and exits; its closed connections fail the driver's next collective.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.config import ModelConfig
from llmserve.distributed.group import TPGroup
from llmserve.distributed.sharding import TPShard
from llmserve.layers import numba_jit

if TYPE_CHECKING:
    from llmserve.lora.manager import LoRAManager
    from llmserve.model_executor.model_loader import LoadedModel

logger = logging.getLogger("llmserve")
_LORA_CALLS = frozenset({"add", "remove", "trim"})
"""The `LoRAManager` methods a driver mirrors on the workers (tp_executor.DriverLoRAManager)."""


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    rank: int
    size: int
    port: int
    """The driver's rendezvous store."""
    model_config: ModelConfig
    threads: int
    """torch threads of this rank."""
    cpus: tuple[int, ...] = ()
    """CPUs this rank's threads are pinned to (empty: not pinned)."""
    host: str = "127.0.0.1"
    """The driver's address (another node's, for a rank started by Ray)."""
    shm_path: str | None = None
    """The driver's shared-memory segment (distributed/shm.py); None: the group runs over gloo."""
    device: str = "cpu"
    """This rank's device (tp_placement.py): "cpu", or its GPU "cuda:<rank>"."""


def run_worker(args: WorkerArgs) -> None:
    """The worker process's main (the mp backend: `ProcessWorkers` spawns it)."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {args.rank}] %(levelname)s %(message)s")
    code = serve_rank(args)
    # Straight out: the interpreter's teardown would destroy gloo's objects in an arbitrary order,
    # and one of them aborted the process now and then ("terminate called without an active
    # exception") after its work was done.
    logging.shutdown()
    os._exit(code)


def serve_rank(args: WorkerArgs) -> int:
    """Join the group, load this rank's shard and run the driver's commands until told to stop;
    the exit code (1: this rank failed, its error logged). The process main of both backends:
    `run_worker` (mp) and the Ray actor's `run` (model_executor/ray_workers.py)."""
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, args.cpus)
    torch.set_num_threads(args.threads)
    numba_jit.limit_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's and the allocator's current device
    group = TPGroup.connect(args.port, args.rank, args.size, args.shm_path, host=args.host, device=device)
    try:
        from llmserve.model_executor.model_loader import load_model

        shard = TPShard(args.rank, args.size, group)
        loaded = load_model(args.model_config, shard)
    except Exception:
        logger.exception("loading this rank's shard failed")
        group.all_ok(False)
        return 1
    if not group.all_ok(True):  # another rank failed: nothing to serve
        return 0
    try:
        _serve(group, shard, loaded)
    except Exception:
        logger.exception("tensor-parallel worker failed")
        group.abort()
        return 1
    group.close()
    return 0


@torch.inference_mode()
def _serve(group: TPGroup, shard: TPShard, loaded: LoadedModel) -> None:
    from llmserve.model_executor.forward_runner import ForwardRunner

    runner: ForwardRunner | None = None
    lora: LoRAManager | None = None
    while True:
        command = group.broadcast_object()
        kind = command[0]
        if kind == "forward":
            assert runner is not None, "forward before init"
            runner.forward(command[1], command[2])
        elif kind == "logits":
            assert runner is not None, "logits before init"
            runner.compute_logits(command[1].to(runner.device))
        elif kind == "init":
            runner = ForwardRunner(loaded.model, profile=loaded.profile, group=group, **command[1])
        elif kind == "lora":
            from llmserve.lora.manager import LoRAManager

            assert runner is not None, "lora before init"
            lora = LoRAManager(loaded.model, command[1], shard)
            runner.use_lora(lora)
        elif kind == "lora_call":
            assert lora is not None and command[1] in _LORA_CALLS, command[:2]
            getattr(lora, command[1])(*command[2:])
        elif kind == "stop":
            return
        else:
            raise AssertionError(f"unknown command {kind!r}")

"""`TPGroup`: the ranks of one tensor-parallel engine, joined by a gloo process group.

The group is an object passed to whoever needs it (the sharded layers' hooks, the executor), not
torch.distributed's global default group: an engine that is closed and another that is built in
the same process (tests, a server that reloads a model) each get their own group, and nothing
else in the process sees them.

Rank 0 is the driver (the engine's process); it creates the rendezvous store and the workers
connect to it. Objects (a step's batch, a command) travel pickled.

Two transports (`shm.transport()` picks one when the driver starts the group):

    shm    the ranks of one machine share a memory segment (shm.py): float32 all-reduces, the
           gather of the LM head's shards and the broadcasts go through it (a few microseconds
           each), and a rank's fused C++ decoder sums its shards there itself
    gloo   loopback TCP (LLMSERVE_TP_TRANSPORT=gloo, or no C++ extension): each collective a
           round trip through the kernel; objects as one broadcast of the length, one of the bytes

The gloo group exists either way: start-up's `all_ok` votes and other dtypes use it.

On CUDA (`device` cuda:r, model_executor/tp_placement.py) a second group, NCCL's, sums and gathers
the ranks' GPU tensors (the sharded layers' hooks); commands, the step's batch and the votes stay
on the CPU transport above.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmserve.distributed.shm import ShmComm

DRIVER = 0

DEFAULT_TIMEOUT = timedelta(seconds=120)
"""How long a collective waits for a rank before failing (a rank that dies outright closes its
sockets, which fails the collectives at once; this bounds a rank that hangs)."""


class TPGroup:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta = DEFAULT_TIMEOUT,
        shm_path: str | None = None,
        shm: ShmComm | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`shm_path`: the driver's shared segment (shm.create_segment) to map, or `shm` the
        mapped one; neither: gloo alone. `device`: this rank's GPU (cuda:r, the current device
        already), whose tensors an NCCL group sums; None or the CPU: no NCCL group."""
        self.rank, self.size = rank, size
        self.store = store  # kept alive: the group's connections were set up through it
        if shm is None and shm_path is not None:
            shm = ShmComm(shm_path, rank, size, timeout.total_seconds())
        self.shm = shm
        self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)  # waits for every rank
        self.nccl: Any = None
        if device is not None and device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout  # (torch's own helper sets it so)
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)

    @classmethod
    def create_store(cls, size: int, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
        """The driver's rendezvous store on a free local port (`store.port` tells the workers)."""
        return dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)

    @classmethod
    def connect(
        cls,
        port: int,
        rank: int,
        size: int,
        shm_path: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        host: str = "127.0.0.1",
        device: torch.device | None = None,
    ) -> TPGroup:
        """A worker's side: join the driver's store at `host` (its node's address when the worker
        runs on another node; the store listens on every interface), saying so
        (`wait_for_workers`), and the group (mapping the shared segment first: the driver unlinks
        it once every rank has joined)."""
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        shm = None if shm_path is None else ShmComm(shm_path, rank, size, timeout.total_seconds())
        store.set(_joined(rank), "1")
        return cls(store, rank, size, timeout, shm=shm, device=device)

    @staticmethod
    def wait_for_workers(
        store: dist.Store, size: int, failed: Callable[[], bool], timeout: timedelta = DEFAULT_TIMEOUT
    ) -> None:
        """The driver's side, before it joins the group: block until every worker has reached the
        store; RuntimeError as soon as `failed()` says one never will (its process died) or at the
        timeout, rather than waiting out the group's own timeout."""
        keys = [_joined(rank) for rank in range(1, size)]
        deadline = time.monotonic() + timeout.total_seconds()
        while not store.check(keys):
            if failed():
                raise RuntimeError("a worker process exited before joining the group")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the workers did not join the group within {timeout.total_seconds():.0f} s"
                )
            time.sleep(0.05)

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (every rank gets the same sum)."""
        if t.is_cuda:
            self.nccl.allreduce([t]).wait()
            return t
        if self.shm is not None and t.dtype == torch.float32:
            return self.shm.all_reduce(t)
        self.pg.allreduce([t]).wait()
        return t

    def gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape everywhere), in rank order, on the driver; None elsewhere."""
        if t.is_cuda:  # an all-gather, as over shared memory
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self.nccl.allgather([parts], [t.contiguous()]).wait()
            return parts if self.is_driver else None
        if self.shm is not None:  # an all-gather: every rank waits for all (shm.py's slots)
            parts = self.shm.all_gather(t)
            return list(parts.unbind(0)) if self.is_driver else None
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = DRIVER
        if self.is_driver:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self.pg.gather([parts], [t], opts).wait()
            return parts
        self.pg.gather([], [t], opts).wait()
        return None

    def broadcast_object(self, obj: Any = None) -> Any:
        """The driver's `obj` on every rank (workers pass nothing and get the driver's)."""
        if self.shm is not None:
            data = self.shm.broadcast(
                pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.is_driver else None
            )
            return obj if self.is_driver else pickle.loads(data)
        if self.is_driver:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        if self.is_driver:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload)
        return obj if self.is_driver else pickle.loads(payload.numpy().tobytes())

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank reports `ok` (each rank calls this once with its own verdict)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        return int(self.all_reduce(flag).item()) == 0

    def abort(self) -> None:
        """Fail the other ranks' waiting shared-memory collectives at once (a rank failed)."""
        if self.shm is not None:
            self.shm.abort()

    def close(self) -> None:
        """Shut the group's connections down (its threads joined: no abort at interpreter exit)."""
        if self.shm is not None:
            self.shm.unlink()
        for pg in (self.pg, self.nccl):
            if pg is not None:
                with contextlib.suppress(RuntimeError):  # a peer already gone
                    pg.shutdown()

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = DRIVER
        self.pg.broadcast([t], opts).wait()


def _joined(rank: int) -> str:
    return f"llmserve/joined/{rank}"

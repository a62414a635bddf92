"""`ShmComm`: the collectives of a tensor-parallel group whose ranks share one machine, over a
shared-memory segment instead of gloo's loopback TCP (what vLLM's CPU backend does too).

The driver creates the segment, a file under /dev/shm, before it starts the workers; each rank
maps it (`torch.UntypedStorage.from_file(shared=True)`) and hands its address to the C++ side
(csrc/shm_comm.cpp), which runs every collective with the GIL released:

    all_reduce(t)      float32, in place; ranks added in rank order, so every rank gets the same bits
    all_gather(t)      every rank's t, in rank order
    broadcast(data)    the driver's bytes (a step's pickled flat batch) to every worker

The fused C++ decoder of a rank calls the same all-reduce inside its layers. The driver unlinks
the file once every rank has mapped it, so a crash leaves nothing behind in /dev/shm.

Which transport a group uses: `transport()` (LLMSERVE_TP_TRANSPORT=gloo forces gloo: tests,
comparisons; gloo also where the C++ extension is not built).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Literal

import torch

from llmserve.layers.quantization.cpu_kernels import native_extension

Transport = Literal["shm", "gloo"]

ENV = "LLMSERVE_TP_TRANSPORT"
SLOT_BYTES = 1 << 20
"""Each rank's share of one exchange; larger tensors go in chunks (a batch of 16 tokens' hidden
states is 36 KiB at hidden 576; the LM head's logits shard 1.5 MiB)."""
BROADCAST_BYTES = 1 << 20
"""The broadcast area (a step's pickled batch is a few KiB; larger payloads go in chunks)."""


def transport() -> Transport:
    """The transport a new tensor-parallel group uses: `shm` where the C++ extension is built,
    unless LLMSERVE_TP_TRANSPORT says `gloo` (ValueError naming any other value)."""
    value = os.environ.get(ENV, "auto")
    if value not in ("auto", "shm", "gloo"):
        raise ValueError(f"{ENV} must be 'auto', 'shm' or 'gloo'; got {value!r}")
    available = hasattr(native_extension(), "comm_new")  # an extension built before it lacks it
    if value == "shm" and not available:
        raise ValueError(f"{ENV}=shm needs llmserve's C++ extension, which is not built")
    return "shm" if value != "gloo" and available else "gloo"


def create_segment(world: int) -> str:
    """The driver's segment for `world` ranks (zero-filled): its path, which the workers map."""
    ext = native_extension()
    assert ext is not None
    size = ext.comm_segment_bytes(world, SLOT_BYTES, BROADCAST_BYTES)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="llmserve-tp-", dir=folder)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def unlinked_on_error(path: str | None) -> Iterator[None]:
    """Remove the segment `path` (when there is one) if the block raises: the workers it was made
    for never started, so nothing else would unlink it."""
    try:
        yield
    except BaseException:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise


class ShmComm:
    """One rank's side of the shared-memory group mapped from `path`."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float) -> None:
        ext = native_extension()
        assert ext is not None
        self.path, self.rank, self.world = path, rank, world
        size = ext.comm_segment_bytes(world, SLOT_BYTES, BROADCAST_BYTES)
        # the mapping lives as long as this storage (the capsule points into it)
        self._storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
        self.handle = ext.comm_new(
            self._storage.data_ptr(), rank, world, SLOT_BYTES, BROADCAST_BYTES, timeout_s
        )
        self._ext = ext

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum float32 `t` over the ranks, in place."""
        assert t.dtype == torch.float32 and t.device.type == "cpu"
        buf = t if t.is_contiguous() else t.contiguous()
        self._ext.comm_all_reduce(self.handle, buf.data_ptr(), buf.numel())
        if buf is not t:
            t.copy_(buf)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape and dtype everywhere) stacked in rank order: [world, *t.shape]."""
        t = t.contiguous()
        out = torch.empty((self.world, *t.shape), dtype=t.dtype)
        self._ext.comm_all_gather(self.handle, t.data_ptr(), t.numel() * t.element_size(), out.data_ptr())
        return out

    def broadcast(self, data: bytes | None) -> bytes:
        """The driver's `data` on every rank (workers pass None)."""
        return self._ext.comm_broadcast(self.handle, data)

    def abort(self) -> None:
        """Fail every rank's waiting and later collectives (a rank failed, or the group closes)."""
        self._ext.comm_abort(self.handle)

    def unlink(self) -> None:
        """Remove the segment's name (the driver, once every rank has mapped it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

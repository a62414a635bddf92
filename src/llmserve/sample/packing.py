"""`HostPack`: one step's per-row sampling scalars, gathered on the host, sent to the device in one
copy. Knows nothing of what the numbers mean; `metadata.py` says which slice is which field.

    host, int64:  [ F floats, as the bits of float64 | I ints ]  --one copy-->  device
    device:       floats = pack[:F].view(float64).to(float32)    one cast for every float field
                  ints   = pack[F:]                               views, no copy

float64 holds every Python float exactly, so each value is rounded to float32 once, on the device,
the rounding `torch.tensor(values, dtype=torch.float32)` applies on the host. With `pin_memory` the
host buffer is pinned and the copy is asynchronous: building the metadata never waits for the
GPU (a pageable copy would, and torch syncs the stream after one). On the CPU nothing is copied.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostPack:
    def __init__(self) -> None:
        self._floats: list[float] = []
        self._ints: list[int] = []

    def floats(self, values: Iterable[float]) -> slice:
        """Append float values; their slice of `DevicePack.floats`."""
        start = len(self._floats)
        self._floats.extend(values)
        return slice(start, len(self._floats))

    def ints(self, values: Iterable[int]) -> slice:
        """Append int64 values; their slice of `DevicePack.ints`."""
        start = len(self._ints)
        self._ints.extend(values)
        return slice(start, len(self._ints))

    def __bool__(self) -> bool:
        return bool(self._floats or self._ints)

    def send(self, device: torch.device, pin_memory: bool) -> DevicePack:
        """The one host->device copy of everything appended (no copy when `device` is the CPU)."""
        floats = torch.tensor(self._floats, dtype=torch.float64).view(torch.int64)
        host = torch.cat([floats, torch.tensor(self._ints, dtype=torch.int64)])  # [F + I]
        if pin_memory:
            host = host.pin_memory()
        packed = host.to(device, non_blocking=pin_memory)  # the CPU: `host` itself
        num_floats = len(self._floats)
        return DevicePack(packed[:num_floats].view(torch.float64).to(torch.float32), packed[num_floats:])


class DevicePack:
    """The device side of a `HostPack`: index it with the slices the pack handed out."""

    __slots__ = ("floats", "ints")

    def __init__(self, floats: torch.Tensor, ints: torch.Tensor) -> None:
        self.floats = floats  # [F] float32
        self.ints = ints  # [I] int64

    @classmethod
    def empty(cls, device: torch.device) -> DevicePack:
        """What an empty pack sends: nothing (an all-greedy step with nothing to process)."""
        return cls(torch.empty(0, device=device), torch.empty(0, dtype=torch.int64, device=device))

    def float_field(self, at: slice | None) -> torch.Tensor | None:
        return None if at is None else self.floats[at]

    def int_field(self, at: slice | None) -> torch.Tensor | None:
        return None if at is None else self.ints[at]

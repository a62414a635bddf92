"""CPU offloading of weights (`--cpu-offload-gb N`, vLLM's flag): whole decoder layers, up to N GiB,
live in pinned host memory and are copied to the GPU ahead of use, every forward pass, on a side
stream. The GPU memory they free goes to the KV cache; the price is reading those bytes over PCIe
each step.

Layout. Each offloaded layer's parameters are one flat pinned host buffer; the GPU holds a ring of
`num_slots` staging buffers (slots) as large as the largest offloaded layer, and offloaded layer
o_j's parameters are permanently views into slot j % num_slots at the same offsets, so the layer's
own forward runs unchanged and one copy per layer refills it:

    host (pinned)                          GPU                          (16 layers, 4 offloaded)
    o_0 = layer 2   [qkv|o|gate_up|down|norms]  -->  slot 0  <- params of layers 2 and 10
    o_1 = layer 6   [ ... ]                     -->  slot 1  <- params of layers 6 and 14
    o_2 = layer 10  [ ... ]                     -->  slot 0
    o_3 = layer 14  [ ... ]                     -->  slot 1

A staging buffer per offloaded layer would keep on the GPU the very bytes offloading frees; two
slots (one being read, one being filled) free (k - 2) layers' worth. With k <= 3 layers one slot
is used (k - 1 freed); one layer alone frees nothing and is not offloaded.

Schedule (`prefetch_schedule`), with S slots:
  1. before the stack's first layer: the side stream waits for the compute stream (the previous
     step's use of the slots), then copies o_0 .. o_{S-1};
  2. before o_j runs: the compute stream waits for o_j's copy;
  3. after o_j ran: if o_{j+S} exists, the side stream waits for that (its slot is free again) and
     copies o_{j+S} into it. The copy overlaps every layer from o_j's end to o_{j+S}'s start.

Which layers: evenly spaced and centred (16 layers, 4 offloaded: 2, 6, 10, 14), not the first k.
A copy hides behind the resident layers computed while it runs: spaced out, each copy has L/k - 1
of them in front of it (and the first copy has some too); packed at the front, each would have
only the one offloaded layer before it. At batch 1 a step is PCIe-bound either way (a 1B model's
layer is 116 MiB: ~4 ms over PCIe against ~60 us of compute); at large batches and in prefill the
spacing hides the copies.

CUDA graphs keep working: the copies (from pinned memory) and the events that order them are
recorded into each graph like its kernels, so a replay re-copies the offloaded layers in the same
order; every side-stream branch joins the compute stream before the stack ends. (vLLM V1 instead
maps the pinned memory into the GPU's address space (UVA) and lets the matmuls read it over PCIe
directly: no staging memory, but every kernel reading host memory runs at PCIe speed.)

This module decides which layers and installs the mechanism (forward hooks on the decoder layers);
the models know nothing of it. On the CPU there is nothing to offload to: the loader refuses the
flag there; `SyncCopies` (copies done in place, in order) lets the CPU tests run the mechanism.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from llmserve.model_executor.device import DeviceProfile

logger = logging.getLogger("llmserve")

ALIGN = 256
"""Bytes each parameter's offset in a layer buffer is rounded up to (any dtype's view is aligned)."""
MAX_SLOTS = 2


# -- which layers, in which order ---------------------------------------------------------------


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder stack: the longest `nn.ModuleList` whose entries are all one class (Llama's
    `model.layers`, GPT-2's `transformer.h`, ...)."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(x) for x in m}) == 1:
            best = list(m)
    if not best:
        raise ValueError(f"cpu_offload_gb: {type(model).__name__} has no stack of decoder layers to offload")
    return best


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layer_bytes(layer: nn.Module) -> int:
    """Bytes of a layer's parameters as laid out in its host buffer (each aligned to ALIGN)."""
    return sum(_aligned(p.numel() * p.element_size()) for p in _params(layer))


def _params(layer: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in layer.parameters()}.values())  # a tied tensor once


def choose_layers(sizes: list[int], budget: int) -> tuple[int, ...]:
    """The most layers, evenly spaced and centred, whose bytes (`sizes[i]` each) total at most
    `budget`: layer ((2i + 1) L) // (2k) for i < k."""
    L = len(sizes)
    for k in range(L, 0, -1):
        chosen = tuple(((2 * i + 1) * L) // (2 * k) for i in range(k))
        if sum(sizes[i] for i in chosen) <= budget:
            return chosen
    return ()


def num_slots_for(num_offloaded: int) -> int:
    """Staging slots: two (one read while the other fills) once that still frees memory."""
    return MAX_SLOTS if num_offloaded > 3 else 1


@dataclass(frozen=True, slots=True)
class PrefetchStep:
    """What happens around one decoder layer of the stack."""

    first: tuple[int, ...] = ()
    """Offloaded positions j copied before this layer runs (the stack's first layer: o_0..o_{S-1})."""
    wait: int | None = None
    """This layer is o_j: the compute stream waits for copy j first."""
    then: int | None = None
    """After this layer (o_j) ran, o_{j+S} is copied into its slot."""


def prefetch_schedule(num_layers: int, offloaded: tuple[int, ...], num_slots: int) -> list[PrefetchStep]:
    """One step per decoder layer (see the module docstring's schedule)."""
    steps = [PrefetchStep() for _ in range(num_layers)]
    if not offloaded:
        return steps
    m = len(offloaded)
    steps[0] = PrefetchStep(first=tuple(range(min(num_slots, m))))
    for j, i in enumerate(offloaded):
        nxt = j + num_slots if j + num_slots < m else None
        steps[i] = PrefetchStep(first=steps[i].first, wait=j, then=nxt)
    return steps


# -- how copies are ordered -----------------------------------------------------------------------


class CopyStreams(Protocol):
    """Orders the copies against the compute stream."""

    def begin(self) -> None:
        """A forward pass starts: copies issued from now on come after all earlier compute."""

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor, after_use: bool) -> None:
        """Copy src (host) into dst (slot `slot`); `after_use`: only once the compute issued so
        far (the layer that read the slot) is done."""

    def wait(self, slot: int) -> None:
        """Compute issued from now on runs after the last copy into `slot`."""


class CudaCopies:
    """Copies on a side CUDA stream, ordered by events (each recorded into a graph under capture)."""

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in range(num_slots)]
        self.freed = [torch.cuda.Event() for _ in range(num_slots)]

    def begin(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor, after_use: bool) -> None:
        if after_use:
            self.freed[slot].record(torch.cuda.current_stream(self.device))
            self.side.wait_event(self.freed[slot])
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
            self.copied[slot].record(self.side)

    def wait(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.copied[slot])


class SyncCopies:
    """Copies done at once, in program order: the CPU tests' stand-in for a device (a wrong order
    shows as wrong outputs, since layers sharing a slot share memory)."""

    def begin(self) -> None:
        pass

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor, after_use: bool) -> None:
        dst.copy_(src)

    def wait(self, slot: int) -> None:
        pass


# -- the mechanism ----------------------------------------------------------------------------------


class LayerOffloader:
    """Moves `offloaded` layers of `layers` to host buffers, rebinds their parameters to staging
    slots on `device`, and refills the slots from forward hooks (see the module docstring)."""

    def __init__(
        self,
        layers: list[nn.Module],
        offloaded: tuple[int, ...],
        copies: CopyStreams,
        device: torch.device,
        pin_memory: bool,
        num_slots: int | None = None,
    ) -> None:
        assert offloaded and list(offloaded) == sorted(set(offloaded)), offloaded
        self.num_layers, self.offloaded, self.copies = len(layers), offloaded, copies
        self.num_slots = min(num_slots or num_slots_for(len(offloaded)), len(offloaded))
        slot_bytes = max(layer_bytes(layers[i]) for i in offloaded)
        self.slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(self.num_slots)
        ]
        self.host: list[torch.Tensor] = []
        for j, i in enumerate(offloaded):
            self.host.append(self._move(layers[i], self.slots[j % self.num_slots], pin_memory))
        self.schedule = prefetch_schedule(len(layers), offloaded, self.num_slots)
        self._hooks = [layers[0].register_forward_pre_hook(self._hook(0, before=True))]
        for i in offloaded:
            if i != 0:
                self._hooks.append(layers[i].register_forward_pre_hook(self._hook(i, before=True)))
            if self.schedule[i].then is not None:
                self._hooks.append(layers[i].register_forward_hook(self._hook(i, before=False)))

    @staticmethod
    def _move(layer: nn.Module, slot: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        """The layer's bytes into a new host buffer; its parameters become views into `slot`."""
        host = torch.empty(layer_bytes(layer), dtype=torch.uint8, pin_memory=pin_memory)
        offset = 0
        for p in _params(layer):
            n = p.numel() * p.element_size()
            host[offset : offset + n].copy_(p.data.contiguous().reshape(-1).view(torch.uint8))
            p.data = slot[offset : offset + n].view(p.dtype).view(p.shape)
            offset += _aligned(n)
        return host

    def _copy(self, j: int, after_use: bool) -> None:
        s = j % self.num_slots
        n = self.host[j].numel()
        self.copies.copy(s, self.slots[s][:n], self.host[j], after_use)

    def _hook(self, i: int, before: bool):
        step = self.schedule[i]

        def pre(module: nn.Module, args: object) -> None:
            if step.first:
                self.copies.begin()
                for j in step.first:
                    self._copy(j, after_use=False)
            if step.wait is not None:
                self.copies.wait(step.wait % self.num_slots)

        def post(module: nn.Module, args: object, output: object) -> None:
            assert step.then is not None
            self._copy(step.then, after_use=True)

        return pre if before else post

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() for h in self.host)

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def summary(self) -> str:
        return (
            f"cpu offload: {len(self.offloaded)} of {self.num_layers} decoder layers "
            f"({', '.join(map(str, self.offloaded))}) in pinned host memory, {self.host_bytes / 2**30:.2f} GiB; "
            f"{self.num_slots} GPU staging buffer(s), {self.staging_bytes / 2**30:.2f} GiB; "
            f"{(self.host_bytes - self.staging_bytes) / 2**30:.2f} GiB of GPU memory freed"
        )

    def remove(self) -> None:
        """Drop the hooks (the parameters stay slot views: for tests that inspect the schedule)."""
        for h in self._hooks:
            h.remove()


def check_offload_device(profile: DeviceProfile) -> None:
    """`cpu_offload_gb` needs device memory to free: refused on the CPU."""
    if profile.is_cpu:
        raise ValueError(
            f"cpu_offload_gb needs a CUDA device; the model runs on {profile.device}, where the weights "
            "are in host memory already"
        )


def offload_layers(model: nn.Module, num_bytes: int, profile: DeviceProfile) -> LayerOffloader | None:
    """Offload up to `num_bytes` of whole decoder layers of a loaded model (`cpu_offload_gb`), or
    None (with a warning) when that is less than two layers: one would free nothing."""
    check_offload_device(profile)
    layers = decoder_layers(model)
    sizes = [layer_bytes(layer) for layer in layers]
    chosen = choose_layers(sizes, num_bytes)
    if len(chosen) < 2:
        logger.warning(
            "cpu_offload_gb %.2f: nothing offloaded; a decoder layer is %.3f GiB and one layer alone frees "
            "nothing (its staging buffer takes as much): ask for at least %.3f GiB",
            num_bytes / 2**30, max(sizes) / 2**30, 2 * max(sizes) / 2**30,
        )  # fmt: skip
        return None
    slots = num_slots_for(len(chosen))
    offloader = LayerOffloader(
        layers, chosen, CudaCopies(profile.device, slots), profile.device, profile.pin_memory
    )
    torch.cuda.empty_cache()  # the moved layers' GPU memory back to the driver, for the KV cache
    return offloader

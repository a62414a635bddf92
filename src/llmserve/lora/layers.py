"""`LoRALinear`: a base linear layer plus the deltas of the adapters in the current step.

The step's adapters run together, as punica's BGMV does in one kernel, in two matmuls per layer
whatever their number: their A's side by side, their B's stacked, and each row keeping only its
own adapter's ranks between the two:

    y  = base(x)                                  x [T, in], y [T, out]
    h  = x @ [A_1 | A_2 | ...]                    [T, R]   R = the adapters' ranks on this layer
    h *= mask                                     mask[t, c] = 1 where column c is row t's adapter's
    y += h @ [B_1 ; B_2 ; ...]                    [T, out]

Rows of the base model (slot 0) get a zero mask row: their y is left as it was. A step whose rows
all run one adapter needs no mask.

Why one pair of matmuls and not one per adapter group (`index_select` -> matmul -> `index_add_`,
the first version): three torch ops per layer instead of four per adapter, which is what a CPU
step of small matrices pays for (each op is a parallel region); the price is R / r_own times the
shrink and expand work, small at decode (4 adapters of rank 16: 64 columns beside a 576-wide
layer) and growing with prefill rows. On the 2-core development machine, loaded by other jobs,
the two were within noise of each other for 16 rows with one thread each, and the grouped one
had 3 ms `index_add_` calls with two; benchmarks/bench_lora.py is the script to settle it on a
quiet machine.

The base layer runs as it is (float, oneDNN-packed or quantized); the wrapper only needs its
logical [..., out] output. While a step carries adapters the wrapper reports `packed = True`, so
a `GatedMLP` takes its plain-layout path (logical [gate | up] columns, which the adapter's B is
laid out in) instead of the per-thread chunked one; without adapters it forwards everything,
chunked path included, to the base layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmserve.layers.linear import Linear
from llmserve.lora.adapter import LoRAAdapter


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """One step's adapters and which of them each flat-batch row runs."""

    adapters: tuple[LoRAAdapter, ...]
    row_slots: torch.Tensor | None
    """[T] int64: the index in `adapters` of each row's adapter, -1 for the base model; None:
    every row runs `adapters[0]`."""
    masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict)
    """Column layout ((slot, rank), ...) -> its [T, R] mask, built once per step and layout."""
    spans: dict[tuple[tuple[int, int], ...], tuple[torch.Tensor, torch.Tensor, int]] = field(
        default_factory=dict
    )
    """Column layout -> (each row's first column [T], its rank [T], the largest rank): the
    Triton kernels' form of the mask (triton_lora.py)."""

    def __post_init__(self) -> None:
        assert self.row_slots is not None or len(self.adapters) == 1, (
            "rows of several adapters need row_slots"
        )

    def mask(
        self, layout: tuple[tuple[int, int], ...], col_slots: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        mask = self.masks.get(layout)
        if mask is None:
            assert self.row_slots is not None
            mask = (self.row_slots[:, None] == col_slots[None, :]).to(dtype)  # [T, R]
            self.masks[layout] = mask
        return mask

    def row_spans(
        self, layout: tuple[tuple[int, int], ...], num_rows: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        spans = self.spans.get(layout)
        if spans is None:
            # index slot + 1: slot -1 (a base row) and slots without this layer keep rank 0
            starts = torch.zeros(len(self.adapters) + 1, dtype=torch.int32)
            ranks = torch.zeros(len(self.adapters) + 1, dtype=torch.int32)
            offset = 0
            for slot, rank in layout:
                starts[slot + 1], ranks[slot + 1] = offset, rank
                offset += rank
            index = (
                self.row_slots + 1 if self.row_slots is not None else torch.ones(num_rows, dtype=torch.long)
            )
            index = index.to(device)
            spans = (starts.to(device)[index], ranks.to(device)[index], max(r for _, r in layout))
            self.spans[layout] = spans
        return spans


@dataclass(frozen=True, slots=True)
class _Packed:
    """A layer's weights of one set of adapters, side by side."""

    adapters: tuple[LoRAAdapter, ...]
    a_t: torch.Tensor  # [in, R]
    b_t: torch.Tensor  # [R, out]
    layout: tuple[tuple[int, int], ...]
    col_slots: torch.Tensor  # [R]: the slot each column belongs to


class LoRAStep:
    """The per-forward context every wrapper reads: the step's `LoRABatch`, or None. Set only by
    `LoRAManager.activate`, which refuses nesting."""

    __slots__ = ("batch", "use_triton")

    def __init__(self, use_triton: bool = False) -> None:
        self.batch: LoRABatch | None = None
        self.use_triton = use_triton
        """The wrappers add the deltas with triton_lora.py's kernels (the manager's choice: CUDA
        with triton installed); otherwise with the masked matmul pair."""


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, path: str, step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        self.path = path
        """The base layer's module path, which keys `LoRAAdapter.layers`."""
        self.step = step
        self._packed: _Packed | None = None

    def __getattr__(self, name: str):  # the base layer's attributes (output_sizes, weight, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    @property
    def packed(self) -> bool:
        return self.step.batch is not None or self.base.packed

    def forward_chunks(self, x: torch.Tensor) -> torch.Tensor:
        assert self.step.batch is None, "a step with adapters runs the plain layout"
        return self.base.forward_chunks(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.base(x)
        batch = self.step.batch
        if batch is None:
            return y
        packed = self._packed_for(batch.adapters, x.dtype)
        if packed is None:  # no adapter of the step changes this layer
            return y
        if self.step.use_triton:
            from llmserve.lora.triton_lora import add_lora

            start, rank, max_rank = batch.row_spans(packed.layout, x.shape[0], x.device)
            return add_lora(y, x, packed.a_t, packed.b_t, start, rank, max_rank)
        h = x @ packed.a_t  # [T, R]
        if batch.row_slots is not None:
            h.mul_(batch.mask(packed.layout, packed.col_slots, h.dtype))
        return y.addmm_(h, packed.b_t)

    def _packed_for(self, adapters: tuple[LoRAAdapter, ...], dtype: torch.dtype) -> _Packed | None:
        """This layer's weights of `adapters` in `dtype` (the activations'; a 16-bit
        `lora_dtype` copy is widened here), concatenated once per set of adapters (kept while
        the steps run the same set)."""
        cached = self._packed
        if (
            cached is not None
            and len(cached.adapters) == len(adapters)
            and all(a is b for a, b in zip(cached.adapters, adapters, strict=True))
        ):
            return cached
        parts = [(slot, a.layers[self.path]) for slot, a in enumerate(adapters) if self.path in a.layers]
        if not parts:
            self._packed = None
            return None
        a_t = parts[0][1].a_t if len(parts) == 1 else torch.cat([p.a_t for _, p in parts], dim=1)
        b_t = parts[0][1].b_t if len(parts) == 1 else torch.cat([p.b_t for _, p in parts], dim=0)
        a_t, b_t = a_t.to(dtype), b_t.to(dtype)
        layout = tuple((slot, p.a_t.shape[1]) for slot, p in parts)
        col_slots = torch.cat([torch.full((r,), slot) for slot, r in layout]).to(a_t.device)
        self._packed = _Packed(adapters, a_t, b_t, layout, col_slots)
        return self._packed

    def extra_repr(self) -> str:
        return f"lora on {self.path}"

"""`LoRALinear`: a base linear layer plus the deltas of the adapters in the current step.

For the rows (tokens) of each adapter group in the step, grouped like punica's SGMV:

    y = base(x)
    y[rows_i] += (x[rows_i] @ A_i.T) @ B_i.T        one shrink and one expand per adapter present

Rows of the base model (slot 0) get nothing. The base layer runs as it is (float, oneDNN-packed or
quantized); the wrapper only needs its logical [..., out] output. While a step carries adapters the
wrapper reports `packed = True`, so a `GatedMLP` takes its plain-layout path (logical [gate | up]
columns, which the adapter's B is laid out in) instead of the per-thread chunked one; without
adapters it forwards everything, chunked path included, to the base layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmserve.layers.linear import Linear
from llmserve.lora.adapter import LoRAAdapter


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """One step's adapter groups: (adapter, its flat-batch rows; None: every row)."""

    groups: tuple[tuple[LoRAAdapter, torch.Tensor | None], ...]


class LoRAStep:
    """The per-forward context every wrapper reads: the step's `LoRABatch`, or None. Set only by
    `LoRAManager.activate`, which refuses nesting."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, path: str, step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        self.path = path
        """The base layer's module path, which keys `LoRAAdapter.layers`."""
        self.step = step

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
        for adapter, rows in batch.groups:
            lora = adapter.layers.get(self.path)
            if lora is None:
                continue
            if rows is None:
                y.add_((x @ lora.a_t) @ lora.b_t)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ lora.a_t) @ lora.b_t)
        return y

    def extra_repr(self) -> str:
        return f"lora on {self.path}"

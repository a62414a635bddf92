"""`FusedLoRA`: a step's LoRA adapters handed to the fused CPU decoder, which adds each token's
adapter deltas inside its one C++ call (csrc/decoder_lora.cpp) instead of the step falling back to
the model's layers with `LoRALinear` wrappers (layers.py).

Each adapter is given to C++ once, as a capsule of addresses: per decoder layer, the (A.T, B.T)
pair the adapter has for each of the four linear layers the fused decoder runs (qkv, o, gate_up,
down; a fused layer's shards already stacked by adapter.py), and, per rank row of B.T, the columns
where it can be non-zero (a q rank of the block-diagonal qkv B reaches only q's columns: the
expand skips the rest). The tensors stay the adapter's; the capsule keeps a reference to them.

What the fused decoder does not take, the step runs layer by layer, as before
(`unsupported_reason` says why): an adapter on a layer outside those four (an MoE layer's experts,
the LM head), or weights that are not on the CPU in float32, bfloat16 or float16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.fused_decoder import LORA_LINEARS, FusedDecoder
from llmserve.lora.adapter import LayerLoRA, LoRAAdapter
from llmserve.lora.layers import LoRABatch

logger = logging.getLogger(__name__)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/decoder_stack.h's kLora*
_MAX_CACHED = 16
"""Adapter capsules kept beyond the current step's (each holds its adapter alive; a dropped one
is rebuilt, a few tens of microseconds, the next time a step runs it)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    adapter: LoRAAdapter
    capsule: object
    cols: list[torch.Tensor]  # the capsule's column spans, kept alive with it


class FusedLoRA:
    """Builds and caches adapters' capsules for one `FusedDecoder`; `step` gives its LoRA argument."""

    def __init__(self, decoder: FusedDecoder, base_paths: dict[int, str]) -> None:
        """`base_paths`: id() of each base linear layer -> its module path (`LoRAManager.base_paths`)."""
        self.decoder = decoder
        # paths[l][j]: the module path of layer l's LORA_LINEARS[j] (None: an MoE layer's MLP)
        self.paths = [
            tuple(
                None if getattr(layer, name) is None else base_paths[id(getattr(layer, name))]
                for name in LORA_LINEARS
            )
            for layer in decoder.spec.layers
        ]
        self._fused_paths = {p for layer in self.paths for p in layer if p is not None}
        self._entries: dict[int, _Entry] = {}
        self._logged: dict[int, str] = {}

    def unsupported_reason(self, adapter: LoRAAdapter) -> str | None:
        """Why the fused decoder cannot add `adapter`'s deltas (None: it can)."""
        outside = sorted(set(adapter.layers) - self._fused_paths)
        if outside:
            return f"adapter {adapter.name!r} changes {outside[0]}, a layer the fused decoder has no LoRA for"
        for path, pair in adapter.layers.items():
            for t in (pair.a_t, pair.b_t):
                if t.device.type != "cpu" or t.dtype not in _DTYPES or not t.is_contiguous():
                    return f"adapter {adapter.name!r}'s {path} weights are {t.dtype} on {t.device}"
            if pair.a_t.dtype != pair.b_t.dtype:
                return f"adapter {adapter.name!r}'s {path} A and B differ in dtype"
        return None

    def step(self, batch: LoRABatch, num_tokens: int) -> tuple[tuple[object, ...], torch.Tensor] | None:
        """The fused decoder's `lora` argument for a step of `num_tokens` tokens running `batch`:
        the adapters' capsules and each token's index among them; None where an adapter of the
        step is one the fused decoder does not take (the step runs layer by layer)."""
        capsules = []
        for adapter in batch.adapters:
            entry = self._entries.get(id(adapter))
            if entry is None or entry.adapter is not adapter:
                if self._reason(adapter) is not None:
                    return None
                entry = self._build(adapter)
                if len(self._entries) >= _MAX_CACHED:
                    self._entries = {
                        id(a): self._entries[id(a)] for a in batch.adapters if id(a) in self._entries
                    }
                self._entries[id(adapter)] = entry
            capsules.append(entry.capsule)
        rows = batch.row_slots
        if rows is None:  # every token runs adapters[0]
            rows = torch.zeros(num_tokens, dtype=torch.int64)
        return tuple(capsules), rows

    def _reason(self, adapter: LoRAAdapter) -> str | None:
        """`unsupported_reason`, logged once per adapter id and reason (an adapter it takes is
        asked once: its capsule is cached; one it does not take is asked at each of its steps,
        a set difference of its layer names)."""
        reason = self.unsupported_reason(adapter)
        if reason is not None and self._logged.get(adapter.lora_int_id) != reason:
            logger.info("LoRA steps with %r run layer by layer: %s", adapter.name, reason)
            self._logged[adapter.lora_int_id] = reason
        return reason

    def _build(self, adapter: LoRAAdapter) -> _Entry:
        cols: list[torch.Tensor] = []
        layers = []
        dtype = 0
        for paths in self.paths:
            pairs: list[tuple | None] = []
            for path in paths:
                pair = adapter.layers.get(path) if path is not None else None
                if pair is None:
                    pairs.append(None)
                    continue
                dtype = _DTYPES[pair.a_t.dtype]
                cols.append(_column_spans(pair))
                pairs.append(
                    (pair.a_t.data_ptr(), pair.b_t.data_ptr(), cols[-1].data_ptr(), pair.a_t.shape[1])
                )
            layers.append(tuple(pairs))
        capsule = cpu_kernels.decoder_lora_new(self.decoder.capsule, dtype, layers)
        return _Entry(adapter, capsule, cols)


def _column_spans(pair: LayerLoRA) -> torch.Tensor:
    """[R, 2] int64: per rank row of B.T, its first non-zero column and one past its last ((0, 0)
    for a row of zeros)."""
    nonzero = pair.b_t != 0  # [R, N]
    n = nonzero.shape[1]
    first = nonzero.int().argmax(dim=1)
    last = n - nonzero.flip(1).int().argmax(dim=1)
    spans = torch.stack([first, last], dim=1).to(torch.int64)
    spans[~nonzero.any(dim=1)] = 0
    return spans.contiguous()

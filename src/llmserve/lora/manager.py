"""`LoRAManager`: the adapters an engine serves, and each step's adapter groups.

It wraps every linear layer of the model in a `LoRALinear` (once, after the runner has built
the fused CPU decoder from the bare layers), loads an adapter the first time a request names it,
keeps `max_cpu_loras` of them (least recently used dropped first; a dropped one is reloaded
from its folder when a step needs it again), and turns a step's per-sequence adapter ids into
groups of flat-batch rows that the wrappers read while the forward pass runs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from llmserve.config.lora import LoRAConfig
from llmserve.layers.linear import Linear
from llmserve.lora.adapter import LoRAAdapter, load_adapter
from llmserve.lora.layers import LoRABatch, LoRALinear, LoRAStep
from llmserve.lora.request import LoRARequest
from llmserve.models import CausalLM

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: CausalLM, config: LoRAConfig) -> None:
        param = next(model.parameters())
        # A quantized model computes in float32; its float params are norms in that dtype
        self.device, self.dtype = param.device, param.dtype
        self.model, self.config = model, config
        self.step = LoRAStep()
        self.requests: dict[int, LoRARequest] = {}
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_layers = _wrap_linears(model, self.step)
        logger.info(
            "LoRA on %d linear layers: steps with an adapter run the layer-by-layer path "
            "(the fused CPU decoder and CUDA graphs take no adapters)",
            self.num_layers,
        )

    @property
    def loaded_ids(self) -> list[int]:
        """Ids of the adapters loaded now, least recently used first."""
        return list(self._loaded)

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Register `request`'s adapter and load it now (so a bad folder fails the request that
        names it); an id already registered must name the same folder."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is already {known.lora_name!r} ({known.lora_path}); "
                f"got {request.lora_name!r} ({request.lora_path})"
            )
        adapter = self.get(request.lora_int_id, request)
        self.requests[request.lora_int_id] = request
        return adapter

    def get(self, lora_id: int, request: LoRARequest | None = None) -> LoRAAdapter:
        """The loaded adapter `lora_id` (loaded now if it is not), most recently used from now."""
        adapter = self._loaded.get(lora_id)
        if adapter is not None:
            self._loaded.move_to_end(lora_id)
            return adapter
        request = request or self.requests[lora_id]
        adapter = load_adapter(request, self.model, self.config.max_lora_rank, self.device, self.dtype)
        self._loaded[lora_id] = adapter
        while len(self._loaded) > self.config.num_cached:
            self._loaded.popitem(last=False)
        return adapter

    @contextmanager
    def activate(self, lora_ids: Sequence[int], num_tokens: Sequence[int]) -> Iterator[None]:
        """The wrappers apply these adapters while the block runs: sequence j's `num_tokens[j]`
        flat-batch rows take adapter `lora_ids[j]` (0: the base model)."""
        assert self.step.batch is None, "LoRAManager.activate does not nest"
        spans: dict[int, list[torch.Tensor]] = {}  # adapter -> its sequences' row ranges
        start = 0
        for lora_id, n in zip(lora_ids, num_tokens, strict=True):
            if lora_id:
                spans.setdefault(lora_id, []).append(torch.arange(start, start + n))
            start += n
        groups = []
        for lora_id, ranges in spans.items():
            rows = torch.cat(ranges)
            index = None if len(rows) == start else rows.to(self.device, non_blocking=True)
            groups.append((self.get(lora_id), index))
        self.step.batch = LoRABatch(tuple(groups))
        try:
            yield
        finally:
            self.step.batch = None


def _wrap_linears(model: CausalLM, step: LoRAStep) -> int:
    """Put a `LoRALinear` in place of every `Linear` of the model; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, layer in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear(layer, name, step))
    return len(targets)

"""`LoRAManager`: the adapters an engine serves, and each step's adapter groups.

It wraps every linear layer of the model in a `LoRALinear` (once, after the runner has built
the fused CPU decoder from the bare layers), loads an adapter the first time a request names it,
keeps `max_cpu_loras` of them (least recently used dropped first, but never one an unfinished
request runs; a dropped one is loaded again from its folder by the next request naming it),
forgets removed ones once their last request ends, and turns a step's per-sequence adapter ids into
groups of flat-batch rows that the wrappers read while the forward pass runs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from llmserve.config.lora import LoRAConfig
from llmserve.layers.linear import Linear
from llmserve.lora.adapter import LoRAAdapter, load_adapter
from llmserve.lora.layers import LoRABatch, LoRALinear, LoRAStep
from llmserve.lora.request import LoRARequest
from llmserve.models import CausalLM

if TYPE_CHECKING:
    from llmserve.distributed.sharding import TPShard

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: CausalLM, config: LoRAConfig, tp_shard: TPShard | None = None) -> None:
        """`tp_shard`: `model` is this tensor-parallel rank's shard; adapters are cut to it."""
        param = next(model.parameters())
        # A quantized model computes in float32; its float params are norms in that dtype
        self.device, self.dtype = param.device, param.dtype
        self.weights_dtype = self.dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        """What adapters' weights are kept in (`lora_dtype`); the deltas are computed in `dtype`."""
        self.model, self.config, self.tp_shard = model, config, tp_shard
        self.step = LoRAStep(use_triton=self.device.type == "cuda" and _has_triton())
        self.requests: dict[int, LoRARequest] = {}
        self.names: dict[int, str] = {}
        """Id -> name of every adapter ever added (a removed one's requests may still run)."""
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_layers = _wrap_linears(model, self.step)
        logger.info(
            "LoRA on %d linear layers: steps with an adapter run in the fused CPU decoder where it "
            "runs the model, else layer by layer (CUDA graphs take no adapters)",
            self.num_layers,
        )

    @property
    def loaded_ids(self) -> list[int]:
        """Ids of the adapters loaded now, least recently used first."""
        return list(self._loaded)

    def loaded(self, lora_id: int) -> LoRAAdapter | None:
        """Adapter `lora_id` if it is loaded now."""
        return self._loaded.get(lora_id)

    def add(self, request: LoRARequest, in_use: AbstractSet[int] = frozenset()) -> LoRAAdapter:
        """Register `request`'s adapter and load it now if it is not (so a bad folder fails the
        request that names it); an id already registered must name the same folder. `in_use`:
        the adapters of unfinished requests, which an eviction this makes leaves loaded."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is already {known.lora_name!r} ({known.lora_path}); "
                f"got {request.lora_name!r} ({request.lora_path})"
            )
        adapter = self._loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(
                request, self.model, self.config.max_lora_rank, self.device, self.weights_dtype, self.tp_shard
            )
            self._loaded[request.lora_int_id] = adapter
        self._loaded.move_to_end(request.lora_int_id)
        self.requests[request.lora_int_id] = request
        self.names[request.lora_int_id] = request.lora_name
        self._trim(in_use | {request.lora_int_id})
        return adapter

    def remove(self, lora_id: int, in_use: AbstractSet[int] = frozenset()) -> bool:
        """Forget adapter `lora_id` (False: it was not registered). Its weights go now, or, while
        requests in `in_use` still run it, at the first `trim` after they end."""
        if self.requests.pop(lora_id, None) is None:
            return False
        self._trim(in_use)
        return True

    @property
    def needs_trim(self) -> bool:
        """Whether `trim` has weights to drop: more than `max_cpu_loras` loaded, or a removed one."""
        return len(self._loaded) > self.config.num_cached or len(self._loaded) > len(
            self._loaded.keys() & self.requests.keys()
        )

    def trim(self, in_use: AbstractSet[int]) -> None:
        """Drop removed adapters, then the least recently used beyond `max_cpu_loras`, never one
        in `in_use` (an unfinished request's: it keeps its adapter to the end, so the cap may be
        exceeded while every loaded adapter is busy). A dropped registered adapter is loaded
        again from its folder by the next request that names it. (The wrappers keep the last
        adapter step's weights side by side until the next one: layers.py.)"""
        self._trim(in_use)

    def _trim(self, in_use: AbstractSet[int]) -> None:
        # (`add` and `remove` trim through this, not `trim`: a tensor-parallel driver's manager
        # mirrors each public call on the workers, whose own `add` / `remove` trim alike)
        for lora_id in [i for i in self._loaded if i not in self.requests and i not in in_use]:
            del self._loaded[lora_id]
        for lora_id in [i for i in self._loaded if i not in in_use]:
            if len(self._loaded) <= self.config.num_cached:
                break
            del self._loaded[lora_id]

    @contextmanager
    def activate(self, lora_ids: Sequence[int], num_tokens: Sequence[int]) -> Iterator[None]:
        """The wrappers apply these adapters while the block runs: sequence j's `num_tokens[j]`
        flat-batch rows take adapter `lora_ids[j]` (0: the base model)."""
        assert self.step.batch is None, "LoRAManager.activate does not nest"
        self.step.batch = self.batch(lora_ids, num_tokens)
        try:
            yield
        finally:
            self.step.batch = None

    def batch(self, lora_ids: Sequence[int], num_tokens: Sequence[int]) -> LoRABatch:
        """The step's adapters and each flat-batch row's index among them: sequence j's
        `num_tokens[j]` rows take adapter `lora_ids[j]` (0: the base model)."""
        # adapter id -> its index in the step's adapters, in id order: the same set of adapters
        # is the same tuple from step to step, which the wrappers' packed weights are kept for
        slots = {lora_id: slot for slot, lora_id in enumerate(sorted({i for i in lora_ids if i}))}
        row_slots: list[int] = []
        for lora_id, n in zip(lora_ids, num_tokens, strict=True):
            row_slots += [slots[lora_id] if lora_id else -1] * n
        adapters = []
        for lora_id in slots:
            adapters.append(self._loaded[lora_id])  # an unfinished request's adapter is never dropped
            self._loaded.move_to_end(lora_id)
        every_row = len(slots) == 1 and -1 not in row_slots  # one adapter, no base rows: no mask
        index = None if every_row else torch.tensor(row_slots).to(self.device, non_blocking=True)
        return LoRABatch(tuple(adapters), index)

    def base_paths(self) -> dict[int, str]:
        """id() of each wrapped base linear layer -> its module path (what `LoRAAdapter.layers`
        is keyed by)."""
        return {id(m.base): m.path for m in self.model.modules() if isinstance(m, LoRALinear)}


def _wrap_linears(model: CausalLM, step: LoRAStep) -> int:
    """Put a `LoRALinear` in place of every `Linear` of the model; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, layer in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear(layer, name, step))
    return len(targets)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

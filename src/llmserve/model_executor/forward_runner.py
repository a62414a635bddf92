"""`ForwardRunner`: owns the model's KV cache and runs one forward pass over a flat batch.

The caller says, per sequence, which new tokens to run, how long the context becomes and which
cache blocks hold it; the runner writes that into its persistent input buffers (`InputBuffers`:
token ids, positions, slot mapping, block tables), lets the attention backend build its per-step
metadata, and runs the stack the way this device runs it:

    fused CPU decoder   quantized Llama-family stacks on the CPU: the whole forward in one C++
                        call (layers/quantization/fused_decoder.py), chosen here, not by the model;
                        a tensor-parallel rank's shard too, over its group's shared memory
    CUDA graph          decode steps on CUDA, replayed from graphs captured at start-up
                        (cuda_graph.py wraps this runner)
    eager               the model's layer-by-layer forward, anything else; also every step
                        with a LoRA adapter in it that the fused decoder does not take (CUDA
                        graphs take none; `use_lora`)

It returns logits for the last new token of each sequence (or for every new token when asked,
for prompt logprobs and parity tests).

The KV cache holds one block more than the scheduler hands out: the pad block, where padding
rows (a CUDA graph's batch rounded up) write their K/V without touching a sequence's blocks.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from llmserve.layers.attention import Attention, KVCacheSpec, KVDtypes, KVPair, LayerKVCache
from llmserve.layers.quantization.fused_decoder import FusedDecoder, unsupported_reason
from llmserve.layers.quantization.layers import packed_weights
from llmserve.model_executor.cpu_memory import back_with_huge_pages, keep_freed_memory
from llmserve.model_executor.cuda_graph import GraphRunner
from llmserve.model_executor.device import DeviceProfile, build_profile
from llmserve.model_executor.input_buffers import ForwardOutput, InputBuffers, SequenceBatchEntry, StepInputs
from llmserve.models import CausalLM

if TYPE_CHECKING:
    from llmserve.distributed.group import TPGroup
    from llmserve.lora.fused import FusedLoRA
    from llmserve.lora.manager import LoRAManager

__all__ = ["ForwardOutput", "ForwardRunner", "SequenceBatchEntry", "runs_fused_decoder"]


class ForwardRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int = 16,
        kv_cache_dtype: torch.dtype | KVDtypes | None = None,
        profile: DeviceProfile | None = None,
        max_num_tokens: int = 256,
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        group: TPGroup | None = None,
    ) -> None:
        """`kv_cache_dtype`: what the cache stores K/V in (default: the model's dtype; a
        `KVDtypes` with K and V apart makes each layer's cache a `KVPair`). `profile`:
        the device's decisions (default: built for the model's device). The sizes are the input
        buffers' first allocation (they grow when a batch needs more)."""
        shape = model.kv_cache_shape()
        param = next(model.parameters())
        self.model = model
        self.device, self.dtype = param.device, param.dtype
        self.profile = profile or build_profile(self.device)
        if self.profile.keep_freed_memory:
            keep_freed_memory()  # activations are reused every step: no page faults on them
        if self.profile.huge_page_weights:  # each step streams them: fewer TLB misses
            back_with_huge_pages(w.data for w in packed_weights(model))
        kv_dtype = kv_cache_dtype or self.dtype
        self.num_blocks = num_blocks
        """Blocks the scheduler hands out (ids 0 .. num_blocks - 1)."""
        self.pad_block = num_blocks  # the extra block past the scheduler's
        self.spec = KVCacheSpec.build(
            num_blocks + 1, block_size, shape.num_kv_heads, shape.head_dim, kv_dtype
        )
        # One [2, num_kv_heads, num_blocks + 1, block_size, head_dim] tensor per layer (a KVPair of
        # two [num_kv_heads, ...] halves in one buffer when K and V have types of their own).
        self.kv_caches: list[LayerKVCache] = _allocate_kv_caches(self.spec, shape.num_layers, self.device)
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        self.backends = list({id(m.backend): m.backend for m in attention}.values())
        self.layer_params = list({m.params: None for m in attention})  # distinct, in layer order
        for backend in self.backends:
            backend.prepare(self.spec.dtypes)
        max_blocks = -(-(max_model_len or 2048) // block_size)
        self.buffers = InputBuffers(
            self.device, block_size, self.pad_block, max_num_tokens, max_num_seqs, max_blocks,
            pin_memory=self.profile.pin_memory, rope_axes=model.rope_axes,
        )  # fmt: skip
        self.group = group
        """A tensor-parallel rank's group (the model is its shard), or None."""
        self.fused: FusedDecoder | None = None
        self.fused_unsupported: str | None = "not a CPU profile"
        if self.profile.fused_cpu_decoder:
            self.use_fused(True)
        self.graphs: GraphRunner | None = None
        """Decode steps padded to fixed sizes (replayed from CUDA graphs where captured)."""
        self.lora: LoRAManager | None = None
        """LoRA adapters (`use_lora`); steps whose sequences all run the base model ignore it."""
        self._fused_lora: FusedLoRA | None = None

    def use_lora(self, manager: LoRAManager) -> None:
        """Serve LoRA adapters from now on. The manager wraps the model's linear layers, so this
        comes after the fused decoder took the bare layers' weights (it runs adapters' steps too,
        given their weights by lora/fused.py)."""
        self.lora = manager

    def fused_lora(self) -> FusedLoRA | None:
        """The adapters' bridge to the fused decoder in use (None: no fused decoder or no LoRA)."""
        if self.fused is None or self.lora is None:
            return None
        if self._fused_lora is None or self._fused_lora.decoder is not self.fused:
            from llmserve.lora.fused import FusedLoRA

            self._fused_lora = FusedLoRA(self.fused, self.lora.base_paths())
        return self._fused_lora

    def use_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> GraphRunner:
        """Run decode batches padded to the capture sizes from now on; `capture`: record CUDA
        graphs for them (call `graphs.capture()` next), else run the padded steps eagerly."""
        self.graphs = GraphRunner(self, max_num_seqs, max_model_len, capture)
        return self.graphs

    def use_fused(self, on: bool) -> None:
        """Run forwards through the fused CPU decoder (when it can take this model and cache) or
        through the model's layers; `fused_unsupported` says why not when it cannot."""
        self.fused, self.fused_unsupported = None, "turned off"
        if not on:
            return
        spec = self.model.decoder_spec()
        comm = None if self.group is None or self.group.shm is None else self.group.shm.handle
        if self.group is not None and comm is None:  # every rank decides alike: same model, same transport
            reason: str | None = (
                "tensor parallelism over gloo (a shard's stack sums over the shared-memory group)"
            )
        elif (
            self.group is not None and spec is not None and any(layer.qk_norm_whole for layer in spec.layers)
        ):
            reason = (
                "q and k normed over every head (OLMo 2): a shard's layers sum their squares over the group"
            )
        else:
            reason = "no decoder spec" if spec is None else unsupported_reason(spec, self.kv_caches)
        if self.group is not None and not self.group.all_ok(reason is None):
            # shards differ (an uneven split): one rank's refusal turns the fused stack off on all,
            # or the ranks' collectives would no longer pair
            reason = reason or "another tensor-parallel rank's shard cannot run the fused decoder"
        if reason is None:
            self.fused = FusedDecoder(spec, self.kv_caches, self.block_size, comm)
        self.fused_unsupported = reason

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def release(self, req_ids: list[str]) -> None:
        """Requests that finished or were preempted (the paged cache keeps nothing per request)."""

    def kv_bytes_per_token(self) -> int:
        """2 x layers x kv_heads x head_dim x dtype bytes."""
        return self.spec.bytes_per_token() * len(self.kv_caches)

    def prepare(
        self,
        batch: list[SequenceBatchEntry],
        width: int | None = None,
        logits_rows: Sequence[int] | None = None,
        layered: bool = False,
    ) -> StepInputs:
        """The step's inputs in the persistent buffers, with every backend's metadata built (none
        for the fused decoder, which attends in C++, unless `layered`: the model's layers run)."""
        inputs = self.buffers.fill(batch, width, logits_rows)
        if self.fused is None or layered:
            for backend in self.backends:
                backend.build_metadata(inputs.metadata, self.layer_params, self.spec)
        return inputs

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The stack over prepared inputs: hidden states [num_new_tokens, hidden]."""
        md = inputs.metadata
        if self.fused is not None:
            return self.fused(self.model.embed(inputs.input_ids), inputs.positions, md)
        return self.model(inputs.input_ids, inputs.model_positions, self.kv_caches, md)

    def forward(
        self, batch: list[SequenceBatchEntry], logits_rows: Sequence[int] | None = None
    ) -> ForwardOutput:
        """Run the model over the flat batch: hidden states [num_new_tokens, hidden], the
        metadata (of the padded step, for a batch the graph runner takes) and `logits_rows` (flat
        rows the caller projects to the vocabulary) on the device."""
        adapters = self.lora is not None and any(e.lora_id for e in batch)
        images = any(e.image_rows for e in batch)
        if adapters and not images and (out := self._forward_fused_lora(batch, logits_rows)) is not None:
            return out
        if adapters or images:
            # the model's layers: adapters' wrappers add each group's delta; images' vectors
            # replace their placeholders' embeddings (neither the fused decoder nor graphs take them)
            inputs = self.prepare(batch, logits_rows=logits_rows, layered=True)
            with (
                self.lora.activate([e.lora_id for e in batch], [len(e.new_token_ids) for e in batch])
                if adapters and self.lora is not None
                else contextlib.nullcontext()
            ):
                embeds = self._embed_images(inputs, batch) if images else None
                hidden = self.model(
                    inputs.input_ids, inputs.model_positions, self.kv_caches, inputs.metadata,
                    **({} if embeds is None else {"inputs_embeds": embeds}),
                )  # fmt: skip
            return ForwardOutput(hidden, inputs.metadata, inputs.logits_rows)
        if self.graphs is not None and self.graphs.applies(batch):
            return self.graphs.forward(batch, logits_rows)
        inputs = self.prepare(batch, logits_rows=logits_rows)
        return ForwardOutput(self.run(inputs), inputs.metadata, inputs.logits_rows)

    def _forward_fused_lora(
        self, batch: list[SequenceBatchEntry], logits_rows: Sequence[int] | None
    ) -> ForwardOutput | None:
        """A step with adapters through the fused decoder, each token adding its adapter's deltas;
        None where it cannot take the step (no fused decoder, or an adapter it has no LoRA for)."""
        bridge = self.fused_lora()
        if bridge is None:
            return None
        assert self.lora is not None
        num_tokens = [len(e.new_token_ids) for e in batch]
        lora = bridge.step(self.lora.batch([e.lora_id for e in batch], num_tokens), sum(num_tokens))
        if lora is None:
            return None
        inputs = self.prepare(batch, logits_rows=logits_rows)
        assert self.fused is not None
        hidden = self.fused(self.model.embed(inputs.input_ids), inputs.positions, inputs.metadata, lora)
        return ForwardOutput(hidden, inputs.metadata, inputs.logits_rows)

    def _embed_images(self, inputs: StepInputs, batch: list[SequenceBatchEntry]) -> torch.Tensor:
        """The step's input embeddings [T, hidden] with the images' vectors in their rows."""
        rows: list[int] = []
        vectors: list[torch.Tensor] = []
        first = 0
        for e in batch:
            for offset, v in e.image_rows:
                rows.extend(range(first + offset, first + offset + v.shape[0]))
                vectors.append(v)
            first += len(e.new_token_ids)
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.embed_with_images(inputs.input_ids, index, torch.cat(vectors))  # type: ignore[attr-defined]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """The LM head over selected hidden rows (a tensor-parallel driver's runner gathers the
        vocabulary shards here)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, batch: list[SequenceBatchEntry], all_logits: bool = False) -> torch.Tensor:
        """Logits [num_seqs, vocab] for each sequence's last new token ([num_new_tokens, vocab]
        over the whole batch when `all_logits`)."""
        last_rows = list(itertools.accumulate(len(e.new_token_ids) for e in batch))
        out = self.forward(batch, None if all_logits else [r - 1 for r in last_rows])
        return self.compute_logits(out.hidden if all_logits else out.rows())


def runs_fused_decoder(model: CausalLM, profile: DeviceProfile) -> bool:
    """Whether a runner of `model` on `profile`'s device will take the fused CPU decoder, given
    a KV cache it takes (the CPU's default caches are): `use_fused`'s choice made before the
    runner exists, for the step's token budget (config/scheduler.py)."""
    spec = model.decoder_spec() if profile.fused_cpu_decoder else None
    return spec is not None and unsupported_reason(spec, []) is None


def _allocate_kv_caches(spec: KVCacheSpec, num_layers: int, device: torch.device) -> list[LayerKVCache]:
    """Zeroed per-layer caches. On the CPU they are views of one anonymous memory map: the OS
    maps zero pages and commits each 4 KiB page when it is first written, so the resident memory
    follows the blocks in use, not the budget (torch.zeros writes every byte: a 2 GiB cache was
    2 GiB of RSS from start-up; numpy's zeros asks for huge pages, which commit 2 MiB per layer,
    head and half at the first block written: +360 MiB for one short request on the embedded
    model). The tensors keep the map alive."""
    if spec.dtypes.mixed:
        return _allocate_kv_pairs(spec, num_layers, device)
    if device.type != "cpu":
        return [torch.zeros(spec.shape(), dtype=spec.dtype, device=device) for _ in range(num_layers)]
    per_layer = math.prod(spec.shape())
    width = torch.empty((), dtype=spec.dtype).element_size()
    buffer = mmap.mmap(-1, max(1, num_layers * per_layer * width))  # anonymous: zero-filled, lazily
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(spec.dtype)
    return [flat[i * per_layer : (i + 1) * per_layer].view(spec.shape()) for i in range(num_layers)]


_HALF_ALIGN = 64
"""Bytes each half of a `KVPair` starts on: a dtype view needs its element's alignment (an int8
K half of 68-byte rows may end on any byte), and 64 keeps rows of either half cache-line aligned
as the single tensor's are."""


def _allocate_kv_pairs(spec: KVCacheSpec, num_layers: int, device: torch.device) -> list[LayerKVCache]:
    """K and V of their own dtypes: per layer, K's bytes then V's in one buffer (one anonymous
    map for all layers on the CPU, as above), each half viewed in its dtype and shape.

        layer l: [ K half: H_kv x blocks x bs x row_k (dtype k) | pad | V half (dtype v) | pad ]
    """
    d = spec.dtypes
    sizes = [math.prod(spec.half_shape(h)) * dt.itemsize for h, dt in enumerate((d.k, d.v))]
    padded = [-(-n // _HALF_ALIGN) * _HALF_ALIGN for n in sizes]
    per_layer = sum(padded)
    if device.type == "cpu":
        raw = torch.frombuffer(mmap.mmap(-1, max(1, num_layers * per_layer)), dtype=torch.uint8)
    else:
        raw = torch.zeros(num_layers * per_layer, dtype=torch.uint8, device=device)
    caches: list[LayerKVCache] = []
    for i in range(num_layers):
        k0, v0 = i * per_layer, i * per_layer + padded[0]
        k = raw[k0 : k0 + sizes[0]].view(d.k).view(spec.half_shape(0))
        v = raw[v0 : v0 + sizes[1]].view(d.v).view(spec.half_shape(1))
        caches.append(KVPair(k, v))
    return caches


def kv_cache_nbytes(cache: LayerKVCache) -> int:
    """Bytes of one layer's cache (both halves)."""
    return cache.nbytes() if isinstance(cache, KVPair) else cache.numel() * cache.element_size()

"""The transformers fallback: an architecture llmserve has no native implementation of runs
through transformers' own modelling code, inside the same engine.

    scheduler -> ModelRunner (sampling, grammars, logprobs) -> TransformersForwardRunner
                                                              -> one HF forward per sequence

Everything above the forward pass is the engine's own: continuous batching, chunked prefill,
preemption, the sampler, structured outputs, streaming, metrics. Below it, each sequence keeps a
transformers `DynamicCache` of its own, and each step calls the HF model once per scheduled
sequence (its prefill chunk, or its one decode token). The scheduler still budgets KV blocks, so
memory stays bounded the same way, but what it gives up is real: no paged attention (so no prefix
caching: the engine turns it off), no quantized or oneDNN kernels, no batching across sequences in
the forward pass. It is several times slower than a native model; the load report says so.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.model_executor.device import build_profile, resolve_device
from llmserve.model_executor.forward_runner import ForwardOutput, SequenceBatchEntry
from llmserve.model_executor.model_loader import LoadedModel, ModelSource
from llmserve.models.base import KVCacheShape

logger = logging.getLogger("llmserve")


class TransformersCausalLM(nn.Module):
    """A transformers `*ForCausalLM` behind the two calls the engine makes of a model outside the
    forward pass: its KV geometry (for the cache budget) and `compute_logits` (the runner's forward
    already returns logits, so it is the identity)."""

    def __init__(self, hf_model: Any) -> None:
        super().__init__()
        self.hf = hf_model
        text = getattr(hf_model.config, "text_config", None) or hf_model.config
        self.text_config = text

    def kv_cache_shape(self) -> KVCacheShape:
        c = self.text_config
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None) or 1
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 0)
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 0)
        return KVCacheShape(int(layers), int(kv_heads), int(head_dim))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def load_transformers_model(
    config: ModelConfig, source: ModelSource, hf_config: Any, why: str
) -> LoadedModel:
    """Load an HF folder with transformers' `AutoModelForCausalLM` (safetensors, or .bin through
    transformers' weights-only loader; no remote code)."""
    import transformers

    start = time.perf_counter()
    if source.kind != "hf":
        raise ValueError(
            f"{source.path}: the transformers implementation loads HF model folders, not GGUF files"
        )
    device = resolve_device(config.device)
    # transformers runs its own attention and no graphs: the profile's dtypes and host choices
    profile = build_profile(device, "torch", enforce_eager=True)
    dtype = profile.model_dtype(config.dtype, hf_config)
    logger.warning(
        "%s: running on transformers' modelling code (%s): several times slower than native", source.name, why
    )
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            source.path, dtype=dtype, trust_remote_code=False
        )
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{source.path}: transformers cannot load this model: {e}") from None
    hf.to(device).eval()
    model = TransformersCausalLM(hf)
    params = {id(p): p for p in hf.parameters()}.values()
    limit = int(
        getattr(model.text_config, "max_position_embeddings", 0)
        or getattr(model.text_config, "n_positions", 0)
        or 2048
    )
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's maximum context of {limit} tokens"
        )
    loaded = LoadedModel(
        model=model,  # type: ignore[arg-type]
        hf_config=hf_config,
        source=source,
        dtype=dtype,
        device=device,
        checkpoint_format="safetensors (transformers)",
        num_params=sum(p.numel() for p in params),
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        load_seconds=time.perf_counter() - start,
        max_model_len=config.max_model_len or limit,
        linear_kernel="transformers",
        model_impl="transformers",
        profile=profile,
    )
    logger.info(loaded.summary())
    return loaded


class TransformersForwardRunner:
    """`ForwardRunner`'s forward for a `TransformersCausalLM`: one transformers call per sequence,
    each with its own `DynamicCache`; returns logits for every new token (as the native runner
    returns hidden states), in batch order."""

    def __init__(self, model: TransformersCausalLM) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.caches: dict[str, Any] = {}
        # transformers renamed `past_key_values` to `cache` (5.x); older versions know only the first
        params = inspect.signature(model.hf.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def release(self, req_ids: list[str]) -> None:
        """Drop the caches of sequences that finished or were preempted (recomputed from scratch)."""
        for req_id in req_ids:
            self.caches.pop(req_id, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def forward(
        self, batch: list[SequenceBatchEntry], logits_rows: Sequence[int] | None = None
    ) -> ForwardOutput:
        """One HF forward per sequence; the "hidden states" are already logits (its LM head ran)."""
        from transformers import DynamicCache

        rows = []
        for entry in batch:
            start = entry.seq_len - len(entry.new_token_ids)
            cache = self.caches.get(entry.req_id) if start else None
            if cache is None:
                if start:  # never happens: the engine runs this model without prefix caching
                    raise RuntimeError(f"{entry.req_id}: no cache for a sequence resumed at position {start}")
                cache = DynamicCache(config=self.model.hf.config)
            if cache.get_seq_length() > start:  # speculative tokens the last step rejected
                cache.crop(start - cache.get_seq_length())  # negative: drop that many (both APIs)
            assert cache.get_seq_length() == start, (entry.req_id, cache.get_seq_length(), start)
            positions = torch.arange(start, entry.seq_len, device=self.device)
            out = self.model.hf(
                input_ids=torch.tensor([entry.new_token_ids], device=self.device),
                position_ids=positions[None],
                cache_position=positions,
                use_cache=True,
                **{self._cache_arg: cache},
            )
            self.caches[entry.req_id] = cache  # filled in place
            rows.append(out.logits[0].float())
        selected = None if logits_rows is None else torch.tensor(logits_rows, device=self.device)
        return ForwardOutput(torch.cat(rows), None, selected)

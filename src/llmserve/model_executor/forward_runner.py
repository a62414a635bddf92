"""`ForwardRunner`: owns the model's KV cache and runs one forward pass over a flat batch.

The caller says, per sequence, which new tokens to run, how long the context becomes and which
cache blocks hold it; the runner flattens that into (input_ids, positions, AttentionMetadata),
runs the model, and returns logits for the last new token of each sequence (or for every new
token when asked, for prompt logprobs and parity tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.layers.attention import Attention, AttentionMetadata, KVCacheSpec
from llmserve.model_executor.cpu_memory import keep_freed_memory
from llmserve.models import CausalLM


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, quantized: bool = False, device: torch.device | str = "cpu"
) -> torch.dtype:
    """`CacheConfig.kv_cache_dtype` as a torch dtype. `auto` is the model's dtype, except for a
    float32 model on the CPU whose linear layers run quantized (`quantized`: a GGUF quant file, or
    `--quantization int8|int4`): its K/V are kept in float16, llama.cpp's default cache type. Its
    weights are already rounded to 8 or 4 bits, and decode attention at a batch of 16 reads K/V for
    about a third of a step: half the bytes make the step 1.2x faster and the cache hold twice the
    tokens (docs/benchmarks.md)."""
    if name != "auto":
        return getattr(torch, name)
    if quantized and model_dtype == torch.float32 and torch.device(device).type == "cpu":
        return torch.float16
    return model_dtype


@dataclass(frozen=True, slots=True)
class SequenceBatchEntry:
    """One sequence's part of a forward pass."""

    new_token_ids: list[int]
    """Tokens to run now: the last `len(new_token_ids)` tokens of the context."""
    seq_len: int
    """Context length after this step (tokens already cached + new ones)."""
    block_ids: list[int]
    """Cache blocks holding this sequence, in order; enough for `seq_len` tokens."""
    req_id: str = ""
    """The request it belongs to (runners that keep per-request state use it)."""


class ForwardRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int = 16,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`kv_cache_dtype`: what the cache stores K/V in (default: the model's dtype)."""
        shape = model.kv_cache_shape()
        param = next(model.parameters())
        self.model = model
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":
            keep_freed_memory()  # activations are reused every step: no page faults on them
        kv_dtype = kv_cache_dtype or self.dtype
        self.spec = KVCacheSpec(num_blocks, block_size, shape.num_kv_heads, shape.head_dim, kv_dtype)
        # One [2, num_kv_heads, num_blocks, block_size, head_dim] tensor per layer.
        self.kv_caches = [
            torch.zeros(self.spec.shape(), dtype=kv_dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]
        for backend in {
            id(m.backend): m.backend for m in model.modules() if isinstance(m, Attention)
        }.values():
            backend.prepare(kv_dtype)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def release(self, req_ids: list[str]) -> None:
        """Requests that finished or were preempted (the paged cache keeps nothing per request)."""

    def kv_bytes_per_token(self) -> int:
        """2 x layers x kv_heads x head_dim x dtype bytes."""
        return self.spec.bytes_per_token() * len(self.kv_caches)

    def forward(self, batch: list[SequenceBatchEntry]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Run the model over the flat batch: hidden states [num_new_tokens, hidden] and the metadata."""
        ids: list[int] = []
        positions: list[int] = []
        for entry in batch:
            ids.extend(entry.new_token_ids)
            positions.extend(range(entry.seq_len - len(entry.new_token_ids), entry.seq_len))
        md = AttentionMetadata.build(
            query_lens=[len(e.new_token_ids) for e in batch],
            seq_lens=[e.seq_len for e in batch],
            block_tables=[e.block_ids for e in batch],
            block_size=self.block_size,
            device=self.device,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(input_ids, pos, self.kv_caches, md), md

    @torch.inference_mode()
    def execute(self, batch: list[SequenceBatchEntry], all_logits: bool = False) -> torch.Tensor:
        """Logits [num_seqs, vocab] for each sequence's last new token ([num_new_tokens, vocab]
        over the whole batch when `all_logits`)."""
        hidden, md = self.forward(batch)
        if not all_logits:
            last = torch.tensor(md.query_start_loc[1:], device=self.device) - 1
            hidden = hidden.index_select(0, last)  # only the rows that are sampled
        return self.model.compute_logits(hidden)

"""GPT-2 (GPT2LMHeadModel): learned absolute positions, pre-LayerNorm blocks, biases everywhere.

    x = wte(ids) + wpe(positions)
    for each block:
        x = x + c_proj(attn(q, k, v))            q, k, v = split(c_attn(ln_1(x)))
        x = x + mlp.c_proj(gelu_tanh(c_fc(ln_2(x))))
    logits = wte^T @ ln_f(x)                     (tied unless the config says otherwise)

Attention scale: 1/sqrt(head_dim) if `scale_attn_weights` (else 1), further divided by
(layer_idx + 1) if `scale_attn_by_inverse_layer_idx`.

HF stores GPT-2's projections as `Conv1D` weights, [in, out], the transpose of `nn.Linear`'s
[out, in] that `Linear.load_shard` expects; `load_weights` hands them over transposed (a view,
so each weight is still copied exactly once). Checkpoints saved before `GPT2LMHeadModel` existed
(the original hub `gpt2`) name tensors without the `transformer.` prefix; both spellings load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmserve.layers.activation import get_activation
from llmserve.layers.attention import Attention, AttentionBackend, AttentionMetadata, LayerKVCache
from llmserve.layers.layernorm import LayerNorm
from llmserve.layers.linear import Linear
from llmserve.layers.vocab_embedding import LMHead, PositionEmbedding, VocabEmbedding
from llmserve.models.base import CausalLM, KVCacheShape

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        H, n_head = config.n_embd, config.n_head
        if H % n_head != 0:
            raise ValueError(f"GPT-2: n_embd ({H}) must be a multiple of n_head ({n_head})")
        D = H // n_head
        scale = D**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.hidden_size = H
        # One checkpoint tensor holds q, k and v side by side, so the fused layer is a single shard.
        self.c_attn = Linear(H, 3 * H, bias=True)
        self.c_proj = Linear(H, H, bias=True)
        # `reorder_and_upcast_attn` only changes where HF upcasts to fp32 in eager fp16 attention;
        # the math is the same, so it needs nothing here.
        self.attn = Attention(n_head, D, n_head, scale=scale, backend=backend)

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.hidden_size, dim=-1)  # [T, 3H] -> 3 x [T, H]
        return self.c_proj(self.attn(q, k, v, kv_cache, md))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        H = config.n_embd
        inner = getattr(config, "n_inner", None) or 4 * H
        self.c_fc = Linear(H, inner, bias=True)
        self.c_proj = Linear(inner, H, bias=True)
        self.act = get_activation(getattr(config, "activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        H, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = LayerNorm(H, eps)
        self.attn = GPT2Attention(config, layer_idx, backend)
        self.ln_2 = LayerNorm(H, eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache, md: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, md)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention (an encoder-decoder half) is not supported")
        self.wte = VocabEmbedding(config.vocab_size, config.n_embd)
        self.wpe = PositionEmbedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i, backend) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKVCache],
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            x = block(x, kv_cache, md)
        return self.ln_f(x)


def _conv1d_as_linear(
    weights: Iterable[tuple[str, torch.Tensor, str]],
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Present HF Conv1D weights ([in, out]) in nn.Linear's [out, in] layout, as a view."""
    for name, tensor, file in weights:
        if name.endswith(_CONV1D) and isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
            tensor = tensor.t()
        yield name, tensor, file


class GPT2LMHeadModel(CausalLM):
    backbone_name = "transformer"

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config)
        self.transformer = GPT2Model(config, backend)
        tied = getattr(config, "tie_word_embeddings", True)
        self.lm_head = LMHead(config.vocab_size, config.n_embd, self.transformer.wte if tied else None)

    def kv_cache_shape(self) -> KVCacheShape:
        c = self.config
        return KVCacheShape(c.n_layer, c.n_head, c.n_embd // c.n_head)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        super().load_weights(_conv1d_as_linear(weights))

    def map_weight_name(self, name: str) -> str | None:
        if name == "lm_head.weight":
            return super().map_weight_name(name)
        if not name.startswith("transformer."):
            name = "transformer." + name  # the original hub checkpoint: "h.0.attn.c_attn.weight"
        return name

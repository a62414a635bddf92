"""Gemma 3 as a bidirectional encoder (HF `Gemma3TextModel` with `use_bidirectional_attention`:
EmbeddingGemma), served for embeddings as bert.py's encoders are.

    x = embed(ids) * sqrt(hidden)                  (the scale rounded to the weights' dtype, as HF does)
    for each layer: Gemma 3's (gemma3.py): sandwich RMSNorms (1 + w), q/k norms per head, RoPE with
        the layer type's base, GELU-tanh gated MLP, scale query_pre_attn_scalar ** -0.5, but
        attention both ways: `full_attention` layers see the whole input, `sliding_attention`
        layers the positions less than `sliding_window` away on either side (transformers' mask)
    -> norm(x), pooled as its sentence-transformers config says (mean), then its Dense layers
       (model_loader/st_dense.py) and the normalisation

Each input runs whole in one step through the encoder runner (no KV cache, no chunked prefill).
Checkpoint names are `Gemma3TextModel`'s (`layers.0.self_attn.q_proj.weight`, no `model.` prefix).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from llmserve.layers.attention import AttentionBackend
from llmserve.layers.attention.encoder import EncoderMetadata, bidirectional_attention
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.rotary_embedding import RotaryEmbedding
from llmserve.layers.vocab_embedding import VocabEmbedding
from llmserve.models.base import QKV_GATE_UP_STACKING
from llmserve.models.bert import RopeEncoder
from llmserve.models.gemma3 import (
    SLIDING,
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3Model,
    gemma3_rope_parameters,
    layer_types_of,
)
from llmserve.models.llama import head_dim_of


class Gemma3EncoderAttention(Gemma3Attention):
    """Gemma 3's projections and q/k norms (gemma3.py), attending both ways without a cache."""

    def __init__(self, config: Any, layer_type: str, backend: AttentionBackend | None = None) -> None:
        super().__init__(config, layer_type, None)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.layer_type = layer_type
        # transformers' bidirectional window: |i - j| < sliding_window; bidirectional_attention's: <= w
        self.window = int(config.sliding_window) - 1 if layer_type == SLIDING else None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rope: RotaryEmbedding,
                md: EncoderMetadata) -> torch.Tensor:  # fmt: skip
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rope(self.q_norm(q.reshape(T, self.num_heads, D)), *cos_sin)  # [T, nh, D]
        k = rope(self.k_norm(k.reshape(T, self.num_kv_heads, D)), *cos_sin)  # [T, nkv, D]
        v = v.reshape(T, self.num_kv_heads, D)
        group = self.num_heads // self.num_kv_heads  # grouped-query: each KV head serves `group` heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.o_proj(bidirectional_attention(q, k, v, md, self.scale, self.window))


class Gemma3EncoderLayer(Gemma3DecoderLayer):
    attention_cls = Gemma3EncoderAttention


class Gemma3EmbeddingModel(RopeEncoder):
    """HF `Gemma3TextModel` with bidirectional attention (EmbeddingGemma)."""

    stacked_params = QKV_GATE_UP_STACKING
    uses_token_types = False
    ignored_weights: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        """`backend` is unused: an encoder attends without a cache (layers/attention/encoder.py)."""
        if not getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma3TextModel without use_bidirectional_attention is a causal decoder saved without its "
                "LM head; only the bidirectional one (EmbeddingGemma) is supported"
            )
        super().__init__(config)
        H = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, H)
        self.register_buffer("embed_scale", torch.tensor(H**0.5, dtype=torch.float32), persistent=False)
        self.layer_types = layer_types_of(config)
        self.layers = nn.ModuleList(Gemma3EncoderLayer(config, t, None) for t in self.layer_types)
        self.norm = RMSNorm(H, config.rms_norm_eps, weight_offset=1.0)
        D = head_dim_of(config)
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(D, D, config.max_position_embeddings, gemma3_rope_parameters(config, t))
             for t in sorted(set(self.layer_types))}
        )  # fmt: skip

    def input_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def output_states(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    embed = Gemma3Model.embed_scaled  # the token rows times sqrt(hidden), rounded as HF rounds it

    def map_weight_name(self, name: str) -> str | None:
        return name.removeprefix("model.")

"""BERT (HF `BertModel`): an encoder-only model, served for embeddings only.

    x = LayerNorm(word(ids) + position(positions) + token_type(0))
    for each layer (post-LayerNorm):
        x = LayerNorm(x + dense(attn(q, k, v)))      bidirectional: each token sees its whole sequence
        x = LayerNorm(x + out(gelu(intermediate(x))))
    -> hidden [T, H], the `last_hidden_state` that sentence-transformers pools

Every input is one segment (token type 0), as sentence-transformers encodes a sentence. There is
no KV cache and no LM head: the engine runs BERT through `EncoderForwardRunner`
(model_executor/encoder_runner.py), which hands the model each sequence whole, and refuses
generation requests. Checkpoint names are HF's (`encoder.layer.0.attention.self.query.weight`);
query, key and value load into one fused `qkv` layer; `pooler.*` (the next-sentence head's
dense + tanh, which sentence embeddings do not read) is skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from llmserve.layers.activation import get_activation
from llmserve.layers.attention import AttentionBackend
from llmserve.layers.attention.encoder import EncoderMetadata, bidirectional_attention
from llmserve.layers.layernorm import LayerNorm
from llmserve.layers.linear import Linear
from llmserve.layers.vocab_embedding import PositionEmbedding, VocabEmbedding
from llmserve.models.base import CausalLM, KVCacheShape


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        H = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, H)
        self.position_embeddings = PositionEmbedding(config.max_position_embeddings, H)
        self.token_type_embeddings = PositionEmbedding(config.type_vocab_size, H)
        self.LayerNorm = LayerNorm(H, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])  # one segment: type 0


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        H, n_heads = config.hidden_size, config.num_attention_heads
        if H % n_heads != 0:
            raise ValueError(f"BERT: hidden_size ({H}) must be a multiple of num_attention_heads ({n_heads})")
        self.n_heads, self.head_dim = n_heads, H // n_heads
        self.qkv = Linear(H, [H, H, H], bias=True)

    def forward(self, x: torch.Tensor, md: EncoderMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.n_heads, self.head_dim).unbind(1)  # 3 x [T, nh, D]
        return bidirectional_attention(q, k, v, md, self.head_dim**-0.5)


class BertDenseNorm(nn.Module):
    """`LayerNorm(residual + dense(x))`: HF's BertSelfOutput and BertOutput."""

    def __init__(self, in_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden_size, bias=True)
        self.LayerNorm = LayerNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)  # HF's name: the checkpoint says `attention.self.query`
        self.output = BertDenseNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, md: EncoderMetadata) -> torch.Tensor:
        return self.output(self.self(x, md), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, I]
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, md: EncoderMetadata) -> torch.Tensor:
        x = self.attention(x, md)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(CausalLM):
    """HF `BertModel` (the checkpoint sentence-transformers' BERT models ship)."""

    is_encoder = True
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        "query": ("qkv", 0),
        "key": ("qkv", 1),
        "value": ("qkv", 2),
    }
    ignored_weights: ClassVar[tuple[str, ...]] = ("pooler.", "embeddings.position_ids")

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        """`backend` (the paged attention backend the loader offers every model) is unused: an
        encoder attends without a cache (layers/attention/encoder.py)."""
        super().__init__(config)
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"BERT: position_embedding_type {kind!r} is not supported (only 'absolute')")
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError("BERT as a decoder (is_decoder, add_cross_attention) is not supported")
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], from 0 in each sequence
        md: EncoderMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, md)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("BERT has no LM head: it serves embeddings only")

    def kv_cache_shape(self) -> KVCacheShape:
        raise ValueError("BERT keeps no KV cache")

    def use_onednn(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_onednn()
            elif isinstance(module, VocabEmbedding):
                module.use_rows()

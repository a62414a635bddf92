"""nomic-bert (nomic-embed-text v1 / v1.5, as Ollama and llama.cpp ship it in GGUF): a BERT encoder
with rotary positions and a SwiGLU MLP, served for embeddings as bert.py's encoders are.

    x = LayerNorm(word_embeddings(ids) + token_type_embeddings[0])     no position embeddings
    for each layer (post-LayerNorm, as BERT):
        q, k, v = split(Wqkv(x));  q, k = rope(q), rope(k)              every layer, one RoPE base
        x = norm1(x + out_proj(attn(q, k, v)))                          bidirectional, 1/sqrt(head_dim)
        x = norm2(x + fc2(fc11(x) * silu(fc12(x))))                     fc11 the up, fc12 the gate
    -> x, pooled as the file's `pooling_type` says (mean)

Names are nomic's HF checkpoint's (`encoder.layers.0.attn.Wqkv`, `emb_ln`), which llama.cpp's tensor
map gives for its `nomic-bert` files (model_loader/gguf_names.py). Its HF folders need nomic's own
modelling code (`trust_remote_code`), which llmserve does not run: GGUF files only. The MoE variant
(`nomic-bert-moe`, nomic-embed-text-v2) is not supported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from llmserve.layers.attention import AttentionBackend
from llmserve.layers.attention.encoder import EncoderMetadata, bidirectional_attention
from llmserve.layers.layernorm import LayerNorm
from llmserve.layers.linear import Linear
from llmserve.layers.rotary_embedding import RotaryEmbedding
from llmserve.layers.vocab_embedding import VocabEmbedding
from llmserve.models.bert import RopeEncoder

FULL = "full_attention"


class NomicBertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        H, n_heads = config.hidden_size, config.num_attention_heads
        self.n_heads, self.head_dim = n_heads, H // n_heads
        self.Wqkv = Linear(H, 3 * H, bias=False)  # [q | k | v] rows
        self.out_proj = Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rope: RotaryEmbedding,
                md: EncoderMetadata) -> torch.Tensor:  # fmt: skip
        T = x.shape[0]
        q, k, v = self.Wqkv(x).view(T, 3, self.n_heads, self.head_dim).unbind(1)  # 3 x [T, nh, D]
        q, k = rope(q, *cos_sin), rope(k, *cos_sin)
        return self.out_proj(bidirectional_attention(q, k, v, md, self.head_dim**-0.5))


class NomicBertMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        H, inner = config.hidden_size, config.intermediate_size
        self.fc11 = Linear(H, inner, bias=False)  # up
        self.fc12 = Linear(H, inner, bias=False)  # gate
        self.fc2 = Linear(inner, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc11(x) * F.silu(self.fc12(x)))


class NomicBertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attn = NomicBertAttention(config)
        self.norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = NomicBertMLP(config)
        self.norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x, cos_sin, rope, md) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = self.norm1(x + self.attn(x, cos_sin, rope, md))
        return self.norm2(x + self.mlp(x))


class NomicBertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        H = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, H)
        self.token_type_embeddings = VocabEmbedding(config.type_vocab_size, H)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # every token is of type 0 (nomic's models are not pair encoders; llama.cpp adds row 0 too)
        return self.word_embeddings(input_ids) + self.token_type_embeddings(
            input_ids.new_zeros(1)
        )  # [T, H] + [1, H]


class NomicBertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NomicBertLayer(config) for _ in range(config.num_hidden_layers))


class NomicBertModel(RopeEncoder):
    """nomic-bert (see the module's docstring)."""

    uses_token_types = False

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        """`backend` is unused: an encoder attends without a cache (layers/attention/encoder.py)."""
        super().__init__(config)
        self.embeddings = NomicBertEmbeddings(config)
        self.emb_ln = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.encoder = NomicBertEncoder(config)
        self.layer_types = [FULL] * config.num_hidden_layers
        D = config.hidden_size // config.num_attention_heads
        rope = {"rope_type": "default", "rope_theta": float(config.rotary_emb_base)}
        self.rotary = nn.ModuleDict({FULL: RotaryEmbedding(D, D, config.max_position_embeddings, rope)})

    @property
    def layers(self) -> nn.ModuleList:  # (RopeEncoder.forward runs them)
        return self.encoder.layers

    def input_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb_ln(self.embeddings(input_ids))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)

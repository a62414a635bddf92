"""ModernBERT encoders (HF `ModernBertModel`, e.g. nomic-ai/modernbert-embed-base and
Alibaba-NLP/gte-modernbert-base, and `ModernBertForSequenceClassification`, e.g. rerankers): served
for embeddings, scores of text pairs and classification, as bert.py's encoders are.

    x = LayerNorm(tok_embeddings(ids))                       no position or token-type embeddings
    for each layer (pre-LayerNorm; layer 0's attention reads x unnormed):
        q, k, v = split(Wqkv(norm(x)));  q, k = rope(q), rope(k)     that layer type's RoPE base
        x = x + Wo(attn(q, k, v))        bidirectional; `sliding_attention` layers see +-local_attention/2
        x = x + Wo(act(a) * g),  a, g = split(Wi(norm(x)))           GeGLU (config.hidden_activation)
    -> LayerNorm(x)                                          final_norm: the last_hidden_state pooled

Every third layer (`global_attn_every_n_layers`, or the config's `layer_types`) attends to the whole
sequence with the global RoPE base (160,000); the others to a window of `local_attention` positions
with the local base (10,000). LayerNorms and linear layers have no biases unless the config says so.
A classifier pools the first token (`classifier_pooling` "cls") or the mean of all of them ("mean"),
then head = LayerNorm(act(dense(pooled))), score = classifier(head). Checkpoint names are HF's
(`layers.0.attn.Wqkv.weight`); a masked-LM checkpoint's `model.` prefix is dropped and its LM head
(`head.`, `decoder.`) skipped.
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
from llmserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from llmserve.layers.vocab_embedding import VocabEmbedding
from llmserve.models.bert import ClassifierOutputs, RopeEncoder

SLIDING, FULL = "sliding_attention", "full_attention"


def modernbert_layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if not types:  # configs before transformers 5 give the period instead
        every = int(getattr(config, "global_attn_every_n_layers", 3))
        types = [SLIDING if i % every else FULL for i in range(config.num_hidden_layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"ModernBERT: unsupported layer types {unknown}; supported: {SLIDING}, {FULL}")
    return list(types)


def modernbert_rope(config: Any, layer_type: str) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        return rope_parameters(config, layer_type)
    key = "local_rope_theta" if layer_type == SLIDING else "global_rope_theta"
    return {
        "rope_type": "default",
        "rope_theta": float(getattr(config, key, 10000.0 if layer_type == SLIDING else 160000.0)),
    }


class ModernBertAttention(nn.Module):
    def __init__(self, config: Any, layer_type: str) -> None:
        super().__init__()
        H, n_heads = config.hidden_size, config.num_attention_heads
        if H % n_heads != 0:
            raise ValueError(
                f"ModernBERT: hidden_size ({H}) must be a multiple of num_attention_heads ({n_heads})"
            )
        self.n_heads, self.head_dim = n_heads, H // n_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.Wqkv = Linear(H, 3 * H, bias=bias)  # stored fused: [q | k | v] rows
        self.Wo = Linear(H, H, bias=bias)
        self.layer_type = layer_type
        # transformers' mask: |i - j| <= local_attention // 2 (its `sliding_window`)
        self.window = int(config.local_attention) // 2 if layer_type == SLIDING else None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rope: RotaryEmbedding,
                md: EncoderMetadata) -> torch.Tensor:  # fmt: skip
        T = x.shape[0]
        q, k, v = self.Wqkv(x).view(T, 3, self.n_heads, self.head_dim).unbind(1)  # 3 x [T, nh, D]
        q, k = rope(q, *cos_sin), rope(k, *cos_sin)
        return self.Wo(bidirectional_attention(q, k, v, md, self.head_dim**-0.5, self.window))


class ModernBertMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = get_activation(getattr(config, "hidden_activation", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(a) * g)


class ModernBertLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        H, eps, bias = config.hidden_size, config.norm_eps, bool(getattr(config, "norm_bias", False))
        self.attn_norm = LayerNorm(H, eps, bias) if layer_idx else None  # layer 0: the embeddings' norm
        self.attn = ModernBertAttention(config, layer_type)
        self.mlp_norm = LayerNorm(H, eps, bias)
        self.mlp = ModernBertMLP(config)

    def forward(self, x, cos_sin, rope, md) -> torch.Tensor:  # type: ignore[no-untyped-def]
        h = x if self.attn_norm is None else self.attn_norm(x)
        x = x + self.attn(h, cos_sin, rope, md)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tok_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.norm = LayerNorm(config.hidden_size, config.norm_eps, bool(getattr(config, "norm_bias", False)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertModel(RopeEncoder):
    """HF `ModernBertModel` (the checkpoint sentence-transformers' ModernBERT models ship)."""

    uses_token_types = False  # pairs are `[CLS] a [SEP] b [SEP]`, one segment
    ignored_weights: ClassVar[tuple[str, ...]] = ("head.", "decoder.")

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        """`backend` is unused: an encoder attends without a cache (layers/attention/encoder.py)."""
        super().__init__(config)
        self.layer_types = modernbert_layer_types(config)
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, t) for i, t in enumerate(self.layer_types))
        self.final_norm = LayerNorm(
            config.hidden_size, config.norm_eps, bool(getattr(config, "norm_bias", False))
        )
        D = config.hidden_size // config.num_attention_heads
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(D, D, config.max_position_embeddings, modernbert_rope(config, t)) for t in sorted(set(self.layer_types))}
        )  # fmt: skip

    def input_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids)

    def output_states(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(x)

    def map_weight_name(self, name: str) -> str | None:
        return name.removeprefix("model.")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.tok_embeddings(input_ids)


class ModernBertPredictionHead(nn.Module):
    """HF's: `norm(act(dense(x)))`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        H = config.hidden_size
        self.dense = Linear(H, H, bias=bool(getattr(config, "classifier_bias", False)))
        self.act = get_activation(getattr(config, "classifier_activation", "gelu"))
        self.norm = LayerNorm(H, config.norm_eps, bool(getattr(config, "norm_bias", False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(ModernBertModel):
    """HF `ModernBertForSequenceClassification` (one label: a reranker such as
    gte-reranker-modernbert-base; several: a classifier of texts): the encoder's first token's state
    or the mean of its states (`classifier_pooling`), then `classifier(head(pooled))`. The scores'
    activation is bert.py's `CrossEncoder`'s (sigmoid for one label unless the config says
    Identity; softmax over several, or a sigmoid each for multi-label)."""

    ignored_weights: ClassVar[tuple[str, ...]] = ("decoder.",)

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        outputs = ClassifierOutputs(config, type(self).__name__)
        pooling = getattr(config, "classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"ModernBERT: classifier_pooling {pooling!r} is not supported (cls or mean)")
        super().__init__(config, backend)
        self.classifier_pooling: str = pooling
        """The engine's pooling for this model's requests (llm_engine.py reads it)."""
        self.num_labels, self.labels, self.activation = outputs.num_labels, outputs.labels, outputs.activation
        self.head = ModernBertPredictionHead(config)
        self.classifier = Linear(config.hidden_size, self.num_labels, bias=True)

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith(("head.", "classifier.")):
            return name
        return name.removeprefix("model.")

    def score_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] pooled states (float32) -> [B, num_labels] scores or probabilities (float32)."""
        dtype = next(self.parameters()).dtype
        return self.activation(self.classifier(self.head(pooled.to(dtype))).float())

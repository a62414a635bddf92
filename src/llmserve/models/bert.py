"""BERT and RoBERTa encoders (HF `BertModel`, `RobertaModel`, `XLMRobertaModel` and their
`...ForSequenceClassification`): served for embeddings, as cross-encoders (rerankers: one label)
for scores of text pairs, and as classifiers of texts.

    x = LayerNorm(word(ids) + position(positions) + token_type(segment))
    for each layer (post-LayerNorm):
        x = LayerNorm(x + dense(attn(q, k, v)))      bidirectional: each token sees its whole sequence
        x = LayerNorm(x + out(gelu(intermediate(x))))
    -> hidden [T, H], the `last_hidden_state` that sentence-transformers pools

A sentence is one segment (token type 0), as sentence-transformers encodes it; a BERT text pair
(`[CLS] a [SEP] b [SEP]`, a cross-encoder's input) has type 1 from its second text on
(`EncoderMetadata.token_types`). RoBERTa differs only in its positions, which count from
`pad_token_id + 1` (`roberta_positions`), and its one token type (its pairs are
`<s> a </s></s> b </s>`). There is no KV cache and no LM head: the engine runs these models
through `EncoderForwardRunner` (model_executor/encoder_runner.py), which hands the model each
sequence whole, and refuses generation requests. Checkpoint names are HF's
(`encoder.layer.0.attention.self.query.weight`); query, key and value load into one fused `qkv`
layer. The embedding models skip `pooler.*` (the next-sentence head's dense + tanh, which sentence
embeddings do not read). A cross-encoder (`CrossEncoder`; its checkpoint names start with `bert.`
or `roberta.`) scores from its first token's state:

    BERT      score = activation(classifier(tanh(pooler.dense(hidden[CLS]))))
    RoBERTa   score = activation(classifier.out_proj(tanh(classifier.dense(hidden[<s>]))))

with, for one label, sentence-transformers' `CrossEncoder` activation: the config's
`sentence_transformers.activation_fn` (Sigmoid or Identity), else Sigmoid, as CrossEncoder
defaults to; for several, softmax over the labels (a sigmoid each for `multi_label_classification`).
"""

from __future__ import annotations

from collections.abc import Callable
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


def roberta_positions(input_ids: torch.Tensor, positions: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """RoBERTa's position ids for a flat batch (`positions` from 0 in each sequence): each
    sequence's real tokens count up from `padding_idx + 1`, and a padding token sits at
    `padding_idx`, as HF's `create_position_ids_from_input_ids` numbers them."""
    real = (input_ids != padding_idx).to(torch.int64)
    count = torch.cumsum(real, 0)
    starts = (
        torch.arange(input_ids.shape[0], device=input_ids.device) - positions
    )  # each token's sequence start
    before = count[starts] - real[starts]  # real tokens before that sequence
    return (count - before) * real + padding_idx


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, padding_idx: int | None = None) -> None:
        """`padding_idx`: RoBERTa's position numbering (`roberta_positions`); None: BERT's, from 0."""
        super().__init__()
        self.padding_idx = padding_idx
        H = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, H)
        self.position_embeddings = PositionEmbedding(config.max_position_embeddings, H)
        self.token_type_embeddings = PositionEmbedding(config.type_vocab_size, H)
        self.LayerNorm = LayerNorm(H, config.layer_norm_eps)

    def forward(  # [T] -> [T, H]
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.padding_idx is not None:
            positions = roberta_positions(input_ids, positions, self.padding_idx)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_types is None:  # one segment: type 0
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


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


class Encoder(CausalLM):
    """What every encoder shares (BERT's, ModernBERT's): no KV cache and no LM head (the engine
    runs it through `EncoderForwardRunner`), oneDNN for its linear layers."""

    is_encoder = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no LM head: it serves embeddings, scores or classes")

    def kv_cache_shape(self) -> KVCacheShape:
        raise ValueError(f"{type(self).__name__} keeps no KV cache")

    def use_onednn(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_onednn()
            elif isinstance(module, VocabEmbedding):
                module.use_rows()


class RopeEncoder(Encoder):
    """An encoder whose layers take rotary positions (ModernBERT, EmbeddingGemma, nomic-bert):
    `input_states(ids)`, then `self.layers`, each called as layer(x, cos_sin, rope, md) with its
    layer type's RoPE (`self.rotary`, keyed by the types in `self.layer_types`), then
    `output_states(x)`."""

    layers: nn.ModuleList
    layer_types: list[str]
    rotary: nn.ModuleDict

    def input_states(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        raise NotImplementedError

    def output_states(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]: the final norm, if any
        return x

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], from 0 in each sequence
        md: EncoderMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.input_states(input_ids)
        cos_sin = {t: rope.cos_sin(positions, x.dtype) for t, rope in self.rotary.items()}
        for layer, t in zip(self.layers, self.layer_types, strict=True):
            x = layer(x, cos_sin[t], self.rotary[t], md)
        return self.output_states(x)


class ClassifierOutputs:
    """A sequence classifier's outputs from its config, as sentence-transformers' `CrossEncoder`
    and transformers' pipeline read them: `num_labels`, `labels` (`id2label`), and the
    `activation` of its logits (one label: the cross-encoder's, sigmoid unless the config says
    Identity; several: softmax, or a sigmoid each for `multi_label_classification`)."""

    def __init__(self, config: Any, owner: str) -> None:
        num_labels = getattr(config, "num_labels", None)
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"{owner}: num_labels must be >= 1; got {num_labels!r}")
        self.num_labels: int = num_labels
        id2label = getattr(config, "id2label", None) or {}
        self.labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]
        self.activation: Callable[[torch.Tensor], torch.Tensor]
        if num_labels == 1:
            self.activation = cross_encoder_activation(config)
        elif getattr(config, "problem_type", None) == "multi_label_classification":
            self.activation = torch.sigmoid
        else:
            self.activation = lambda x: torch.softmax(x, dim=-1)


class BertModel(Encoder):
    """HF `BertModel` (the checkpoint sentence-transformers' BERT models ship)."""

    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        "query": ("qkv", 0),
        "key": ("qkv", 1),
        "value": ("qkv", 2),
    }
    ignored_weights: ClassVar[tuple[str, ...]] = ("pooler.", "embeddings.position_ids")
    roberta_positions: ClassVar[bool] = False
    """RoBERTa's position ids (from `pad_token_id + 1`, `roberta_positions`)."""

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        """`backend` (the paged attention backend the loader offers every model) is unused: an
        encoder attends without a cache (layers/attention/encoder.py)."""
        super().__init__(config)
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"BERT: position_embedding_type {kind!r} is not supported (only 'absolute')")
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError("BERT as a decoder (is_decoder, add_cross_attention) is not supported")
        # (a GGUF file's table starts at RoBERTa's first position: llama.cpp's converter cut the rows before it)
        roberta = self.roberta_positions and not getattr(config, "positions_from_zero", False)
        self.embeddings = BertEmbeddings(config, config.pad_token_id if roberta else None)
        self.encoder = BertEncoder(config)
        self.uses_token_types = config.type_vocab_size > 1
        """Whether a text pair's second text gets token type 1 (BERT); RoBERTa has one type."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], from 0 in each sequence
        md: EncoderMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.embeddings(input_ids, positions, md.token_types)
        for layer in self.encoder.layer:
            x = layer(x, md)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)


class RobertaModel(BertModel):
    """HF `RobertaModel` and `XLMRobertaModel` (e.g. BGE-M3, multilingual-E5): BERT's layers with
    RoBERTa's position ids and one token type."""

    roberta_positions = True


# sentence-transformers' CrossEncoder activations (the config's class paths) this model applies
_ACTIVATIONS = {"Sigmoid": torch.sigmoid, "Identity": lambda x: x}


def cross_encoder_activation(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation sentence-transformers' `CrossEncoder` applies to a one-label model's logit."""
    st = getattr(config, "sentence_transformers", None)
    path = st.get("activation_fn") if isinstance(st, dict) else None
    path = path or getattr(config, "sbert_ce_default_activation_function", None)  # before v4
    if path is None:
        return torch.sigmoid
    name = str(path).rpartition(".")[2]
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"cross-encoder: activation_fn {path!r} is not supported (only Sigmoid and Identity)"
        )
    return _ACTIVATIONS[name]


class CrossEncoder(BertModel):
    """A sequence classifier over the encoder, from its first token's state ([CLS], <s>):
    `score_head` gives its output per input. With one label it is a cross-encoder (reranker)
    that scores text pairs; with several, a classifier of texts (`/classify`): softmax over the
    labels, or a sigmoid per label when the config's `problem_type` is
    `multi_label_classification` (as transformers' text-classification pipeline reads them). Its
    pooling is the first token's, never normalised (the engine's default for a model with a
    `score_head`)."""

    checkpoint_prefix: ClassVar[str] = ""
    """What the checkpoint puts before the encoder's names (`bert.`, `roberta.`)."""
    ignored_weights: ClassVar[tuple[str, ...]] = ("embeddings.position_ids",)

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        outputs = ClassifierOutputs(config, type(self).__name__)
        super().__init__(config, backend)
        self.num_labels, self.activation = outputs.num_labels, outputs.activation
        self.labels = outputs.labels
        """Each output's label (the config's `id2label`)."""

    def map_weight_name(self, name: str) -> str | None:
        return name.removeprefix(self.checkpoint_prefix)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H] first-token states -> [B, num_labels] logits."""
        raise NotImplementedError

    def score_head(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[B, H] first-token states (pooled in float32) -> [B, num_labels] scores or
        probabilities (float32)."""
        dtype = next(self.parameters()).dtype
        return self.activation(self.classify(cls_rows.to(dtype)).float())


class DenseTanh(nn.Module):
    """`tanh(dense(x))`: HF's BertPooler (`pooler.dense`), and the first half of RoBERTa's head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertForSequenceClassification(CrossEncoder):
    """HF `BertForSequenceClassification`: `classifier(pooler(x))`."""

    checkpoint_prefix = "bert."

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        super().__init__(config, backend)
        self.pooler = DenseTanh(config.hidden_size)
        self.classifier = Linear(config.hidden_size, self.num_labels, bias=True)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(x))


class RobertaClassificationHead(nn.Module):
    """HF's RobertaClassificationHead: `out_proj(tanh(dense(x)))`."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size, bias=True)
        self.out_proj = Linear(hidden_size, num_labels, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class RobertaForSequenceClassification(CrossEncoder):
    """HF `RobertaForSequenceClassification` and `XLMRobertaForSequenceClassification` (with one
    label, e.g. the BGE rerankers): RoBERTa's encoder, then its classification head on <s>."""

    checkpoint_prefix = "roberta."
    roberta_positions = True

    def __init__(self, config: Any, backend: AttentionBackend | None = None) -> None:
        super().__init__(config, backend)
        self.classifier = RobertaClassificationHead(config.hidden_size, self.num_labels)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x)

"""Decoder LMs as sequence classifiers: rerankers, reward models and text classifiers built on a
causal LM's stack.

    checkpoint                                   head (`score`, [labels, hidden])
    XForSequenceClassification (Llama, Mistral,  the checkpoint's `score.weight`
      Qwen2, Qwen3, Gemma 2, Gemma 3): reward
      models, Qwen3-Reranker converted to one
      label (seq-cls)
    a causal LM with `classifier_from_token`     rows of its LM head (or of its tied embedding):
      in its config (`--hf-overrides`, as vLLM     two tokens and `from_2_way_softmax` (the original
      reads it: the original Qwen3-Reranker)       Qwen3-Reranker: "no", "yes") give one label,
                                                   W[yes] - W[no]; otherwise a label a token

The stack runs as the causal LM's (the fused CPU decoder included); the classifier reads the
final-norm state of the input's last token (transformers pools the last non-pad token; an input
here has no padding) and `score_head` turns the pooled rows into outputs: one label is a
cross-encoder's score (sigmoid of the logit, P(yes) for the two-token head), several a softmax (a
sigmoid each for `multi_label_classification`), as transformers' pipeline reads them
(`ClassifierOutputs`). The LM head is tied to the embedding and never used: these models pool,
they do not generate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from llmserve.layers.attention import AttentionBackend
from llmserve.models.base import CausalLM
from llmserve.models.bert import ClassifierOutputs
from llmserve.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.qwen2 import Qwen2ForCausalLM
from llmserve.models.qwen3 import Qwen3ForCausalLM

TWO_WAY = "from_2_way_softmax"
"""vLLM's name for a head made of two tokens' rows whose softmax's second entry is the score."""


def from_token_method(config: Any) -> str | None:
    """How `classifier_from_token` rows become the head: `from_2_way_softmax` (one label) or
    `no_post_processing` (a label a token); None when the config names no tokens."""
    tokens = getattr(config, "classifier_from_token", None)
    if tokens is None:
        return None
    if not isinstance(tokens, list | tuple) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings; got {tokens!r}")
    method = getattr(config, "method", None) or (
        TWO_WAY if getattr(config, "is_original_qwen3_reranker", False) else "no_post_processing"
    )
    if method not in (TWO_WAY, "no_post_processing"):
        raise ValueError(f"classifier method {method!r} is not supported ({TWO_WAY} or no_post_processing)")
    if method == TWO_WAY and len(tokens) != 2:
        raise ValueError(f"{TWO_WAY} needs two classifier_from_token tokens (false, true); got {tokens!r}")
    return method


class ScoreHead(nn.Module):
    """The classifier's [labels, hidden] matrix (`score.weight`): a parameter the checkpoint
    fills, or a buffer made from LM-head rows at load (`DecoderClassifier.load_weights`)."""

    def __init__(self, num_labels: int, hidden_size: int, from_checkpoint: bool) -> None:
        super().__init__()
        weight = torch.empty(num_labels, hidden_size)
        if from_checkpoint:
            self.weight = nn.Parameter(weight, requires_grad=False)
        else:
            self.register_buffer("weight", weight)


class DecoderClassifier(CausalLM):
    """A decoder stack with a linear classifier on its last token (see the module's table): a mixin
    before the causal LM class whose stack it runs (`Qwen3ForSequenceClassification`...)."""

    classifier_pooling: ClassVar[str] = "last"
    uses_token_types: ClassVar[bool] = False
    """A pair is its two texts as the tokenizer joins them (no token types: a decoder has none)."""
    head_sources: ClassVar[tuple[str, ...]] = ("lm_head.weight", "model.embed_tokens.weight")
    """Where `classifier_from_token` rows come from, in order of preference: the LM head, else
    the embedding it is tied to."""

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        self.method = from_token_method(config)
        token_ids: list[int] = list(getattr(config, "classifier_token_ids", None) or [])
        if self.method is not None and len(token_ids) != len(config.classifier_from_token):
            raise ValueError("classifier_from_token: the loader did not resolve the tokens' ids")
        if self.method == TWO_WAY:
            # a cross-encoder: sigmoid(W[true] x - W[false] x) is the two-way softmax's P(true)
            labels = ClassifierOutputs(_Labels(1, {0: config.classifier_from_token[1]}), type(self).__name__)
        elif self.method is not None:
            tokens = config.classifier_from_token
            labels = ClassifierOutputs(_Labels(len(tokens), dict(enumerate(tokens))), type(self).__name__)
        else:
            labels = ClassifierOutputs(config, type(self).__name__)
        super().__init__(config, backend)
        self.pooling_only = True
        self.token_ids = token_ids
        self.num_labels, self.activation, self.labels = labels.num_labels, labels.activation, labels.labels
        self.score = ScoreHead(self.num_labels, config.hidden_size, from_checkpoint=self.method is None)

    def load_weights(self, weights: Iterable[tuple[str, Any, str]]) -> None:
        if self.method is None:
            super().load_weights(weights)
            return
        rows: dict[str, torch.Tensor] = {}

        def tap(stream: Iterable[tuple[str, Any, str]]) -> Iterator[tuple[str, Any, str]]:
            for name, tensor, file in stream:
                if name in self.head_sources:
                    if not isinstance(tensor, torch.Tensor):
                        raise ValueError(
                            f"{file}: classifier_from_token needs {name} in a float format; it is quantized"
                        )
                    rows[name] = tensor[self.token_ids].float()  # [tokens, hidden]
                yield name, tensor, file

        super().load_weights(tap(weights))
        source = next((rows[n] for n in self.head_sources if n in rows), None)
        if source is None:
            raise ValueError(f"classifier_from_token: the checkpoint has none of {list(self.head_sources)}")
        head = source[1:2] - source[0:1] if self.method == TWO_WAY else source
        self.score.weight.copy_(head)

    def score_head(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, H] last-token states (pooled in float32) -> [B, labels] scores or probabilities."""
        return self.activation(rows.float() @ self.score.weight.float().t())


class _Labels:
    """A config's label fields for a head whose labels are tokens (`ClassifierOutputs` reads them)."""

    def __init__(self, num_labels: int, id2label: dict[int, str]) -> None:
        self.num_labels, self.id2label = num_labels, id2label


class LlamaForSequenceClassification(DecoderClassifier, LlamaForCausalLM):
    """HF `LlamaForSequenceClassification` (and Mistral's): reward models such as Skywork-Reward."""


class Qwen2ForSequenceClassification(DecoderClassifier, Qwen2ForCausalLM):
    """HF `Qwen2ForSequenceClassification`."""


class Qwen3ForSequenceClassification(DecoderClassifier, Qwen3ForCausalLM):
    """HF `Qwen3ForSequenceClassification`: Qwen3-Reranker as a one-label classifier, or the
    original Qwen3-Reranker (a `Qwen3ForCausalLM`) with vLLM's overrides:
    `{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}`."""


class Gemma2ForSequenceClassification(DecoderClassifier, Gemma2ForCausalLM):
    """HF `Gemma2ForSequenceClassification`: reward models such as Skywork-Reward-Gemma-2."""


class Gemma3TextForSequenceClassification(DecoderClassifier, Gemma3ForCausalLM):
    """HF `Gemma3TextForSequenceClassification` (Gemma 3's text stack)."""

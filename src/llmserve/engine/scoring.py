"""Scores of text pairs (vLLM's score task), shared by `LLM.score` and the server's `/v1/score`
and `/v1/rerank`:

    cross-encoder   (a model with a `score_head`, e.g. BertForSequenceClassification with one
                    label) runs each pair as one input, `[CLS] text_1 [SEP] text_2 [SEP]`, and
                    its head's output is the score (sigmoid of the logit by default, as
                    sentence-transformers' `CrossEncoder` gives it)
    any other model embeds each text once (the engine's pooling, normalised) and a pair's score is
                    the cosine similarity of its two embeddings, as vLLM scores with an
                    embedding model

`pair_texts` says which texts meet: one first text against every second text, or the two lists
side by side (then of equal length), as vLLM pairs `text_1` and `text_2`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from llmserve.errors import ParameterError


def pair_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, in order; ValueError when they cannot pair."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise ParameterError(f"{name} must not be empty", param=name)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ParameterError(
                f"{name}[{bad}] must be a string; got {type(texts[bad]).__name__}", param=name
            )
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ParameterError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2",
            param="text_2",
        )
    return list(zip(first, second, strict=True))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0.0 when either is all zeros)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0

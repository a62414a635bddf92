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
side by side (then of equal length), as vLLM pairs `text_1` and `text_2`; `plan_scores` turns the
pairs into the engine's pooling inputs and their vectors back into scores. `classify_input` is a
sequence classifier's input (`/classify`, `LLM.classify`). `truncate` is vLLM's
`truncate_prompt_tokens`: an input keeps at most that many tokens (-1: the context); None: an
input over the context is an error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.errors import ParameterError

if TYPE_CHECKING:
    from llmserve.engine.llm_engine import LLMEngine, ProcessedPrompt


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


def truncation_limit(engine: LLMEngine, truncate: int) -> int:
    """The most tokens an input keeps under `truncate` (k >= 1, or -1 for the context)."""
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate == 0 or truncate < -1:
        raise ParameterError(
            f"truncate_prompt_tokens must be -1 (the context) or >= 1; got {truncate!r}",
            "truncate_prompt_tokens",
        )
    return engine.max_model_len if truncate == -1 else min(truncate, engine.max_model_len)


def truncated_ids(engine: LLMEngine, text: str, truncate: int) -> list[int]:
    """`text`'s tokens, its first ones kept under `truncate`; an encoder's closing [SEP] (or
    </s>) stays last, as sentence-transformers truncates."""
    limit = truncation_limit(engine, truncate)
    ids = engine.tokenizer.encode(text)
    kept = ids[:limit]
    if len(ids) > limit and engine.tokenizer.wraps_cls_sep:
        kept[-1] = ids[-1]
    return kept


def classify_input(
    engine: LLMEngine, prompt: str | Sequence[int], truncate: int | None = None
) -> ProcessedPrompt:
    """A classifier's input: one text (or its token ids), wrapped as the tokenizer wraps a text
    (`[CLS] text [SEP]`). Raises ValueError, changes nothing; safe beside `step()`."""
    if not engine.is_classifier:
        raise ParameterError(
            f"model {engine.loaded.source.name!r} ({type(engine.loaded.model).__name__}) is not a sequence "
            "classifier: it has no labels to classify into",
            param="model",
        )
    if engine.scheduler_config.is_static:
        raise ParameterError("classification needs continuous batching", param="model")
    if truncate is not None and isinstance(prompt, str):
        text, ids = prompt, truncated_ids(engine, prompt, truncate)
    else:
        text, ids = engine.encode_prompt(prompt)
        if truncate is not None:
            ids = ids[: truncation_limit(engine, truncate)]
    return engine.pooled_prompt(text, ids, engine.default_pooling)


def pair_input(engine: LLMEngine, text_1: str, text_2: str, truncate: int | None = None) -> ProcessedPrompt:
    """A cross-encoder's input: the pair encoded as its tokenizer encodes pairs (BERT's
    `[CLS] text_1 [SEP] text_2 [SEP]`, token type 1 from `text_2` on); under `truncate` the
    longer text loses a token at a time (HF's `longest_first`, as sentence-transformers'
    CrossEncoder truncates). Raises ValueError, changes nothing; safe beside `step()`."""
    if not engine.is_cross_encoder:
        why = (
            f"a classifier of {len(engine.classifier_labels)} labels (send texts to /classify)"
            if engine.is_classifier
            else "not a cross-encoder: score its texts' embeddings instead"
        )
        raise ParameterError(f"model {engine.loaded.source.name!r} is {why}", param="model")
    if engine.scheduler_config.is_static:
        raise ParameterError("scores need continuous batching", param="model")
    template = getattr(engine.loaded.hf_config, "rerank_template", None)
    if template is not None:
        return templated_pair_input(engine, template, text_1, text_2, truncate)
    backend = engine.tokenizer.backend
    if truncate is None:
        encoding = backend.encode(text_1, text_2, add_special_tokens=True)
    else:
        first, second = (backend.encode(t, add_special_tokens=False) for t in (text_1, text_2))
        budget = truncation_limit(engine, truncate) - backend.num_special_tokens_to_add(True)
        if budget < 2:
            raise ParameterError(
                f"truncate_prompt_tokens {truncate} leaves no room for a pair", "truncate_prompt_tokens"
            )
        n1, n2 = len(first.ids), len(second.ids)
        while n1 + n2 > budget:  # longest_first: a token off the longer text (the second on a tie)
            n1, n2 = (n1 - 1, n2) if n1 > n2 else (n1, n2 - 1)
        first.truncate(n1)
        second.truncate(n2)
        encoding = backend.post_process(first, second, add_special_tokens=True)
    ids, types = list(encoding.ids), list(encoding.type_ids)
    start = next((i for i, t in enumerate(types) if t == 1), None)
    if start is None and getattr(engine.loaded.model, "uses_token_types", True):
        raise ParameterError(
            f"model {engine.loaded.source.name!r}: its tokenizer does not mark a pair's second text "
            "(no token type 1), so it cannot encode text pairs",
            param="model",
        )
    return engine.pooled_prompt(None, ids, dataclasses.replace(engine.default_pooling, second_segment=start))


def templated_pair_input(
    engine: LLMEngine, template: str, query: str, document: str, truncate: int | None
) -> ProcessedPrompt:
    """A pair written into the model's rerank prompt (a GGUF's `tokenizer.chat_template.rerank`, as
    llama-server formats it: `{query}` and `{document}` replaced, special tokens read as such,
    none added). Under `truncate` the document keeps as many of its first tokens as fit."""
    text = template.replace("{query}", query).replace("{document}", document)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if truncate is not None and len(ids) > truncation_limit(engine, truncate):
        limit = truncation_limit(engine, truncate)
        doc_ids = engine.tokenizer.encode(document, add_special_tokens=False)
        num_fixed = len(ids) - len(doc_ids)  # the template and the query around the document
        if num_fixed >= limit:
            raise ParameterError(
                f"truncate_prompt_tokens {truncate} leaves no room for the document in the rerank "
                f"prompt ({num_fixed} tokens without it)",
                "truncate_prompt_tokens",
            )
        kept = engine.tokenizer.decode(doc_ids[: limit - num_fixed])
        text = template.replace("{query}", query).replace("{document}", kept)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[:limit]
    return engine.pooled_prompt(text, ids, engine.default_pooling)


@dataclass(frozen=True, slots=True)
class ScorePlan:
    """The pooling inputs that score some pairs, and how their vectors become the scores."""

    pairs: list[tuple[str, str]]
    inputs: list[ProcessedPrompt]
    texts: list[str] | None
    """Each input's text (an embedding model: each distinct text once); None: one input a pair."""

    def scores(self, vectors: list[list[float]]) -> list[float]:
        """The pairs' scores from the inputs' vectors, in order."""
        if self.texts is None:
            return [v[0] for v in vectors]
        by_text = dict(zip(self.texts, vectors, strict=True))
        return [cosine(by_text[a], by_text[b]) for a, b in self.pairs]

    def pair_token_ids(self) -> list[list[int]]:
        """The tokens read for each pair: its one input, or its two texts' inputs back to back."""
        if self.texts is None:
            return [list(p.token_ids) for p in self.inputs]
        by_text = {t: list(p.token_ids) for t, p in zip(self.texts, self.inputs, strict=True)}
        return [by_text[a] + by_text[b] for a, b in self.pairs]

    @property
    def num_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.inputs)


def plan_scores(
    engine: LLMEngine,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    names: tuple[str, str] = ("text_1", "text_2"),
) -> ScorePlan:
    """The engine's inputs for `pairs`: a classifier's pair inputs, or each distinct text's
    embedding input (pooled, normalised). ParameterError naming the pair (or text) and its field
    (`names`: the request's fields for a pair's first and second text)."""
    if truncate is not None:
        truncation_limit(engine, truncate)
    if engine.is_classifier:
        inputs = []
        for i, (a, b) in enumerate(pairs):
            try:
                inputs.append(pair_input(engine, a, b, truncate))
            except ValueError as e:
                own = getattr(e, "param", None)
                param = own if own in ("model", "truncate_prompt_tokens") else names[1]
                raise ParameterError(f"pair {i} ({names[0]}, {names[1]}[{i}]): {e}", param=param) from None
        return ScorePlan(pairs, inputs, None)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
    pooling = dataclasses.replace(engine.default_pooling, normalize=True, dimensions=None)
    inputs = []
    for t in texts:
        try:
            x = t if truncate is None else truncated_ids(engine, t, truncate)
            inputs.append(engine.process_embedding_inputs(x, pooling))
        except ValueError as e:
            field = names[0] if any(a == t for a, _ in pairs) else names[1]
            param = "model" if getattr(e, "param", None) == "model" else field
            raise ParameterError(f"{field}: text {t[:40]!r}: {e}", param=param) from None
    return ScorePlan(pairs, inputs, texts)

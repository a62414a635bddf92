"""What the loader changes in a checkpoint's config before it builds the model: the user's
`hf_overrides` (vLLM's `--hf-overrides`: config fields set over config.json's or a GGUF file's), and
a classifier's `classifier_from_token` turned into token ids with the model's own tokenizer."""

from __future__ import annotations

import copy
from typing import Any

from llmserve.model_executor.model_loader.source import ModelSource
from llmserve.models.decoder_classifier import from_token_method


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | None) -> Any:
    """A copy of `hf_config` with each of `overrides`' fields set (a dict merges into a dict
    field, as transformers' `update` would not: `rope_scaling: {"factor": 4}` keeps the type)."""
    if not overrides:
        return hf_config
    hf_config = copy.copy(hf_config)
    for name, value in overrides.items():
        old = getattr(hf_config, name, None)
        if isinstance(value, dict) and isinstance(old, dict):
            value = {**old, **value}
        setattr(hf_config, name, value)
    return hf_config


def with_classifier_token_ids(hf_config: Any, source: ModelSource) -> Any:
    """`hf_config` with `classifier_token_ids` beside its `classifier_from_token` (the tokens'
    ids in the model's vocabulary); unchanged when it names no tokens. ValueError for a token
    the vocabulary lacks."""
    if from_token_method(hf_config) is None:
        return hf_config
    from llmserve.tokenizer import load_tokenizer

    backend = load_tokenizer(source).backend
    ids = []
    for token in hf_config.classifier_from_token:
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of {source.name}'s vocabulary")
        ids.append(token_id)
    hf_config = copy.copy(hf_config)
    hf_config.classifier_token_ids = ids
    return hf_config

"""`SamplingParams`: how one request's tokens are chosen and when it stops.

The OpenAI parameter set plus vLLM's extras. Every field is validated on construction; a bad value
raises `ValueError` naming the parameter and its allowed range (the server turns it into a 400).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmserve.errors import ParameterError

_MAX_LOGPROBS = 20


class SamplingType(Enum):
    GREEDY = "greedy"
    RANDOM = "random"
    RANDOM_SEED = "random_seed"


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ParameterError(f"{name} must be {allowed}; got {value!r}", param=name)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrained decoding: every sampled token keeps the output a prefix of a string in this
    language, and EOS is allowed only where the output is complete. Exactly one field is set."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (a dict, or its JSON text): the output is a JSON value that validates."""
    json_object: bool = False
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    regex: str | None = None
    """The output matches this regular expression in full."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar in Lark syntax (llguidance's dialect) or llama.cpp's GBNF."""

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ParameterError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}",
                param="structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ParameterError(
                "structured_outputs.json must be a JSON schema (an object)", param="structured_outputs"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParameterError(
                    f"structured_outputs.{name} must be a non-empty string", param="structured_outputs"
                )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ParameterError(
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                param="structured_outputs",
            )

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)

    def cache_key(self) -> str:
        """A canonical text of the constraint: equal constraints share one compiled grammar."""
        value = getattr(self, self.kind) if self.kind != "json_object" else True
        if self.kind == "json" and isinstance(value, str):
            with contextlib.suppress(ValueError):  # an invalid schema is reported when compiled
                value = json.loads(value)
        return f"{self.kind}:{json.dumps(value, sort_keys=True)}"


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    """Number of independent completions of the prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output (divides positive logits, multiplies negative)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    """Per-request generator seed: the same request and seed give the same tokens in any batch."""
    max_tokens: int | None = 16
    """None: up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated."""
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; never included in the output text."""
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives per output token."""
    prompt_logprobs: int | None = None
    """Return logprobs of each prompt token (the first is None) plus this many alternatives."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (see the class)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(0.0 <= self.temperature <= 2.0, "temperature", self.temperature, "in [0, 2]")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "0 (off), -1 (off) or >= 1"
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(
            0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", self.repetition_penalty, "in (0, 2]"
        )
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "in [-2, 2]"
        )
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                ">= 1",
            )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0"
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens ({self.max_tokens})",
            )
        if self.seed is not None:
            _check(
                isinstance(self.seed, int) and 0 <= self.seed < 2**63,
                "seed",
                self.seed,
                "an integer in [0, 2^63)",
            )
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None:
                _check(
                    isinstance(value, int) and 0 <= value <= _MAX_LOGPROBS,
                    name,
                    value,
                    f"in [0, {_MAX_LOGPROBS}]",
                )
        for s in self.stop:
            _check(isinstance(s, str) and len(s) > 0, "stop", s, "a list of non-empty strings")
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids", t, "non-negative token ids")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ParameterError(
                "structured_outputs must be a StructuredOutputsParams", param="structured_outputs"
            )
        for tok, bias in (self.logit_bias or {}).items():
            _check(isinstance(tok, int) and tok >= 0, "logit_bias", tok, "keyed by non-negative token ids")
            _check(-100.0 <= bias <= 100.0, "logit_bias", bias, "values in [-100, 100]")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0 or self.top_k == 1:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in the vocabulary."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise ParameterError(
                    f"{name} has token id(s) {bad[:5]} outside the vocabulary (size {vocab_size})", param=name
                )

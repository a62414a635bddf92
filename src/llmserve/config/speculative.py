"""`SpeculativeConfig`: speculative decoding, in vLLM's shape.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4})

A proposer guesses the next k tokens of a decoding request; one forward pass scores all of them
(with the last real token), and verification keeps the longest prefix the model agrees with, plus
one token of its own (sample/rejection.py). Outputs are plain decoding's: greedy ones and
seeded sampled ones token for token, unseeded ones in distribution; only the time per token changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    """`ngram`: prompt lookup (the tokens that followed the latest earlier occurrence of the
    context's last n tokens); `draft_model`: a small model's own greedy continuation."""
    num_speculative_tokens: int = 4
    """k: tokens proposed per request and step."""
    prompt_lookup_min: int = 2
    """ngram: the shortest context suffix that counts as a match."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix tried first."""
    model: str | None = None
    """draft_model: the draft (a folder, .gguf file or bundled name) sharing the target's vocabulary."""
    quantization: str = "auto"
    """draft_model: the draft's weight format on the CPU (as the engine's `quantization`)."""
    adaptive: bool = True
    """Verify only the proposed tokens that pay for themselves, from each request's acceptance so
    far and a cost model of the step fitted online (spec_decode/controller.py), so unpredictable
    text and full batches decode (almost) plainly. False: always verify up to k."""
    disable_by_batch_size: int | None = None
    """Speculate only while fewer requests than this are running (None: always). Verifying k
    extra tokens is nearly free while a step is bound by reading the weights (small batches) and
    costs real compute once it is not."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16]; got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got {self.prompt_lookup_min} and "
                f"{self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("the draft_model method needs `model`: the draft model to load")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantization must be auto, none, int8 or int4; got {self.quantization!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1; got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict, its JSON text, or an instance; None stays None. Unknown keys are errors."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object; got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

"""`PoolingParams`: how one embedding request turns its prompt's hidden states into one vector.

An embedding request (vLLM's "pooling" request) runs its prompt through the same scheduler and
forward passes as a generation request, never samples, and ends when its prefill is done. The
vector is pooled from the final-norm hidden states (what the LM head reads):

    last   the last prompt token's state (decoder LMs: the only token that saw the whole prompt)
    mean   the mean over every prompt token
    cls    the first token's state (BERT-style [CLS])

then, with `dimensions`, cut to its first `dimensions` values (Matryoshka models), then, with
`normalize`, scaled to unit L2 norm (after the cut, so a truncated vector is unit length too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from llmserve.errors import ParameterError

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    pooling: PoolingType = "last"
    normalize: bool = True
    """Scale the vector to unit L2 norm (the cosine-ready form every embedding API returns)."""
    dimensions: int | None = None
    """Keep only the first `dimensions` values (Matryoshka truncation); None: all of them."""
    second_segment: int | None = None
    """Where a text pair's second text starts in the prompt (a cross-encoder's `[CLS] a [SEP] b
    [SEP]`: BERT token type 1 from there on); None: the prompt is one segment. Set by the engine's
    score inputs (`engine/scoring.py pair_input`), as vLLM carries token types in its pooling
    parameters."""

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ParameterError(
                f"pooling must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}", param="pooling"
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise ParameterError(f"dimensions must be an integer >= 1; got {self.dimensions!r}", "dimensions")
        if self.second_segment is not None and (
            not isinstance(self.second_segment, int)
            or isinstance(self.second_segment, bool)
            or self.second_segment < 1
        ):
            raise ParameterError(
                f"second_segment must be an integer >= 1; got {self.second_segment!r}", "input"
            )

    def validate_for_model(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ParameterError(
                f"dimensions must be between 1 and the model's embedding size {hidden_size}; got {self.dimensions}",
                param="dimensions",
            )

    @property
    def needs_every_token(self) -> bool:
        """Whether the pooled value reads tokens a prefix-cache hit would skip computing (mean and
        cls do; `last` reads the last token, which a hit always leaves to compute)."""
        return self.pooling != "last"

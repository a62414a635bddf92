"""The results users get back: one `RequestOutput` per prompt, with one `CompletionOutput` per
sample (`n`). Streaming callers receive a `RequestOutput` per step with the text so far."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> (logprob, rank). The chosen token is always included.
PositionLogprobs = dict[int, tuple[float, int]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    """Per output token, when `SamplingParams.logprobs` was set."""
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length" or "abort"; None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it (None for EOS or length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """`time.monotonic()` timestamps of a request (the earliest / latest over its n samples)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    """Tokens generated so far, over all samples."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """One entry per prompt token; the first is None (nothing precedes it)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    embedding: list[float] | None = None
    """An embedding request's vector (`outputs` is then one empty completion, finished "stop")."""
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`)."""

    embedding: list[float]
    prompt_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class ScoreOutput:
    """One text pair's score (`LLM.score`): a cross-encoder's output for the pair, or the cosine
    similarity of the two texts' embeddings (engine/scoring.py)."""

    score: float
    prompt_token_ids: list[int]
    """The tokens the model read for this pair: a cross-encoder's one input, or the two texts'
    inputs back to back."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class ClassificationOutput:
    """One text's classification (`LLM.classify`): each label's probability (softmax over the
    labels; a sigmoid each for a multi-label model, or a one-label model's score) and the most
    likely label."""

    probs: list[float]
    label: str
    prompt_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

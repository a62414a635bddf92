"""`SamplingMetadata`: one step's sampling parameters as batched tensors.

Built once per step from the `RequestSamplingState`s of the rows being sampled (row i of the logits is
`states[i]`). Every optional part is None when no row uses it, so the sampler can skip that work
entirely; in particular a batch where every row is greedy with no penalties, bias or min_tokens ban
needs nothing but an argmax. This module turns Python lists into tensors; it does not touch logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from llmserve.sample.state import RequestSamplingState
from llmserve.sampling_params import SamplingParams, SamplingType


@dataclass(slots=True)
class PenaltyTensors:
    """Penalties of the P rows that use any; the other rows of the batch are left alone."""

    rows: torch.Tensor  # [P] int64: row indices into the batch
    repetition: torch.Tensor  # [P] fp32, 1.0 = off
    frequency: torch.Tensor  # [P] fp32, 0.0 = off
    presence: torch.Tensor  # [P] fp32, 0.0 = off
    prompt_mask: torch.Tensor  # [P, V] bool: the token occurs in the prompt (only set where repetition != 1)
    output_counts: torch.Tensor  # [P, V] fp32: occurrences of the token in the output so far


@dataclass(slots=True)
class SamplingMetadata:
    """Sampling parameters of the B rows of one step; optional parts are None when unused."""

    temperature: torch.Tensor | None  # [B] fp32; 1.0 on greedy rows so dividing by it is harmless
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool, only for a batch that mixes greedy and random rows
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; V where off
    top_p: torch.Tensor | None  # [B] fp32; 1.0 where off
    min_p: torch.Tensor | None  # [B] fp32; 0.0 where off
    generators: dict[int, torch.Generator]  # row -> generator, for seeded random rows only
    has_unseeded_random: bool  # some random row draws from the global RNG
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows [N], token ids [N]) forced to -inf (min_tokens)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, biases), each [N]
    penalties: PenaltyTensors | None
    max_num_logprobs: int | None  # the most alternatives any row asked for; None when no row wants logprobs

    @property
    def needs_logits_processing(self) -> bool:
        """Whether any row's logits change before greedy argmax (ban, bias or penalties)."""
        return self.banned is not None or self.logit_bias is not None or self.penalties is not None

    @classmethod
    def build(
        cls, states: Sequence[RequestSamplingState], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """One pass over the rows' states, then one tensor per field that some row uses."""
        num_rows = len(states)
        temperature = [1.0] * num_rows
        top_k = [vocab_size] * num_rows
        top_p = [1.0] * num_rows
        min_p = [0.0] * num_rows
        is_greedy = [False] * num_rows
        use_top_k = use_top_p = use_min_p = has_unseeded = False
        generators: dict[int, torch.Generator] = {}
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        penalty_rows: list[int] = []
        max_num_logprobs: int | None = None

        for i, state in enumerate(states):
            params = state.params
            if params.sampling_type is SamplingType.GREEDY:
                is_greedy[i] = True
            else:
                temperature[i] = params.temperature
                if params.top_k > 0:
                    top_k[i] = min(params.top_k, vocab_size)
                    use_top_k = True
                if params.top_p < 1.0:
                    top_p[i] = params.top_p
                    use_top_p = True
                if params.min_p > 0.0:
                    min_p[i] = params.min_p
                    use_min_p = True
                if state.generator is not None:
                    generators[i] = state.generator
                else:
                    has_unseeded = True
            if params.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, params.logprobs)
            if len(state.output_token_ids) < params.min_tokens:
                ids = _min_tokens_banned_ids(params, state.eos_token_ids, vocab_size)
                banned_rows.extend([i] * len(ids))
                banned_ids.extend(ids)
            if params.logit_bias:
                bias_rows.extend([i] * len(params.logit_bias))
                bias_ids.extend(params.logit_bias.keys())
                bias_values.extend(params.logit_bias.values())
            if _uses_penalties(params):
                penalty_rows.append(i)

        all_greedy = all(is_greedy)
        all_random = not any(is_greedy)

        def rows_tensor(values: list, dtype: torch.dtype, used: bool) -> torch.Tensor | None:
            return torch.tensor(values, dtype=dtype, device=device) if used and not all_greedy else None

        def index_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            temperature=rows_tensor(temperature, torch.float32, True),
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=rows_tensor(is_greedy, torch.bool, not all_random),
            top_k=rows_tensor(top_k, torch.int64, use_top_k),
            top_p=rows_tensor(top_p, torch.float32, use_top_p),
            min_p=rows_tensor(min_p, torch.float32, use_min_p),
            generators=generators,
            has_unseeded_random=has_unseeded,
            banned=(index_tensor(banned_rows), index_tensor(banned_ids)) if banned_rows else None,
            logit_bias=(
                (
                    index_tensor(bias_rows),
                    index_tensor(bias_ids),
                    torch.tensor(bias_values, dtype=torch.float32, device=device),
                )
                if bias_rows
                else None
            ),
            penalties=_build_penalties(states, penalty_rows, vocab_size, device) if penalty_rows else None,
            max_num_logprobs=max_num_logprobs,
        )


def _min_tokens_banned_ids(
    params: SamplingParams, eos_token_ids: frozenset[int], vocab_size: int
) -> list[int]:
    """Stop token ids, plus the EOS ids unless `ignore_eos` (then EOS does not stop anything anyway)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= eos_token_ids
    return sorted(t for t in ids if t < vocab_size)


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    )


def _build_penalties(
    states: Sequence[RequestSamplingState], rows: list[int], vocab_size: int, device: torch.device
) -> PenaltyTensors:
    """Penalty values plus the prompt-presence mask and output counts of the penalized rows.

    Each row's token list is flattened into one index tensor and scattered in a single call:
    `row_of[j]` says which of the P rows flat token j belongs to.
    """
    params = [states[i].params for i in rows]
    # The prompt only matters to the repetition penalty; skip it for rows that do not use one.
    prompts = [states[i].prompt_token_ids if states[i].params.repetition_penalty != 1.0 else [] for i in rows]
    outputs = [states[i].output_token_ids for i in rows]

    def scatter_index(token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device=device)
        row_of = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)  # [T]
        token_ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64, device=device)
        return row_of, token_ids  # [T], [T]

    num_rows = len(rows)
    prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)  # [P, V]
    prompt_mask[scatter_index(prompts)] = True
    output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)  # [P, V]
    out_rows, out_ids = scatter_index(outputs)
    output_counts.index_put_(
        (out_rows, out_ids), torch.ones_like(out_ids, dtype=torch.float32), accumulate=True
    )

    def values(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)

    return PenaltyTensors(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        repetition=values("repetition_penalty"),
        frequency=values("frequency_penalty"),
        presence=values("presence_penalty"),
        prompt_mask=prompt_mask,
        output_counts=output_counts,
    )

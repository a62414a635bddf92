"""`SamplingMetadata`: one step's sampling parameters as batched tensors.

Built once per step from the `RequestSamplingState`s of the rows being sampled (row i of the logits is
`states[i]`). Every optional part is None when no row uses it, so the sampler can skip that work
entirely; in particular a batch where every row is greedy with no penalties, bias or min_tokens ban
needs nothing but an argmax, and builds no tensor at all. Otherwise one pass over the rows gathers
every number on the host and one copy sends them to the device (packing.py): the cost of a step's
metadata on a GPU is one transfer, whatever the batch. This module does not touch logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import torch

from llmserve.sample.packing import DevicePack, HostPack
from llmserve.sample.state import RequestSamplingState
from llmserve.sampling_params import SamplingParams, SamplingType

SeededDrawMode = Literal["generator", "counter"]
"""How seeded rows draw their exponentials (random_sampling.py): from each request's own
`torch.Generator`, one call per row; or from the counter-based stream keyed by (seed, output
position) (philox.py), one launch for every seeded row."""


@dataclass(frozen=True, slots=True)
class SamplingDevicePolicy:
    """The sampler's device decisions, made in one place."""

    seeded_draws: SeededDrawMode
    """CPU: "generator", the torch streams seeded outputs have always come from. Elsewhere
    "counter": no launch per row, and nothing but the seed and the position decides a draw."""
    host_checks: bool
    """The sampler may read a device value on the host (free on the CPU, a sync on a GPU): min-p
    uses it to reproduce the sort-based reference bit for bit (filters.py)."""
    pin_memory: bool
    """The metadata's host buffer is pinned and copied asynchronously (CUDA)."""

    @classmethod
    def for_device(cls, device: torch.device) -> SamplingDevicePolicy:
        cpu = device.type == "cpu"
        return cls("generator" if cpu else "counter", host_checks=cpu, pin_memory=device.type == "cuda")


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
class SeededDraws:
    """The seeded random rows, for the counter-based draw (the "counter" mode)."""

    rows: torch.Tensor  # [S] int64: row indices into the batch
    seeds: torch.Tensor  # [S] int64: each request's seed
    positions: torch.Tensor  # [S] int64: the output position each row samples (0 = the first token)


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
    filter_width: int  # the largest k of a top-k row or of a top-p row under a top-k; 0: none
    sort_rows: torch.Tensor | None  # [R] int64: the rows whose top-p has no top-k (they sort the vocabulary)
    host_checks: bool  # SamplingDevicePolicy.host_checks
    generators: dict[int, torch.Generator]  # row -> generator, for seeded random rows ("generator" mode)
    seeded: SeededDraws | None  # the seeded random rows in the "counter" mode
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
        cls,
        states: Sequence[RequestSamplingState],
        vocab_size: int,
        device: torch.device,
        positions: Sequence[int] | None = None,
        policy: SamplingDevicePolicy | None = None,
    ) -> SamplingMetadata:
        """One pass over the rows' states on the host, then one copy to `device`. `positions`: the
        output position each row samples, which keys a seeded row's draw in the "counter" mode
        (default: the number of tokens it has output; speculative verification passes its own)."""
        policy = policy or SamplingDevicePolicy.for_device(device)
        rows = _RowScan(states, vocab_size, positions, policy.seeded_draws)
        pack, random_rows = HostPack(), not rows.all_greedy
        # 1. every number into the host pack (a slice of it each)
        temperature = pack.floats(rows.temperature) if random_rows else None
        greedy = pack.ints(rows.is_greedy) if random_rows and not rows.all_random else None
        top_k = pack.ints(rows.top_k) if random_rows and rows.use_top_k else None
        top_p = pack.floats(rows.top_p) if random_rows and rows.use_top_p else None
        min_p = pack.floats(rows.min_p) if random_rows and rows.use_min_p else None
        banned = pack.ints(rows.banned_rows + rows.banned_ids) if rows.banned_rows else None
        bias = pack.ints(rows.bias_rows + rows.bias_ids) if rows.bias_rows else None
        biases = pack.floats(rows.bias_values) if rows.bias_rows else None
        sort_rows = pack.ints(rows.sort_rows) if random_rows and rows.sort_rows else None
        seeded = pack.ints(rows.seeded_rows + rows.seeds + rows.seed_positions) if rows.seeds else None
        penalties = _PenaltyPack(states, rows.penalty_rows, pack) if rows.penalty_rows else None
        # 2. one copy; 3. the fields are views of it
        dev = pack.send(device, policy.pin_memory) if pack else DevicePack.empty(device)
        return cls(
            temperature=dev.float_field(temperature),
            all_greedy=rows.all_greedy,
            all_random=rows.all_random,
            greedy_mask=None if greedy is None else dev.ints[greedy] != 0,
            top_k=dev.int_field(top_k),
            top_p=dev.float_field(top_p),
            min_p=dev.float_field(min_p),
            filter_width=rows.filter_width if random_rows else 0,
            sort_rows=dev.int_field(sort_rows),
            host_checks=policy.host_checks,
            generators=rows.generators,
            seeded=None if seeded is None else SeededDraws(*dev.ints[seeded].view(3, -1)),
            has_unseeded_random=rows.has_unseeded,
            banned=None if banned is None else tuple(dev.ints[banned].view(2, -1)),
            logit_bias=None if bias is None else (*dev.ints[bias].view(2, -1), dev.floats[biases]),
            penalties=None if penalties is None else penalties.tensors(dev, vocab_size),
            max_num_logprobs=rows.max_num_logprobs,
        )


class _RowScan:
    """The host pass over a step's rows: every per-row number as Python lists."""

    def __init__(
        self,
        states: Sequence[RequestSamplingState],
        vocab_size: int,
        positions: Sequence[int] | None,
        seeded_draws: SeededDrawMode,
    ) -> None:
        num_rows = len(states)
        self.temperature = [1.0] * num_rows
        self.top_k = [vocab_size] * num_rows
        self.top_p = [1.0] * num_rows
        self.min_p = [0.0] * num_rows
        self.is_greedy = [0] * num_rows
        self.use_top_k = self.use_top_p = self.use_min_p = self.has_unseeded = False
        self.filter_width = 0
        self.sort_rows: list[int] = []
        self.generators: dict[int, torch.Generator] = {}
        self.seeded_rows: list[int] = []
        self.seeds: list[int] = []
        self.seed_positions: list[int] = []
        self.banned_rows: list[int] = []
        self.banned_ids: list[int] = []
        self.bias_rows: list[int] = []
        self.bias_ids: list[int] = []
        self.bias_values: list[float] = []
        self.penalty_rows: list[int] = []
        self.max_num_logprobs: int | None = None
        for i, state in enumerate(states):
            params = state.params
            if params.sampling_type is SamplingType.GREEDY:
                self.is_greedy[i] = 1
            else:
                position = len(state.output_token_ids) if positions is None else positions[i]
                self._random_row(i, state, vocab_size, position, seeded_draws)
            if params.logprobs is not None:
                self.max_num_logprobs = max(self.max_num_logprobs or 0, params.logprobs)
            if len(state.output_token_ids) < params.min_tokens:
                ids = _min_tokens_banned_ids(params, state.eos_token_ids, vocab_size)
                self.banned_rows.extend([i] * len(ids))
                self.banned_ids.extend(ids)
            if params.logit_bias:
                self.bias_rows.extend([i] * len(params.logit_bias))
                self.bias_ids.extend(params.logit_bias.keys())
                self.bias_values.extend(params.logit_bias.values())
            if _uses_penalties(params):
                self.penalty_rows.append(i)
        self.all_greedy = all(self.is_greedy)
        self.all_random = not any(self.is_greedy)

    def _random_row(
        self, i: int, state: RequestSamplingState, vocab_size: int, position: int, mode: SeededDrawMode
    ) -> None:
        params = state.params
        self.temperature[i] = params.temperature
        if params.top_k > 0:
            self.top_k[i] = min(params.top_k, vocab_size)
            self.use_top_k = True
            if self.top_k[i] < vocab_size:
                self.filter_width = max(self.filter_width, self.top_k[i])
        if params.top_p < 1.0:
            self.top_p[i] = params.top_p
            self.use_top_p = True
            if self.top_k[i] < vocab_size:
                self.filter_width = max(self.filter_width, self.top_k[i])
            else:  # the smallest set reaching top_p may be any size: this row sorts
                self.sort_rows.append(i)
        if params.min_p > 0.0:
            self.min_p[i] = params.min_p
            self.use_min_p = True
        if mode == "counter" and params.seed is not None:
            self.seeded_rows.append(i)
            self.seeds.append(params.seed)
            self.seed_positions.append(position)
        elif mode == "generator" and state.generator is not None:
            self.generators[i] = state.generator
        else:
            self.has_unseeded = True


class _PenaltyPack:
    """The penalized rows' values and token lists, appended to the step's `HostPack`.

    Each token list is flattened with the row it belongs to; on the device one `index_fill_` and
    one `index_add_` over flat [P * V] indices build the prompt mask and the output counts."""

    def __init__(self, states: Sequence[RequestSamplingState], rows: list[int], pack: HostPack) -> None:
        params = [states[i].params for i in rows]
        # The prompt only matters to the repetition penalty; skip it for rows that do not use one.
        prompts = [
            states[i].prompt_token_ids if p.repetition_penalty != 1.0 else []
            for i, p in zip(rows, params, strict=True)
        ]
        outputs = [states[i].output_token_ids for i in rows]
        self.num_rows = len(rows)
        self.rows = pack.ints(rows)
        self.values = pack.floats(
            [p.repetition_penalty for p in params]
            + [p.frequency_penalty for p in params]
            + [p.presence_penalty for p in params]
        )
        self.prompt = pack.ints(_flatten(prompts))
        self.output = pack.ints(_flatten(outputs))

    def tensors(self, dev: DevicePack, vocab_size: int) -> PenaltyTensors:
        def flat_index(at: slice) -> torch.Tensor:
            owner, token_ids = dev.ints[at].view(2, -1)  # [T] each
            return owner * vocab_size + token_ids  # [T] into the [P * V] view

        device = dev.ints.device
        prompt_mask = torch.zeros(self.num_rows * vocab_size, dtype=torch.bool, device=device)
        prompt_mask.index_fill_(0, flat_index(self.prompt), True)
        out_index = flat_index(self.output)
        output_counts = torch.zeros(self.num_rows * vocab_size, dtype=torch.float32, device=device)
        output_counts.index_add_(0, out_index, torch.ones_like(out_index, dtype=torch.float32))
        repetition, frequency, presence = dev.floats[self.values].view(3, -1)
        return PenaltyTensors(
            rows=dev.ints[self.rows],
            repetition=repetition,
            frequency=frequency,
            presence=presence,
            prompt_mask=prompt_mask.view(self.num_rows, vocab_size),
            output_counts=output_counts.view(self.num_rows, vocab_size),
        )


def _flatten(token_lists: list[list[int]]) -> list[int]:
    """[owners..., token ids...]: the penalized row (0..P-1) of each token, then the tokens."""
    owners: list[int] = []
    for p, tokens in enumerate(token_lists):
        owners += [p] * len(tokens)
    return owners + list(chain.from_iterable(token_lists))


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

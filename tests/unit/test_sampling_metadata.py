"""`SamplingMetadata.build` sends a step's parameters in one host->device copy (counted on the
`meta` device, which stands in for a GPU), with the values the per-field tensors had; the
penalties' token lists are batched; `SamplerOutput.to_host` reads a step back in one copy."""

from __future__ import annotations

import pytest
import torch

from llmserve.sample import RequestSamplingState, Sampler, SamplingMetadata
from llmserve.sample.metadata import SamplingDevicePolicy
from llmserve.sample.processing import apply_penalties
from llmserve.sampling_params import SamplingParams

CPU, META = torch.device("cpu"), torch.device("meta")
KINDS = [
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=1, repetition_penalty=1.2),
    SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.5, logit_bias={5: 3.0, 9: -1.0}),
    SamplingParams(temperature=1.1, min_p=0.1, seed=2, min_tokens=4, stop_token_ids=[7]),
    SamplingParams(temperature=0.7, top_k=5, presence_penalty=0.3, seed=3, logprobs=5),
]


def rows(num: int) -> list[RequestSamplingState]:
    return [
        RequestSamplingState(
            KINDS[i % len(KINDS)], [1, 2, 3, i % 50], [4, 5, i % 7] * (i % 4), frozenset([0]), None
        )
        for i in range(num)
    ]


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every host->meta copy made while the fixture is active, by the API that made it."""
    seen: list[str] = []
    real_to, real_copy, real_tensor = torch.Tensor.to, torch.Tensor.copy_, torch.tensor

    def to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "meta":
            seen.append("Tensor.to")
        return out

    def copy_(self: torch.Tensor, src: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if src.device.type == "cpu" and self.device.type == "meta":
            seen.append("Tensor.copy_")
        return real_copy(self, src, *args, **kwargs)

    def tensor(data, *args, device=None, **kwargs) -> torch.Tensor:
        if device is not None and torch.device(device).type == "meta":
            seen.append("torch.tensor")
        return real_tensor(data, *args, device=device, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch, "tensor", tensor)
    return seen


@pytest.mark.parametrize("num_rows", [2, 5, 64])
def test_one_host_to_device_copy_per_step(transfers: list[str], num_rows: int) -> None:
    metadata = SamplingMetadata.build(rows(num_rows), 100, META)
    assert transfers == ["Tensor.to"]
    assert metadata.temperature is not None and metadata.temperature.device == META
    if num_rows == 64:  # every optional part is there, all from that one copy
        assert metadata.penalties is not None and metadata.logit_bias is not None
        assert metadata.banned is not None and metadata.seeded is not None  # "counter" off the CPU


def test_all_greedy_step_copies_nothing(transfers: list[str]) -> None:
    states = [RequestSamplingState(SamplingParams(temperature=0.0), [1], [], frozenset(), None)] * 8
    metadata = SamplingMetadata.build(states, 100, META)
    assert transfers == [] and metadata.all_greedy and metadata.temperature is None


def test_packed_fields_hold_what_per_field_tensors_held() -> None:
    states = rows(10)
    md = SamplingMetadata.build(states, 100, CPU, policy=SamplingDevicePolicy("counter", True, False))
    params = [s.params for s in states]
    random = [p.temperature > 0 for p in params]
    assert torch.equal(
        md.temperature,
        torch.tensor([p.temperature if r else 1.0 for p, r in zip(params, random, strict=True)]),
    )
    assert torch.equal(md.greedy_mask, torch.tensor([not r for r in random]))
    assert torch.equal(
        md.top_k,
        torch.tensor([p.top_k if p.top_k and r else 100 for p, r in zip(params, random, strict=True)]),
    )
    assert torch.equal(md.top_p, torch.tensor([p.top_p for p in params], dtype=torch.float32))
    assert torch.equal(md.min_p, torch.tensor([p.min_p for p in params], dtype=torch.float32))
    assert md.filter_width == 40 and md.sort_rows.tolist() == [2, 7]  # top-p without top-k: sorted
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    assert md.seeded.rows.tolist() == seeded
    assert md.seeded.seeds.tolist() == [params[i].seed for i in seeded]
    assert md.seeded.positions.tolist() == [len(states[i].output_token_ids) for i in seeded]
    rows_, ids, biases = md.logit_bias
    assert (
        rows_.tolist() == [2, 2, 7, 7] and ids.tolist() == [5, 9, 5, 9] and biases.tolist() == [3.0, -1.0] * 2
    )
    banned = [
        i
        for i, (s, p) in enumerate(zip(states, params, strict=True))
        if len(s.output_token_ids) < p.min_tokens
    ]
    assert banned and md.banned[0].tolist() == [i for i in banned for _ in range(2)]
    assert md.banned[1].tolist() == [0, 7] * len(banned)  # EOS and the stop id


def test_penalties_of_a_batch_equal_each_row_alone() -> None:
    """The flattened [P * V] scatter puts each row's counts in its own row."""
    states = [s for s in rows(12) if s.params.repetition_penalty != 1.0 or s.params.frequency_penalty != 0.0
              or s.params.presence_penalty != 0.0]  # fmt: skip
    logits = torch.randn(len(states), 60, generator=torch.Generator().manual_seed(0))
    batched = logits.clone()
    apply_penalties(batched, SamplingMetadata.build(states, 60, CPU).penalties)
    for i, s in enumerate(states):
        alone = logits[i : i + 1].clone()
        apply_penalties(alone, SamplingMetadata.build([s], 60, CPU).penalties)
        assert torch.equal(batched[i], alone[0])
        counts = SamplingMetadata.build([s], 60, CPU).penalties.output_counts[0]
        assert counts.tolist() == [float(s.output_token_ids.count(t)) for t in range(60)]


def test_to_host_reads_ids_and_logprobs_in_one_copy_bit_for_bit() -> None:
    states = rows(7)
    logits = torch.randn(7, 100, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, SamplingMetadata.build(states, 100, CPU))
    tokens, logprobs = out.to_host()
    assert tokens == out.sampled_token_ids.tolist()
    assert torch.equal(logprobs.token_ids, out.logprobs.token_ids)
    assert torch.equal(logprobs.logprobs.view(torch.int32), out.logprobs.logprobs.view(torch.int32))
    assert torch.equal(logprobs.ranks, out.logprobs.ranks)
    assert logprobs.to_lists(4, 5) == out.logprobs.to_lists(4, 5)

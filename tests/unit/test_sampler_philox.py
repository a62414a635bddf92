"""Seeded draws from the counter-based stream (sample/philox.py, the "counter" mode CUDA uses):
Philox against its published answers, the Triton kernel against the torch ops, the draws against
Exp(1), and the sampler's guarantees built on them: a seeded row samples the same tokens alone or
in any batch, after a rebuild of its state (preemption), and in speculative verification.

Without CUDA the kernel runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported); the `gpu` tests run it compiled and check that a sampling step never syncs.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmserve.sample import RequestSamplingState, Sampler, SamplingMetadata
from llmserve.sample.metadata import SamplingDevicePolicy
from llmserve.sample.philox import exponential_from_uint32, philox4x32, philox_exponentials_, philox_uint32
from llmserve.sample.rejection import verify_proposals
from llmserve.sampling_params import SamplingParams
from tests.unit.test_sampler import DIST_LOGITS, assert_matches, reference_distribution

CPU = torch.device("cpu")
COUNTER = SamplingDevicePolicy("counter", host_checks=True, pin_memory=False)


def draws(seeds: list[int], positions: list[int], vocab_size: int) -> torch.Tensor:
    q = torch.zeros(len(seeds), vocab_size)
    index = torch.arange(len(seeds))
    philox_exponentials_(q, index, torch.tensor(seeds), torch.tensor(positions))
    return q


# ---------------------------------------------------------------- the generator


def test_philox_matches_the_published_answers() -> None:
    """Random123's kat_vectors for philox4x32_10 (counter, key -> output)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        words = philox4x32(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
        assert tuple(int(w) for w in words) == expected


def test_triton_kernel_equals_the_torch_ops() -> None:
    pytest.importorskip("triton")
    from llmserve.sample import philox_triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seeds = torch.tensor([0, 1, 2**62 + 12345, 987654321987], device=device)
    positions = torch.tensor([0, 5, 2**33 + 7, 100], device=device)
    rows = torch.tensor([4, 0, 2, 5], device=device)
    vocab_size = 2100  # three blocks, the last one partial
    raw = torch.full((6, vocab_size), -1, dtype=torch.int64, device=device)
    philox_triton.philox_exponentials_(raw, rows, seeds, positions, raw=True)
    expected = philox_uint32(seeds, positions, vocab_size)
    assert torch.equal(raw[rows], expected)  # the integers bit for bit
    assert (raw[[1, 3]] == -1).all()  # other rows untouched
    q = torch.zeros(6, vocab_size, device=device)
    philox_triton.philox_exponentials_(q, rows, seeds, positions)
    # the logs differ (numpy's under the interpreter; a GPU's may be an approximation of ~2^-22)
    torch.testing.assert_close(q[rows], exponential_from_uint32(expected), rtol=1e-6, atol=2e-7)


def test_a_draw_depends_on_seed_position_and_token_only() -> None:
    q = draws([7, 7, 7, 8], [3, 3, 4, 3], 500)
    assert torch.equal(q[0], q[1])  # same (seed, position)
    assert not torch.equal(q[0], q[2]) and not torch.equal(q[0], q[3])
    # alone, or as row 2 of 5 beside other seeds, with the vocabulary cut: the same numbers
    alone = draws([7], [4], 500)
    batch = torch.zeros(5, 500)
    philox_exponentials_(batch, torch.tensor([3, 2, 0]), torch.tensor([1, 7, 9]), torch.tensor([0, 4, 2]))
    assert torch.equal(batch[2], alone[0]) and torch.equal(q[2], alone[0])
    assert torch.equal(draws([7], [4], 300)[0], alone[0, :300])


def test_transform_is_minus_log1p_to_float32_accuracy() -> None:
    """q = -log(1 - u) of the float32 u within 2^-19 relative over the whole range of r, the
    fine small-q end (the series) included: the race is decided by the smallest q of a row.
    (u near 1, the large-q end, is as coarse as float32 makes it: 2^-24 steps.)"""
    r = torch.cat([torch.arange(0, 2**12), torch.randint(0, 2**32, (100_000,), generator=torch.Generator().manual_seed(0)),
                   torch.tensor([2**24 - 1, 2**24, 2**25 + 1, 2**32 - 2**8, 2**32 - 1])])  # fmt: skip
    u = ((r.float() + 0.5) * 2.0**-32).clamp(max=1.0 - 2.0**-24).double()
    torch.testing.assert_close(exponential_from_uint32(r).double(), -torch.log1p(-u), rtol=2.0**-19, atol=0)


def _ks_uniform(u: torch.Tensor) -> float:
    """The Kolmogorov-Smirnov statistic of samples `u` against Uniform(0, 1)."""
    u = u.double().sort().values
    n = len(u)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max(float((i / n - u).max()), float((u - (i - 1) / n).max()))


def _chi_square(counts: torch.Tensor) -> float:
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_are_exponential_and_independent() -> None:
    """A million draws (64 seeds x 16 positions x 1024 tokens, fixed): exp(-q) is uniform (KS at
    the 0.1% level, chi-square over 1000 bins within 5 sd); neighbouring tokens, positions and
    seeds are independent (chi-square of 10 x 10 pair cells within 5 sd)."""
    seeds = [s * 7919 for s in range(64) for _ in range(16)]
    positions = [p for _ in range(64) for p in range(16)]
    q = draws(seeds, positions, 1024).view(64, 16, 1024)  # [seed, position, token]
    u = torch.exp(-q.double()).flatten()  # = 1 - the uniform
    n = u.numel()
    assert _ks_uniform(u) < 1.95 / math.sqrt(n)
    bins = torch.bincount((u * 1000).long().clamp_(max=999), minlength=1000).double()
    assert _chi_square(bins) < 999 + 5 * math.sqrt(2 * 999)
    assert abs(float(q.double().mean()) - 1.0) < 5 / math.sqrt(n)  # Exp(1): mean 1, sd 1
    cell = (torch.exp(-q.double()) * 10).long().clamp_(max=9)  # [seed, position, token] in 0..9
    for a, b in [
        (cell[:, :, :-1], cell[:, :, 1:]),  # adjacent tokens
        (cell[:, :-1, :], cell[:, 1:, :]),  # adjacent positions
        (cell[:-1], cell[1:]),  # adjacent seeds
    ]:
        pairs = torch.bincount((a * 10 + b).flatten(), minlength=100).double()
        assert _chi_square(pairs) < 99 + 5 * math.sqrt(2 * 99)


# ---------------------------------------------------------------- the sampler in the counter mode

VOCAB = 64


def state(params: SamplingParams, output: list[int] | None = None) -> RequestSamplingState:
    return RequestSamplingState(params, [1, 2, 3], list(output or []), frozenset(), None)


def model_logits(s: RequestSamplingState) -> torch.Tensor:
    """Next-token logits [V] that depend only on the request's own history."""
    history = s.prompt_token_ids + s.output_token_ids
    g = torch.Generator().manual_seed((history[-1] * 1_000_003 + len(history)) % 2**31)
    return 2.0 * torch.randn(VOCAB, generator=g)


def generate(states: list[RequestSamplingState], target: int, num_steps: int = 16) -> list[int]:
    for _ in range(num_steps):
        logits = torch.stack([model_logits(s) for s in states])
        metadata = SamplingMetadata.build(states, VOCAB, CPU, policy=COUNTER)
        assert not metadata.generators
        for s, token in zip(states, Sampler()(logits, metadata).sampled_token_ids.tolist(), strict=True):
            s.output_token_ids.append(token)
    return states[target].output_token_ids


SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, frequency_penalty=0.3, seed=1234)
NEIGHBOURS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.2, seed=99),
    SamplingParams(temperature=0.7, top_k=5, min_p=0.05),
]


def test_seeded_row_is_the_same_alone_and_in_any_batch() -> None:
    alone = generate([state(SEEDED)], 0)
    torch.manual_seed(1)
    first = generate([state(SEEDED), *(state(p) for p in NEIGHBOURS)], 0)
    torch.manual_seed(2)
    third = generate([*(state(p) for p in NEIGHBOURS[:2]), state(SEEDED), *(state(p) for p in NEIGHBOURS)], 2)
    assert alone == first == third
    assert alone != generate([state(dataclass_replace_seed(SEEDED, 1235))], 0)


def dataclass_replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, seed=seed)


def test_position_not_history_keys_the_draw() -> None:
    """A state rebuilt from its tokens (a preempted request) samples what the original would:
    nothing but the seed and the number of tokens output decides the draw."""
    original = state(SEEDED)
    generate([original], 0, num_steps=6)
    rebuilt = state(SEEDED, output=original.output_token_ids)
    assert generate([original], 0, num_steps=5) == generate([rebuilt], 0, num_steps=5)


def test_counter_mode_samples_the_filtered_distribution() -> None:
    num_rows = 4000
    states = [
        state(SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=seed)) for seed in range(num_rows)
    ]
    metadata = SamplingMetadata.build(states, len(DIST_LOGITS), CPU, policy=COUNTER)
    tokens = Sampler()(torch.tensor(DIST_LOGITS).repeat(num_rows, 1), metadata).sampled_token_ids
    assert_matches(tokens, reference_distribution(0.8, 6, 0.9, 0.0))


def test_verification_draws_what_plain_sampling_draws_at_each_position() -> None:
    """Row j of a verification samples position base + j: the token plain sampling picks there,
    with no generator to rewind (verify_proposals gets none)."""
    torch.manual_seed(3)
    logits = torch.randn(4, 8) * 2
    params = SamplingParams(temperature=1.0, seed=5)
    base = [4, 4]  # two tokens already output

    def plain(j: int) -> int:
        s = state(params, output=base + [0] * j)
        md = SamplingMetadata.build([s], 8, CPU, policy=COUNTER)
        return int(Sampler()(logits[j : j + 1], md).sampled_token_ids)

    expected = [plain(j) for j in range(4)]
    for drafts in ([*expected[:3]], [expected[0], (expected[1] + 1) % 8, 0], [(expected[0] + 1) % 8, 1, 2]):
        s = state(params, output=base)
        md = SamplingMetadata.build([s] * 4, 8, CPU, positions=range(2, 6), policy=COUNTER)
        out = verify_proposals(logits, md, drafts, None)
        assert out == expected[: len(out)]


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_sampling_step_never_syncs_on_cuda() -> None:
    """Metadata, processing, filters, seeded and unseeded draws and logprobs of a batch using every
    feature enqueue without one host sync; `to_host` is the step's one."""
    device = torch.device("cuda")
    kinds = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=1, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.5, logit_bias={5: 3.0}),
        SamplingParams(temperature=1.1, min_p=0.1, seed=2, min_tokens=4, stop_token_ids=[7]),
        SamplingParams(temperature=0.7, top_k=5, presence_penalty=0.3, seed=3, logprobs=5),
    ]
    states = [RequestSamplingState(p, [1, 2, 3], [4, 5], frozenset([0]), None) for p in kinds * 8]
    logits = torch.randn(len(states), 49152, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        metadata = SamplingMetadata.build(states, 49152, device)
        out = Sampler()(logits, metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, logprobs = out.to_host()
    assert len(tokens) == len(states) and logprobs is not None


@pytest.mark.gpu
def test_counter_mode_is_batch_independent_on_cuda() -> None:
    device = torch.device("cuda")
    logits = torch.randn(1, 151936, device=device)
    alone = Sampler()(logits, SamplingMetadata.build([state(SEEDED, [3] * 9)], 151936, device))
    states = [state(p) for p in NEIGHBOURS] + [state(SEEDED, [3] * 9)]
    batch_logits = torch.cat([torch.randn(len(NEIGHBOURS), 151936, device=device), logits])
    batch = Sampler()(batch_logits, SamplingMetadata.build(states, 151936, device))
    assert int(batch.sampled_token_ids[-1]) == int(alone.sampled_token_ids[0])

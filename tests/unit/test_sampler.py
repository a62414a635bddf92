"""The batched sampler: greedy, seeded reproducibility, filtered distributions, penalties, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from llmserve.sample import (
    RequestSamplingState,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_logprobs,
    make_generator,
)
from llmserve.sample.processing import apply_logits_processing
from llmserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_state(
    params: SamplingParams | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
    **kwargs: object,
) -> RequestSamplingState:
    params = params if params is not None else SamplingParams(**kwargs)
    return RequestSamplingState(
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=frozenset(eos),
        generator=make_generator(params.seed, CPU),
    )


def sample(logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> SamplerOutput:
    metadata = SamplingMetadata.build(states, logits.shape[-1], CPU)
    return Sampler()(logits, metadata)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_on_the_fast_path(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    states = [make_state(temperature=0.0) for _ in range(3)] + [make_state(top_k=1) for _ in range(3)]
    metadata = SamplingMetadata.build(states, 50, CPU)
    # Nothing but an argmax to do: no tensors built for the random path or for processing.
    assert metadata.all_greedy and not metadata.needs_logits_processing
    assert metadata.temperature is None and metadata.top_k is None and metadata.greedy_mask is None
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_batch_mixing_greedy_and_random_rows() -> None:
    vocab_size = 16
    logits = torch.linspace(0.0, 1.0, vocab_size).repeat(400, 1)  # nearly flat; argmax = V-1
    before = logits.clone()
    states = [
        make_state(temperature=0.0) if i % 2 == 0 else make_state(temperature=1.0, top_k=4)
        for i in range(400)
    ]
    torch.manual_seed(0)
    tokens = sample(logits, states).sampled_token_ids
    assert torch.all(tokens[0::2] == vocab_size - 1)
    random_rows = tokens[1::2]
    assert set(random_rows.tolist()) == {12, 13, 14, 15}  # top-4, each drawn ~50 times
    assert torch.equal(logits, before)  # the caller's logits are never modified


# ---------------------------------------------------------------- seeded reproducibility

VOCAB = 64


def fake_model_logits(state: RequestSamplingState) -> torch.Tensor:
    """Next-token logits [V] that depend only on the request's own history (a stand-in model)."""
    history = state.prompt_token_ids + state.output_token_ids
    seed = (history[-1] * 1_000_003 + len(history)) % (2**31)
    return 2.0 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))


def generate(states: list[RequestSamplingState], target: int, num_steps: int = 20) -> list[int]:
    """Run `num_steps` steps, appending each sampled token; return `states[target]`'s tokens."""
    sampler = Sampler()
    for _ in range(num_steps):
        logits = torch.stack([fake_model_logits(s) for s in states])  # [B, V]
        metadata = SamplingMetadata.build(states, VOCAB, CPU)
        for state, token in zip(states, sampler(logits, metadata).sampled_token_ids.tolist(), strict=True):
            state.output_token_ids.append(token)
    return states[target].output_token_ids


def seeded(seed: int) -> RequestSamplingState:
    params = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.3, seed=seed)
    return make_state(params, prompt=[1, 2, 3])


def others(num: int) -> list[RequestSamplingState]:
    """Neighbours of every kind: unseeded random, greedy, differently seeded, filtered."""
    kinds = [
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=1.2, seed=99),
        dict(temperature=0.7, top_k=5, min_p=0.05),
        dict(temperature=1.0, repetition_penalty=1.3, logit_bias={3: 2.0}),
    ]
    return [make_state(SamplingParams(**kinds[i % len(kinds)]), prompt=[i + 5]) for i in range(num)]


def test_seeded_request_is_reproducible_in_any_batch() -> None:
    alone = generate([seeded(1234)], target=0)
    assert len(alone) == 20
    torch.manual_seed(1)  # the unseeded neighbours' draws differ between runs: must not matter
    first_of_six = generate([seeded(1234), *others(5)], target=0)
    torch.manual_seed(2)
    fourth_of_eight = generate([*others(3), seeded(1234), *others(4)], target=3)
    assert first_of_six == alone
    assert fourth_of_eight == alone


def test_different_seeds_give_different_tokens() -> None:
    sequences = {tuple(generate([seeded(seed)], target=0)) for seed in range(5)}
    assert len(sequences) == 5


# ---------------------------------------------------------------- distributions

DIST_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]


def reference_distribution(temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """The exact filtered distribution, computed in plain Python independently of the sampler."""
    weights = [math.exp(x / temperature) for x in DIST_LOGITS]
    probs = [w / sum(weights) for w in weights]
    keep = sorted(range(len(probs)), key=lambda i: -probs[i])  # most likely first (logits are distinct)
    if top_k:
        keep = keep[:top_k]
    if top_p < 1.0:
        total, kept, mass = sum(probs[i] for i in keep), [], 0.0
        for i in keep:
            kept.append(i)
            mass += probs[i] / total
            if mass >= top_p:
                assert mass - top_p > 1e-3, "test case too close to the top-p boundary"
                break
        keep = kept
    if min_p > 0.0:
        p_max = max(probs[i] for i in keep)
        assert all(abs(probs[i] - min_p * p_max) > 1e-4 for i in keep), "too close to the min-p boundary"
        keep = [i for i in keep if probs[i] >= min_p * p_max]
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


DIST_CASES = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (1.7, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.7, 5, 0.9, 0.0),
    (1.3, 6, 0.95, 0.1),
    (1.5, 0, 0.7, 0.3),
]


def assert_matches(tokens: torch.Tensor, expected: list[float]) -> None:
    """Each token's frequency within 5 standard errors of its exact probability; impossible ones never."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=len(expected)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected, strict=True)):
        if p == 0.0:
            assert count == 0, f"filtered-out token {token} sampled {count} times"
        else:
            tolerance = 5 * math.sqrt(p * (1 - p) / n) + 1e-9
            assert abs(count / n - p) <= tolerance, (
                f"token {token}: {count / n:.4f} vs {p:.4f} (±{tolerance:.4f})"
            )


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), DIST_CASES)
def test_sampled_frequencies_match_the_filtered_distribution(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    num_rows = 20_000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    states = [make_state(params) for _ in range(num_rows)]
    torch.manual_seed(0)
    tokens = sample(torch.tensor(DIST_LOGITS).repeat(num_rows, 1), states).sampled_token_ids
    assert_matches(tokens, reference_distribution(temperature, top_k, top_p, min_p))


def test_seeded_rows_sample_the_filtered_distribution() -> None:
    # Each row has its own generator: the per-row path must draw from the same distribution.
    num_rows = 4_000
    states = [make_state(temperature=0.8, top_k=6, top_p=0.9, seed=seed) for seed in range(num_rows)]
    tokens = sample(torch.tensor(DIST_LOGITS).repeat(num_rows, 1), states).sampled_token_ids
    assert_matches(tokens, reference_distribution(0.8, 6, 0.9, 0.0))


# ---------------------------------------------------------------- penalties, bias, min_tokens

PEN_LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
PROMPT, OUTPUT = [0, 1], [2, 2, 4]  # token 2 twice and token 4 once in the output; 3 and 5 never seen


@pytest.mark.parametrize(
    ("penalties", "expected"),
    [
        # repetition 1.5 on prompt and output tokens: positive / 1.5, negative * 1.5
        (dict(repetition_penalty=1.5), [2.0 / 1.5, -1.5, 0.5 / 1.5, 3.0, -3.0, 0.0]),
        # repetition < 1 encourages: positive / 0.5 doubles, negative * 0.5 halves
        (dict(repetition_penalty=0.5), [4.0, -0.5, 1.0, 3.0, -1.0, 0.0]),
        # frequency: minus 0.5 per occurrence in the output (the prompt is not counted)
        (dict(frequency_penalty=0.5), [2.0, -1.0, 0.5 - 1.0, 3.0, -2.5, 0.0]),
        (dict(frequency_penalty=-1.0), [2.0, -1.0, 2.5, 3.0, -1.0, 0.0]),
        # presence: minus 0.3 once for each token present in the output
        (dict(presence_penalty=0.3), [2.0, -1.0, 0.2, 3.0, -2.3, 0.0]),
        # all three: repetition first, then frequency and presence
        (
            dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -2.0, 0.25 - 1.0 - 0.25, 3.0, -4.0 - 0.5 - 0.25, 0.0],
        ),
    ],
)
def test_penalties_against_hand_computed_logits(penalties: dict, expected: list[float]) -> None:
    states = [
        make_state(SamplingParams(**penalties), prompt=PROMPT, output=OUTPUT),
        make_state(SamplingParams(), prompt=PROMPT, output=OUTPUT),  # no penalties: untouched
    ]
    logits = torch.tensor([PEN_LOGITS, PEN_LOGITS])
    apply_logits_processing(logits, SamplingMetadata.build(states, len(PEN_LOGITS), CPU))
    torch.testing.assert_close(logits[0], torch.tensor(expected))
    torch.testing.assert_close(logits[1], torch.tensor(PEN_LOGITS))


def test_penalties_change_the_greedy_choice() -> None:
    # Token 3 leads; a repetition penalty on it (it was already output) hands the choice to token 0.
    states = [make_state(temperature=0.0, repetition_penalty=2.0, output=[3])]
    assert sample(torch.tensor([PEN_LOGITS]), states).sampled_token_ids.tolist() == [0]


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = torch.randn(200, 10, generator=torch.Generator().manual_seed(0))
    forced = sample(logits, [make_state(temperature=1.0, logit_bias={7: 100.0}) for _ in range(200)])
    assert torch.all(forced.sampled_token_ids == 7)
    top = logits.argmax(dim=-1)
    forbidden = [make_state(temperature=0.0, logit_bias={int(t): -100.0}) for t in top]
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert torch.equal(sample(logits, forbidden).sampled_token_ids, second)


EOS, STOP = 7, 3
MIN_TOK_LOGITS = [0.0, 0.0, 1.0, 5.0, 0.0, 0.0, 0.0, 9.0]  # EOS (7) first, the stop id (3) second


def greedy_min_tokens(num_output: int, **kwargs: object) -> int:
    state = make_state(
        temperature=0.0, stop_token_ids=[STOP], output=[0] * num_output, eos=[EOS], max_tokens=50, **kwargs
    )
    return sample(torch.tensor([MIN_TOK_LOGITS]), [state]).sampled_token_ids.item()


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    assert greedy_min_tokens(0, min_tokens=2) == 2  # EOS and the stop id both banned
    assert greedy_min_tokens(1, min_tokens=2) == 2
    assert greedy_min_tokens(2, min_tokens=2) == EOS  # reached: allowed again
    assert greedy_min_tokens(0) == EOS  # no min_tokens: nothing banned


def test_ignore_eos_bans_nothing_itself_and_keeps_eos_under_min_tokens() -> None:
    assert greedy_min_tokens(0, ignore_eos=True) == EOS  # EOS may be sampled; it just does not stop
    # With ignore_eos, min_tokens still bans the stop ids but not EOS (which cannot end the request).
    assert greedy_min_tokens(0, ignore_eos=True, min_tokens=2) == EOS
    logits = torch.tensor([[0.0, 0.0, 1.0, 5.0, 0.0, 0.0, 0.0, -9.0]])
    state = make_state(temperature=0.0, stop_token_ids=[STOP], eos=[EOS], ignore_eos=True, min_tokens=2)
    assert sample(logits, [state]).sampled_token_ids.item() == 2


def test_min_tokens_ban_holds_for_random_rows() -> None:
    states = [
        make_state(temperature=2.0, min_tokens=1, stop_token_ids=[STOP], eos=[EOS]) for _ in range(2000)
    ]
    tokens = sample(torch.tensor(MIN_TOK_LOGITS).repeat(2000, 1), states).sampled_token_ids
    assert not torch.isin(tokens, torch.tensor([EOS, STOP])).any()


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_logits_with_chosen_token_first() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    states = [
        make_state(temperature=0.0, logprobs=3),
        make_state(temperature=0.7, top_k=5, repetition_penalty=1.3, output=[1, 2], logprobs=5, seed=1),
        make_state(temperature=1.0),  # no logprobs asked: still computed at the batch's max k
        make_state(temperature=0.0, logprobs=0, logit_bias={4: 50.0}),
    ]
    out = sample(logits, states)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 6)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.token_ids))  # raw values, not processed
    top = raw.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)  # top-k in descending order
    expected_ranks = [
        int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(out.sampled_token_ids.tolist())
    ]
    assert lp.ranks.tolist() == expected_ranks
    assert lp.ranks[0] == 1  # greedy picks the most likely token

    row = lp.to_lists(3, 0)  # the biased row: chosen token only
    assert row.token_ids == [[4]] and row.ranks == [expected_ranks[3]]
    assert row.logprobs[0] == pytest.approx([raw[3, 4].item()])
    row = lp.to_lists(0, 3)
    assert row.token_ids == [lp.token_ids[0, :4].tolist()]
    assert row.logprobs[0] == pytest.approx(raw[0, lp.token_ids[0, :4]].tolist())


def test_rank_of_a_chosen_token_outside_the_top_k() -> None:
    logits = torch.tensor([[-5.0, 1.0, 3.0, 2.0, 0.0, 4.0]])
    out = sample(logits, [make_state(temperature=0.0, logit_bias={0: 100.0}, logprobs=2)])
    assert out.sampled_token_ids.tolist() == [0]
    result = out.logprobs.to_lists(0, 2)
    assert result.token_ids == [[0, 5, 2]]
    assert result.ranks == [6]  # the least likely of six
    assert result.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[[0, 5, 2]].tolist())


def test_compute_logprobs_for_prompt_positions() -> None:
    # As the runner uses it for prompt logprobs: logits at 0..n-2 scored against tokens 1..n-1.
    prompt = torch.tensor([5, 1, 1, 0, 9])
    logits = torch.randn(len(prompt), 10, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    lp = compute_logprobs(logits[:-1], prompt[1:], num_alternatives=2)
    raw = torch.log_softmax(logits[:-1].float(), dim=-1)
    assert lp.logprobs.dtype == torch.float32
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, prompt[1:, None]).squeeze(1))
    chunk = lp.rows_to_lists(1, 4, 1)
    assert chunk.token_ids == [
        [t, i] for t, i in zip(prompt[2:].tolist(), raw.argmax(-1)[1:].tolist(), strict=True)
    ]
    assert len(chunk.ranks) == 3


def test_tied_tokens_share_the_best_rank() -> None:
    lp = compute_logprobs(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([1]), num_alternatives=1)
    assert lp.ranks.tolist() == [1]

"""Speculative decoding's parts alone: the n-gram proposer, the rejection sampler (exact
distributions, checked statistically with fixed seeds), the scheduler's budgeting and rollback of
proposed tokens, the adaptive back-off, and the configuration."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.request import Request
from llmserve.core.sched_output import ModelRunnerOutput
from llmserve.core.scheduler import Scheduler
from llmserve.sample import SamplingMetadata
from llmserve.sample.rejection import verify_proposals
from llmserve.sample.state import RequestSamplingState
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.controller import MAX_STEPS, PROBE_INTERVAL, SpecController
from llmserve.spec_decode.ngram import NgramProposer


def request(tokens: list[int], rid: str = "r", max_tokens: int = 100, **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)


# -- the n-gram proposer -----------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3]  # "2 3" occurs at 1 and 6: the latest (6) wins
    assert proposer.propose(request(tokens), 3) == [7, 8, 2]
    # a longer match beats a later shorter one: "9 2 3" is only at 5..7
    tokens = [9, 2, 3, 4, 4, 2, 3, 6, 9, 2, 3]
    assert proposer.propose(request(tokens, "r2"), 2) == [4, 4]


def test_ngram_without_a_match_proposes_nothing() -> None:
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4))
    assert proposer.propose(request([1, 2, 3, 4, 5, 6]), 4) == []
    assert proposer.propose(request([7], "short"), 4) == []


def test_ngram_proposal_stops_at_the_context_end_and_follows_growth() -> None:
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=2))
    r = request([5, 6, 5])
    assert proposer.propose(r, 4) == [6, 5]  # after the match at 0 only two tokens exist
    for t in range(300):  # the buffer grows with the request (past its first 256 slots)
        r.output_token_ids.append(1000 + t)
    r.output_token_ids += [1000, 1001]
    assert proposer.propose(r, 3) == [1002, 1003, 1004]
    proposer.retain({})
    assert proposer._contexts == {}


# -- the rejection sampler ---------------------------------------------------------------------------


def metadata(params: SamplingParams, rows: int, generator=None, outputs=None) -> SamplingMetadata:
    states = [
        RequestSamplingState(params, [1], list(outputs[j]) if outputs else [], frozenset(), generator)
        for j in range(rows)
    ]
    return SamplingMetadata.build(states, 8, torch.device("cpu"))


def test_greedy_keeps_the_agreeing_prefix_then_the_argmax() -> None:
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 4, 6, 2]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert verify_proposals(logits, metadata(greedy, 4), [3, 4, 6], None) == [3, 4, 6, 2]
    assert verify_proposals(logits, metadata(greedy, 4), [3, 5, 6], None) == [3, 4]
    assert verify_proposals(logits, metadata(greedy, 4), [0, 4, 6], None) == [3]


def test_greedy_applies_penalties_per_position() -> None:
    """Row 1 is judged with proposal 0 already in the output: a repetition penalty on it flips
    row 1's argmax away from that token, as plain decoding would."""
    logits = torch.zeros(2, 8)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    md = metadata(params, 2, outputs=[[], [3]])
    assert verify_proposals(logits, md, [3], None) == [3, 4]


def _frequencies(tokens: list[int], size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=size).double() / len(tokens)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_tokens_follow_the_model_distribution(temperature: float, top_p: float) -> None:
    """Whatever is proposed, the first emitted token is distributed as the model's (processed)
    distribution at row 0, and the second, given the first was the proposal, as row 1's: the
    total variation distance to the exact distributions is within sampling noise."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=1)

    def exact(row: int) -> torch.Tensor:
        x = (logits[row].double() / temperature).softmax(-1)
        order = x.argsort(descending=True)
        keep = x[order].cumsum(0) - x[order] < top_p  # the smallest set reaching top_p
        p = torch.zeros_like(x)
        p[order[keep]] = x[order[keep]]
        return p / p.sum()

    generator = torch.Generator().manual_seed(1234)
    n = 20000
    drafts = [int(exact(0).argmax()), int(exact(1).argmin())]  # a likely and an unlikely proposal
    firsts, seconds = [], []
    for _ in range(n):
        out = verify_proposals(logits, metadata(params, 3, generator), drafts, generator)
        firsts.append(out[0])
        if out[0] == drafts[0]:
            seconds.append(out[1])
    noise = 4 * math.sqrt(8 / n)  # a generous bound on TV for 8 outcomes at this sample size
    assert 0.5 * (_frequencies(firsts, 8) - exact(0)).abs().sum() < noise
    assert 0.5 * (_frequencies(seconds, 8) - exact(1)).abs().sum() < 4 * math.sqrt(8 / len(seconds))
    accepted = sum(t == drafts[0] for t in firsts) / n
    assert abs(accepted - float(exact(0)[drafts[0]])) < 0.02  # acceptance is p(proposal)


# -- the scheduler -----------------------------------------------------------------------------------


def scheduler(k: int = 4, blocks: int = 64, budget: int = 64, max_model_len: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget), CacheConfig(block_size=4), blocks, max_model_len, k
    )


def prefill(s: Scheduler, r: Request) -> None:
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([r.request_id], [[7]]))


def test_proposals_are_scheduled_and_the_rejected_rolled_back() -> None:
    s = scheduler()
    r = request([1, 2, 3, 4, 5])
    prefill(s, r)
    assert (r.num_tokens, r.num_computed_tokens) == (6, 5)
    r.spec_token_ids = [8, 9, 10]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 4} and out.scheduled_spec_tokens == {"r": [8, 9, 10]}
    assert len(s.kv_cache_manager.get_block_ids("r")) == 3  # room for 9 tokens
    s.update_from_output(out, ModelRunnerOutput(["r"], [[8, 11]]))  # one accepted, then the model's 11
    assert r.output_token_ids == [7, 8, 11] and r.num_computed_tokens == 7 and r.spec_token_ids == []
    stats = s.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.accepted_per_pos == (1, 0, 0, 0)


def test_proposals_are_cut_to_max_tokens_the_context_and_the_budget() -> None:
    s = scheduler(max_model_len=10)
    r = request([1, 2, 3, 4, 5], max_tokens=3)
    prefill(s, r)
    r.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()
    assert out.scheduled_spec_tokens == {"r": [8]}  # 1 output + 1 proposal + the model's = max_tokens
    s2 = scheduler(max_model_len=8)
    r2 = request([1, 2, 3, 4, 5], "r2")
    prefill(s2, r2)
    r2.spec_token_ids = [8, 9, 10, 11]
    assert s2.schedule().scheduled_spec_tokens == {"r2": [8, 9]}  # positions 6, 7: the context's end
    s3 = scheduler(budget=6)
    r3 = request([1, 2, 3, 4, 5], "r3")
    prefill(s3, r3)
    r3.spec_token_ids = [8, 9, 10, 11]
    assert s3.schedule().num_scheduled_tokens == {"r3": 5}


def test_no_room_for_proposals_decodes_plainly() -> None:
    s = scheduler(blocks=2)  # 8 slots: the 6-token request has room for 2 more, not 5
    r = request([1, 2, 3, 4, 5])
    prefill(s, r)
    r.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 1} and out.scheduled_spec_tokens == {}


def test_verifications_update_the_acceptance_estimate() -> None:
    s = scheduler()
    r = request([1, 2, 3, 4, 5])
    prefill(s, r)
    r.spec_token_ids = [8, 9]
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["r"], [[3]]))  # nothing accepted
    assert (r.spec_accepted, r.spec_rejected) == (0.0, 1.0)
    r.spec_token_ids = [3, 4]
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["r"], [[3, 4, 5]]))  # both accepted: no rejection
    assert (r.spec_accepted, r.spec_rejected) == (2.0, 0.8) and r.spec_idle == 0


def candidate(rid: str, accepted: float, rejected: float, idle: int = 0) -> Request:
    r = request([1, 2, 3], rid)
    r.spec_accepted, r.spec_rejected, r.spec_idle = accepted, rejected, idle
    return r


def fitted(a: float, b: float) -> SpecController:
    """A controller whose cost model has seen decode steps of t(n) = a + b n."""
    c = SpecController(max_k=6)
    for n in (1, 2, 3, 5, 1, 4, 2, 6):
        c.observe_step(n, a + b * n)
    return c


def test_cost_model_fits_decode_steps() -> None:
    a, b = fitted(4.0, 1.0).cost()
    assert abs(a - 4.0) < 1e-9 and abs(b - 1.0) < 1e-9
    c = SpecController(max_k=4)
    for _ in range(5):
        c.observe_step(1, 5.2)  # all steps alike: the prior ratio splits the time
    a, b = c.cost()
    assert abs(a + b - 5.2) < 1e-9 and abs(b / a - 0.3) < 1e-9


def test_cost_model_forgets_old_steps() -> None:
    """The fit covers the last MAX_STEPS decode steps only: after the machine's cost changes, a
    window of new steps gives the new cost exactly (the running sums drop what leaves)."""
    c = fitted(4.0, 1.0)
    sizes = (1, 2, 3, 5, 1, 4, 2, 6)
    for i in range(3 * MAX_STEPS):
        c.observe_step(sizes[i % len(sizes)], 4.0 + 1.0 * sizes[i % len(sizes)])
    for i in range(MAX_STEPS):
        c.observe_step(sizes[i % len(sizes)], 0.002 + 0.003 * sizes[i % len(sizes)])
    a, b = c.cost()
    assert abs(a - 0.002) < 1e-9 and abs(b - 0.003) < 1e-9


def test_allocation_verifies_what_pays() -> None:
    """Alone, a request whose proposals are usually kept verifies several tokens and one that
    usually misses none; in a batch of 16, where a step costs a + 16 b already, fewer."""
    c = fitted(3.0, 1.0)
    likely, unlikely = candidate("likely", 20.0, 1.0), candidate("unlikely", 0.0, 5.0)
    assert c.allocate([(likely, 6)], 1, 1) == {"likely": 6}
    assert c.allocate([(unlikely, 6)], 1, 1) == {}
    assert c.allocate([(likely, 2)], 1, 1) == {"likely": 2}  # never more than offered
    crowd = [(candidate(f"r{i}", 3.0, 1.0), 4) for i in range(16)]
    alone = c.allocate(crowd[:1], 1, 1)["r0"]
    assert sum(c.allocate(crowd, 16, 16).values()) < 16 * alone
    # a request held at zero still probes one token now and then
    assert c.allocate([(candidate("stale", 0.0, 5.0, idle=PROBE_INTERVAL), 4)], 1, 1) == {"stale": 1}
    assert SpecController(max_k=3, adaptive=False).allocate([(unlikely, 6)], 1, 1) == {"unlikely": 3}


@pytest.mark.parametrize(
    "value,message",
    [
        ('{"method": "medusa"}', "method must be one of"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be in"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
        ('{"method": "draft_model"}', "needs `model`"),
        ('{"num_spec_tokens": 3}', "unknown key(s) ['num_spec_tokens']"),
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_config_errors(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SpeculativeConfig.parse(value)


def test_config_parse() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max) == ("ngram", 5, 3)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(c) is c


def test_seeded_verification_draws_what_plain_sampling_draws() -> None:
    """Row j's token is the one plain sampling's j-th next step picks with the same generator, and
    the generator ends where plain sampling of the emitted tokens leaves it."""
    from llmserve.sample import Sampler

    torch.manual_seed(3)
    logits = torch.randn(4, 8) * 2
    params = SamplingParams(temperature=1.0, seed=5)
    plain_gen = torch.Generator().manual_seed(99)
    plain = [
        int(Sampler()(logits[j : j + 1], metadata(params, 1, plain_gen)).sampled_token_ids) for j in range(4)
    ]
    for drafts in (
        [plain[0], plain[1], plain[2]],
        [plain[0], (plain[1] + 1) % 8, 0],
        [(plain[0] + 1) % 8, 1, 2],
    ):
        gen = torch.Generator().manual_seed(99)
        out = verify_proposals(logits, metadata(params, 4, gen), drafts, gen)
        assert out == plain[: len(out)]
        # the generator is where plain sampling of len(out) tokens leaves it
        check = torch.Generator().manual_seed(99)
        for _ in out:
            torch.empty(8).exponential_(generator=check)
        assert torch.equal(gen.get_state(), check.get_state())


def test_engine_acceptance_is_the_prior_of_new_requests() -> None:
    """A proposer that rarely helps lowers the prior of requests with no history (they are not
    asked at all then) and makes probes rarer."""
    c = fitted(3.0, 1.0)
    fresh = candidate("fresh", 0.0, 0.0)
    assert c.worth_proposing(fresh, 1, 1)
    for _ in range(30):
        c.observe_acceptance(0, 4)
    assert c.prior_alpha < 0.05 and c.probe_interval == 4 * PROBE_INTERVAL
    assert not c.worth_proposing(fresh, 1, 1)
    assert c.worth_proposing(candidate("due", 0.0, 0.0, idle=4 * PROBE_INTERVAL), 1, 1)

"""The engine with seeded rows drawn from the counter-based stream (the mode CUDA uses, forced here
on the CPU): a seeded request's tokens do not depend on the batch, on preemption, or on how many
speculative proposals each step verified — the output position keys every draw."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.sample.metadata import SamplingDevicePolicy
from tests.models.tiny import make_tiny_model

PROMPTS = [
    [5, 17, 99, 3],
    [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400],
    [42],
    list(range(100, 160)),
]
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True)


@pytest.fixture
def counter_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = SamplingDevicePolicy("counter", host_checks=True, pin_memory=False)
    monkeypatch.setattr(SamplingDevicePolicy, "for_device", classmethod(lambda cls, device: policy))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("counter-llama")
    make_tiny_model("llama", folder)
    return folder


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_tokens_survive_preemption_and_batching(tiny, counter_mode) -> None:
    roomy = LLM(str(tiny), show_progress=False, num_kv_blocks=128, block_size=4, enable_prefix_caching=False)
    tight = LLM(str(tiny), show_progress=False, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    expected = token_ids(roomy.generate(PROMPTS, SEEDED, use_tqdm=False))
    assert token_ids(tight.generate(PROMPTS, SEEDED, use_tqdm=False)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    alone = [token_ids(roomy.generate([p], SEEDED, use_tqdm=False))[0] for p in PROMPTS]
    assert alone == expected
    others = SamplingParams(temperature=1.0, max_tokens=20)
    mixed = roomy.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others, SEEDED, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == expected[1]


@pytest.mark.slow
def test_speculative_verification_draws_what_plain_decoding_draws(counter_mode) -> None:
    """Verification row j samples output position base + j, so a seeded request gets plain
    decoding's tokens whatever was proposed and accepted (the embedded model copying a text
    accepts most proposals, so rows past the first decide many tokens)."""
    text = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France."
    chat = [[{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}]]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40) for seed in range(6)]
    plain = LLM(show_progress=False, kv_cache_memory=128 * 2**20)
    # not adaptive: every step verifies what the n-gram proposer offers, however it fares
    spec_config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "adaptive": False}
    spec = LLM(show_progress=False, kv_cache_memory=128 * 2**20, speculative_config=spec_config)
    want = [o.outputs[0].token_ids for o in plain.chat(chat * 6, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.chat(chat * 6, params, use_tqdm=False)] == want
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 5

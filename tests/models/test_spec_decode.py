"""Speculative decoding (n-gram) in the engine on the embedded model: greedy outputs are the very
tokens plain decoding gives, on text it can predict (a copy, a summary) and text it cannot, with
chunked prefill, prefix caching, preemption, n > 1, stop strings, logprobs and grammars (which
speculate too); proposals
are accepted where the text repeats its input; seeded sampling gives plain decoding's tokens. The
draft-model proposer on tiny models."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}],
    [{"role": "user", "content": f"Summarize in one sentence:\n\n{TEXT}"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def make(**kw) -> LLM:
    kw.setdefault("kv_cache_memory", 128 * 2**20)
    return LLM(show_progress=False, **kw)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return make()


@pytest.fixture(scope="module")
def spec() -> LLM:
    return make(speculative_config=SPEC)


def outputs(llm: LLM, params: SamplingParams, conversations=CONVERSATIONS):
    return [o.outputs for o in llm.chat(conversations, params, use_tqdm=False)]


def test_greedy_outputs_are_plain_decodings(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=80, logprobs=1)
    before = spec.engine.scheduler.spec_stats
    for want, got in zip(outputs(plain, params), outputs(spec, params), strict=True):
        assert got[0].token_ids == want[0].token_ids and got[0].text == want[0].text
        assert got[0].finish_reason == want[0].finish_reason
        for a, b, t in zip(want[0].logprobs, got[0].logprobs, want[0].token_ids, strict=True):
            assert abs(a[t][0] - b[t][0]) < 2e-2  # the same position, scored in a batch of k+1
    stats = spec.engine.scheduler.spec_stats
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    proposed = stats.num_draft_tokens - before.num_draft_tokens
    assert proposed > 20 and accepted / proposed > 0.5  # the copy repeats its input


def test_copying_takes_fewer_steps(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60)
    steps = []
    for llm in (plain, spec):
        before = llm.engine.scheduler.num_steps
        outputs(llm, params, CONVERSATIONS[:1])
        steps.append(llm.engine.scheduler.num_steps - before)
    assert steps[1] < 0.7 * steps[0], steps


def test_with_chunked_prefill_prefix_caching_and_preemption(plain: LLM) -> None:
    """A 24-token step budget chunks every prompt; the same prompt twice hits the prefix cache;
    14 blocks of 16 tokens cannot hold two whole sequences at once, so some are preempted."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    conversations = [*CONVERSATIONS, CONVERSATIONS[0]]
    want = [o[0].token_ids for o in outputs(plain, params, conversations)]
    tight = make(speculative_config=SPEC, max_num_batched_tokens=24, num_kv_blocks=14, kv_cache_memory=None)
    got = [o[0].token_ids for o in outputs(tight, params, conversations)]
    assert got == want
    stats = tight.engine.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec.num_accepted_tokens > 0


def test_n_samples_stop_strings_and_grammars(plain: LLM, spec: LLM) -> None:
    greedy_n = SamplingParams(temperature=0.0, max_tokens=40, n=2)
    assert [[c.token_ids for c in o] for o in outputs(spec, greedy_n, CONVERSATIONS[:1])] == [
        [c.token_ids for c in o] for o in outputs(plain, greedy_n, CONVERSATIONS[:1])
    ]
    # a stop string inside a step's accepted tokens ends the text, and the tokens, right there
    stopped = SamplingParams(temperature=0.0, max_tokens=80, stop=["Gustave"])
    (want,), (got,) = outputs(plain, stopped, CONVERSATIONS[:1]), outputs(spec, stopped, CONVERSATIONS[:1])
    assert want[0].finish_reason == "stop" and want[0].stop_reason == "Gustave"
    assert (got[0].text, got[0].token_ids, got[0].stop_reason) == (want[0].text, want[0].token_ids, "Gustave")
    # a request with a grammar speculates too: only the proposals its grammar allows are verified,
    # each row masked by the grammar state after the proposals before it
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    constrained = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    conversations = [
        [{"role": "user", "content": f"Put this text in a JSON object, word for word:\n\n{TEXT}"}]
    ]
    before = spec.engine.scheduler.spec_stats
    got = outputs(spec, constrained, conversations)[0][0]
    assert got.text == outputs(plain, constrained, conversations)[0][0].text and got.text.startswith(
        '{"text":'
    )
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > before.num_accepted_tokens


def test_seeded_sampling_gives_plain_decodings_tokens(plain: LLM, spec: LLM) -> None:
    """Row j of a verification draws what plain decoding's j-th next step would draw, so a seeded
    request samples the very tokens it samples without speculation, however many proposals each
    step verified (which depends on timing)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=60, repetition_penalty=1.05)
    want = [o[0].token_ids for o in outputs(plain, params)]
    for _ in range(2):
        assert [o[0].token_ids for o in outputs(spec, params)] == want


def test_draft_model_proposals(tmp_path) -> None:
    """A draft model run by the same machinery (its own paged KV cache): the target itself as its
    draft has every greedy proposal accepted; an unrelated draft has (nearly) none; the tokens are
    plain decoding's either way, greedy and seeded."""
    from tests.models.tiny import make_tiny_model

    target, other = tmp_path / "target", tmp_path / "other"
    make_tiny_model("llama", target)
    make_tiny_model("llama", other, seed=1)
    prompts = [[5, 17, 99, 3], list(range(100, 160)), [42, 43, 44, 42, 43, 44, 42, 43]]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=4, max_tokens=40, ignore_eos=True)

    def run(llm: LLM, params: SamplingParams) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = LLM(str(target), num_kv_blocks=128, block_size=4, show_progress=False)
    want_greedy, want_seeded = run(plain, greedy), run(plain, seeded)
    for draft, accepts in ((target, True), (other, False)):
        spec = LLM(str(target), num_kv_blocks=128, block_size=4, show_progress=False,
                   speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4,
                                       "adaptive": False})  # fmt: skip
        before = spec.engine.scheduler.spec_stats
        assert run(spec, greedy) == want_greedy
        stats = spec.engine.scheduler.spec_stats
        proposed = stats.num_draft_tokens - before.num_draft_tokens
        accepted = stats.num_accepted_tokens - before.num_accepted_tokens
        assert proposed > 0 and (accepted == proposed if accepts else accepted < 0.1 * proposed)
        assert run(spec, seeded) == want_seeded


def test_draft_models_cache_shares_the_kv_budget(tmp_path) -> None:
    """A budget in bytes pays for the draft's cache too: the target as its own draft (the same
    bytes per token) halves the blocks a given budget holds; the CPU default (room for every
    sequence at full context) keeps its blocks and reserves for both caches."""
    from tests.models.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path)
    draft = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2}
    for budget, share in (({"kv_cache_memory": 4 * 2**20}, 2), ({}, 1)):
        plain = LLM(str(tmp_path), block_size=4, max_num_seqs=4, show_progress=False, **budget).engine
        spec = LLM(str(tmp_path), block_size=4, max_num_seqs=4, show_progress=False, speculative_config=draft,
                   **budget).engine  # fmt: skip
        assert spec.kv_info.draft_bytes_per_token == plain.kv_info.bytes_per_token > 0
        assert spec.kv_info.num_blocks == plain.kv_info.num_blocks // share
        assert spec.proposer.kv.num_blocks == spec.kv_info.num_blocks  # type: ignore[union-attr]
        assert "for the draft model" in spec.kv_info.summary()
    given = LLM(str(tmp_path), num_kv_blocks=64, show_progress=False, speculative_config=draft).engine
    assert given.kv_info.num_blocks == 64  # blocks given are blocks kept, for both caches


def test_draft_model_must_share_the_vocabulary(tmp_path) -> None:
    import transformers

    from tests.models.tiny import TINY_CONFIGS, make_tiny_model

    make_tiny_model("llama", tmp_path / "t")
    config = TINY_CONFIGS["llama"]()
    config.vocab_size = 1024
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens, larger than the target's 512"):
        LLM(str(tmp_path / "t"), num_kv_blocks=32, show_progress=False,
            speculative_config={"method": "draft_model", "model": str(tmp_path / "d")})  # fmt: skip

"""The transformers implementation (model_impl="transformers", and the automatic fallback for an
architecture with no native implementation) inside the engine: greedy continuations equal
transformers' own, alone and in a batch, with chunked prefill and with preemption; n > 1 with a
seed repeats; logprobs and structured outputs run through the same sampler; a native architecture
gives the same tokens on both implementations."""

from __future__ import annotations

import json
import logging

import pytest

from llmserve import LLM, SamplingParams
from llmserve.sampling_params import StructuredOutputsParams
from tests.models.test_engine import PROMPTS, hf_greedy, token_ids
from tests.models.tiny import FALLBACK_CONFIGS, make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FALLBACK_CONFIGS))
def fallback(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"fallback-{request.param}")
    hf = make_tiny_model(request.param, folder)
    for name in ("config.json", "generation_config.json"):  # EOS = <|endoftext|> (0): transformers'
        path = folder / name  # default EOS id is a quote in the tiny vocabulary, which JSON needs
        if path.exists():
            path.write_text(
                json.dumps({**json.loads(path.read_text()), "eos_token_id": 0, "bos_token_id": None})
            )
    return folder, [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def make_llm(folder, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLM(str(folder), show_progress=False, **kw)


def test_unsupported_architecture_falls_back_to_transformers(fallback, caplog) -> None:
    folder, reference = fallback
    with caplog.at_level(logging.WARNING, logger="llmserve"):
        llm = make_llm(folder)
    assert llm.engine.loaded.linear_kernel == "transformers"
    assert "several times slower than native" in caplog.text
    assert not llm.engine.cache_config.enable_prefix_caching  # no shared KV blocks to reuse
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    for p, ref in zip(PROMPTS, reference, strict=True):
        assert token_ids(llm.generate([p], GREEDY, use_tqdm=False)) == [ref]


def test_chunked_prefill_and_preemption(fallback) -> None:
    """A step budget of 8 tokens splits every long prompt; 24 blocks of 4 tokens cannot hold the
    four sequences at once, so some are preempted and recomputed: the tokens do not change."""
    folder, reference = fallback
    llm = make_llm(folder, max_num_batched_tokens=8, num_kv_blocks=24)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.stats().num_preemptions > 0


def test_sampling_logprobs_and_grammar_through_the_same_sampler(fallback) -> None:
    folder, _ = fallback
    llm = make_llm(folder)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=3, ignore_eos=True, logprobs=2)
    a, b = (llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    for c in a.outputs:
        assert len(c.logprobs) == 12 and all(
            tok in pos for tok, pos in zip(c.token_ids, c.logprobs, strict=True)
        )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    (out,) = llm.generate(["The quick"], params, use_tqdm=False)
    assert out.outputs[0].text.startswith('{"n":')
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(out.outputs[0].text)["n"], int)


def test_native_architecture_same_tokens_on_both_implementations(tmp_path) -> None:
    make_tiny_model("llama", tmp_path)
    native = make_llm(tmp_path, model_impl="native")
    hf = make_llm(tmp_path, model_impl="transformers")
    assert (
        hf.engine.loaded.linear_kernel == "transformers"
        and native.engine.loaded.linear_kernel != "transformers"
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    got_native, got_hf = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (native, hf))
    assert token_ids(got_hf) == token_ids(got_native)
    for x, y in zip(got_native, got_hf, strict=True):
        for px, py in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            for tok, (lp, _rank) in px.items():
                if tok in py:
                    assert abs(py[tok][0] - lp) < 1e-3


def test_gguf_with_the_transformers_implementation_is_refused() -> None:
    with pytest.raises(ValueError, match="HF model folders, not GGUF"):
        LLM(model_impl="transformers", show_progress=False)  # the embedded model is a GGUF file


def test_speculative_decoding_rolls_back_transformers_caches(tmp_path) -> None:
    """Rejected proposals leave K/V in a request's transformers cache; the next step crops it.
    A prompt that repeats itself gets proposals (n-gram), and the tokens stay plain greedy's."""
    make_tiny_model("llama", tmp_path)
    prompts = [[5, 17, 99, 3, 5, 17, 99, 3, 5, 17], [42, 43, 44, 42, 43, 44, 42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = make_llm(tmp_path, model_impl="transformers")
    spec = make_llm(tmp_path, model_impl="transformers",
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "adaptive": False})  # fmt: skip
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False)
    )
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some were rejected and rolled back

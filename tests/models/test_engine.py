"""The engine end to end on real (tiny random, and the embedded) models: in-flight batching,
chunked prefill, preemption, reservation, prefix caching, n > 1, seeds, stops and logprobs —
each compared with a run that does not use the mechanism, or with transformers."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.models.tiny import make_tiny_model

PROMPTS = [
    [5, 17, 99, 3],
    [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25, 88, 89, 90],
    [42],
    list(range(100, 160)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-llama")
    hf = make_tiny_model("llama", folder)
    return folder, hf


def make_llm(folder, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLM(str(folder), show_progress=False, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(tiny):
    _folder, hf = tiny
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def test_batched_greedy_equals_alone_and_transformers(tiny, reference):
    llm = make_llm(tiny[0])
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    for p, ref in zip(PROMPTS, reference, strict=True):
        assert token_ids(llm.generate([p], GREEDY, use_tqdm=False)) == [ref]


def test_many_decodes_grouped_by_length(tiny):
    """20 running sequences of spread-out lengths (decoded in several length groups) give the
    tokens each gives alone (the single-sequence attention path)."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 70))] for _ in range(20)]
    llm = make_llm(tiny[0], num_kv_blocks=512, max_num_batched_tokens=2048)
    batched = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert batched == alone


def test_chunked_prefill_gives_the_same_tokens(tiny, reference):
    llm = make_llm(tiny[0], max_num_batched_tokens=7)  # the 60-token prompt takes 9 steps
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


@pytest.mark.parametrize("admission", ["optimistic", "reserve"])
def test_small_kv_pool(tiny, reference, admission):
    # 24 blocks of 4 = 96 slots for four requests that need 28 + 47 + 25 + 84 tokens in total.
    llm = make_llm(tiny[0], num_kv_blocks=24, admission_policy=admission, enable_prefix_caching=False)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    preemptions = llm.engine.scheduler.num_preemptions
    if admission == "optimistic":
        assert preemptions > 0  # the pool really was too small
    else:
        assert preemptions == 0
    assert llm.engine.scheduler.kv_cache_manager.get_num_free_blocks() == 24


def test_prefix_cache_reuses_blocks_and_keeps_outputs(tiny):
    system = list(range(300, 340))  # 40 shared tokens = 10 full blocks
    prompts = [[*system, 7, 8, 9], [*system, 10, 11]]
    cached = make_llm(tiny[0])
    uncached = make_llm(tiny[0], enable_prefix_caching=False)
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    second = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 40
    stats = cached.engine.scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.hits >= 40
    assert token_ids(first + second) == token_ids(uncached.generate(prompts, GREEDY, use_tqdm=False))


def test_n_samples_share_the_prompt_and_seeds_reproduce(tiny):
    llm = make_llm(tiny[0])
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    out = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in out.outputs]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) == 3  # per-sample seeds differ
    # The second and third sample found the first one's full prompt blocks in the cache.
    assert out.num_cached_tokens == 56
    # Same seed again, now inside a batch with other random requests: same samples.
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1]], [others, params, others], use_tqdm=False)
    assert [c.token_ids for c in batch[1].outputs] == samples


def test_seeded_request_unchanged_by_preemption(tiny):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    roomy = make_llm(tiny[0], enable_prefix_caching=False)
    tight = make_llm(tiny[0], num_kv_blocks=24, enable_prefix_caching=False)
    expected = token_ids(roomy.generate(PROMPTS, params, use_tqdm=False))
    assert token_ids(tight.generate(PROMPTS, params, use_tqdm=False)) == expected
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode", ["static", "static-ragged"])
def test_static_batching_gives_the_same_tokens(tiny, reference, mode):
    # Batches of 2 with prompts of 4 and 23, then 1 and 60 tokens: in `static` mode the short
    # ones are prefilled beside 19 and 59 pad positions that they must not see.
    llm = make_llm(tiny[0], batching_mode=mode, max_num_seqs=2, max_num_batched_tokens=32)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.requests == {}
    assert llm.engine.scheduler.kv_cache_manager.get_num_free_blocks() == 128


def test_prompt_logprobs_match_transformers(tiny):
    folder, hf = tiny
    llm = make_llm(folder, max_num_batched_tokens=16)  # several chunks
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, logprobs=3, temperature=0.0)
    out = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPTS[3]])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[3])
    for pos in range(1, len(PROMPTS[3])):
        entry = out.prompt_logprobs[pos]
        tok = PROMPTS[3][pos]
        assert entry[tok][0] == pytest.approx(ref[pos - 1, tok].item(), abs=1e-4)
        assert len(entry) in (3, 4)  # the prompt token plus 2 alternatives (it may be one of them)
    sampled = out.outputs[0]
    (lp,) = sampled.logprobs
    tok = sampled.token_ids[0]
    assert lp[tok][1] == 1 and len(lp) == 3 + (tok not in lp or 0)  # greedy token has rank 1
    assert sampled.cumulative_logprob == pytest.approx(lp[tok][0])


def test_prompt_logprobs_survive_preemption(tiny):
    """A preempted request recomputes its prompt but returns each prompt logprob exactly once."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    roomy = make_llm(tiny[0], enable_prefix_caching=False).generate(PROMPTS, params, use_tqdm=False)
    tight_llm = make_llm(tiny[0], num_kv_blocks=24, enable_prefix_caching=False)
    tight = tight_llm.generate(PROMPTS, params, use_tqdm=False)
    assert tight_llm.engine.scheduler.num_preemptions > 0
    for a, b, prompt in zip(roomy, tight, PROMPTS, strict=True):
        assert len(b.prompt_logprobs) == len(prompt)
        assert [p and sorted(p) for p in a.prompt_logprobs] == [p and sorted(p) for p in b.prompt_logprobs]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_abort_frees_blocks(tiny):
    llm = make_llm(tiny[0])
    engine = llm.engine
    engine.add_request("x", PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() < 128
    (out,) = engine.abort_request(["x"])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == 128
    assert not engine.has_unfinished_requests()


def test_final_only_requests_come_back_once_as_the_cumulative_ones_end(tiny):
    """The offline `LLM`'s requests (final_only) give no output until they finish, and then the
    same tokens, text, logprobs, stop and metrics as a request that accumulated every step; a
    stop string and n = 2 included."""
    engine = make_llm(tiny[0]).engine
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[" "]),
    ]
    for i, p in enumerate(params):
        engine.add_request(f"cum{i}", PROMPTS[i], p)
        engine.add_request(f"fin{i}", PROMPTS[i], p, final_only=True)
    finals, seen = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((out.request_id, out.finished))
            if out.finished:
                finals[out.request_id] = out
    assert all(finished for rid, finished in seen if rid.startswith("fin"))
    assert sum(rid.startswith("fin") for rid, _ in seen) == len(params)
    for i in range(len(params)):
        cum, fin = finals[f"cum{i}"], finals[f"fin{i}"]
        for a, b in zip(cum.outputs, fin.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
            )
            assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
        assert fin.metrics.num_generation_tokens == cum.metrics.num_generation_tokens
    assert finals["fin2"].outputs[0].stop_reason == " "  # the stop string cut it


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_whole(tiny):
    llm = make_llm(tiny[0])
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        llm.generate([PROMPTS[0], list(range(250))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 9999]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued


def test_16_bit_kv_cache_holds_twice_the_tokens_and_keeps_greedy_tokens(tiny, reference):
    fp32 = make_llm(tiny[0], num_kv_blocks=None, kv_cache_memory=2**20)
    fp16 = make_llm(tiny[0], num_kv_blocks=None, kv_cache_memory=2**20, kv_cache_dtype="float16")
    assert fp16.engine.kv_info.bytes_per_token * 2 == fp32.engine.kv_info.bytes_per_token
    assert fp16.engine.kv_info.num_blocks == 2 * fp32.engine.kv_info.num_blocks
    assert fp16.engine.kv_info.summary().startswith("KV cache (float16): ")
    assert fp32.engine.kv_info.dtype == "float32"  # auto: the model's dtype
    assert fp16.engine.runner.runner.kv_caches[0].dtype == torch.float16
    # The tiny model's greedy tokens survive the rounding (its logit margins are wide enough).
    assert token_ids(fp16.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_auto_kv_cache_is_float16_under_quantized_weights(tiny):
    """`auto` follows the model's dtype, except that quantized linear layers on the CPU keep K/V
    in float16 (llama.cpp's default cache); an explicit dtype always wins."""
    assert make_llm(tiny[0], quantization="int8").engine.kv_info.dtype == "float16"
    assert make_llm(tiny[0], quantization="int4").engine.kv_info.dtype == "float16"
    assert make_llm(tiny[0], quantization="none").engine.kv_info.dtype == "float32"
    pinned = make_llm(tiny[0], quantization="int8", kv_cache_dtype="float32")
    assert pinned.engine.kv_info.dtype == "float32"
    assert pinned.engine.runner.runner.kv_caches[0].dtype == torch.float32


def test_auto_step_budget_follows_the_path_the_stack_runs_on(tiny):
    """256 tokens a step where the fused CPU decoder runs the stack (quantized weights), 1024 on
    the float path; a given budget always wins. The fused path's tokens do not depend on how the
    steps cut the prompts: six 100-token prompts at once (three steps at 256, one at 1024) give
    the same greedy tokens under either budget."""
    fused = make_llm(tiny[0], quantization="int8")
    assert fused.engine.runner.runner.fused is not None
    assert fused.engine.scheduler_config.max_num_batched_tokens == 256
    assert make_llm(tiny[0], quantization="none").engine.scheduler_config.max_num_batched_tokens == 1024
    whole = make_llm(tiny[0], quantization="int8", max_num_batched_tokens=1024)
    assert whole.engine.scheduler_config.max_num_batched_tokens == 1024
    prompts = [[(7 * i + 13 * j) % 400 + 5 for i in range(100)] for j in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert token_ids(fused.generate(prompts, params, use_tqdm=False)) == token_ids(
        whole.generate(prompts, params, use_tqdm=False)
    )


def test_int8_kv_cache_holds_3_7x_the_tokens(tiny, reference):
    """int8 rows: head_dim values and a float16 scale per 32 of them (16 + 2 bytes for this
    model's 16-dim heads, against 64 in float32)."""
    fp32 = make_llm(tiny[0], num_kv_blocks=None, kv_cache_memory=2**20)
    int8 = make_llm(tiny[0], num_kv_blocks=None, kv_cache_memory=2**20, kv_cache_dtype="int8")
    head_dim = fp32.engine.runner.runner.spec.head_dim
    assert int8.engine.kv_info.bytes_per_token * 4 * head_dim == fp32.engine.kv_info.bytes_per_token * (
        head_dim + 2
    )
    assert int8.engine.kv_info.summary().startswith("KV cache (int8): ")
    out = token_ids(int8.generate(PROMPTS, GREEDY, use_tqdm=False))
    # A prompt's first token attends to its own K/V unrounded; later ones read the int8 cache,
    # whose rounding can move this random model's near-ties (parity tolerances: test_parity.py).
    assert [o[0] for o in out] == [r[0] for r in reference]
    assert [len(o) for o in out] == [len(r) for r in reference]


@pytest.mark.parametrize("bad", ["fp8", "int4", "float64", ""])
def test_unknown_kv_cache_dtype_is_refused(tiny, bad):
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be .*got {bad!r}"):
        make_llm(tiny[0], kv_cache_dtype=bad)


def test_embedded_model_batch_matches_llamacpp(llamacpp_reference):
    """int16 activations: the file's float model token for token, on any CPU."""
    llm = LLM(show_progress=False, cpu_activations="int16")
    cases = [g for g in llamacpp_reference["greedy"] if g["weights"] == "f32"]
    outs = llm.generate(
        [c["prompt_ids"] for c in cases], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )
    for case, out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == case["greedy_ids"]
        assert out.outputs[0].text == case["greedy_text"]
        assert out.outputs[0].finish_reason == ("stop" if case["greedy_ids"][-1] == 2 else "length")


def test_chat_and_stop_strings_on_the_embedded_model(llamacpp_reference):
    llm = LLM(show_progress=False, cpu_activations="int16")
    case = next(g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == "chat")
    (out,) = llm.chat(
        [{"role": "user", "content": case["prompt"]}], SamplingParams(temperature=0, max_tokens=32)
    )
    assert out.prompt_token_ids == case["prompt_ids"]
    assert out.outputs[0].text == case["greedy_text"]  # "The capital of France is Paris."
    # A stop string spanning tokens: cut before it, reported as the stop reason.
    (out,) = llm.chat(
        [{"role": "user", "content": case["prompt"]}],
        SamplingParams(temperature=0, max_tokens=32, stop=["France is"]),
    )
    assert out.outputs[0].text == "The capital of "
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "France is"
    assert not llm.engine.has_unfinished_requests()


def test_vllm_prompt_forms_give_the_same_tokens(tiny, reference):
    """str, token ids, {"prompt": ...} and {"prompt_token_ids": ...}, alone or in lists, mixed."""
    llm = make_llm(tiny[0])
    text = "The quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    by_text = token_ids(llm.generate(text, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate({"prompt": text}, GREEDY, use_tqdm=False)) == by_text
    assert token_ids(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)) == by_text
    mixed = [{"prompt_token_ids": PROMPTS[0]}, PROMPTS[1], {"prompt": text}, *PROMPTS[2:]]
    out = token_ids(llm.generate(mixed, GREEDY, use_tqdm=False))
    assert out[:2] == reference[:2] and out[2] == by_text[0] and out[3:] == reference[2:]


@pytest.mark.parametrize(
    ("prompts", "match"),
    [({"prompt_token_ids": "abc"}, "prompt 0: 'prompt_token_ids' must be a non-empty list of ints"),
     ([{"prompt": "a", "prompt_token_ids": [1]}], "prompt 0: a dict prompt needs exactly one of"),
     (["fine", {"text": "a"}], r"prompt 1: a dict prompt needs exactly one of .*\['text'\]"),
     ([{"prompt": "a", "multi_modal_data": {}}], r"prompt 0: 'multi_modal_data' must be a dict with keys 'image'"),
     (["ok", {"prompt": "a", "multi_modal_data": {"image": b"x"}}], r"prompt 1: model .* takes no images \(text only\)"),
     (["ok", {"prompt": "a", "multi_modal_data": {"video": [b"x"]}}], r"prompt 1: model .* takes no videos"),
     ([{"prompt": 5}], "prompt 0: 'prompt' must be a string; got int"),
     (["ok", 3.5], "prompt 1: expected a string, a list of token ids, or a dict"),
     (42, "prompts must be a prompt or a list of prompts; got int")],
)  # fmt: skip
def test_bad_prompt_forms_are_refused_before_anything_runs(tiny, prompts, match):
    llm = make_llm(tiny[0])
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

"""Embedding requests on tiny random models: pooled final hidden states against transformers'
(`model.model(...).last_hidden_state`, the final norm's output) pooled the same way, through
chunked prefill, preemption-free batching beside generation requests, truncation and the
model's own sentence-transformers pooling config."""

from __future__ import annotations

import json

import pytest
import torch

from llmserve import LLM, PoolingParams, SamplingParams
from llmserve.errors import ParameterError
from tests.models.tiny import make_tiny_model

PROMPTS = [
    [5, 17, 99, 3],
    [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25, 88, 89, 90],
    [42],
    list(range(100, 160)),  # longer than the 16-token chunks below
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"embed-{request.param}")
    hf = make_tiny_model(request.param, folder)
    return folder, hf


def make_llm(folder, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLM(str(folder), show_progress=False, **kw)


def hf_embedding(hf, prompt: list[int], params: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # [T, H], after the final norm
    v = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[params.pooling]
    if params.dimensions is not None:
        v = v[: params.dimensions]
    return torch.nn.functional.normalize(v, dim=0) if params.normalize else v


def assert_close(ours: list[float], ref: torch.Tensor, normalize: bool) -> None:
    got = torch.tensor(ours)
    assert got.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) >= 0.9999
    if normalize:
        assert abs(got.norm().item() - 1.0) < 1e-4
    else:  # the scale is the model's too
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_embeddings_match_transformers(tiny, pooling, normalize):
    folder, hf = tiny
    params = PoolingParams(pooling, normalize)  # type: ignore[arg-type]
    # chunks of 16 tokens: the 60-token prompt is pooled over four steps
    llm = make_llm(folder, max_num_batched_tokens=16)
    outs = llm.embed(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.num_prompt_tokens == len(prompt)
        assert_close(out.embedding, hf_embedding(hf, prompt, params), normalize)


def test_dimensions_truncate_then_renormalise(tiny):
    folder, hf = tiny
    llm = make_llm(folder)
    params = PoolingParams("mean", dimensions=16)
    out = llm.embed([PROMPTS[1]], params, use_tqdm=False)[0]
    assert len(out.embedding) == 16
    assert_close(out.embedding, hf_embedding(hf, PROMPTS[1], params), True)
    with pytest.raises(ParameterError, match="dimensions"):
        llm.embed([PROMPTS[1]], PoolingParams(dimensions=65), use_tqdm=False)


def test_generation_unchanged_beside_embeddings_and_blocks_freed(tiny):
    """Embedding requests batched with generation ones (chunked, in the same steps) change no
    greedy token, and give every KV block back."""
    folder, hf = tiny
    llm = make_llm(folder, max_num_batched_tokens=16)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine = llm.engine
    mean = PoolingParams("mean")
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"gen-{i}", p, GREEDY)
        engine.add_request(f"emb-{i}", engine.process_embedding_inputs(p[::-1], mean))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[f"gen-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
    for i, p in enumerate(PROMPTS):
        assert_close(done[f"emb-{i}"].embedding, hf_embedding(hf, p[::-1], mean), True)
        assert done[f"emb-{i}"].outputs[0].token_ids == []
    kv = engine.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_last_pooling_reuses_cached_prefix_mean_does_not(tiny):
    folder, hf = tiny
    llm = make_llm(folder)
    prompt = PROMPTS[3]
    llm.generate([prompt], GREEDY, use_tqdm=False)  # fills the prefix cache
    for pooling in ("last", "mean"):
        params = PoolingParams(pooling)  # type: ignore[arg-type]
        engine = llm.engine
        engine.add_request(pooling, engine.process_embedding_inputs(prompt, params))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        assert (outs[0].num_cached_tokens > 0) == (pooling == "last")
        assert_close(outs[0].embedding, hf_embedding(hf, prompt, params), True)


def test_sentence_transformers_config_sets_the_default(tmp_path):
    make_tiny_model("llama", tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    # no Normalize module: not normalised, unless asked
    assert make_llm(tmp_path).engine.default_pooling == PoolingParams("mean", False)
    engine = make_llm(tmp_path, pooling="cls", normalize_embeddings=True).engine
    assert engine.default_pooling == PoolingParams("cls", True)


def test_bad_inputs_are_refused(tiny):
    llm = make_llm(tiny[0], max_model_len=64)
    with pytest.raises(ParameterError, match="65 tokens exceeds"):
        llm.embed([[1] * 65], use_tqdm=False)
    with pytest.raises(ParameterError, match="empty"):
        llm.engine.process_embedding_inputs([])
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams("max")  # type: ignore[arg-type]


def test_fused_cpu_decoder_pools_its_final_hidden_states(tiny):
    """int8 weights run through the fused C++ decoder, which returns the final norm's output
    too; the vectors are transformers' within the int8 rounding of the weights."""
    folder, hf = tiny
    llm = make_llm(folder, quantization="int8", max_num_batched_tokens=16)
    assert llm.engine.runner.runner.fused is not None
    for pooling in ("last", "mean", "cls"):
        params = PoolingParams(pooling)  # type: ignore[arg-type]
        out = llm.embed([PROMPTS[3]], params, use_tqdm=False)[0]
        ref = hf_embedding(hf, PROMPTS[3], params)
        assert torch.nn.functional.cosine_similarity(torch.tensor(out.embedding), ref, dim=0) >= 0.999


def test_preempted_embedding_request_starts_its_pooling_again(tiny):
    """A pool too small for both: a decoding generation request's growth preempts the embedding
    request (the newest) in the middle of its chunked prefill; it is recomputed later, and its
    vector is still transformers' (the accumulator starts over)."""
    folder, hf = tiny
    llm = make_llm(folder, num_kv_blocks=24, max_num_batched_tokens=16)
    engine, params = llm.engine, PoolingParams("mean")
    long_gen = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.add_request("gen", PROMPTS[1], long_gen)
    for _ in range(20):  # the generation holds 11 of the 24 blocks, and will need 22
        engine.step()
    prompt = [(7 * j) % 500 + 1 for j in range(60)]  # 15 blocks
    engine.add_request("emb", engine.process_embedding_inputs(prompt, params))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0
    assert_close(done["emb"].embedding, hf_embedding(hf, prompt, params), True)
    alone = llm.generate([PROMPTS[1]], long_gen, use_tqdm=False)[0].outputs[0].token_ids
    assert done["gen"].outputs[0].token_ids == alone


def test_embeddings_beside_speculative_decoding(tiny):
    """An embedding request one token short of its prompt's end looks like a decoding request:
    the engine asks no proposals for it (and its max_tokens 0 would leave no room to verify
    any); its vector is transformers', and the speculating generation keeps its greedy tokens."""
    folder, hf = tiny
    llm = make_llm(
        folder, max_num_batched_tokens=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "adaptive": False},
    )  # fmt: skip
    repetitive = [5, 6, 7, 8] * 6
    alone = llm.generate([repetitive], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine, params = llm.engine, PoolingParams("cls")
    # 17 tokens in chunks of 16: after the first step one token is left, as for a decode, and
    # the repetition gives the n-gram proposer something to propose
    prompts = [[9, 10, 11, 12] * 4 + [9], [9, 10, 11] * 11]
    for i, p in enumerate(prompts):
        engine.add_request(f"emb-{i}", engine.process_embedding_inputs(p, params))
    engine.add_request("gen", repetitive, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["gen"].outputs[0].token_ids == alone
    for i, p in enumerate(prompts):
        assert_close(done[f"emb-{i}"].embedding, hf_embedding(hf, p, params), True)


def _save_backbone(folder, name: str, causal_lm_config: bool) -> torch.nn.Module:
    """A tiny decoder saved as HF's backbone alone (`Qwen3Model`, `LlamaModel`: `layers.0...`
    without `model.`, no LM head), with a sentence-transformers last-token, normalised pooling;
    `causal_lm_config`: its config names the `...ForCausalLM` class, as Qwen3-Embedding's does."""
    from pathlib import Path

    import transformers

    from tests.models.tiny import TINY_CONFIGS, save_tiny_tokenizer

    config = TINY_CONFIGS[name]()
    torch.manual_seed(0)
    backbone = transformers.AutoModel.from_config(config).eval()
    backbone.save_pretrained(folder)
    save_tiny_tokenizer(Path(folder), config.vocab_size, ())
    if causal_lm_config:
        saved = json.loads((folder / "config.json").read_text())
        saved.update(
            architectures=[type(backbone).__name__.replace("Model", "ForCausalLM")], tie_word_embeddings=True
        )
        (folder / "config.json").write_text(json.dumps(saved))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config.hidden_size, "pooling_mode_lasttoken": True})
    )
    return backbone


@pytest.mark.parametrize(
    ("name", "causal_lm_config"), [("qwen3", False), ("qwen3", True), ("llama", False)],
    ids=["Qwen3Model", "Qwen3-Embedding-layout", "LlamaModel"],
)  # fmt: skip
def test_a_decoder_saved_without_its_head_serves_embeddings_only(tmp_path, name, causal_lm_config):
    """Embedding models saved as a decoder backbone (gte-Qwen2, e5-mistral; Qwen3-Embedding, whose
    config names Qwen3ForCausalLM over a backbone's tensors) load natively: last-token, normalised
    embeddings as transformers' backbone gives them (its sentence-transformers config is the
    default), and generation is refused naming the model."""
    backbone = _save_backbone(tmp_path, name, causal_lm_config)
    llm = make_llm(tmp_path)
    assert llm.engine.loaded.model_impl == "native" and llm.engine.loaded.model.pooling_only
    assert llm.engine.default_pooling == PoolingParams("last", True)
    for out, prompt in zip(llm.embed(PROMPTS, use_tqdm=False), PROMPTS, strict=True):
        with torch.no_grad():
            ref = backbone(torch.tensor([prompt])).last_hidden_state[0, -1]
        assert_close(out.embedding, torch.nn.functional.normalize(ref, dim=0), normalize=True)
    with pytest.raises(
        ParameterError, match="an embedding model .a decoder without an LM head.*/v1/embeddings"
    ):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)


def test_a_gguf_embedding_models_pooling_type_is_the_default(tmp_path):
    """A `qwen3` GGUF with `qwen3.pooling_type` set (what llama.cpp's converter writes from an
    embedding model's sentence-transformers config; MEAN here, since last-token pooling is the
    default anyway): that pooling, normalised, by default, as transformers' backbone gives it."""
    import gguf

    from tests.gguf_writer import convert_state_dict, hf_metadata, with_placeholder_tokenizer, write_gguf

    hf = make_tiny_model("qwen3", tmp_path / "hf")

    def metadata(w) -> None:
        with_placeholder_tokenizer(hf_metadata("qwen3", hf.config), hf.config.vocab_size)(w)
        w.add_pooling_type(gguf.PoolingType.MEAN)

    tensors = convert_state_dict("qwen3", hf.config, hf.state_dict())
    (path,) = write_gguf(tmp_path / "embed.gguf", "qwen3", dict(tensors), metadata)
    llm = make_llm(path)
    assert llm.engine.default_pooling == PoolingParams("mean", True)
    (out,) = llm.embed([PROMPTS[1]], use_tqdm=False)
    assert_close(out.embedding, hf_embedding(hf, PROMPTS[1], PoolingParams("mean", True)), normalize=True)

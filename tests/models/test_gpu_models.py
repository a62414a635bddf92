"""The models beyond plain decoder stacks on CUDA (skipped without it), each at float32 with CUDA
graphs on (the default) against transformers (or PEFT) run on the CPU: gpt-oss's attention sinks
and sliding window in the Triton kernels, Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) with
their M-RoPE positions in the graphs' persistent buffer, Gemma 3's vision spans, a BERT encoder's
embeddings and LoRA adapters through the Triton shrink/expand kernels. All passed on an H100
(2026-11-26).

The logprob tolerance is 2e-3 rather than the CPU tests' 1e-4: cuDNN runs float32 convolutions
(SigLIP's patch embedding) in TF32 by default, and CUDA's reductions sum in other orders."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, PoolingParams, SamplingParams
from llmserve.lora import LoRARequest
from tests.models.tiny import assert_greedy_matches, make_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

ATOL = 2e-3


def cuda_llm(folder, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 128)  # not 0.9 of the GPU: the test files run side by side
    llm = LLM(str(folder), device="cuda", dtype="float32", show_progress=False, **kw)
    assert llm.engine.loaded.device.type == "cuda"
    return llm


def graphs_of(llm: LLM):
    return llm.engine.runner.runner.graphs


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpt_oss_sinks_and_window_match_transformers(tmp_path, eager) -> None:
    """Prompts prefilled in chunks of 8 across the window of 8, the second pass from cached
    blocks: transformers' greedy tokens, with the sinks in the Triton kernels."""
    from tests.models.test_gpt_oss import PROMPT

    hf = make_tiny_model("gpt-oss", tmp_path)
    prompts = [PROMPT, [*PROMPT[:13], 77, 78, 79], [5, 17, 99, 3]]
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    llm = cuda_llm(tmp_path, max_num_batched_tokens=8, enable_prefix_caching=True, enforce_eager=eager)
    assert llm.engine.loaded.profile.attention_backend == "triton"
    assert (graphs_of(llm) is None or not graphs_of(llm).graphs) == eager
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want


def _vl_outputs(llm: LLM, image_tag: str, make_image):
    small, large = make_image(0, (40, 24)), make_image(1, (30, 50))
    prompt = f"The quick brown {image_tag} fox jumps over"
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in (small, large)]
    prompts.append(
        {"prompt": f"A {image_tag} and {image_tag} two", "multi_modal_data": {"image": [large, small]}}
    )
    prompts.append("The lazy dog")
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), [[small], [large], [large, small], []]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("budget", [256, 13])
def test_qwen_vl_under_graphs_matches_transformers(tmp_path, kind, budget) -> None:
    """Images between text, two in one prompt and none (budget 13 splits prompts inside images):
    greedy tokens and logprobs against transformers' generate, decode steps replayed from graphs."""
    from tests.models import tiny
    from tests.models.test_qwen2_5_vl import IMAGE, _hf_images, hf_generate, make_image

    make = {
        "qwen2_vl": tiny.make_tiny_qwen2_vl,
        "qwen2_5_vl": tiny.make_tiny_qwen2_5_vl,
        "qwen3_vl": tiny.make_tiny_qwen3_vl,
        "qwen3_vl_moe": lambda folder: tiny.make_tiny_qwen3_vl(folder, moe=True),
    }[kind]
    hf = make(tmp_path)
    llm = cuda_llm(tmp_path, max_num_batched_tokens=budget)
    assert graphs_of(llm) is not None and graphs_of(llm).graphs
    outputs, images = _vl_outputs(llm, IMAGE, make_image)
    for out, ims in zip(outputs, images, strict=True):
        hf_images = _hf_images(tmp_path, ims) if ims else {}
        assert_greedy_matches(
            out.outputs[0], *hf_generate(hf, out.prompt_token_ids, hf_images, 10), atol=ATOL
        )


def test_gemma3_vision_matches_transformers(tmp_path) -> None:
    """Gemma 3's image spans attended both ways (the Triton backend hands them to the reference
    mask) on CUDA, text-only prompts through the graphs."""
    from tests.models.test_gemma3_vision import _pixels, hf_greedy, make_image
    from tests.models.tiny import make_tiny_gemma3_vlm

    hf = make_tiny_gemma3_vlm(tmp_path)
    llm = cuda_llm(tmp_path, max_num_batched_tokens=24)
    prompt = "The quick brown <start_of_image> fox jumps over"
    images = [make_image(0), make_image(1)]
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in images]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
    outputs = llm.generate([*prompts, "The lazy dog"], params, use_tqdm=False)
    pixels = [_pixels(tmp_path, im) for im in images]
    for out, px in zip(outputs, [*pixels, None], strict=True):
        assert_greedy_matches(out.outputs[0], *hf_greedy(hf, out.prompt_token_ids, px, 10), atol=ATOL)


def test_bert_embeddings_match_transformers(tmp_path) -> None:
    """The encoder runner on CUDA: pooled hidden states of sequences of different lengths in one
    batch against transformers' BertModel."""
    import transformers

    from tests.models.test_bert import CONFIG, PROMPTS, _write_wordpiece_tokenizer, hf_hidden

    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    hf.save_pretrained(tmp_path)
    _write_wordpiece_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", show_progress=False)
    for pooling in ("mean", "cls"):
        outs = llm.embed(PROMPTS, PoolingParams(pooling, normalize=False), use_tqdm=False)
        for out, p in zip(outs, PROMPTS, strict=True):
            h = hf_hidden(hf, p)
            ref = h.mean(0) if pooling == "mean" else h[0]
            torch.testing.assert_close(torch.tensor(out.embedding), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_match_transformers(tmp_path, arch) -> None:
    """A cross-encoder on CUDA (not yet run on a GPU): token types (BERT) or RoBERTa's positions,
    the head on the first token, a batch of pairs of different lengths, against transformers on
    the CPU."""
    import transformers

    from tests.models.test_cross_encoder import (
        DOCS,
        QUERY,
        ROBERTA,
        hf_logits,
        save_cross_encoder,
        write_roberta_tokenizer,
    )  # fmt: skip

    if arch == "bert":
        hf = save_cross_encoder(tmp_path)
    else:
        torch.manual_seed(5)
        config = transformers.XLMRobertaConfig(**ROBERTA, num_labels=1)
        hf = transformers.AutoModelForSequenceClassification.from_config(config).eval()
        hf.save_pretrained(tmp_path)
        write_roberta_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", show_progress=False)
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    ref = hf_logits(tmp_path, hf, [(QUERY, d) for d in DOCS]).sigmoid()
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), ref, rtol=1e-3, atol=1e-3)


def test_lora_adapters_match_peft(tmp_path) -> None:
    """Two PEFT adapters and the base in one batch on CUDA (the Triton LoRA kernels): each greedy
    continuation equals PEFT's generate on the CPU, and the adapters change it."""
    pytest.importorskip("peft")
    from tests.models.test_lora import ALL, SOME, make_adapter, peft_reference

    make_tiny_model("llama", tmp_path)
    adapters = [
        make_adapter(tmp_path, tmp_path / "lora-all", ALL, seed=1),
        make_adapter(tmp_path, tmp_path / "lora-some", SOME, seed=2),
    ]
    llm = cuda_llm(tmp_path, enable_lora=True, max_loras=2)
    one, two = (LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(adapters, start=1))
    prompt = list(range(30, 50))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([prompt] * 3, params, lora_request=[one, two, None], use_tqdm=False)
    for out, adapter in zip(outs, [*adapters, None], strict=True):
        ref = peft_reference(tmp_path, adapter, "none")
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert out.outputs[0].token_ids == want[0, len(prompt) :].tolist()
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 3

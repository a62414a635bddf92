"""Qwen2-VL against transformers' Qwen2VLForConditionalGeneration on a tiny random checkpoint
(tests/models/tiny.py: a 3-block LayerNorm / quick-GELU vision tower, the M-RoPE text model of the
Qwen2.5-VL tests): greedy tokens and logprobs through the whole engine, with images of two sizes,
two images in one prompt, and a token budget that splits prompts inside an image."""

from __future__ import annotations

import pytest

from llmserve.engine.llm import LLM
from llmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from llmserve.sampling_params import SamplingParams
from tests.models.test_qwen2_5_vl import IMAGE, NUM_TOKENS, PAD, PROMPT, _check, make_image
from tests.models.tiny import make_tiny_qwen2_vl


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_vl")
    return make_tiny_qwen2_vl(folder), folder


@pytest.mark.parametrize("budget", [256, 13])
def test_greedy_and_logprobs_match_transformers(checkpoint, budget) -> None:
    hf, folder = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=budget, block_size=4, show_progress=False)
    assert isinstance(llm.engine.runner.runner.model, Qwen2VLForConditionalGeneration)
    small, large = make_image(0, (40, 24)), make_image(1, (30, 50))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in (small, large)]
    prompts.append({"prompt": f"A {IMAGE} and {IMAGE} two", "multi_modal_data": {"image": [large, small]}})
    prompts.append("The lazy dog")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _check(outputs, hf, folder, [[small], [large], [large, small], []])
    assert [o.prompt_token_ids.count(PAD) for o in outputs] == [15, 24, 39, 0]
    # the same prompt with the other image scores differently: the images reach the model
    first, second = ({t: round(v[0], 2) for t, v in o.outputs[0].logprobs[0].items()} for o in outputs[:2])
    assert first != second

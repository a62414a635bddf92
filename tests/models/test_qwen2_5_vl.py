"""Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration on a tiny random checkpoint
(tests/models/tiny.py: a 4-block vision tower with window and full attention blocks, M-RoPE in
the language model): preprocessing against its image processor, greedy tokens against its
`generate` and logprobs within fp32 tolerance, through the whole engine (prompt expansion, the
scheduler, the paged KV cache, M-RoPE positions in prefill and decode), also when the token
budget splits the prompt inside an image and when a prefix-cache hit covers part of an image."""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

from llmserve.engine.llm import LLM
from llmserve.layers.mrope import mrope_prompt_positions
from llmserve.model_executor.image_inputs import RopePositions
from llmserve.multimodal.qwen_vl import QwenVLImagePreprocessor
from llmserve.sampling_params import SamplingParams
from tests.models.test_gemma3_vision import make_image as random_image
from tests.models.tiny import assert_greedy_matches, make_tiny_qwen2_5_vl

NUM_TOKENS = 10
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"The quick brown {IMAGE} fox jumps over"
PAD = 511


def make_image(seed: int, size: tuple[int, int] = (40, 24)) -> Image.Image:
    """Random pixels of `size` (width, height); the default is 15 image tokens."""
    return random_image(seed, size)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    return make_tiny_qwen2_5_vl(folder), folder


def _hf_images(folder, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    return dict(processor(images=images, return_tensors="pt"))  # pixel_values, image_grid_thw


def hf_generate(hf, ids: list[int], images: dict, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy `generate` (its KV cache and rope deltas): tokens and their logprobs."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == PAD).int(), **images,
            max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    tokens = out.sequences[0, len(ids) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def _check(outputs, hf, folder, images_by_prompt) -> None:
    for out, images in zip(outputs, images_by_prompt, strict=True):
        hf_images = _hf_images(folder, images) if images else {}
        assert_greedy_matches(out.outputs[0], *hf_generate(hf, out.prompt_token_ids, hf_images, NUM_TOKENS))


def test_preprocessing_matches_the_image_processor(checkpoint) -> None:
    hf, folder = checkpoint
    ours = QwenVLImagePreprocessor.for_model(folder, hf.config.vision_config)
    for seed, size in ((0, (40, 24)), (1, (7, 90)), (2, (64, 64)), (3, (10, 12))):
        image = make_image(seed, size)
        ref = _hf_images(folder, [image])
        got = ours(image)
        assert got.grid == tuple(ref["image_grid_thw"][0].tolist())
        torch.testing.assert_close(got.pixels, ref["pixel_values"], atol=1e-5, rtol=0)


def test_mrope_positions_match_transformers(checkpoint) -> None:
    """Two images of different grids between text: the same [3, T] positions and delta."""
    hf, _ = checkpoint
    ids = [5, 6] + [PAD] * 6 + [7] + [PAD] * 4 + [8, 9]
    grids = torch.tensor([[1, 4, 6], [1, 4, 4]])  # patches; the language model sees (2, 3) and (2, 2)
    x = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(x, (x == PAD).int(), image_grid_thw=grids)
    got, delta = mrope_prompt_positions(len(ids), [(2, 1, 2, 3), (9, 1, 2, 2)])
    assert got.tolist() == ref[:, 0].tolist() and delta == int(ref_delta)


@pytest.mark.parametrize("budget", [256, 13])
def test_greedy_and_logprobs_match_transformers(checkpoint, budget) -> None:
    """budget 13: chunks end inside the images (attended causally, they split anywhere)."""
    hf, folder = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=budget, block_size=4, show_progress=False)
    small, large = make_image(0, (40, 24)), make_image(1, (30, 50))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in (small, large)]
    prompts.append({"prompt": f"A {IMAGE} and {IMAGE} two", "multi_modal_data": {"image": [large, small]}})
    prompts.append("The lazy dog")  # text only: plain RoPE, delta 0
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _check(outputs, hf, folder, [[small], [large], [large, small], []])
    # the images' pads: 40x24 -> 40x24 pixels, 10x6 patches, 15 tokens; 30x50 -> 32x48, 8x12, 24
    counts = [o.prompt_token_ids.count(PAD) for o in outputs]
    assert counts == [15, 24, 39, 0]
    # the same prompt with the other image scores differently: the images reach the model
    first, second = (o.outputs[0].logprobs[0] for o in outputs[:2])
    assert max(abs(first[t][0] - second[t][0]) for t in first.keys() & second.keys()) > 1e-2


def test_prefix_cache_keys_blocks_by_the_image(checkpoint) -> None:
    """The second run of a prompt hits blocks holding the image's tokens and answers the same (the
    decode positions from the same delta); another image of the same size shares no block from
    its first on."""
    hf, folder = checkpoint
    llm = LLM(str(folder), block_size=4, enable_prefix_caching=True, show_progress=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)

    def run(image: Image.Image):
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
        return llm.generate(prompt, params, use_tqdm=False)[0]

    first, again, other = run(make_image(0)), run(make_image(0)), run(make_image(5))
    offset = first.prompt_token_ids.index(PAD)
    assert again.num_cached_tokens > offset + 8  # the hit reaches well into the image's blocks
    assert other.num_cached_tokens <= offset  # another image: nothing from its first block on
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _check([again, other], hf, folder, [[make_image(0)], [make_image(5)]])


def test_bad_image_inputs_are_value_errors(checkpoint) -> None:
    _, folder = checkpoint
    llm = LLM(str(folder), show_progress=False)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="image marker"):
        llm.generate({"prompt": "no marker", "multi_modal_data": {"image": make_image(0)}}, params)
    with pytest.raises(ValueError, match="not a readable image"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": b"not a png"}}, params)
    with pytest.raises(ValueError, match="aspect ratio"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": make_image(0, (2, 500))}}, params)
    with pytest.raises(ValueError, match="placeholder token"):  # typed without an image
        llm.generate("<|vision_start|><|image_pad|><|vision_end|>What?", params)


def test_gemma_only_image_options_are_refused(checkpoint) -> None:
    _, folder = checkpoint
    with pytest.raises(ValueError, match="do_pan_and_scan is Gemma 3's"):
        LLM(str(folder), do_pan_and_scan=True, show_progress=False)


def test_the_fused_decoder_refuses_mrope(checkpoint) -> None:
    _, folder = checkpoint
    llm = LLM(str(folder), quantization="int8", show_progress=False)
    runner = llm.engine.runner.runner
    assert runner.fused is None and "M-RoPE" in str(runner.fused_unsupported)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    out = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3  # the layers' path, quantized weights


def test_triton_backend_takes_mrope_rotated_by_torch(checkpoint) -> None:
    """The Triton backend (here under its interpreter) rotates q and k in its cache write from one
    table row a token; M-RoPE's are rotated before it, and its answers stay transformers'."""
    pytest.importorskip("triton")
    hf, folder = checkpoint
    llm = LLM(str(folder), attention_backend="triton", block_size=4, show_progress=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    out = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
    )
    _check(out, hf, folder, [[make_image(0)]])


def test_rope_positions_of_later_tokens_add_the_delta() -> None:
    """A chunk's M-RoPE positions: the prompt's table, then index + delta on every axis (decode
    steps, proposals verified, the rest of a prompt after a prefix-cache hit)."""
    prompt, delta = mrope_prompt_positions(6, [(1, 1, 2, 2)])  # text, a 2 x 2 image, text
    assert prompt.tolist() == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]] and delta == -2
    rope = RopePositions(prompt, delta)
    assert rope.slice(2, 4).tolist() == prompt[:, 2:4].tolist()
    assert rope.slice(5, 8).tolist() == [[3, 4, 5]] * 3
    assert rope.slice(8, 9).tolist() == [[6]] * 3


def run_image_prompts(llm: LLM) -> list[list[int]]:
    """Greedy tokens of four prompts with images of different sizes (24 tokens each)."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed, size)}}
        for seed, size in ((0, (40, 24)), (1, (30, 50)), (2, (48, 16)), (3, (24, 24)))
    ]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_preemption_keeps_answers(folder) -> list[list[int]]:
    """`run_image_prompts` in 24 blocks of 4 (requests preempted and recomputed, their images
    encoded again) answers as with room for all; returns those answers."""
    want = run_image_prompts(LLM(str(folder), block_size=4, show_progress=False))
    small = LLM(str(folder), block_size=4, num_kv_blocks=24, enable_prefix_caching=False, show_progress=False)
    assert run_image_prompts(small) == want
    assert small.engine.scheduler.num_preemptions > 0
    return want


def test_preemption_and_speculation_keep_the_positions(checkpoint) -> None:
    """Requests with images preempted and recomputed (their M-RoPE positions rebuilt from the
    prompt), and verified n-gram proposals (each at index + delta), answer as plain decoding."""
    _, folder = checkpoint
    want = assert_preemption_keeps_answers(folder)
    spec = LLM(str(folder), block_size=4, show_progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})  # fmt: skip
    assert run_image_prompts(spec) == want
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0


def test_tied_embeddings_from_the_top_level_config(tmp_path) -> None:
    """Qwen2.5-VL 3B ties its LM head to the embedding in the top-level config (its text config
    has no such field); the checkpoint then has no lm_head tensor."""
    hf = make_tiny_qwen2_5_vl(tmp_path, seed=1, tied=True)
    llm = LLM(str(tmp_path), block_size=4, show_progress=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    out = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
    )
    images = _hf_images(tmp_path, [make_image(0)])
    assert_greedy_matches(out[0].outputs[0], *hf_generate(hf, out[0].prompt_token_ids, images, 4))

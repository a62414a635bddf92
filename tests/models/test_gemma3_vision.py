"""Gemma 3 with images against transformers' Gemma3ForConditionalGeneration on a tiny random
checkpoint (tests/models/tiny.py): preprocessing against its image processor, greedy tokens token
for token and their logprobs within fp32 tolerance, through the whole engine (prompt expansion,
scheduler, paged KV cache, the images' both-ways attention), also when the token budget splits the
prompt into chunks around the image and when a prefix-cache hit covers part of an image."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from llmserve.engine.llm import LLM
from llmserve.multimodal.image import ImagePreprocessor
from llmserve.sampling_params import SamplingParams
from tests.models.tiny import assert_greedy_matches, make_tiny_gemma3_vlm

NUM_TOKENS = 12
PROMPT = "The quick brown <start_of_image> fox jumps over"


def make_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-vlm")
    return make_tiny_gemma3_vlm(folder), folder


def _pixels(folder, image: Image.Image) -> torch.Tensor:
    processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    return processor(images=image, return_tensors="pt")["pixel_values"]  # [1, 3, 32, 32]


def hf_greedy(hf, ids: list[int], pixels: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens (a full forward per token: images' mask from token_type_ids)."""
    x, out, logprobs = torch.tensor([ids]), [], []
    with torch.no_grad():
        for _ in range(n):
            token_type_ids = (x == hf.config.image_token_id).long()
            logits = hf(input_ids=x, pixel_values=pixels, token_type_ids=token_type_ids).logits[0, -1]
            logprobs.append(torch.log_softmax(logits.float(), -1))
            out.append(int(logits.argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], dim=1)
    return out, logprobs


def _check(outputs, hf, pixels_by_prompt) -> None:
    for out, pixels in zip(outputs, pixels_by_prompt, strict=True):
        assert_greedy_matches(out.outputs[0], *hf_greedy(hf, out.prompt_token_ids, pixels, NUM_TOKENS))


def test_preprocessing_matches_the_image_processor(checkpoint) -> None:
    hf, folder = checkpoint
    ours = ImagePreprocessor.for_model(folder, hf.config.vision_config)
    for seed, size in ((0, (48, 40)), (1, (7, 90)), (2, (32, 32))):
        image = make_image(seed, size)
        torch.testing.assert_close(ours(image), _pixels(folder, image)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget", [256, 24])
def test_greedy_and_logprobs_match_transformers(checkpoint, budget) -> None:
    """budget 24: the 16 image tokens never split, so chunks end before the image or after it."""
    hf, folder = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=budget, block_size=4, show_progress=False)
    images = [make_image(0), make_image(1)]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images]
    prompts.append(
        {"prompt": "A <start_of_image><start_of_image> two", "multi_modal_data": {"image": images}}
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    pixels = [_pixels(folder, im) for im in images]
    _check(outputs, hf, [pixels[0], pixels[1], torch.cat(pixels)])
    # the expanded prompt holds the 16 placeholders between <start_of_image> and <end_of_image>
    ids = outputs[0].prompt_token_ids
    assert ids.count(509) == 16 and ids.count(510) == ids.count(511) == 1
    # the same prompt with the other image scores differently: the images reach the model
    first, second = (o.outputs[0].logprobs[0] for o in outputs[:2])
    assert max(abs(first[t][0] - second[t][0]) for t in first.keys() & second.keys()) > 1e-2


def test_prefix_cache_keys_blocks_by_the_image(checkpoint) -> None:
    """Two runs of one prompt: the second hits the cached blocks (part of the image's tokens among
    them) and answers the same; the prompt with another image hits nothing past the text before it."""
    hf, folder = checkpoint
    llm = LLM(str(folder), block_size=4, enable_prefix_caching=True, show_progress=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    first = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
    )
    again = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
    )
    other = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(1)}}, params, use_tqdm=False
    )
    offset = first[0].prompt_token_ids.index(509)
    assert again[0].num_cached_tokens > offset  # the hit reaches into the image's blocks
    assert other[0].num_cached_tokens <= offset  # another image: nothing from its first block on
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    _check([again[0], other[0]], hf, [_pixels(folder, make_image(0)), _pixels(folder, make_image(1))])


def test_bad_image_inputs_are_value_errors(checkpoint) -> None:
    _, folder = checkpoint
    llm = LLM(str(folder), show_progress=False)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="image marker"):
        llm.generate(
            {"prompt": "no marker", "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
        )
    with pytest.raises(ValueError, match="not a readable image"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": b"not a png"}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="token budget"):
        LLM(str(folder), max_num_batched_tokens=8, show_progress=False).generate(
            {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
        )


def test_triton_backend_runs_images_through_the_reference(checkpoint) -> None:
    """The Triton backend (here under its interpreter) hands sequences with images to the torch
    reference's both-ways mask: the same tokens and logprobs as transformers."""
    pytest.importorskip("triton")
    hf, folder = checkpoint
    llm = LLM(str(folder), attention_backend="triton", block_size=4, show_progress=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    out = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
    )
    expected, logprobs = hf_greedy(hf, out[0].prompt_token_ids, _pixels(folder, make_image(0)), 4)
    assert out[0].outputs[0].token_ids == expected
    for lp, ref in zip(out[0].outputs[0].logprobs, logprobs, strict=True):
        assert all(abs(value[0] - float(ref[token])) < 1e-4 for token, value in lp.items())


def _hf_processor(folder):
    """transformers' Gemma3Processor over the tiny checkpoint's tokenizer and image processor."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        extra_special_tokens={
            "image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"
        },
    )  # fmt: skip
    images = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    return transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=16)


def test_pan_and_scan_matches_transformers(tmp_path) -> None:
    """Pan-and-scan (opt-in: the engine option, or the checkpoint's preprocessor config): a wide
    and a tall image get crops, a near-square one none; the prompt ids equal transformers'
    Gemma3Processor's, and the greedy tokens and logprobs its model's on the processor's pixels."""
    hf = make_tiny_gemma3_vlm(tmp_path)
    path = tmp_path / "preprocessor_config.json"
    config = json.loads(path.read_text()) | {"pan_and_scan_min_crop_size": 16}  # 32-pixel images here
    path.write_text(json.dumps(config))
    processor = _hf_processor(tmp_path)
    llm = LLM(str(tmp_path), do_pan_and_scan=True, block_size=4, show_progress=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    images = [make_image(3, (100, 30)), make_image(4, (30, 70)), make_image(5, (40, 36))]
    outputs = llm.generate(
        [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images], params, use_tqdm=False
    )
    num_crops = []
    for out, image in zip(outputs, images, strict=True):
        ref = processor(text=PROMPT, images=[image], do_pan_and_scan=True, pan_and_scan_min_crop_size=16,
                        return_tensors="pt")  # fmt: skip
        assert out.prompt_token_ids == ref["input_ids"][0].tolist()
        num_crops.append(len(ref["pixel_values"]) - 1)
        expected, logprobs = hf_greedy(hf, out.prompt_token_ids, ref["pixel_values"], 6)
        assert out.outputs[0].token_ids == expected
        for lp, r in zip(out.outputs[0].logprobs, logprobs, strict=True):
            assert all(abs(value[0] - float(r[token])) < 1e-4 for token, value in lp.items())
    assert num_crops == [3, 2, 0]
    # the checkpoint's own setting turns it on; the engine option wins over it
    path.write_text(json.dumps(config | {"do_pan_and_scan": True}))
    for option, count in ((None, 4 * 16), (False, 16)):
        engine = LLM(str(tmp_path), do_pan_and_scan=option, show_progress=False).engine
        ids = engine.process_inputs(PROMPT, SamplingParams(max_tokens=1), [images[0]]).token_ids
        assert ids.count(509) == count

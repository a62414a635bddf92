"""Videos for Qwen2-VL and Qwen2.5-VL against transformers, on the tiny random checkpoints of
tests/models/tiny.py with short videos made here.

transformers' video processor needs torchvision, which the test environment lacks, so the
preprocessing is checked against its image processor (the same smart_resize, normalization and
merge-block order): a grid frame of two video frames holds each frame's pixels where a still image
holds its one frame twice. The model's answers are checked against transformers' `generate` fed
those pixels with the video's grid (and, on Qwen2.5-VL, its `second_per_grid_ts`), and the M-RoPE
positions against its `get_rope_index` with videos.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from llmserve.engine.llm import LLM
from llmserve.layers.mrope import mrope_prompt_positions
from llmserve.multimodal.processor import ImageSource
from llmserve.multimodal.qwen_vl_video import QwenVLVideoPreprocessor, Video
from llmserve.sampling_params import SamplingParams
from tests.models.test_qwen2_5_vl import IMAGE, _hf_images, make_image
from tests.models.tiny import assert_greedy_matches, make_tiny_qwen2_5_vl, make_tiny_qwen2_vl

NUM_TOKENS = 8
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_PAD, IMAGE_PAD = 508, 511


def make_video(seed: int, num_frames: int, size: tuple[int, int] = (24, 16)) -> np.ndarray:
    """[num_frames, height, width, 3] uint8 random frames (`size`: width, height)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num_frames, size[1], size[0], 3), dtype=np.uint8)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make = make_tiny_qwen2_vl if request.param == "qwen2_vl" else make_tiny_qwen2_5_vl
    return make(folder), folder


def _preprocessor(hf, folder) -> QwenVLVideoPreprocessor:
    return QwenVLVideoPreprocessor.for_model(ImageSource(folder), hf.config.vision_config)


def test_frames_are_patched_as_the_image_processor_patches_a_frame(checkpoint) -> None:
    """Each grid frame's patches hold its two video frames' pixels in the image processor's
    layout [3, T, P, P]; an odd frame count repeats the last frame; frames of another size are
    resized to the image processor's grid."""
    hf, folder = checkpoint
    ours = _preprocessor(hf, folder)
    for frames in (make_video(0, 4), make_video(1, 3), make_video(2, 2, (40, 30))):
        got = ours(list(frames))  # a list of [H, W, 3] arrays: one video
        padded = list(frames) + [frames[-1]] * (len(frames) % 2)
        refs = [_hf_images(folder, [Image.fromarray(f)]) for f in padded]
        t, h, w = got.grid
        assert t == len(padded) // 2 and (1, h, w) == tuple(refs[0]["image_grid_thw"][0].tolist())
        pixels = got.pixels.view(t, h * w, 3, 2, -1)
        for i, ref in enumerate(refs):
            ref_pixels = ref["pixel_values"].view(h * w, 3, 2, -1)[:, :, 0]
            torch.testing.assert_close(pixels[i // 2, :, :, i % 2], ref_pixels, atol=1e-5, rtol=0)
        assert got.second_per_grid_t == 2 / 2.0  # T / the default 2 fps


def test_mrope_positions_with_a_video_match_transformers(checkpoint) -> None:
    """An image and a video of 3 grid frames between text: Qwen2.5-VL spaces the frames'
    temporal ids by tokens_per_second x second_per_grid_t (here 2 x 0.75 -> 0, 1, 3), Qwen2-VL by 1."""
    hf, _ = checkpoint
    ids = [5, 6] + [IMAGE_PAD] * 6 + [7] + [VIDEO_PAD] * 12 + [8, 9]
    x = torch.tensor([ids])
    types = (x == IMAGE_PAD).int() + 2 * (x == VIDEO_PAD).int()
    kwargs = dict(image_grid_thw=torch.tensor([[1, 4, 6]]), video_grid_thw=torch.tensor([[3, 4, 4]]))
    video: tuple = (9, 3, 2, 2)
    if hasattr(hf.config.vision_config, "tokens_per_second"):
        kwargs["second_per_grid_ts"] = torch.tensor([0.75])
        video += (hf.config.vision_config.tokens_per_second * 0.75,)
    ref, ref_delta = hf.model.get_rope_index(x, types, **kwargs)
    got, delta = mrope_prompt_positions(len(ids), [(2, 1, 2, 3), video])
    assert got.tolist() == ref[:, 0].tolist() and delta == int(ref_delta)


def hf_generate(hf, ids: list[int], inputs: dict, n: int) -> tuple[list[int], list[torch.Tensor]]:
    x = torch.tensor([ids])
    types = (x == IMAGE_PAD).int() + 2 * (x == VIDEO_PAD).int()
    with torch.no_grad():
        out = hf.generate(
            input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=types, **inputs,
            max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out.sequences[0, len(ids) :].tolist(), [torch.log_softmax(s[0].float(), -1) for s in out.logits]


def _video_inputs(hf, folder, videos: list[Video]) -> dict:
    prep = _preprocessor(hf, folder)
    patches = [prep(v) for v in videos]
    inputs = {
        "pixel_values_videos": torch.cat([p.pixels for p in patches]),
        "video_grid_thw": torch.tensor([p.grid for p in patches]),
    }
    if hasattr(hf.config.vision_config, "tokens_per_second"):
        inputs["second_per_grid_ts"] = torch.tensor([p.second_per_grid_t for p in patches])
    return inputs


@pytest.mark.parametrize("budget", [256, 11])
def test_video_greedy_and_logprobs_match_transformers(checkpoint, budget) -> None:
    """Videos of 4 and 3 frames (the last repeated) at 2 and 4 fps, and a video beside an image,
    through the whole engine; budget 11 splits the prompts inside the videos."""
    hf, folder = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=budget, block_size=4, show_progress=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    four, three = make_video(0, 4), make_video(1, 3, (16, 32))
    image = make_image(0)
    prompts = [
        {"prompt": f"The quick {VIDEO} brown fox", "multi_modal_data": {"video": four}},
        {"prompt": f"A {VIDEO} jumps", "multi_modal_data": {"video": (list(three), {"fps": 4.0})}},
        {"prompt": f"A {IMAGE} then {VIDEO} over", "multi_modal_data": {"image": image, "video": four}},
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    refs = [
        _video_inputs(hf, folder, [Video(four)]),
        _video_inputs(hf, folder, [Video(three, 4.0)]),
        {**_video_inputs(hf, folder, [Video(four)]), **_hf_images(folder, [image])},
    ]
    for out, ref in zip(outputs, refs, strict=True):
        assert_greedy_matches(out.outputs[0], *hf_generate(hf, out.prompt_token_ids, ref, NUM_TOKENS))
    # 4 frames of 24x16: 2 grid frames of 4 x 6 patches, 12 tokens; 3 of 16x32: 2 x 8 x 4, 16
    assert [o.prompt_token_ids.count(VIDEO_PAD) for o in outputs] == [12, 16, 12]
    assert outputs[2].prompt_token_ids.count(IMAGE_PAD) == 15


def test_prefix_cache_keys_blocks_by_the_frames(checkpoint) -> None:
    """The same video hits its cached blocks and answers the same; other frames of the same size,
    or the same frames at another frame rate (part of the identity: Qwen2.5-VL places their temporal
    positions by it), do not."""
    _, folder = checkpoint
    llm = LLM(str(folder), block_size=4, enable_prefix_caching=True, show_progress=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)

    def run(video):
        prompt = {"prompt": f"The quick brown fox {VIDEO} jumps", "multi_modal_data": {"video": video}}
        return llm.generate(prompt, params, use_tqdm=False)[0]

    first, again, other = run(make_video(0, 4)), run(make_video(0, 4)), run(make_video(5, 4))
    offset = first.prompt_token_ids.index(VIDEO_PAD)
    assert again.num_cached_tokens > offset + 4 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens <= offset
    slower = run((list(make_video(0, 4)), {"fps": 1.0}))
    assert slower.num_cached_tokens <= offset


def test_video_limits_and_bad_videos_are_value_errors(checkpoint) -> None:
    _, folder = checkpoint
    llm = LLM(str(folder), max_video_frames=4, max_video_pixels=4 * 24 * 16, show_progress=False)
    params = SamplingParams(max_tokens=2)

    def generate(prompt: str, video) -> None:
        llm.generate({"prompt": prompt, "multi_modal_data": {"video": video}}, params, use_tqdm=False)

    with pytest.raises(ValueError, match=r"6 frames exceeds max_video_frames \(4\)"):
        generate(VIDEO, make_video(0, 6))
    with pytest.raises(ValueError, match="exceeds max_video_pixels"):
        generate(VIDEO, make_video(0, 4, (32, 16)))
    with pytest.raises(ValueError, match="video marker"):
        generate("no marker", make_video(0, 2))
    with pytest.raises(ValueError, match=r"\[frames, height, width, 3\] uint8"):
        generate(VIDEO, np.zeros((2, 16, 16), dtype=np.uint8))
    with pytest.raises(ValueError, match="share one size"):
        generate(VIDEO, [make_video(0, 1)[0], make_video(0, 1, (16, 24))[0]])
    with pytest.raises(ValueError, match="fps must be a number"):
        generate(VIDEO, (list(make_video(0, 2)), {"fps": 0}))
    with pytest.raises(ValueError, match="video placeholder token"):  # typed without a video
        llm.generate(f"{VIDEO} What?", params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_video_frames"):
        LLM(str(folder), max_video_frames=0, show_progress=False)
    out = llm.generate(
        {"prompt": VIDEO, "multi_modal_data": {"video": make_video(0, 4)}}, params, use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2  # still serving

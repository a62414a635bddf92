"""Qwen3-VL (and Qwen3-VL-MoE) against transformers' Qwen3VLForConditionalGeneration on a tiny random checkpoint
(tests/models/tiny.py `make_tiny_qwen3_vl`: a 3-block vision tower with learned position
embeddings and two DeepStack mergers, a Qwen3 text model with interleaved M-RoPE): the tower's
vectors against its vision model, greedy tokens against its `generate` and logprobs within fp32
tolerance through the whole engine, also when the token budget splits the prompt inside an image
(each chunk adds its rows' DeepStack vectors), after a prefix-cache hit inside an image, and when
requests are preempted and recomputed."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from llmserve.engine.llm import LLM
from llmserve.layers.mrope import MRotaryEmbedding
from llmserve.models.qwen3_vl_vision import Qwen3VisionTransformer
from llmserve.sampling_params import SamplingParams
from tests.models.test_qwen2_5_vl import (
    IMAGE,
    NUM_TOKENS,
    PAD,
    PROMPT,
    _check,
    _hf_images,
    assert_preemption_keeps_answers,
    make_image,
)
from tests.models.tiny import make_tiny_qwen3_vl


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_vl")
    return make_tiny_qwen3_vl(folder), folder


def _params(n: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=3, ignore_eos=True)


def test_vision_tower_and_deepstack_match_transformers(checkpoint) -> None:
    """Each image token's row: the merger's vector, then each DeepStack merger's (transformers'
    `pooler_output` and `deepstack_features`), on grids other than the 4 x 4 position table."""
    hf, folder = checkpoint
    llm = LLM(str(folder), show_progress=False)
    model = llm.engine.runner.runner.model
    preprocess = llm.engine.media.processor.preprocess  # type: ignore[union-attr]
    for seed, size in ((0, (40, 24)), (1, (30, 50)), (2, (16, 16))):
        image = make_image(seed, size)
        ref = _hf_images(folder, [image])
        with torch.no_grad():
            out = hf.model.visual(ref["pixel_values"], grid_thw=ref["image_grid_thw"])
        want = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        got = model.encode_image(preprocess(image))
        assert got.shape == want.shape == (want.shape[0], 64 * 3)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_interleaved_mrope_matches_transformers(checkpoint) -> None:
    """Frequency j rotated by the height id (j % 3 == 1), the width id (j % 3 == 2) or the
    temporal id, as transformers' Qwen3-VL text rotary embedding lays them out."""
    hf, _ = checkpoint
    rope = MRotaryEmbedding(
        16, 64, {"rope_type": "default", "rope_theta": 10000.0}, [4, 2, 2], interleaved=True
    )
    positions = torch.tensor([[0, 3, 3, 3, 7], [0, 3, 4, 5, 7], [0, 3, 6, 4, 7]])
    cos, sin = rope.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = hf.model.language_model.rotary_emb(torch.zeros(1), positions[:, None, :])
    torch.testing.assert_close(cos[:, 0], ref_cos[0], atol=1e-6, rtol=0)
    half = sin.shape[-1] // 2  # our sin is signed for the rotation: -sin on the first half
    torch.testing.assert_close(sin[:, 0, half:], ref_sin[0, :, half:], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0, :half].abs(), ref_sin[0, :, :half].abs(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget", [256, 13])
def test_greedy_and_logprobs_match_transformers(checkpoint, budget) -> None:
    """budget 13: chunks end inside the images; each takes its rows' main and DeepStack vectors."""
    hf, folder = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=budget, block_size=4, show_progress=False)
    small, large = make_image(0, (40, 24)), make_image(1, (30, 50))
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in (small, large)]
    prompts.append({"prompt": f"A {IMAGE} and {IMAGE} two", "multi_modal_data": {"image": [large, small]}})
    prompts.append("The lazy dog")  # text only: no DeepStack, plain RoPE
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    _check(outputs, hf, folder, [[small], [large], [large, small], []])
    assert [o.prompt_token_ids.count(PAD) for o in outputs] == [15, 24, 39, 0]


def test_prefix_cache_hit_inside_an_image(checkpoint) -> None:
    """The second run hits blocks holding part of the image; the rest of the image's tokens take
    their own rows' DeepStack vectors, and the answer stays transformers'. Blocks of 16: the image's
    tokens are positions 5 to 19, so the hit (whole blocks) ends at 16."""
    hf, folder = checkpoint
    llm = LLM(str(folder), block_size=16, enable_prefix_caching=True, show_progress=False)

    def run(seed: int):
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed)}}
        return llm.generate(prompt, _params(), use_tqdm=False)[0]

    first, again, other = run(0), run(0), run(5)
    offset = first.prompt_token_ids.index(PAD)
    assert offset < again.num_cached_tokens < offset + 15  # the hit ends inside the image
    assert other.num_cached_tokens <= offset
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _check([again, other], hf, folder, [[make_image(0)], [make_image(5)]])


def test_preemption_recomputes_the_deepstack_rows(checkpoint) -> None:
    """Requests with images preempted and recomputed (their images encoded again, DeepStack
    vectors too) answer as without preemption."""
    assert_preemption_keeps_answers(checkpoint[1])


def test_the_fused_decoder_refuses_mrope(checkpoint) -> None:
    _, folder = checkpoint
    llm = LLM(str(folder), quantization="int8", show_progress=False)
    runner = llm.engine.runner.runner
    assert runner.fused is None and "M-RoPE" in str(runner.fused_unsupported)
    out = llm.generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, _params(3), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_videos_are_refused(checkpoint) -> None:
    """Qwen3-VL's videos (frames between timestamps) are not taken: a ValueError naming videos."""
    _, folder = checkpoint
    llm = LLM(str(folder), show_progress=False)
    frames = [make_image(0)] * 2
    prompt = {"prompt": "<|vision_start|><|video_pad|><|vision_end|>", "multi_modal_data": {"video": frames}}
    with pytest.raises(ValueError, match="takes no videos"):
        llm.generate(prompt, _params(2), use_tqdm=False)


def test_bad_deepstack_indexes_are_refused() -> None:
    config = transformers.Qwen3VLVisionConfig(depth=2, deepstack_visual_indexes=[0, 5])
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[0, 5\]"):
        Qwen3VisionTransformer(config)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_vl_moe")
    return make_tiny_qwen3_vl(folder, moe=True), folder


def test_moe_greedy_and_logprobs_match_transformers(moe_checkpoint) -> None:
    """Qwen3-VL-MoE: the sparse stack under the same tower, DeepStack and M-RoPE; chunks of 13."""
    hf, folder = moe_checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=13, block_size=4, show_progress=False)
    small, large = make_image(0, (40, 24)), make_image(1, (30, 50))
    prompts = [{"prompt": f"A {IMAGE} and {IMAGE} two", "multi_modal_data": {"image": [large, small]}}]
    prompts.append("The lazy dog")
    _check(llm.generate(prompts, _params(), use_tqdm=False), hf, folder, [[large, small], []])


def test_moe_experts_stacked_input_major_load_alike(moe_checkpoint, tmp_path) -> None:
    """Released Qwen3-VL-MoE checkpoints stack experts input-major ([E, H, 2I], [E, I, H]);
    transformers' `save_pretrained` writes them output-major. Both load to the same model."""
    _, folder = moe_checkpoint
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    stacked = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacked) == 4
    save_file({k: v.transpose(1, 2).contiguous() if k in stacked else v for k, v in tensors.items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}
    outs = [
        LLM(str(d), show_progress=False).generate(prompt, _params(), use_tqdm=False)[0]
        for d in (folder, tmp_path)
    ]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].logprobs == outs[1].outputs[0].logprobs

"""Qwen2-VL through the server with the `openai` client: chat with `image_url` parts, and with
vLLM's `video_url` parts whose `url` lists the frames as data URLs, against a server on the tiny
Qwen2-VL; the answers equal the offline engine's (whose parity with transformers
tests/models/test_qwen2_vl.py and test_qwen_vl_video.py check). A video file's URL, a video over
--max-video-frames and a malformed part are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from llmserve.engine.llm import LLM
from llmserve.sampling_params import SamplingParams
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_vision_api import data_url
from tests.models.test_qwen2_5_vl import make_image
from tests.models.test_qwen_vl_video import make_video
from tests.models.tiny import make_tiny_qwen2_vl

NUM_TOKENS = 8
MAX_FRAMES = 6


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def frame_urls(video: np.ndarray) -> list[str]:
    return [data_url(png(Image.fromarray(f))) for f in video]


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_vl")
    make_tiny_qwen2_vl(folder)
    return folder


@pytest.fixture(scope="module")
def server(qwen2_vl_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(qwen2_vl_dir, "--max-video-frames", str(MAX_FRAMES)).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(qwen2_vl_dir: Path) -> LLM:
    return LLM(str(qwen2_vl_dir), show_progress=False)


def expected_text(llm: LLM, parts: list[dict], media: dict) -> str:
    """The offline engine's greedy answer to one user message of `parts` ({"type": "image"} /
    {"type": "video"} / text) with `media` as `multi_modal_data`."""
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt": prompt, "multi_modal_data": media}, params, use_tqdm=False)
    return out[0].outputs[0].text


def chat(client: openai.OpenAI, parts: list[dict]) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": parts}], max_tokens=NUM_TOKENS,
        temperature=0.0, extra_body={"ignore_eos": True},
    )  # fmt: skip


def video_part(video: np.ndarray, fps: float | None = None) -> dict:
    return {"type": "video_url", "video_url": {"url": frame_urls(video), **({"fps": fps} if fps else {})}}


def test_chat_with_images_answers_as_the_engine(server, offline) -> None:
    small, large = make_image(0, (40, 24)), make_image(1, (30, 50))
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(im))}} for im in (small, large)]
    response = chat(server.client(), [*parts, {"type": "text", "text": "What is this?"}])
    want = expected_text(offline, [{"type": "image"}] * 2 + [{"type": "text", "text": "What is this?"}],
                         {"image": [png(small), png(large)]})  # fmt: skip
    assert response.choices[0].message.content == want


def test_chat_with_a_video_answers_as_the_engine(server, offline) -> None:
    client = server.client()
    video, image = make_video(0, 4), make_image(0)
    text = {"type": "text", "text": "What happens?"}
    response = chat(client, [video_part(video, fps=4), text])
    want = expected_text(offline, [{"type": "video"}, text], {"video": (list(video), {"fps": 4.0})})
    assert response.choices[0].message.content == want
    # a video beside an image; 4 frames of 24x16 are 12 tokens
    both = chat(
        client, [{"type": "image_url", "image_url": {"url": data_url(png(image))}}, video_part(video), text]
    )
    want = expected_text(
        offline, [{"type": "image"}, {"type": "video"}, text], {"image": png(image), "video": video}
    )
    assert both.choices[0].message.content == want
    alone = chat(client, [video_part(video), text])
    assert both.usage.prompt_tokens - alone.usage.prompt_tokens == 15 + 2  # the image's pads, start, end


def test_bad_videos_are_400s_naming_the_field(server) -> None:
    client = server.client()
    text = {"type": "text", "text": "What happens?"}
    cases = [
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
         "messages[0].content[0].video_url.url", "decodes no video files"),
        (video_part(make_video(0, MAX_FRAMES + 1)), "messages[0].content[0].video_url", "max_video_frames"),
        ({"type": "video_url", "video_url": {"url": ["data:image/png;base64,bm90IGEgcG5n"]}},
         "messages[0].content[0].video_url", "not a readable image"),
    ]  # fmt: skip
    for part, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, [part, text])
        assert e.value.body["param"] == param and message in e.value.body["message"], e.value.body
    malformed = [{"url": [], "fps": 2}, {"url": frame_urls(make_video(0, 2)), "fps": 0}]  # no frames, fps 0
    for video_url in malformed:
        with pytest.raises(openai.BadRequestError) as e:  # the request schema's 400
            chat(client, [{"type": "video_url", "video_url": video_url}, text])
        assert e.value.body["param"] == "messages"
    assert chat(client, [video_part(make_video(1, 2)), text]).choices[0].message.content  # still serving

"""Qwen2.5-VL through the server: OpenAI chat `image_url` data URLs with the `openai` client (one
image, two of different sizes, streamed) and Ollama's `images`, against a server on the tiny
Qwen2.5-VL; the answers equal the offline engine's (whose parity with transformers
tests/models/test_qwen2_5_vl.py checks). An image the processor refuses is a 400 naming its field,
and the server keeps serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmserve.engine.llm import LLM
from llmserve.sampling_params import SamplingParams
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_vision_api import data_url
from tests.models.test_qwen2_5_vl import make_image
from tests.models.tiny import make_tiny_qwen2_5_vl

NUM_TOKENS = 8
SIZES = {0: (40, 24), 1: (30, 50), 2: (2, 500)}
"""Each test image's size: 15 and 24 image tokens; the last too narrow for the processor."""


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    make_image(seed, SIZES[seed]).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    make_tiny_qwen2_5_vl(folder)
    return folder


@pytest.fixture(scope="module")
def qwen_vl_server(qwen_vl_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(qwen_vl_dir).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(qwen_vl_dir: Path) -> LLM:
    return LLM(str(qwen_vl_dir), show_progress=False)


def expected_text(llm: LLM, seeds: list[int], text: str = "What is this?") -> str:
    """The offline engine's greedy answer to one user message of the images then `text`."""
    content = [{"type": "image"} for _ in seeds] + [{"type": "text", "text": text}]
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    images = [png(s) for s in seeds]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params, use_tqdm=False)
    return out[0].outputs[0].text


def messages(urls: list[str], text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def chat(client: openai.OpenAI, urls: list[str], **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="tiny-llama", messages=messages(urls), max_tokens=NUM_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True}, **kw,
    )  # fmt: skip


def test_chat_with_data_url_images_answers_as_the_engine(qwen_vl_server, offline) -> None:
    client = qwen_vl_server.client()
    for seeds in ([0], [1], [1, 0]):
        response = chat(client, [data_url(png(s)) for s in seeds])
        assert response.choices[0].message.content == expected_text(offline, seeds)
    # the usage counts the images' tokens: 15 and 24 pads with their start and end tokens
    one, two = (chat(client, [data_url(png(s)) for s in seeds]).usage for seeds in ([0], [1, 0]))
    assert two.prompt_tokens - one.prompt_tokens == 24 + 2


def test_chat_streams_with_an_image(qwen_vl_server, offline) -> None:
    stream = chat(qwen_vl_server.client(), [data_url(png(1))], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected_text(offline, [1])


def test_an_image_the_processor_refuses_is_a_400(qwen_vl_server) -> None:
    client = qwen_vl_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [data_url(png(0)), data_url(png(2))])
    assert e.value.body["param"] == "messages[0].content[1].image_url"
    assert "aspect ratio" in e.value.body["message"]
    assert chat(client, [data_url(png(0))]).choices[0].message.content  # still serving


def test_ollama_images_answer_as_the_engine(qwen_vl_server, offline) -> None:
    image = base64.b64encode(png(1)).decode()
    r = httpx.post(f"{qwen_vl_server.url}/api/chat", timeout=60, json={
        "model": "tiny-llama", "stream": False, "options": {"temperature": 0, "num_predict": NUM_TOKENS},
        "messages": [{"role": "user", "content": "What is this?", "images": [image]}],
    })  # fmt: skip
    assert r.status_code == 200, r.text
    content = r.json()["message"]["content"]  # ends at EOS (no ignore_eos in Ollama's API)
    assert content and expected_text(offline, [1]).startswith(content)

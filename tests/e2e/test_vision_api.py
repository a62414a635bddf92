"""Images through the server: OpenAI chat `image_url` parts (data URLs, local files under
--allowed-local-media-path) with the `openai` client, Ollama's base64 `images` on /api/chat and
/api/generate, against a server on the tiny Gemma 3 VLM; the answers equal the offline engine's
(whose parity with transformers tests/models/test_gemma3_vision.py checks). Bad images and images
for a text-only model are 400s naming the field, and the server keeps serving."""

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
from tests.models.test_gemma3_vision import make_image
from tests.models.tiny import make_tiny_gemma3_vlm

NUM_TOKENS = 8


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    make_image(seed).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3-vlm")
    make_tiny_gemma3_vlm(folder)
    return folder


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png(0))
    return folder


@pytest.fixture(scope="module")
def vlm_server(vlm_dir: Path, media_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        vlm_dir, "--allowed-local-media-path", str(media_dir), "--media-max-size", "64KiB"
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(vlm_dir: Path) -> LLM:
    return LLM(str(vlm_dir), show_progress=False)


def expected_text(llm: LLM, text: str, seed: int) -> str:
    """The offline engine's greedy answer to one user message of an image then `text`."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": png(seed)}}, params, use_tqdm=False)
    return out[0].outputs[0].text


def chat(client: openai.OpenAI, url: str, text: str = "What is this?") -> str:
    response = client.chat.completions.create(
        model="tiny-llama",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
            }
        ],
        max_tokens=NUM_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return response.choices[0].message.content or ""


def test_chat_with_a_data_url_image_answers_as_the_engine(vlm_server, offline) -> None:
    client = vlm_server.client()
    assert chat(client, data_url(png(0))) == expected_text(offline, "What is this?", 0)
    assert chat(client, data_url(png(1))) == expected_text(offline, "What is this?", 1)


def test_chat_streams_with_an_image(vlm_server, offline) -> None:
    stream = vlm_server.client().chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(1))}},
                                               {"type": "text", "text": "What is this?"}]}],
        max_tokens=NUM_TOKENS, temperature=0.0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected_text(offline, "What is this?", 1)


def test_local_files_only_under_the_allowed_folder(vlm_server, offline, media_dir, tmp_path) -> None:
    client = vlm_server.client()
    expected = expected_text(offline, "What is this?", 0)
    assert chat(client, str(media_dir / "cat.png")) == expected
    assert chat(client, (media_dir / "cat.png").as_uri()) == expected
    outside = tmp_path / "dog.png"
    outside.write_bytes(png(0))
    for url in (str(outside), str(media_dir / ".." / outside.parent.name / "dog.png")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, url)
        assert e.value.body["param"] == "messages[0].content[0].image_url"
        assert "not under the allowed media folder" in e.value.body["message"]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,@@@", "not valid base64"),
        (data_url(b"not an image at all"), "not a readable image"),
        ("data:text/plain;base64,aGk=", "must hold an image/* type"),
        ("http://127.0.0.1:9/cat.png", "remote images are not allowed"),
        ("ftp://example.com/cat.png", "unsupported URL scheme"),
        (data_url(bytes(70 * 1024)), "larger than 65536 bytes"),
    ],
)
def test_bad_images_are_400s_naming_the_field(vlm_server, url, message) -> None:
    client = vlm_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, url)
    assert e.value.body["param"] == "messages[0].content[0].image_url"
    assert message in e.value.body["message"]
    assert chat(client, data_url(png(0)))  # still serving


def test_a_text_only_model_refuses_images(server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(server.client(), data_url(png(0)))
    assert e.value.body["param"] == "messages"
    assert "takes no images" in e.value.body["message"]
    r = httpx.post(
        f"{server.url}/api/generate", json={"model": "tiny-llama", "prompt": "hi", "images": ["aGk="]}
    )
    assert r.status_code == 400 and "takes no images" in r.json()["error"]


def test_ollama_images_answer_as_the_engine(vlm_server, offline) -> None:
    image = base64.b64encode(png(1)).decode()
    options = {"temperature": 0, "num_predict": NUM_TOKENS}
    expected = expected_text(offline, "What is this?", 1)
    r = httpx.post(f"{vlm_server.url}/api/chat", timeout=60, json={
        "model": "tiny-llama", "stream": False, "options": options,
        "messages": [{"role": "user", "content": "What is this?", "images": [image]}],
    })  # fmt: skip
    assert r.status_code == 200, r.text
    # Ollama's reply ends at EOS (no ignore_eos there): a prefix of the engine's answer
    content = r.json()["message"]["content"]
    assert content and expected.startswith(content)
    r = httpx.post(f"{vlm_server.url}/api/generate", timeout=60, json={
        "model": "tiny-llama", "stream": False, "options": options, "prompt": "What is this?", "images": [image],
    })  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["response"] and expected.startswith(r.json()["response"])
    r = httpx.post(f"{vlm_server.url}/api/chat", json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "x", "images": ["%%%"]}],
    })  # fmt: skip
    assert r.status_code == 400 and "messages[0].images[0]" in r.json()["error"]

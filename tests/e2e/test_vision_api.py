"""Images through the server: OpenAI chat `image_url` parts (data URLs, local files under
--allowed-local-media-path) with the `openai` client, Ollama's base64 `images` on /api/chat and
/api/generate, Responses `input_image` parts (`openai` client) and Anthropic `image` blocks
(`anthropic` client), against a server on the tiny Gemma 3 VLM; the answers equal the offline
engine's (whose parity with transformers tests/models/test_gemma3_vision.py checks) and the chat
completions answer for the same image and text. Bad images and images for a text-only model are
400s naming the field, and the server keeps serving; /v1/completions takes no images (a typed
image placeholder is a 400, a typed image marker plain text)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from llmserve.engine.llm import LLM
from llmserve.sampling_params import SamplingParams
from tests.e2e.conftest import ServerProcess
from tests.models.test_gemma3_mmproj import make_gguf_vlm
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


def chat(client: openai.OpenAI, url: str, text: str = "What is this?", ignore_eos: bool = True) -> str:
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
        extra_body={"ignore_eos": ignore_eos},
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
        ("/etc/hostname", "not under the allowed media folder"),
    ],
)
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_bad_images_are_400s_naming_the_field(vlm_server, url, message, api) -> None:
    client = vlm_server.client()
    call, field = (chat, "messages[0].content[0].image_url") if api == "chat" else (
        respond, "input.0.content.0.image_url")  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        call(client, url)
    assert e.value.body["param"] == field
    assert message in e.value.body["message"]
    assert call(client, data_url(png(0)))  # still serving


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


def respond(
    client: openai.OpenAI, url: str, text: str = "What is this?", **kwargs
) -> openai.types.responses.Response:
    return client.responses.create(
        model="tiny-llama",
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                            {"type": "input_text", "text": text}]}],
        max_output_tokens=NUM_TOKENS, temperature=0.0, **kwargs,
    )  # fmt: skip


def test_responses_images_answer_as_chat(vlm_server, media_dir) -> None:
    """The same greedy answer as chat completions (both end at EOS: the Responses API has no
    ignore_eos), from a data URL or a file under the allowed folder, whole or streamed."""
    client = vlm_server.client()
    for seed in (0, 1):
        expected = chat(client, data_url(png(seed)), ignore_eos=False)
        assert respond(client, data_url(png(seed))).output_text == expected
    assert respond(client, str(media_dir / "cat.png")).output_text == chat(
        client, data_url(png(0)), ignore_eos=False
    )
    events = list(respond(client, data_url(png(1)), stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == chat(client, data_url(png(1)), ignore_eos=False)
    # the conversation is stored with its image: a follow-up renders it (and its 16 tokens) again
    first = respond(client, data_url(png(1)))
    follow = client.responses.create(model="tiny-llama", input="And?", previous_response_id=first.id,
                                     max_output_tokens=2, temperature=0.0)  # fmt: skip
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    r = httpx.post(f"{vlm_server.url}/v1/responses", json={"model": "tiny-llama", "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})  # fmt: skip
    assert r.status_code == 400 and "file_id images are not served" in r.json()["error"]["message"]


def _claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def message(client: anthropic.Anthropic, source: dict, **kwargs):
    return client.messages.create(
        model="tiny-llama", max_tokens=NUM_TOKENS, extra_body={"temperature": 0.0},  # the 2.x client has no temperature
        messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": "What is this?"}]}],
        **kwargs,
    )  # fmt: skip


def test_anthropic_images_answer_as_chat(vlm_server, media_dir) -> None:
    client, openai_client = _claude(vlm_server), vlm_server.client()
    for seed in (0, 1):
        data = base64.b64encode(png(seed)).decode()
        reply = message(client, {"type": "base64", "media_type": "image/png", "data": data})
        expected = chat(openai_client, data_url(png(seed)), ignore_eos=False)
        assert reply.content[0].text == expected
        counted = client.messages.count_tokens(
            model="tiny-llama",
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                {"type": "text", "text": "What is this?"}]}],
        )  # fmt: skip
        assert counted.input_tokens == reply.usage.input_tokens
    reply = message(client, {"type": "url", "url": (media_dir / "cat.png").as_uri()})
    assert reply.content[0].text == chat(openai_client, data_url(png(0)), ignore_eos=False)
    with client.messages.stream(
        model="tiny-llama", max_tokens=NUM_TOKENS, extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(1)).decode()}},
            {"type": "text", "text": "What is this?"}]}],
    ) as stream:  # fmt: skip
        assert "".join(stream.text_stream) == chat(openai_client, data_url(png(1)), ignore_eos=False)


def test_anthropic_bad_images_are_400s_naming_the_block(vlm_server) -> None:
    client = _claude(vlm_server)
    with pytest.raises(anthropic.BadRequestError) as e:
        message(client, {"type": "url", "url": "http://127.0.0.1:9/cat.png"})
    assert "messages.0.content.0.source: remote images are not allowed" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        message(
            client, {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"xx").decode()}
        )
    assert "messages.0.content.0.source" in e.value.body["error"]["message"]
    assert "not a readable image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # images go in user messages only
        client.messages.create(model="tiny-llama", max_tokens=2, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": base64.b64encode(png(0)).decode()}}]},
        ])  # fmt: skip
    assert "messages.1.content.0" in e.value.body["error"]["message"]
    assert message(
        client, {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(0)).decode()}
    )


def test_completions_take_no_images(vlm_server) -> None:
    """OpenAI's /v1/completions has no image input (vLLM takes multi_modal_data offline only): a
    typed image placeholder is refused (the model would read its own embedding as an image, and
    transformers refuses it too); a typed image marker is plain text."""
    client = vlm_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="a <image_soft_token> b", max_tokens=2)
    assert e.value.body["param"] == "prompt" and "image placeholder" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt=[1, 2, 509], max_tokens=2)
    ok = client.completions.create(model="tiny-llama", prompt="a <start_of_image> b", max_tokens=2)
    assert ok.usage.prompt_tokens > 0 and ok.choices[0].finish_reason == "length"


def test_gguf_with_mmproj_serves_images(tmp_path) -> None:
    """`llmserve serve model.gguf --mmproj mmproj.gguf` (llama-server's flag): chat images answer as
    the offline engine on the same two files (tests/models/test_gemma3_mmproj.py: as transformers)."""
    _, text, mmproj = make_gguf_vlm(tmp_path)
    offline = LLM(str(text), mmproj=str(mmproj), show_progress=False)
    proc = ServerProcess(text, "--mmproj", str(mmproj)).start()
    try:
        assert chat(proc.client(), data_url(png(1))) == expected_text(offline, "What is this?", 1)
        with pytest.raises(openai.BadRequestError) as e:
            proc.client().completions.create(model="tiny-llama", prompt="<image_soft_token>", max_tokens=2)
        assert "image placeholder" in e.value.body["message"]
    finally:
        proc.stop()

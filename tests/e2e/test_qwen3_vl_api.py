"""Qwen3-VL through the server with the `openai` client: chat `image_url` data URLs answer as the
offline engine (whose parity with transformers tests/models/test_qwen3_vl.py checks), streamed
too; an image the processor refuses is a 400 naming its field and the server keeps serving. The
helpers are Qwen2.5-VL's (tests/e2e/test_qwen_vl_api.py), on the tiny Qwen3-VL."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from llmserve.engine.llm import LLM
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_qwen_vl_api import chat, expected_text, png
from tests.e2e.test_vision_api import data_url
from tests.models.tiny import make_tiny_qwen3_vl


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, LLM]]:
    """A server on the tiny Qwen3-VL and the offline engine on the same folder."""
    folder = tmp_path_factory.mktemp("qwen3_vl")
    make_tiny_qwen3_vl(folder)
    proc = ServerProcess(folder).start()
    yield proc, LLM(str(folder), show_progress=False)
    proc.stop()


def test_chat_images_answer_as_the_engine(served) -> None:
    server, offline = served
    client = server.client()
    for seeds in ([0], [1, 0]):
        response = chat(client, [data_url(png(s)) for s in seeds])
        assert response.choices[0].message.content == expected_text(offline, seeds)
    stream = chat(client, [data_url(png(1))], stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == expected_text(offline, [1])


def test_a_refused_image_is_a_400_and_the_server_keeps_serving(served) -> None:
    client = served[0].client()
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [data_url(png(0)), data_url(png(2))])
    assert e.value.body["param"] == "messages[0].content[1].image_url"
    assert "aspect ratio" in e.value.body["message"]
    assert chat(client, [data_url(png(0))]).choices[0].message.content

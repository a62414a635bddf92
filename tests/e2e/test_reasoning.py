"""`<think>…</think>` split into `reasoning_content` (vLLM's reasoning parsers): a template that
uses `<think>` turns it on (`--reasoning-parser auto`); a regex constraint makes the tiny random
model think and answer, streamed and not; `--reasoning-parser none` leaves the text alone. The
splitters are checked on text too, including a template that opens the thinking itself."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from openai.types.chat import ChatCompletionChunk

from llmserve.server.serving.reasoning import ReasoningStreamSplitter, split_reasoning
from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.models.tiny import make_tiny_model_eos0

pytestmark = pytest.mark.e2e

# ChatML with Qwen3's habit of mentioning <think> (here: in a comment the template keeps)
THINK_TEMPLATE = (
    "{# replies may open with <think> #}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FORCED = {"structured_outputs": {"regex": "<think>[a-z]{2,6}</think>[A-Z][a-z]{1,4}"}}
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("think")
    make_tiny_model_eos0(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(folder) -> Iterator[ServerProcess]:
    proc = ServerProcess(folder).start()
    yield proc
    proc.stop()


def test_reasoning_content_split(server: ServerProcess) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 3,
        **FORCED,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"].isalpha() and message["reasoning_content"].islower()
    assert message["content"][0].isupper() and "<think>" not in message["content"]
    streamed = {"reasoning_content": "", "content": ""}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = ChatCompletionChunk.model_validate_json(line[6:])
                delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
                for key in streamed:
                    streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": message["reasoning_content"], "content": message["content"]}


def test_reasoning_parser_none_keeps_the_text(folder) -> None:
    proc = ServerProcess(folder, "--reasoning-parser", "none").start()
    try:
        body = {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "max_tokens": 60,
            "seed": 3,
            "temperature": 1.0,
            **FORCED,
        }
        message = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0][
            "message"
        ]
        assert message["content"].startswith("<think>") and "reasoning_content" not in message
    finally:
        proc.stop()


@pytest.mark.parametrize(
    ("pieces", "opened", "want"),
    [(["<thi", "nk>ab", "c</th", "ink>\n\nPar", "is."], False, ("abc", "Paris.")),
     (["ab", "c</thi", "nk>Paris"], True, ("abc", "Paris")),
     (["Pa", "ris"], False, ("", "Paris")),
     (["<think>ab"], False, ("ab", "")),
     ([" ", "<", "x"], False, ("", " <x"))],
)  # fmt: skip
def test_splitters(pieces, opened, want) -> None:
    splitter, reasoning, content = ReasoningStreamSplitter(opened), "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    assert (reasoning + r, content + c) == want
    whole_r, whole_c = split_reasoning("".join(pieces), opened)
    assert ((whole_r or "").strip(), (whole_c or "").strip()) == (want[0].strip(), want[1].strip())

"""Ollama's `think` through the `ollama` client, on the tiny model with a Qwen3-like template that
opens `<think>` itself unless `enable_thinking` is false. A `format` whose only value is a string
holding `</think>` makes the random model's reply deterministic: `"ab</think>Paris"`, whose
thinking is `"ab` and whose answer is `Paris"`. Checked on /api/chat and /api/generate, whole and
streamed, against /v1/chat/completions' `chat_template_kwargs`, and through a remote (openai
engine) model whose upstream splits the thinking itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.models.tiny import make_tiny_model_eos0

pytestmark = pytest.mark.e2e

# ChatML; the generation prompt opens the thinking (Qwen3-Thinking, DeepSeek-R1), or writes an
# empty one when thinking is off (Qwen3's `enable_thinking: false`)
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
REPLY = "ab</think>Paris"
FORMAT = {"type": "string", "const": REPLY}  # the reply is this JSON string, quotes included
THINKING, CONTENT = '"ab', 'Paris"'
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
OPTIONS = {"num_predict": 40, "seed": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("thinking")
    make_tiny_model_eos0(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    proc = ServerProcess(folder).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def proxy(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose model `up` is `server`'s, reached over the OpenAI API (the openai engine)."""
    folder: Path = tmp_path_factory.mktemp("thinking-proxy")
    (folder / "models.yaml").write_text(
        f"models:\n  - name: up\n    engine: openai\n    source: {server.url}/v1\n    options: {{model: {MODEL_NAME}}}\n"
    )
    proc = ServerProcess(
        [], "--config", str(folder / "models.yaml"), served_name=None, log_dir=folder
    ).start()
    yield proc
    proc.stop()


def _streamed(parts: list, chat: bool) -> tuple[str, str]:
    """(thinking, content) joined from streamed objects; thinking never follows content."""
    thinking, content = "", ""
    for p in parts:
        piece_thinking, piece_content = (
            (p.message.thinking, p.message.content) if chat else (p.thinking, p.response)
        )
        assert not (piece_thinking and content), "thinking after the answer began"
        thinking, content = thinking + (piece_thinking or ""), content + (piece_content or "")
    assert parts[-1].done and parts[-1].done_reason == "stop"
    return thinking, content


@pytest.mark.parametrize("think", [True, None])  # None: as Ollama, a model that thinks does
def test_chat_thinking_whole_and_streamed(server: ServerProcess, think: bool | None) -> None:
    client = ollama.Client(host=server.url)
    r = client.chat(model=MODEL_NAME, messages=MESSAGES, think=think, format=FORMAT, options=OPTIONS)
    assert (r.message.thinking, r.message.content) == (THINKING, CONTENT)
    parts = list(
        client.chat(
            model=MODEL_NAME, messages=MESSAGES, think=think, format=FORMAT, options=OPTIONS, stream=True
        )
    )
    assert _streamed(parts, chat=True) == (THINKING, CONTENT)


def test_generate_thinking_whole_and_streamed(server: ServerProcess) -> None:
    client = ollama.Client(host=server.url)
    r = client.generate(
        model=MODEL_NAME, prompt="The quick brown fox", think=True, format=FORMAT, options=OPTIONS
    )
    assert (r.thinking, r.response) == (THINKING, CONTENT)
    parts = list(
        client.generate(
            model=MODEL_NAME,
            prompt="The quick brown fox",
            think=True,
            format=FORMAT,
            options=OPTIONS,
            stream=True,
        )
    )
    assert _streamed(parts, chat=False) == (THINKING, CONTENT)
    # raw: no template, so nothing opened the thinking: the reply is all answer
    raw = client.generate(model=MODEL_NAME, prompt="x", raw=True, format=FORMAT, options=OPTIONS)
    assert (raw.thinking, raw.response) == (None, f'"{REPLY}"')


def test_think_false_reaches_the_template(server: ServerProcess) -> None:
    """`think: false` is the template's `enable_thinking: false` (the same prompt as
    /v1/chat/completions with that chat_template_kwarg, which is longer: it holds an empty
    thinking), and the reply is left whole; /api/show says the model thinks."""
    client = ollama.Client(host=server.url)
    off = client.chat(model=MODEL_NAME, messages=MESSAGES, think=False, format=FORMAT, options=OPTIONS)
    on = client.chat(model=MODEL_NAME, messages=MESSAGES, think=True, format=FORMAT, options=OPTIONS)
    assert (off.message.thinking, off.message.content) == (None, f'"{REPLY}"')
    assert off.prompt_eval_count > on.prompt_eval_count
    for think, counted in [(False, off), (True, on)]:
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1,
                "chat_template_kwargs": {"enable_thinking": think}}  # fmt: skip
        usage = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        assert usage["prompt_tokens"] == counted.prompt_eval_count
    generated = client.generate(model=MODEL_NAME, prompt="The quick brown fox", think=False, format=FORMAT,
                                options=OPTIONS)  # fmt: skip
    assert (generated.thinking, generated.response) == (None, f'"{REPLY}"')
    assert "thinking" in client.show(MODEL_NAME).capabilities


def test_thinking_through_a_remote_model(proxy: ServerProcess, server: ServerProcess) -> None:
    """A remote model: `think` goes upstream as chat_template_kwargs, and the upstream's
    `reasoning_content` comes back as Ollama's `thinking`, whole and streamed."""
    via, direct = ollama.Client(host=proxy.url), ollama.Client(host=server.url)
    r = via.chat(model="up", messages=MESSAGES, think=True, format=FORMAT, options=OPTIONS)
    assert (r.message.thinking, r.message.content) == (THINKING, CONTENT)
    parts = list(
        via.chat(model="up", messages=MESSAGES, think=True, format=FORMAT, options=OPTIONS, stream=True)
    )
    assert _streamed(parts, chat=True) == (THINKING, CONTENT)
    g = via.generate(model="up", prompt="The quick brown fox", think=True, format=FORMAT, options=OPTIONS)
    assert (g.thinking, g.response) == (THINKING, CONTENT)
    off = via.chat(model="up", messages=MESSAGES, think=False, format=FORMAT, options=OPTIONS)
    want = direct.chat(model=MODEL_NAME, messages=MESSAGES, think=False, format=FORMAT, options=OPTIONS)
    assert off.message.content == f'"{REPLY}"' and off.prompt_eval_count == want.prompt_eval_count

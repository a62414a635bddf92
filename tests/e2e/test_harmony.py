"""gpt-oss's harmony replies through the `openai` and `anthropic` clients, on a tiny random gpt-oss
whose tokenizer carries gpt-oss's own chat template (`--reasoning-parser auto` reads harmony off
its `<|channel|>`). The markers are special tokens in the tiny vocabulary, as in gpt-oss's: under a
grammar the reply spells them in plain pieces, which decode to the same text. A regex constraint
makes the random model write harmony; the server returns reasoning_content and tool calls, streamed and
not; `required` forces a call in harmony on chat, Responses and Messages; an earlier turn's
reasoning and call reach the template as gpt-oss's template reads them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.models.tiny import make_tiny_model

pytestmark = pytest.mark.e2e

TEMPLATE = (Path(__file__).parents[1] / "data" / "gpt_oss_chat_template.jinja").read_text()
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
THINK = "The user wants the weather."
ARGS = {"city": "Paris", "unit": "c"}
CALL_REPLY = (
    f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>commentary "
    f"to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGS)}<|call|>"
)
FINAL_REPLY = (
    f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("gpt-oss-harmony")
    make_tiny_model("gpt-oss", folder, special=MARKERS)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    for name in (
        "config.json",
        "generation_config.json",
    ):  # EOS <|endoftext|>; room for the template's prompt
        path = folder / name
        if path.exists():
            values = {**json.loads(path.read_text()), "eos_token_id": 0, "bos_token_id": None}
            if name == "config.json":
                values["max_position_embeddings"] = 2048
            path.write_text(json.dumps(values))
    proc = ServerProcess(folder).start()
    yield proc
    proc.stop()


def _forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def _streamed(server: ServerProcess, body: dict) -> dict:
    """A streamed chat reply's first choice put together."""
    out = {"reasoning_content": "", "content": "", "calls": {}, "finish_reason": None}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as s:
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                out["reasoning_content"] += delta.get("reasoning_content") or ""
                out["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    entry = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    entry["name"] += call["function"].get("name") or ""
                    entry["arguments"] += call["function"].get("arguments") or ""
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def test_reasoning_and_a_tool_call(server: ServerProcess) -> None:
    client = server.client()
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 300,
        **_forced(CALL_REPLY),
    }
    r = client.chat.completions.create(**{k: v for k, v in body.items() if k != "structured_outputs"},
                                       extra_body=_forced(CALL_REPLY))  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == THINK
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    streamed = _streamed(server, body)
    assert streamed["reasoning_content"] == THINK and streamed["content"] == ""
    assert streamed["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [
        ("get_weather", ARGS)
    ]


def test_reasoning_and_an_answer(server: ServerProcess) -> None:
    client = server.client()
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=300,
                                       extra_body=_forced(FINAL_REPLY))  # fmt: skip
    choice = r.choices[0]
    assert (choice.message.model_extra["reasoning_content"], choice.message.content) == (THINK, "Sunny.")
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    streamed = _streamed(
        server, {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 300, **_forced(FINAL_REPLY)}
    )
    assert (streamed["reasoning_content"], streamed["content"], streamed["calls"]) == (THINK, "Sunny.", {})
    # cut short while thinking: reasoning only
    long = "<|channel|>analysis<|message|>" + "a" * 200
    cut = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60,
                                         extra_body=_forced(long))  # fmt: skip
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    assert set(cut.choices[0].message.model_extra["reasoning_content"]) == {"a"}


def test_required_call_on_every_api(server: ServerProcess) -> None:
    """`required` is a grammar in harmony's call syntax: chat's tool_calls, a Responses
    function_call item, a Messages tool_use block, each with arguments that fit the schema. Every
    call decodes deterministically (seeded, or greedy): an unseeded sample of this random model
    could spend its 200 tokens inside a string and end before the call closes."""
    client = server.client()
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=1)  # fmt: skip
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    resp = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", max_output_tokens=200,
                                   tools=[{"type": "function", **TOOLS[0]["function"]}], tool_choice="required",
                                   parallel_tool_calls=False, temperature=0)  # fmt: skip
    calls = [item for item in resp.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and set(json.loads(calls[0].arguments)) == {
        "city",
        "unit",
    }
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused").messages.create(
        model=MODEL_NAME, max_tokens=200, messages=MESSAGES, tool_choice={"type": "any"}, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}],
    )  # fmt: skip
    uses = [b for b in messages.content if b.type == "tool_use"]
    assert messages.stop_reason == "tool_use" and [b.name for b in uses] == ["get_weather"]
    assert set(uses[0].input) == {"city", "unit"}


def test_an_earlier_call_and_its_reasoning_reach_the_template(server: ServerProcess) -> None:
    """The assistant turn as the client sends it back (arguments as JSON text, reasoning_content)
    renders as gpt-oss's template reads it: the reasoning as the analysis before the call, the
    arguments as an object; the conversation goes on."""
    history = [
        *MESSAGES,
        {"role": "assistant", "reasoning_content": THINK, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    ids = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": history}, timeout=30
    ).json()
    prompt = httpx.post(
        f"{server.url}/detokenize", json={"model": MODEL_NAME, "tokens": ids["tokens"]}
    ).json()
    assert (
        f"<|start|>assistant<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant to=functions.get_weather"
        f"<|channel|>commentary json<|message|>{json.dumps(ARGS)}<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
    ) in prompt["prompt"]
    r = server.client().chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=300,
                                                extra_body=_forced(FINAL_REPLY))  # fmt: skip
    assert r.choices[0].message.content == "Sunny."


def test_a_required_call_writes_the_markers_as_special_tokens(server: ServerProcess) -> None:
    """The forced call's markers are the vocabulary's special tokens, as gpt-oss was trained to
    write them: each is one token of the reply (a special id; the logprobs spell it whole), never
    the text pieces `<`, `|`, `channel`, ...; the API returns the call."""
    r = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=200, temperature=1.0, seed=3, logprobs=True,
    )  # fmt: skip
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[0] == "<|channel|>", tokens
    markers = [t for t in tokens if t.startswith("<|")]  # then the tiny model's EOS, <|endoftext|>
    assert markers == ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|endoftext|>"]
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}

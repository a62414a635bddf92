"""Anthropic's Messages API through the `anthropic` client (PyPI) on the tiny model: a plain
message is the very answer /v1/chat/completions gives (greedy), streamed it is the same text in
Anthropic's event order, stop_sequences and max_tokens end it with their stop reasons, count_tokens
counts the prompt the message used, a forced tool call round-trips (tool_use -> tool_result ->
answer), whole and streamed, thinking comes back in thinking blocks, both auth headers work, and
bad requests are 4xx in Anthropic's error shape while the server keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from llmserve.server.errors import anthropic_error_body
from tests.e2e.conftest import CHAT_TEMPLATE, MODEL_NAME, ServerProcess
from tests.models.tiny import make_tiny_model_eos0

pytestmark = pytest.mark.e2e

KEY = "sk-anthropic-test"
USER = [{"role": "user", "content": "The quick brown fox"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}  # fmt: skip
TOOLS = [
    {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER},
    {"name": "add", "description": "a + b", "input_schema": {"type": "object", "properties": {}}},
]
EVENTS = TypeAdapter(RawMessageStreamEvent)
# the 2.x client has no temperature, top_p or top_k arguments; the server takes them (older clients)
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with EOS <|endoftext|> and the ChatML template."""
    folder = tmp_path_factory.mktemp("anthropic")
    make_tiny_model_eos0(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    """The tiny model behind an API key; `--reasoning-parser think` splits `<think>` off on every
    route, so a prefilled `<think>` makes the model think."""
    proc = ServerProcess(folder, "--api-key", KEY, "--reasoning-parser", "think").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def chat(server: ServerProcess, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def text_of(message: Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def streamed(client: anthropic.Anthropic, **kwargs) -> tuple[list, Message]:
    """Every event of a streamed message, each checked against the client's own types, and the
    message the client's accumulator made of them."""
    with client.messages.stream(model=MODEL_NAME, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop")]  # fmt: skip
    for e in raw:
        EVENTS.validate_python(e.model_dump())
    return raw, final


def check_order(events: list) -> None:
    """message_start, then blocks (start, deltas of its index, stop), then message_delta, message_stop."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    index, open_ = -1, False
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert not open_ and e.index == index + 1
            index, open_ = e.index, True
        else:
            assert open_ and e.index == index, kinds
            open_ = e.type != "content_block_stop"
    assert not open_


@pytest.mark.parametrize("max_tokens", [12, 200])
def test_plain_message_is_the_chat_answer(
    client: anthropic.Anthropic, server: ServerProcess, max_tokens
) -> None:
    """Greedy: the chat endpoint's text, its counts, its finish reason as Anthropic's stop reason."""
    r = client.messages.create(model=MODEL_NAME, max_tokens=max_tokens, messages=USER, **GREEDY)
    c = chat(server, messages=USER, max_tokens=max_tokens, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert text_of(r) == c["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == c["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == c["usage"]["completion_tokens"]
    want = {"length": "max_tokens", "stop": "end_turn"}[c["choices"][0]["finish_reason"]]
    assert r.stop_reason == want and r.stop_sequence is None


def test_system_prompt_as_string_and_blocks(client: anthropic.Anthropic, server: ServerProcess) -> None:
    system = "Answer in French."
    as_string = client.messages.create(
        model=MODEL_NAME, max_tokens=10, messages=USER, **GREEDY, system=system
    )
    as_blocks = client.messages.create(model=MODEL_NAME, max_tokens=10, messages=USER, **GREEDY,
                                       system=[{"type": "text", "text": system}])  # fmt: skip
    c = chat(server, messages=[{"role": "system", "content": system}, *USER], max_tokens=10, temperature=0)
    assert text_of(as_string) == text_of(as_blocks) == c["choices"][0]["message"]["content"]
    assert as_string.usage.input_tokens == c["usage"]["prompt_tokens"]


def test_streamed_is_the_whole_message(client: anthropic.Anthropic) -> None:
    kwargs = {"max_tokens": 16, "messages": USER, **GREEDY}
    whole = client.messages.create(model=MODEL_NAME, **kwargs)
    events, final = streamed(client, **kwargs)
    check_order(events)
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert [e.delta.type for e in events if e.type == "content_block_delta"] == ["text_delta"] * (
        len(events) - 5
    )
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 16


def test_the_wire_has_event_lines_and_a_ping(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": USER, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert [d["type"] for d in datas] == names and "[DONE]" not in "".join(lines)


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    full = text_of(client.messages.create(model=MODEL_NAME, max_tokens=20, messages=USER, **GREEDY))
    stop = full[5:8]
    r = client.messages.create(
        model=MODEL_NAME, max_tokens=20, messages=USER, **GREEDY, stop_sequences=[stop]
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert full.startswith(text_of(r)) and stop not in text_of(r)
    _, final = streamed(client, max_tokens=20, messages=USER, **GREEDY, stop_sequences=["zzzz", stop])
    assert (
        final.stop_reason == "stop_sequence" and final.stop_sequence == stop and text_of(final) == text_of(r)
    )


def test_count_tokens_is_what_the_message_used(client: anthropic.Anthropic) -> None:
    kwargs = {"messages": USER, "system": "Be brief.", "tools": TOOLS}
    counted = client.messages.count_tokens(model=MODEL_NAME, **kwargs)
    used = client.messages.create(model=MODEL_NAME, max_tokens=2, **kwargs)
    assert counted.input_tokens == used.usage.input_tokens
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL_NAME, messages=USER).input_tokens


def tool_uses(message: Message) -> list:
    calls = [b for b in message.content if b.type == "tool_use"]
    for call in calls:
        assert call.id.startswith("toolu_") and call.name in ("get_weather", "add")
        if call.name == "get_weather":
            jsonschema.validate(call.input, WEATHER)
    return calls


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    """A named choice forces the call (a grammar); its result goes back as a tool_result block, and
    the model answers with text; the result is in the prompt (a longer result, more tokens)."""
    first = client.messages.create(model=MODEL_NAME, max_tokens=100, messages=USER, tools=TOOLS, **GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    (call,) = tool_uses(first)
    assert first.stop_reason == "tool_use" and call.name == "get_weather"

    def history(result: str) -> list:
        answer = {"type": "tool_result", "tool_use_id": call.id, "content": result}
        return [*USER, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [answer]}]  # fmt: skip

    final = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=history("12 C"), tools=TOOLS,
                                   tool_choice={"type": "none"}, **GREEDY)  # fmt: skip
    assert final.stop_reason in ("end_turn", "max_tokens") and text_of(final) and not tool_uses(final)
    counts = [client.messages.count_tokens(model=MODEL_NAME, messages=history(r), tools=TOOLS).input_tokens
              for r in ("12 C", "12 C, sunny, light wind")]  # fmt: skip
    assert counts[1] > counts[0]
    # text blocks as the result are the same result; an error is marked as one
    blocks = history([{"type": "text", "text": "12 C"}])
    assert (
        client.messages.count_tokens(model=MODEL_NAME, messages=blocks, tools=TOOLS).input_tokens == counts[0]
    )
    blocks[-1]["content"][0]["is_error"] = True
    assert (
        client.messages.count_tokens(model=MODEL_NAME, messages=blocks, tools=TOOLS).input_tokens > counts[0]
    )


def test_tool_use_streamed(client: anthropic.Anthropic) -> None:
    """`any` forces a call; it streams as a tool_use block whose input comes in input_json_deltas
    as the model writes it. Sampled (this endpoint takes no seed): about 1 draw in 40 is still
    inside its call at 100 tokens (`add`'s schema allows any properties, so its arguments have no
    end); its block opened and took part of the input, and the message ends at max_tokens. The
    next draw is used then."""
    for _ in range(3):
        events, final = streamed(client, max_tokens=100, messages=USER, tools=TOOLS, extra_body={"temperature": 1.0, "top_k": 50},
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})  # fmt: skip
        check_order(events)
        starts = [e.content_block for e in events if e.type == "content_block_start"]
        if final.stop_reason != "max_tokens":
            break
        assert [b.type for b in starts] in ([], ["tool_use"])  # a cut call: sent in part
    assert [b.type for b in starts] == ["tool_use"] and starts[-1].input == {}
    deltas = [
        e.delta for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    (call,) = tool_uses(final)
    assert len(deltas) > 1 and json.loads("".join(d.partial_json for d in deltas)) == call.input
    assert final.stop_reason == "tool_use" and events[-2].delta.stop_reason == "tool_use"


def test_tool_use_streamed_is_the_whole_message(client: anthropic.Anthropic) -> None:
    """Greedy, the streamed tool_use block's input is the whole message's."""
    body = dict(model=MODEL_NAME, max_tokens=100, messages=USER, tools=TOOLS, **GREEDY,
                tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    whole = client.messages.create(**body)
    events, final = streamed(client, **{k: v for k, v in body.items() if k != "model"})
    (call,), (streamed_call,) = tool_uses(whole), tool_uses(final)
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)
    assert final.stop_reason == whole.stop_reason == "tool_use"
    starts = [i for i, e in enumerate(events) if e.type == "content_block_start"]
    deltas = [i for i, e in enumerate(events) if e.type == "content_block_delta"]
    assert len(deltas) > 1 and min(deltas) > starts[-1]


def test_thinking_blocks(client: anthropic.Anthropic) -> None:
    """A prefilled `<think>` opens the thinking: what follows comes back as a thinking block
    (whole), as thinking_delta events (streamed), the same text both ways."""
    messages = [*USER, {"role": "assistant", "content": "<think>"}]
    whole = client.messages.create(model=MODEL_NAME, max_tokens=10, messages=messages, **GREEDY)
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking
    events, final = streamed(client, max_tokens=10, messages=messages, **GREEDY)
    check_order(events)
    assert {e.delta.type for e in events if e.type == "content_block_delta"} == {"thinking_delta"}
    assert final.content[0].thinking == whole.content[0].thinking


def test_prefill_continues_and_an_empty_one_is_left_out(client: anthropic.Anthropic) -> None:
    """A final assistant message is continued (its text is the prompt's end, no turn closes it);
    an empty one changes nothing."""
    whole = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=USER, **GREEDY)
    empty = [*USER, {"role": "assistant", "content": []}]
    assert text_of(
        client.messages.create(model=MODEL_NAME, max_tokens=12, messages=empty, **GREEDY)
    ) == text_of(whole)
    head = [*USER, {"role": "assistant", "content": "Sure, the"}]
    rest = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=head, **GREEDY)
    closed = client.messages.count_tokens(
        model=MODEL_NAME, messages=[*head, {"role": "user", "content": "x"}]
    )
    assert text_of(rest) and whole.usage.input_tokens < rest.usage.input_tokens < closed.input_tokens


def test_output_config_format(client: anthropic.Anthropic) -> None:
    """A JSON schema the answer follows (structured outputs)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    r = client.messages.create(model=MODEL_NAME, max_tokens=40, messages=USER, **GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(text_of(r)), schema)


def test_auth(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": USER}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert (
            httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
        )
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert r.json()["type"] == "error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**body)
    # the key in x-api-key works on every route, and OpenAI's routes keep OpenAI's error shape
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert "message" in httpx.get(f"{server.url}/v1/models").json()["error"]


BAD = [
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages.0.content.0.source"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x.png"}}]}]}, 400,
     "takes no images"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]}, 400,
     "tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     400, "'tool_use'"),
    ({"frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"tool_choice": {"type": "tool"}}, 400, "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400, "nope"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "budget_tokens"),
    ({"stop_sequences": [""]}, 400, "stop_sequences"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "status", "named"), BAD)
def test_bad_requests(client: anthropic.Anthropic, server: ServerProcess, change, status, named) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": USER, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert r.status_code == status and r.json() == {"type": "error", "error": {"type": kind, "message": r.json()[
        "error"]["message"]}}, r.text  # fmt: skip
    assert named in r.json()["error"]["message"]
    if "max_tokens" in body:  # the client's own arguments, and the rest as they come
        known = {k: body.pop(k) for k in ("model", "max_tokens", "messages", "tools", "tool_choice", "thinking")
                 if k in body}  # fmt: skip
        with pytest.raises({400: anthropic.BadRequestError, 404: anthropic.NotFoundError}[status]):
            client.messages.create(**known, extra_body=body)
    assert text_of(
        client.messages.create(model=MODEL_NAME, max_tokens=2, messages=USER, **GREEDY)
    )  # still serving


def test_bad_bodies_and_paths(server: ServerProcess) -> None:
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/messages/batches", json={}, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/messages", headers=headers)
    assert r.status_code == 404 and r.json()["type"] == "error"


def test_error_statuses() -> None:
    """A full queue is Anthropic's 529 overloaded_error (the client retries it), a failure a 500 api_error."""
    assert anthropic_error_body(429, "full")[0] == 529
    assert anthropic_error_body(429, "full")[1]["error"]["type"] == "overloaded_error"
    assert anthropic_error_body(500, "x")[1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "x"},
    }


def stats(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/stats", headers={"x-api-key": KEY}, timeout=10).json()


def test_a_client_that_leaves_a_stream_aborts_it(client: anthropic.Anthropic, server: ServerProcess) -> None:
    """The whole answer takes `long` steps (greedy, this prompt meets no EOS on the way); a
    stream left after a few events frees its request long before that."""
    long, hello = 1500, [{"role": "user", "content": "Hello"}]
    before = stats(server)["num_steps"]
    whole = client.messages.create(model=MODEL_NAME, max_tokens=long, messages=hello, **GREEDY)
    assert whole.usage.output_tokens == long
    steps_alone = stats(server)["num_steps"] - before
    with client.messages.stream(model=MODEL_NAME, max_tokens=long, messages=hello, **GREEDY) as stream:
        for seen, _ in enumerate(stream):
            if seen == 5:
                break
    deadline = time.monotonic() + 10
    while stats(server)["num_active_requests"]:
        assert time.monotonic() < deadline, stats(server)
        time.sleep(0.05)
    assert stats(server)["num_steps"] - before - steps_alone < steps_alone // 2


@pytest.fixture(scope="module")
def proxy(
    server: ServerProcess, folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server whose model `up` is the tiny server, reached as an OpenAI upstream."""
    config = tmp_path_factory.mktemp("anthropic-proxy") / "models.yaml"
    config.write_text(f"models:\n  - name: up\n    engine: openai\n    source: {server.url}/v1\n"
                      f"    options: {{model: {MODEL_NAME}, api_key: {KEY}}}\n")  # fmt: skip
    proc = ServerProcess([], "--config", str(config), served_name=None, log_dir=config.parent).start()
    yield proc
    proc.stop()


def test_a_remote_model_answers_the_same(client: anthropic.Anthropic, proxy: ServerProcess) -> None:
    """Sent upstream as the chat request it means: the same text and counts, whole and streamed;
    a forced tool call comes back as a tool_use block; count_tokens needs a native model."""
    remote = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    kwargs = {"max_tokens": 12, "messages": USER, "system": "Be brief.", **GREEDY}
    native = client.messages.create(model=MODEL_NAME, **kwargs)
    relayed = remote.messages.create(model="up", **kwargs)
    assert text_of(relayed) == text_of(native) and relayed.stop_reason == native.stop_reason == "max_tokens"
    assert relayed.usage.input_tokens == native.usage.input_tokens
    with remote.messages.stream(model="up", **kwargs) as stream:
        assert stream.get_final_message().content[0].text == text_of(native)
    called = remote.messages.create(model="up", max_tokens=100, messages=USER, tools=TOOLS, **GREEDY,
                                    tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    (call,) = tool_uses(called)
    assert called.stop_reason == "tool_use" and call.name == "get_weather"
    with pytest.raises(anthropic.BadRequestError):
        remote.messages.count_tokens(model="up", messages=USER)

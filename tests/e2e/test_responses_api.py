"""OpenAI's Responses API through the `openai` client on the tiny model: a plain response is the
very answer /v1/chat/completions gives (greedy), streamed it is the same text in the semantic
events' order (each event checked against the client's own types), max_output_tokens makes it
incomplete, text.format constrains it (`responses.parse`), a forced function call round-trips
through `previous_response_id`, stored responses are read and deleted (not with `store: false`),
and bad requests are 4xx in OpenAI's error shape while the server keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field

from tests.e2e.conftest import CHAT_TEMPLATE, MODEL_NAME, ServerProcess
from tests.models.tiny import make_tiny_model_eos0

pytestmark = pytest.mark.e2e

USER = "The quick brown fox"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}  # fmt: skip
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    {
        "type": "function",
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {}},
    },
]
# every event type the client knows, by its `type` (the union is tagged for the client, not pydantic)
EVENTS = {
    get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(get_args(ResponseStreamEvent)[0])
}
STORE_SIZE = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny Llama with EOS <|endoftext|> and the ChatML template; `--reasoning-parser think`
    splits `<think>` off, and the template opens `<think>` when `enable_thinking` is set."""
    folder: Path = tmp_path_factory.mktemp("responses")
    make_tiny_model_eos0(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = CHAT_TEMPLATE.replace(
        "assistant\n{% endif %}", "assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
    )
    assert template != CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    proc = ServerProcess(
        folder, "--reasoning-parser", "think", "--responses-store-size", str(STORE_SIZE)
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client(max_retries=0)


def chat(client: openai.OpenAI, messages: list, max_tokens: int) -> dict:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.model_dump()


def streamed(client: openai.OpenAI, **kwargs) -> tuple[list, Response]:
    """Every event of a streamed response, each checked against the client's own types (raw, as
    the server sent it), and the response the client's accumulator made of them (its helper takes
    only `response.completed`; an incomplete one is the `response.incomplete` event's)."""
    with client.responses.stream(model=MODEL_NAME, **kwargs) as stream:
        events = list(stream)
        final = (
            stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
        )
    for e in events:
        EVENTS[e.type].model_validate(e.model_dump(exclude_unset=True))
    return events, final


def check_order(events: list) -> None:
    """created, in_progress; items (added, parts, deltas of the item, done) one after another with
    increasing output_index; a terminal event; sequence numbers 0, 1, 2, ..."""
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    index, open_ = -1, False
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert not open_ and e.output_index == index + 1, kinds
            index, open_ = e.output_index, True
        else:
            assert open_ and e.output_index == index, kinds
            open_ = e.type != "response.output_item.done"
    assert not open_
    done = [(e.item.id, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert [(item.id, item.type) for item in events[-1].response.output] == done


@pytest.mark.parametrize("max_tokens", [12, 200])
def test_plain_response_is_the_chat_answer(client: openai.OpenAI, max_tokens: int) -> None:
    r = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=max_tokens, temperature=0)
    c = chat(client, [{"role": "user", "content": USER}], max_tokens)
    assert r.id.startswith("resp_") and r.object == "response" and r.output[0].type == "message"
    assert r.output_text == c["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == c["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == c["usage"]["completion_tokens"]
    cut = c["choices"][0]["finish_reason"] == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == (
        "max_output_tokens" if cut else None
    )


def test_instructions_and_items(client: openai.OpenAI) -> None:
    """instructions are a system message; message items (text parts) are the chat messages."""
    system = "Answer in French."
    r = client.responses.create(model=MODEL_NAME, instructions=system, max_output_tokens=10, temperature=0,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": USER}]}])  # fmt: skip
    c = chat(client, [{"role": "system", "content": system}, {"role": "user", "content": USER}], 10)
    assert r.output_text == c["choices"][0]["message"]["content"] and r.instructions == system
    assert r.usage.input_tokens == c["usage"]["prompt_tokens"]


def test_streamed_is_the_whole_response(client: openai.OpenAI) -> None:
    kwargs = {"input": USER, "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(model=MODEL_NAME, **kwargs)
    events, final = streamed(client, **kwargs)
    check_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 16
    assert final.status == whole.status == "incomplete"


def test_streamed_completed(client: openai.OpenAI) -> None:
    events, final = streamed(client, input=USER, max_output_tokens=300, temperature=0)
    check_order(events)
    assert events[-1].type == "response.completed" and final.status == "completed"


def test_reasoning_items(client: openai.OpenAI) -> None:
    """reasoning.effort turns the template's thinking on (it opens `<think>`): the answer is a
    reasoning item with reasoning_text, streamed as reasoning_text deltas, the same text both ways."""
    body = {"input": USER, "max_output_tokens": 10, "temperature": 0, "reasoning": {"effort": "low"}}
    whole = client.responses.create(model=MODEL_NAME, **body)
    assert [item.type for item in whole.output] == ["reasoning"] and whole.output[0].content[0].text
    events, final = streamed(client, **body)
    check_order(events)
    assert {e.type for e in events if e.type.endswith(".delta")} == {"response.reasoning_text.delta"}
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == whole.output[0].content[0].text == final.output[0].content[0].text
    plain = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=10, temperature=0)
    assert plain.output[0].type == "message"


def test_text_format_json_schema_with_parse(client: openai.OpenAI) -> None:
    class Answer(BaseModel):
        a: int = Field(ge=0, le=99)

    r = client.responses.parse(
        model=MODEL_NAME, input=USER, max_output_tokens=200, temperature=0, text_format=Answer
    )
    assert r.status == "completed" and isinstance(r.output_parsed, Answer)
    j = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=8, temperature=0,
                                text={"format": {"type": "json_object"}})  # fmt: skip
    assert j.output_text.startswith("{") and j.text.format.type == "json_object"


def function_calls(r: Response) -> list:
    calls = [item for item in r.output if item.type == "function_call"]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER)
    return calls


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    """A named tool_choice forces the call (a grammar); its output goes back as a
    function_call_output with previous_response_id, and the model answers with text."""
    first = client.responses.create(model=MODEL_NAME, input=USER, tools=TOOLS, max_output_tokens=100, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = function_calls(first)
    assert first.status == "completed" and call.name == "get_weather"
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}]
    final = client.responses.create(model=MODEL_NAME, input=answer, previous_response_id=first.id, tools=TOOLS,
                                    tool_choice="none", max_output_tokens=8, temperature=0)  # fmt: skip
    assert final.output_text and not function_calls(final) and final.previous_response_id == first.id
    # the same conversation sent whole is the same prompt
    history = [{"role": "user", "content": USER}, call.model_dump(exclude_none=True), *answer]
    again = client.responses.create(model=MODEL_NAME, input=history, tools=TOOLS, tool_choice="none",
                                    max_output_tokens=8, temperature=0)  # fmt: skip
    assert again.output_text == final.output_text and again.usage.input_tokens == final.usage.input_tokens


def test_function_call_streamed(client: openai.OpenAI) -> None:
    events, final = streamed(client, input=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=100, temperature=0)  # fmt: skip
    check_order(events)
    (call,) = function_calls(final)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[-1].type == "function_call" and added[-1].arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == call.arguments and events[-1].type == "response.completed"
    # the arguments streamed as the model wrote them, and are the whole response's
    whole = client.responses.create(model=MODEL_NAME, input=USER, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=100, temperature=0)  # fmt: skip
    (whole_call,) = function_calls(whole)
    assert len(deltas) > 1 and (call.name, call.arguments) == (whole_call.name, whole_call.arguments)


def test_stored_responses(client: openai.OpenAI, server: ServerProcess) -> None:
    r = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="more", previous_response_id=unstored.id)
    # bounded: the oldest goes first
    ids = [client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=1).id for _ in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


BAD = [
    ({"model": "no-such-model"}, 404, "no-such-model"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": 3}, 400, "temperature"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "takes no images"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "only in user"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400, "call_id"),
    ({"tools": [{"type": "web_search"}]}, 400, "web_search"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, 400, "nope"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"previous_response_id": "resp_nope"}, 404, "resp_nope"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "status", "named"), BAD)
def test_bad_requests(
    client: openai.OpenAI, server: ServerProcess, change: dict, status: int, named: str
) -> None:
    body = {"model": MODEL_NAME, "input": USER, "max_output_tokens": 4, **change}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert named in error["message"] and set(error) == {"message", "type", "param", "code"}
    # still serving: greedy, so a sampled end-of-text cannot make the check flaky
    after = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=2, temperature=0)
    assert (
        after.status in ("completed", "incomplete") and after.usage.output_tokens >= 1 and after.output_text
    )


def test_input_items_listed_as_given_with_pagination(client: openai.OpenAI) -> None:
    given = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}], "id": "msg_mine"},
        {"type": "message", "role": "assistant", "content": "jumps"},
        {"role": "user", "content": "over"},
    ]  # fmt: skip
    r = client.responses.create(model=MODEL_NAME, input=given, max_output_tokens=2, instructions="x")
    newest_first = client.responses.input_items.list(r.id)
    assert [i.role for i in newest_first.data] == ["user", "assistant", "user", "developer"]
    assert newest_first.data[2].id == "msg_mine" and not newest_first.has_more
    asc = client.responses.input_items.list(r.id, order="asc")
    assert [i.id for i in asc.data] == [i.id for i in reversed(newest_first.data)]
    assert len({i.id for i in asc.data}) == 4 and all(i.type == "message" for i in asc.data)
    texts = [[p.text for p in i.content] for i in asc.data]
    assert texts == [["Be brief."], [USER], ["jumps"], ["over"]]  # the instructions are not an input item
    assert [p.type for i in asc.data for p in i.content] == [
        "input_text",
        "input_text",
        "output_text",
        "input_text",
    ]
    first = client.responses.input_items.list(r.id, order="asc", limit=3)
    assert first.has_more and [i.id for i in first.data] == [i.id for i in asc.data[:3]]
    assert first.first_id == asc.data[0].id and first.last_id == asc.data[2].id
    rest = client.responses.input_items.list(r.id, order="asc", limit=3, after=first.last_id)
    assert [i.id for i in rest.data] == [asc.data[3].id] and not rest.has_more
    # the client's auto-pagination walks every page
    assert [i.id for i in client.responses.input_items.list(r.id, order="asc", limit=1)] == [
        i.id for i in asc.data
    ]
    # a continuation lists its own input only
    more = client.responses.create(
        model=MODEL_NAME, input="again", previous_response_id=r.id, max_output_tokens=2
    )
    (only,) = client.responses.input_items.list(more.id).data
    assert only.role == "user" and only.content[0].text == "again"


@pytest.mark.parametrize(
    ("query", "named"),
    [({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")],
)
def test_input_items_bad_queries(
    client: openai.OpenAI, server: ServerProcess, query: dict, named: str
) -> None:
    r = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=1)
    resp = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items", params=query)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == named
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def wait_for(client: openai.OpenAI, response_id: str) -> Response:
    for _ in range(600):
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {got.status}")


def test_background_response_is_polled_to_the_foreground_answer(client: openai.OpenAI) -> None:
    fg = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=12, temperature=0)
    bg = client.responses.create(
        model=MODEL_NAME, input=USER, max_output_tokens=12, temperature=0, background=True
    )
    assert bg.status == "queued" and bg.background is True and bg.output == []
    done = wait_for(client, bg.id)
    assert done.status == fg.status and done.output_text == fg.output_text
    assert done.usage is not None and done.usage.output_tokens == fg.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(bg.id).data] == [USER]
    # a response that ended is answered as it is
    assert client.responses.cancel(bg.id).status == fg.status


def test_background_response_cancelled(client: openai.OpenAI, server: ServerProcess) -> None:
    """Cancelled while it runs (a 200-token answer takes longer than the cancel's round trip;
    a few tries in case one finishes first): `cancelled`, no output, its engine request aborted."""
    for _ in range(5):
        bg = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=200, background=True)
        cancelled = client.responses.cancel(bg.id)
        if cancelled.status == "cancelled":
            break
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert client.responses.retrieve(bg.id).status == "cancelled"
    assert client.responses.cancel(bg.id).status == "cancelled"
    for _ in range(100):  # the engine holds nothing of it
        if httpx.get(f"{server.url}/stats").json()["num_active_requests"] == 0:
            break
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/stats").json()["num_active_requests"] == 0


def test_background_refusals(client: openai.OpenAI, server: ServerProcess) -> None:
    fg = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="background: true"):
        client.responses.cancel(fg.id)
    for change in ({"stream": True}, {"store": False}):
        body = {"model": MODEL_NAME, "input": USER, "background": True, **change}
        resp = httpx.post(f"{server.url}/v1/responses", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "background"
    resp = httpx.post(f"{server.url}/v1/responses", json={"model": "nope", "input": USER, "background": True})
    assert resp.status_code == 404

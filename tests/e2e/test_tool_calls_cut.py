"""Tool calls that `max_tokens` cuts short, on the embedded model (SmolLM2-135M, whose template
has no tool support: the tools are described in a system message, calls come in Hermes blocks).

Greedy, `tool_choice: "required"` and "Weather in Oslo?" make it call get_weather for Oslo, twice,
31 tokens a call. So `max_tokens: 45` cuts the second call inside its JSON, and 12 cuts the first:
the reply holds the whole calls only (`finish_reason: "tool_calls"`), or none and `length`, and
never a piece of `<tool_call>` syntax as content, whole or streamed. A stream sends a call's
arguments as they are written (server/serving/tool_stream.py), so a call cut inside its arguments
was sent in part: the stream then ends with `length`, as OpenAI's does. `auto` gets the same
text forced by a regex, with content before the calls."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.e2e.test_tools import streamed_reply

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # the embedded model: about a minute

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}}]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
FORCED = ["required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess("smollm2-135m-instruct", log_dir=tmp_path_factory.mktemp("cut-calls")).start()
    yield proc
    proc.stop()


def whole_and_streamed(server: ServerProcess, **kwargs) -> list[tuple[str | None, list[dict], str, int]]:
    """(content, calls as {name, arguments}, finish_reason, completion tokens) of the whole reply and
    of the same request streamed."""
    client = server.client()
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, **kwargs}
    r = client.chat.completions.create(**body)
    message = r.choices[0].message
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    results = [(message.content, calls, r.choices[0].finish_reason, r.usage.completion_tokens)]
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    content, calls, finish = streamed_reply(chunks)
    results.append((content or None, calls, finish, chunks[-1].usage.completion_tokens))
    return results


@pytest.mark.parametrize("choice", FORCED, ids=["required", "named"])
def test_a_forced_call_cut_short_is_dropped(embedded: ServerProcess, choice) -> None:
    for content, calls, finish, num_tokens in whole_and_streamed(embedded, tool_choice=choice, max_tokens=45):
        assert num_tokens == 45  # cut: the model was writing a second call
        assert (content, finish, [c["name"] for c in calls]) == (None, "tool_calls", ["get_weather"])
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("choice", FORCED, ids=["required", "named"])
def test_no_forced_call_finished_is_length(embedded: ServerProcess, choice) -> None:
    for content, calls, finish, num_tokens in whole_and_streamed(embedded, tool_choice=choice, max_tokens=12):
        assert (content, calls, finish, num_tokens) == (None, [], "length", 12)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
LONG = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + "Oslo " * 60 + '"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "max_tokens", "calls", "finish"),
    [(f"Checking.\n{CALL}\n{LONG}", 60, 1, "tool_calls"), (f"Checking.\n{LONG}", 30, 0, "length")],
)
def test_auto_call_cut_short_is_dropped(embedded: ServerProcess, text, max_tokens, calls, finish) -> None:
    """`auto`: the model's own text (here forced by a regex) holds content, then calls; the long
    call is cut inside its arguments. The content stays, the cut call goes."""
    extra = {"structured_outputs": {"regex": re.escape(text)}}
    results = whole_and_streamed(embedded, tool_choice="auto", max_tokens=max_tokens, extra_body=extra)
    for i, (content, found, reason, num_tokens) in enumerate(results):
        assert num_tokens == max_tokens
        assert content.strip() == "Checking." and "<tool" not in content
        assert [json.loads(c["arguments"]) for c in found[:calls]] == [{"city": "Oslo"}] * calls
        if i == 0:  # whole: the cut call dropped
            assert reason == finish and len(found) == calls
        else:  # streamed: the cut call went out in part, and the stream says so
            assert reason == "length" and len(found) == calls + 1 and found[-1]["name"] == "get_weather"
            assert found[-1]["arguments"].startswith('{"city": "Oslo Oslo')

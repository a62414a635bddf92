"""Tool calling through the `openai` client on a tiny random Llama: `required` and named choices
always return calls whose arguments validate against the function's schema (streamed and not),
`none` never calls and hides the tools, a tool result round-trips, and malformed tools or choices
are 400s naming the field. The Hermes parser and the stream splitter are checked on text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from llmserve.server.serving.tools import FORMATS, ToolStreamSplitter
from tests.e2e.conftest import CHAT_TEMPLATE, MODEL_NAME, ServerProcess
from tests.models.tiny import make_tiny_model_eos0

pytestmark = pytest.mark.e2e

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}  # fmt: skip
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


def check_calls(calls, only: str | None = None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_reply(chunks: Iterable[ChatCompletionChunk]) -> tuple[str, list[dict[str, str]], str | None]:
    """A streamed reply's first choice put together: (content, calls as {name, arguments} in
    their order, finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_validate(so_server: ServerProcess, choice) -> None:
    client = so_server.client()
    only = None if choice == "required" else "add"
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            seed=seed, temperature=1.0, max_tokens=120,
        )  # fmt: skip
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls"
        assert len(choice0.message.tool_calls or []) == 1
        check_calls(choice0.message.tool_calls, only)


def test_forced_calls_stream(so_server: ServerProcess) -> None:
    client = so_server.client()
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        seed=7, temperature=1.0, max_tokens=120, stream=True,
    )  # fmt: skip
    _, calls, finish = streamed_reply(stream)
    assert finish == "tool_calls" and len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_calls_are_the_unstreamed_ones_sent_as_they_are_written(
    so_server: ServerProcess, parallel
) -> None:
    """The same greedy request, streamed and not: the streamed calls (joined by index) are the
    unstreamed ones, name and arguments; each call opens in one chunk (id, type, name) and its
    arguments come in several chunks before the reply's last one. A call that max_tokens cuts was
    streamed in part: the unstreamed reply drops it, and the stream ends with `length`."""
    client = so_server.client()
    body = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=parallel, temperature=0, max_tokens=160)  # fmt: skip
    whole = client.chat.completions.create(**body).choices[0]
    chunks = list(client.chat.completions.create(**body, stream=True))
    _, calls, finish = streamed_reply(chunks)
    unstreamed = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
    ]
    assert whole.finish_reason == "tool_calls" and calls[: len(unstreamed)] == unstreamed
    if parallel:  # the tiny model calls until max_tokens cuts a call: sent in part, the stream says `length`
        assert len(calls) == len(unstreamed) + 1 and finish == "length"
        with pytest.raises(ValueError):
            json.loads(calls[-1]["arguments"])
    else:
        assert len(calls) == len(unstreamed) == 1 and finish == "tool_calls"
    deltas = [
        (i, d) for i, chunk in enumerate(chunks) for c in chunk.choices for d in c.delta.tool_calls or []
    ]
    opened = [(i, d) for i, d in deltas if d.id is not None]
    assert len(opened) == len(calls) and all(d.type == "function" and d.function.name for _, d in opened)
    last = max(i for i, chunk in enumerate(chunks) if chunk.choices and chunk.choices[0].finish_reason)
    argument_chunks = {i for i, d in deltas if d.id is None and d.function.arguments}
    assert len([i for i in argument_chunks if i < last]) >= 3, "the arguments did not stream"


def test_none_never_calls_and_hides_the_tools(so_server: ServerProcess) -> None:
    client = so_server.client()
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=8,
            temperature=0,
            seed=seed,
        )
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"
        assert r.usage.prompt_tokens == plain.usage.prompt_tokens
        assert r.choices[0].message.content == plain.choices[0].message.content
    auto = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # auto: the tools are described


def test_a_tool_result_round_trips(so_server: ServerProcess) -> None:
    client = so_server.client()
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=120,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "42"}]  # fmt: skip
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=5, temperature=0)  # fmt: skip
    assert second.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
     ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
     ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}}, "tool_choice", "must name a function"),
     ({"tools": TOOLS, "tool_choice": 5}, "tool_choice", "must name a function"),
     ({"tool_choice": "required"}, "tool_choice", "needs tools"),
     ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "function.name"),
     ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be"),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools", "parameters"),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
       "tool_choice": "required"}, "tools", "invalid structured_outputs.grammar"),
     ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
      "cannot be combined")],
)  # fmt: skip
def test_bad_tools_are_400s(so_server: ServerProcess, extra, param, message) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(f"{so_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        so_server.client().chat.completions.create(**body)


def test_hermes_parser_and_stream_splitter() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{bad}\n</tool_call>'
    content, calls = FORMATS["hermes"].parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert content == "Sure.\n\n<tool_call>\n{bad}\n</tool_call>"  # a block that does not parse stays text
    assert FORMATS["hermes"].parse("no calls here") == ("no calls here", [])
    splitter, streamed = ToolStreamSplitter(), []
    for piece in ["Sure. <", "tool_c", 'all>\n{"name": "add", "arguments": {}}\n</tool_call>']:
        streamed.append(splitter.feed(piece))
    assert streamed == ["Sure. ", "", ""]
    rest, calls = splitter.finish()
    assert rest is None and [c.name for c in calls] == ["add"]
    splitter = ToolStreamSplitter()
    assert (
        splitter.feed("a <t") == "a " and splitter.feed("ag>") == "<tag>" and splitter.finish() == (None, [])
    )


# Chat templates in the style of Llama 3.1's and Mistral's (their markers spelled as plain text in
# the tiny vocabulary): the server reads the tool-call format off them (--tool-call-parser auto).
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\nEnvironment: ipython\nCall a function by "
    'replying {"name": function name, "parameters": arguments}: {{ tools | tojson }}<|eot_id|>{% endif %}'
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n"
    "{% if m.tool_calls %}<|python_tag|>{{ m.tool_calls | tojson }}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}</s>"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
OPENERS = {"llama3_json": '{"name": ', "mistral": '[TOOL_CALLS][{"name": '}


@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def fmt_server(request, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(f"tools-{request.param}")
    make_tiny_model_eos0(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = LLAMA3_TEMPLATE if request.param == "llama3_json" else MISTRAL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    proc = ServerProcess(folder).start()
    yield request.param, proc
    proc.stop()


def test_llama3_and_mistral_formats_read_off_the_template(fmt_server) -> None:
    """Forced calls come out in the template's format (the raw tokens, from logprobs, open with its
    marker) and are parsed back into tool_calls that validate, streamed and not."""
    fmt, server = fmt_server
    client = server.client()
    for seed in range(2):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed,
            parallel_tool_calls=False, temperature=1.0, max_tokens=160, logprobs=True,
        )  # fmt: skip
        choice = r.choices[0]
        raw = "".join(t.token for t in choice.logprobs.content)
        assert raw.startswith(OPENERS[fmt]), raw
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, seed=3, temperature=1.0, max_tokens=160, stream=True,
    )  # fmt: skip
    content, calls, finish = streamed_reply(stream)
    assert finish == "tool_calls" and content == "" and [c["name"] for c in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD)


AUTO_CALL = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
             "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
             "mistral": 'Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'}  # fmt: skip


def _auto_round_trip(server: ServerProcess, fmt: str) -> None:
    """`auto`: the model's own text decides. A regex constraint makes the tiny model write a call in
    the format (or plain text), and the server must find it, streamed and not."""
    client = server.client()
    content = "Adding." if fmt == "mistral" else None
    for text, calls in ((AUTO_CALL[fmt], True), ("just text", False)):
        extra = {"structured_outputs": {"regex": re.escape(text)}}
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                           max_tokens=80, extra_body=extra)  # fmt: skip
        message = r.choices[0].message
        if calls:
            assert r.choices[0].finish_reason == "tool_calls" and message.content == content
            assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
                ("add", {"a": 1, "b": 2})
            ]
        else:
            assert r.choices[0].finish_reason == "stop" and message.content == text and not message.tool_calls
        stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                                max_tokens=80, extra_body=extra, stream=True)  # fmt: skip
        streamed, names, arguments, finish = "", [], "", None
        for chunk in stream:
            for c in chunk.choices:
                streamed += c.delta.content or ""
                names += [
                    d.function.name for d in c.delta.tool_calls or [] if d.id is not None
                ]  # a call opens
                arguments += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
                finish = c.finish_reason or finish
        assert (streamed, names, finish) == (
            (content or "", ["add"], "tool_calls") if calls else (text, [], "stop")
        )
        assert arguments == (message.tool_calls[0].function.arguments if calls else "")


def test_auto_calls_round_trip_hermes(so_server: ServerProcess) -> None:
    _auto_round_trip(so_server, "hermes")


def test_auto_calls_round_trip_other_formats(fmt_server) -> None:
    fmt, server = fmt_server
    _auto_round_trip(server, fmt)


def test_tool_call_parser_flag_overrides_the_template(tmp_path) -> None:
    """`--tool-call-parser llama3_json` on a ChatML (hermes-looking) template: calls are written and
    read in Llama's format."""
    make_tiny_model_eos0(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    server = ServerProcess(tmp_path, "--tool-call-parser", "llama3_json").start()
    try:
        r = server.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            seed=0, temperature=1.0, max_tokens=160, logprobs=True,
        )  # fmt: skip
        raw = "".join(t.token for t in r.choices[0].logprobs.content)
        assert raw.startswith(OPENERS["llama3_json"]), raw
        check_calls(r.choices[0].message.tool_calls)
    finally:
        server.stop()


def test_ollama_chat_tools(fmt_server) -> None:
    """Ollama's /api/chat with `tools`, through the `ollama` client: the model's call (here forced
    into Llama's JSON form by `format`) comes back as Ollama's `tool_calls` with object arguments,
    whole and streamed; a call and its result round-trip into the next prompt; the same reply
    without `tools` stays text."""
    import ollama

    fmt, server = fmt_server
    if fmt != "llama3_json":
        pytest.skip("`format` (a JSON schema) can force a call only in a JSON call format")
    client = ollama.Client(host=server.url)
    call_schema = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                   "properties": {"name": {"const": "add"}, "parameters": ADD}}  # fmt: skip
    options = {"temperature": 1.0, "seed": 1, "num_predict": 120}
    r = client.chat(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, format=call_schema, options=options)
    assert r.done and r.message.content == ""
    ((call),) = r.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(dict(call.function.arguments), ADD)
    parts = list(client.chat(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, format=call_schema, options=options,
                             stream=True))  # fmt: skip
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        ("add", dict(call.function.arguments))
    ]
    assert "".join(p.message.content for p in parts) == "" and parts[-1].done
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3", "tool_name": "add"},
    ]
    again = client.chat(model=MODEL_NAME, messages=history, tools=TOOLS, options={"num_predict": 4})
    shorter = client.chat(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, options={"num_predict": 4})
    assert again.prompt_eval_count > shorter.prompt_eval_count  # the call and its result were rendered
    plain = client.chat(model=MODEL_NAME, messages=MESSAGES, format=call_schema, options=options)
    assert not plain.message.tool_calls and json.loads(plain.message.content)["name"] == "add"

"""Tool-call formats on text: each family's parser reads its own calls (and leaves anything else as
content), the stream splitter holds back exactly what may become a call, the format is read off
chat templates, and each format's grammar compiles and accepts the calls its parser reads."""

from __future__ import annotations

import json
from typing import ClassVar

import llguidance
import pytest

from llmserve.config import ServerConfig
from llmserve.server.serving.tools import (
    FORMATS,
    ToolStreamSplitter,
    detect_tool_format,
    finish_reason_with_calls,
    tool_format,
)

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},
]


def calls_of(text: str, fmt: str) -> tuple[str | None, list[tuple[str, object]]]:
    content, calls = FORMATS[fmt].parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert calls_of(text, "hermes") == ("Sure.", [("add", {"a": 1, "b": 2})])
    assert calls_of("no calls", "hermes") == ("no calls", [])


def test_llama3_json() -> None:
    one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert calls_of(one, "llama3_json") == (None, [("add", {"a": 1, "b": 2})])
    assert calls_of(f"<|python_tag|>{one}; {{\"name\": \"now\", \"parameters\": {{}}}}", "llama3_json") == (
        None, [("add", {"a": 1, "b": 2}), ("now", {})],
    )  # fmt: skip
    assert calls_of('{"name": "add", "arguments": "{\\"a\\": 1}"}', "llama3_json") == (
        None,
        [("add", {"a": 1})],
    )
    # content: prose, JSON that is not a call, a call followed by prose
    assert calls_of("The sum is 3.", "llama3_json") == ("The sum is 3.", [])
    assert calls_of('{"answer": 3}', "llama3_json") == ('{"answer": 3}', [])
    assert calls_of(f"{one} and then", "llama3_json") == (f"{one} and then", [])


def test_mistral_both_generations() -> None:
    v3 = 'Let me add.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]'
    assert calls_of(v3, "mistral") == ("Let me add.", [("add", {"a": 1, "b": 2}), ("now", {})])
    v11 = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]now[ARGS]{}'
    assert calls_of(v11, "mistral") == (None, [("add", {"a": 1, "b": 2}), ("now", {})])
    broken = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1'
    assert calls_of(broken, "mistral") == (broken, [])  # cut short: kept as written
    assert calls_of("plain", "mistral") == ("plain", [])


@pytest.mark.parametrize(
    ("fmt", "pieces", "streamed", "calls"),
    [
        ("hermes", ["Sure. <", "tool_c", 'all>\n{"name": "now", "arguments": {}}\n</tool_call>'], ["Sure. ", "", ""],
         ["now"]),
        ("mistral", ["Ok [TOOL", "_CALLS][", '{"name": "now", "arguments": {}}]'], ["Ok ", "", ""], ["now"]),
        ("llama3_json", [" ", '{"name": "now", ', '"parameters": {}}'], ["", "", ""], ["now"]),
        ("llama3_json", ["<|python", '_tag|>{"name": "now", "parameters": {}}'], ["", ""], ["now"]),
        ("llama3_json", ["<|", "im here", " to help"], ["", "<|im here", " to help"], []),
        ("llama3_json", ["Hello", " {x}"], ["Hello", " {x}"], []),
    ],
)  # fmt: skip
def test_stream_splitter(fmt, pieces, streamed, calls) -> None:
    splitter = ToolStreamSplitter(FORMATS[fmt])
    assert [splitter.feed(p) for p in pieces] == streamed
    rest, found = splitter.finish()
    assert [c.name for c in found] == calls
    if not calls:
        assert rest is None


def test_a_reply_held_back_but_not_a_call_comes_back_as_content() -> None:
    splitter = ToolStreamSplitter(FORMATS["llama3_json"])
    assert splitter.feed('{"answer": ') == "" and splitter.feed("3}") == ""
    assert splitter.finish() == ('{"answer": 3}', [])


# Replies cut short by max_tokens (`cut`): the calls written in full come back, the call cut short
# (or the start of its marker) never does, as a call or as content.
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ADD_LLAMA = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
ADD_MISTRAL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
OSLO = ("get_weather", {"city": "Oslo"})
SUM = ("add", {"a": 1, "b": 2})
CUT_REPLIES = [
    # the issue's case: a whole call, then one cut inside its name
    ("hermes", WEATHER + '\n<tool_call>\n{"name": "get_weather", "', None, [OSLO]),
    ("hermes", WEATHER + "\n<tool_call>\n", None, [OSLO]),
    ("hermes", WEATHER + "\n<tool_", None, [OSLO]),  # inside the second marker
    (
        "hermes",
        WEATHER + WEATHER.removesuffix("</tool_call>") + "</tool",
        None,
        [OSLO, OSLO],
    ),  # only </tool_call> cut
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Na', None, []),
    ("hermes", "Let me check.\n<tool_call>\n{", "Let me check.\n", []),
    ("hermes", "Let me check. <tool", "Let me check. ", []),
    ("hermes", "A plain answer, cut", "A plain answer, cut", []),
    ("llama3_json", f'{ADD_LLAMA}; {{"name": "ad', None, [SUM]),
    ("llama3_json", '{ "name": "add", "parameters": {"a"', None, []),
    ("llama3_json", f'<|python_tag|>{ADD_LLAMA}; {{"x', None, [SUM]),  # after the tag all is calls
    ("llama3_json", "<|python_ta", None, []),
    ("llama3_json", '{"answer": 3', '{"answer": 3', []),  # JSON that is no call stays content
    ("llama3_json", f"{ADD_LLAMA} and then", f"{ADD_LLAMA} and then", []),
    ("mistral", f'Adding.[TOOL_CALLS][{ADD_MISTRAL}, {{"name": "now", "argu', "Adding.", [SUM]),
    ("mistral", f"[TOOL_CALLS][{ADD_MISTRAL}", None, [SUM]),  # only the "]" cut
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]now[AR', None, [SUM]),
    ("mistral", "Adding.[TOOL_CA", "Adding.", []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1', None, []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CUT_REPLIES)
def test_a_reply_cut_by_max_tokens_keeps_whole_calls_only(fmt, text, content, calls) -> None:
    found, parsed = FORMATS[fmt].parse(text, cut=True)
    assert (found, [(c.name, json.loads(c.arguments)) for c in parsed]) == (content, calls)
    # streamed in pieces of 3 characters, the content sent plus what `finish` returns is the same
    splitter, streamed = ToolStreamSplitter(FORMATS[fmt]), ""
    for at in range(0, len(text), 3):
        streamed += splitter.feed(text[at : at + 3])
    rest, stream_calls = splitter.finish(cut=True)
    assert [(c.name, json.loads(c.arguments)) for c in stream_calls] == calls
    if calls:  # content around calls comes back stripped
        assert ((streamed + (rest or "")).strip() or None) == content
    else:
        assert ((streamed + (rest or "")) or None) == content


@pytest.mark.parametrize(
    ("fmt", "text"), [(fmt, text) for fmt, text, _, calls in CUT_REPLIES if fmt != "hermes" or not calls]
)
def test_uncut_replies_keep_the_unfinished_text(fmt, text) -> None:
    """The same text ended on its own (EOS, a stop string) is not cut: a call that does not parse
    stays content, as the model wrote it."""
    assert FORMATS[fmt].parse(text) == (text, [])
    content, calls = FORMATS["hermes"].parse(WEATHER + "\n<tool_call>\n{")
    assert content == "<tool_call>\n{" and [c.name for c in calls] == ["get_weather"]


def test_finish_reason_with_calls() -> None:
    call = FORMATS["hermes"].parse(WEATHER)[1]
    assert finish_reason_with_calls("stop", call) == "tool_calls"
    assert finish_reason_with_calls("length", call) == "tool_calls"  # the calls that came back are whole
    assert finish_reason_with_calls("length", []) == "length"  # no call finished inside max_tokens
    assert finish_reason_with_calls("abort", call) == "abort"
    assert finish_reason_with_calls("stop", []) == "stop"


# Fragments in the style of each family's published template (the markers they use).
LLAMA31 = ('{%- if tools is not none %}Environment: ipython\nRespond in the format {"name": function name, '
           '"parameters": dictionary of argument name and its value}{% endif %}'
           "{%- for m in messages %}{%- if m.tool_calls %}<|python_tag|>{{ m.tool_calls | tojson }}{% endif %}{% endfor %}")  # fmt: skip
MISTRAL = "{%- for m in messages %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]{% endfor %}"  # fmt: skip
QWEN = "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> ... <tool_call>{% endif %}"
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(
    ("template", "name"),
    [(LLAMA31, "llama3_json"), (MISTRAL, "mistral"), (QWEN, "hermes"), (CHATML, "hermes"), (None, "hermes")],
)
def test_format_read_off_the_template(template, name) -> None:
    assert detect_tool_format(template).name == name
    assert tool_format("auto", template).name == name
    assert tool_format("mistral", template).name == "mistral"  # a named parser wins


def test_bad_parser_name_is_refused() -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be .*got 'qwen'"):
        ServerConfig(tool_call_parser="qwen")


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "now", "parameters": {}}'),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]',
        ),
    ],
)
def test_grammar_accepts_what_the_parser_reads(fmt, text) -> None:
    """Each format's grammar (what `required` enforces) matches a well-formed reply byte for byte,
    and refuses a call of a function that is not among the tools."""
    grammar = FORMATS[fmt].grammar(TOOLS, parallel=True)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(lark, tokenizer) == ""

    def accepts(s: str) -> bool:
        m = llguidance.LLMatcher(tokenizer, lark)
        ok = m.consume_tokens(list(s.encode()))
        return ok and m.is_accepting() and not m.is_error()

    assert accepts(text)
    assert not accepts(text.replace('"add"', '"sub"'))
    assert FORMATS[fmt].parse(text)[1]


class _ByteTokenizer:
    """A tokenizer whose 256 tokens are the bytes, plus an EOS: enough for llguidance to match text."""

    eos_token_id = 256
    bos_token_id = None
    tokens: ClassVar[list[bytes]] = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, s: str) -> list[int]:
        return list(s.encode())

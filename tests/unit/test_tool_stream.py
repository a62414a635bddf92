"""Tool calls streamed as they are written (server/serving/tool_stream.py): `CanonicalJson`
against Python's own `json.dumps(json.loads(...))` on JSON written every which way and cut at
every point; and each format's replies, fed in pieces, give call deltas that open each call before
its block ends and join to exactly the calls the format's parser reads from the whole reply."""

from __future__ import annotations

import json
import random

import pytest

from llmserve.server.serving.tool_stream import CanonicalJson
from llmserve.server.serving.tools import FORMATS, ToolStreamSplitter

DOCS = [
    '{"a": 1, "b": 2}',
    '{ "path" : "src/a.py" ,\n  "content":"line 1\\nline \\"2\\"\\t\\u00e9\\u4e2d\\ud83d\\ude00 \\/ \\\\" }',
    '{"n":[1.50, -0, 1e2, 2E-3, 10, 0.1, -12.5e+1, 123456789012345678901234567890],"t":true,"f":false,"z":null}',
    '{"nested":{"deep":[{"x":[]},{},[[]],"s"]},"empty":""}',
    '{"ctrl": "\\u0001\\u001f\\b\\f\\r", "lone": "\\ud800x", "lone2": "\\udc00", "hi_esc": "\\ud800\\n"}',
    '{"é": "naïve café — ✓", "emoji": "😀"}',
    "{}",
    '{"k": "}]{[,:\\"", "after": 1}',
]


def chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("doc", DOCS)
def test_canonical_json_streams_what_json_dumps_writes(doc):
    """Fed in random pieces (and one character at a time), the canonical text joins to
    json.dumps(json.loads(doc), ensure_ascii=False) and the value ends where the doc does; text
    after the value is left unread."""
    want = json.dumps(json.loads(doc), ensure_ascii=False)
    rng = random.Random(doc)
    for pieces in [list(doc + " tail"), *(chunks(doc + "} </tool_call>", rng) for _ in range(30))]:
        stream, out, used_total = CanonicalJson(), [], 0
        for piece in pieces:
            if stream.done:
                break
            text, used = stream.feed(piece)
            out.append(text)
            used_total += used
        assert stream.done
        assert "".join(out) == want
        assert used_total == len(doc)


@pytest.mark.parametrize("bad", ['{"a": tru}', '{"a": 1]]', '{"a": "\\x"}', '{"a": 01x}', '{"a" @ 1}'])
def test_canonical_json_refuses_what_is_not_json(bad):
    with pytest.raises(ValueError):
        CanonicalJson().feed(bad + " ")


REPLIES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", '
        '"content": "def f():\\n    return 1\\n"}}\n</tool_call>\n<tool_call>\n{"arguments": {"x": 1}, '
        '"name": "late_name"}\n</tool_call>\n<tool_call>\n{"name":"add","arguments":{"a":1 ,"b" :2.50}}\n'
        "</tool_call>"
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "write_file", "parameters": {"path": "a.py", "content": "x\\ty"}}; '
        '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    ),
    "mistral": (
        'Sure.[TOOL_CALLS][{"name": "write_file", "arguments": {"path": "a.py", "content": "x"}}, '
        '{"name": "now", "arguments": {}}]'
    ),
}


def stream_reply(fmt: str, pieces: list[str]) -> tuple[str, dict[int, dict], list[list[dict]], list]:
    """Feed a reply in pieces: the content streamed, each call's joined deltas by index, the
    deltas of each step, and the format's parse of the whole reply."""
    splitter = ToolStreamSplitter(FORMATS[fmt])
    content, steps = "", []
    for piece in pieces:
        content += splitter.feed(piece)
        steps.append([d.to_dict() for d in splitter.call_deltas()])
    rest, calls = splitter.finish()
    steps.append([d.to_dict() for d in splitter.final_call_deltas(calls)])
    joined: dict[int, dict] = {}
    for d in (d for step in steps for d in step):
        call = joined.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in d:
            assert call["id"] is None, "a call opened twice"
            call["id"], call["name"] = d["id"], d["function"]["name"]
        call["arguments"] += d["function"]["arguments"]
    return content + (rest or ""), joined, steps, calls


@pytest.mark.parametrize("fmt", list(REPLIES))
def test_streamed_calls_join_to_the_parsed_calls(fmt):
    reply = REPLIES[fmt]
    rng = random.Random(fmt)
    _, whole = FORMATS[fmt].parse(reply)
    assert len(whole) >= 2
    for pieces in [list(reply), *(chunks(reply, rng) for _ in range(40))]:
        _, joined, _, calls = stream_reply(fmt, pieces)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
        assert sorted(joined) == list(range(len(whole)))
        # each index is one call, opened once with an id and a name, in the order written
        assert [(joined[i]["name"], joined[i]["arguments"]) for i in range(len(whole))] == [
            (c.name, c.arguments) for c in whole
        ]
        assert all(c["id"].startswith("call_") for c in joined.values())


def test_a_long_argument_streams_before_its_call_ends():
    """The call opens as soon as its head is read, and its arguments grow while the model writes
    them: most of the content argument is out before the closing brace comes."""
    body = "x" * 200
    reply = f'<tool_call>\n{{"name": "write_file", "arguments": {{"content": "{body}"}}}}\n</tool_call>'
    pieces = [reply[i : i + 5] for i in range(0, len(reply), 5)]
    _, joined, steps, _ = stream_reply("hermes", pieces)
    first_open = next(i for i, step in enumerate(steps) if any("id" in d for d in step))
    assert first_open <= 10  # the head is ~45 characters: 9 pieces
    closing = reply.index("}}") // 5
    sent_before_close = "".join(d["function"]["arguments"] for step in steps[:closing] for d in step)
    assert sent_before_close.startswith('{"content": "') and len(sent_before_close) >= 190
    assert joined[0]["arguments"] == json.dumps({"content": body})


def test_a_call_that_cannot_stream_goes_out_whole_at_the_end():
    """Arguments as a JSON string (Llama writes them so sometimes) or before the name: no delta
    until the reply ends, then the call whole."""
    for reply, fmt in [
        ('{"name": "add", "parameters": "{\\"a\\": 1}"}', "llama3_json"),
        ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>', "hermes"),
    ]:
        _, joined, steps, calls = stream_reply(fmt, list(reply))
        assert all(not step for step in steps[:-1]) and len(steps[-1]) == 1
        assert joined[0]["name"] == "add" and joined[0]["arguments"] == calls[0].arguments


def test_content_that_is_not_a_call_streams_nothing():
    for reply, fmt in [("no calls at all", "hermes"), ('{"answer": 3}', "llama3_json"), ("Hello", "mistral")]:
        content, joined, _, calls = stream_reply(fmt, list(reply))
        assert joined == {} and calls == [] and content == reply

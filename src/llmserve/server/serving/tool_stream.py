"""Tool calls streamed as the model writes them (`/v1/chat/completions` with `stream`), the way
vLLM and OpenAI stream them: a call's first delta carries its index, id and name, the next ones
pieces of its `arguments`, so a client sees a long argument (a file's content) grow instead of
waiting for the whole reply.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
    llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}; {...}
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]
    (gpt-oss's harmony calls stream from `HarmonySplitter`, through `StreamedCalls` below)

`CallStreamer` reads the text a `ToolStreamSplitter` holds back once calls may have started. It
finds each call object where the format puts one (`seek`), and once the object's head reads
`{"name": "<name>", "arguments": ` followed by an object, the call goes out with its name, then
its arguments as they come. A call written otherwise (its arguments first, or as a JSON string)
stops the streaming: it and the calls after it go out whole at the end, in the order written. The argument text is re-written as it streams by `CanonicalJson`:
whitespace and number spellings as `json.dumps(json.loads(text), ensure_ascii=False)` writes
them, so the streamed pieces join to exactly the `arguments` that the same reply gives unstreamed
(`ToolFormat.parse`). At the end (`finish`), each parsed call is matched with the call streamed
for it: what was not yet sent of its arguments goes out, and a call never streamed goes out
whole, with the next index.

What streaming cannot take back: a call whose head and some arguments went out, and whose reply
then does not parse (bad JSON later on, a duplicate key, text after a Llama call that makes the
reply content), stays sent, as in vLLM; and a call cut by `max_tokens` has sent what was written,
where the unstreamed reply drops it (`finish_reason` is then `length`, as OpenAI's stream ends).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

Seek = Callable[[str, int, bool], tuple[Literal["found", "wait", "stop"], int]]
"""A format's call finder: (held text, position, first call?) -> ("found", where the call object's
`{` is), ("wait", position to look from when more text comes) or ("stop", _): no further call
can be streamed (the rest goes out whole at the end)."""

# `{"name": "<name>", "arguments": ` (or Llama's "parameters"), whitespace anywhere JSON allows it
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MAX_HEAD = 512  # a head not read by then (another key first, a very long name) is not streamed


@dataclass(slots=True)
class CallDelta:
    """One `tool_calls` entry of a streamed chunk: a call's opening (id and name) or more of its
    arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CanonicalJson:
    """One JSON value re-written as it arrives, as `json.dumps(json.loads(text),
    ensure_ascii=False)` would write it: no whitespace outside strings, ", " and ": " between
    items, each string's escapes re-made (only `"`, `\\` and control characters escaped), each
    number as Python reads and writes it (`1.50` -> `1.5`, `1e2` -> `100.0`). `feed` returns the
    canonical text it can write so far and how much of its input the value took; `done` once the
    value has ended. ValueError on text that cannot be JSON."""

    _ESCAPES: ClassVar[dict[str, str]] = {
        '"': '"',
        "\\": "\\",
        "/": "/",
        "b": "\b",
        "f": "\f",
        "n": "\n",
        "r": "\r",
        "t": "\t",
    }

    def __init__(self) -> None:
        self.done = False
        self._open: list[str] = []  # the brackets open, innermost last
        self._in_string = False
        self._escape = ""  # an escape sequence being read: "\\", "\\u12", ... ("" outside one)
        self._high = ""  # a high surrogate's \\uXXXX, waiting for its low half
        self._scalar = ""  # a number or literal being read

    def feed(self, text: str) -> tuple[str, int]:
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.done:
                return "".join(out), i
            if self._in_string:
                self._string_char(ch, out)
            else:
                self._outside_char(ch, out)
        return "".join(out), len(text)

    def _outside_char(self, ch: str, out: list[str]) -> None:
        if self._scalar and ch not in "0123456789+-.eEtrufalsn":
            self._end_scalar(out)
            if self.done:
                return
        if ch in " \t\r\n":
            return
        if ch in "{[":
            self._open.append(ch)
            out.append(ch)
        elif ch in "}]":
            if not self._open or self._open.pop() != ("{" if ch == "}" else "["):
                raise ValueError(f"unbalanced JSON: {ch!r}")
            out.append(ch)
            self.done = not self._open
        elif ch == ",":
            out.append(", ")
        elif ch == ":":
            out.append(": ")
        elif ch == '"':
            self._in_string = True
            out.append('"')
        elif ch in "0123456789+-.eEtrufalsn":
            self._scalar += ch
        else:
            raise ValueError(f"not JSON: {ch!r}")

    def _end_scalar(self, out: list[str]) -> None:
        scalar, self._scalar = self._scalar, ""
        out.append(json.dumps(json.loads(scalar)))  # ValueError on a bad number or literal
        self.done = not self._open

    def _string_char(self, ch: str, out: list[str]) -> None:
        if self._escape:
            self._escape += ch
            esc = self._escape
            if esc[1] != "u":
                if esc[1] not in self._ESCAPES:
                    raise ValueError(f"bad escape {esc!r}")
                self._escape = ""
                if self._high:  # a lone high surrogate before this escape
                    self._char(chr(int(self._high[2:], 16)), out)
                    self._high = ""
                self._char(self._ESCAPES[esc[1]], out)
            elif len(esc) == 6:
                self._escape = ""
                self._unicode(esc, out)
            return
        if self._high and ch != "\\":  # a lone high surrogate: json.loads keeps it as it is
            self._char(chr(int(self._high[2:], 16)), out)
            self._high = ""
        if ch == "\\":
            self._escape = ch
        elif ch == '"':
            self._in_string = False
            out.append('"')
        else:
            self._char(ch, out)

    def _unicode(self, esc: str, out: list[str]) -> None:
        code = int(esc[2:], 16)  # ValueError on non-hex digits
        if self._high:
            high, self._high = int(self._high[2:], 16), ""
            if 0xDC00 <= code <= 0xDFFF:
                self._char(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)), out)
                return
            self._char(chr(high), out)
        if 0xD800 <= code <= 0xDBFF:
            self._high = esc
        else:
            self._char(chr(code), out)

    @staticmethod
    def _char(ch: str, out: list[str]) -> None:
        out.append(json.dumps(ch, ensure_ascii=False)[1:-1])


class _ObjectEnd:
    """Where a JSON object that starts at a given `{` ends (strings and nesting followed)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int | None:
        """The index just past the object's closing `}` in `text`, or None if it goes on."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


@dataclass(slots=True)
class _Streamed:
    index: int
    name: str
    sent: str  # the arguments sent so far


class StreamedCalls:
    """The calls a stream has opened and what it sent of each: the deltas to send next, and at
    the end the ones that complete the parsed calls (shared by `CallStreamer` and harmony's)."""

    def __init__(self) -> None:
        self._streamed: list[_Streamed] = []
        self._pending: list[CallDelta] = []
        self.unmatched = 0
        """After `finish`: streamed calls that no parsed call completes (cut by max_tokens, or a
        reply that did not parse after all)."""

    def open(self, name: str) -> None:
        """A call opens (its index, a new id and its name go out)."""
        call = _Streamed(len(self._streamed), name, "")
        self._streamed.append(call)
        self._pending.append(CallDelta(call.index, "", new_call_id(), name))

    def add(self, text: str) -> None:
        """More of the open call's arguments."""
        if text:
            self._streamed[-1].sent += text
            self._pending.append(CallDelta(self._streamed[-1].index, text))

    def take(self) -> list[CallDelta]:
        """The deltas found since the last call."""
        pending, self._pending = self._pending, []
        return pending

    def finish(self, calls: list[Any]) -> list[CallDelta]:
        """The deltas that complete the stream, given the reply's parsed calls (`ToolCall`s):
        the rest of each streamed call's arguments, then each call never streamed, whole."""
        out = self.take()
        next_index = len(self._streamed)
        j = 0
        self.unmatched = len(self._streamed)
        for call in calls:
            match = next(
                (k for k in range(j, len(self._streamed))
                 if self._streamed[k].name == call.name and call.arguments.startswith(self._streamed[k].sent)),
                None,
            )  # fmt: skip
            if match is None:
                out.append(CallDelta(next_index, call.arguments, new_call_id(), call.name))
                next_index += 1
                continue
            streamed, j = self._streamed[match], match + 1
            self.unmatched -= 1
            if len(call.arguments) > len(streamed.sent):
                out.append(CallDelta(streamed.index, call.arguments[len(streamed.sent) :]))
        return out


class CallStreamer:
    """The calls of one streamed reply as deltas, as its held-back text grows (module docstring)."""

    def __init__(self, seek: Seek) -> None:
        self._seek = seek
        self._pos = 0  # in the held text: where scanning goes on
        self._state: Literal["seek", "head", "args", "object", "stopped"] = "seek"
        self._first = True
        self._object_start = 0
        self._args: CanonicalJson | None = None
        self._end: _ObjectEnd | None = None
        self.calls = StreamedCalls()

    def scan(self, held: str) -> None:
        """Read what `held` (the text held back since calls may have started; it only grows)
        adds since the last call."""
        while True:
            state = self._state
            if state == "seek":
                status, at = self._seek(held, self._pos, self._first)
                if status != "found":
                    self._pos = at
                    if status == "stop":
                        self._state = "stopped"
                    return
                self._first = False
                self._object_start = self._pos = at
                self._end = _ObjectEnd()
                self._state = "head"
            elif state == "head":
                if not self._read_head(held):
                    return
            elif state == "args":
                assert self._args is not None
                try:
                    text, used = self._args.feed(held[self._pos :])
                except ValueError:  # not JSON after all: the end's parse decides what it was
                    self._state = "stopped"
                    return
                self._advance(held, used)
                self.calls.add(text)
                if not self._args.done:
                    return
                self._state = "object"
            elif state == "object":
                if not self._to_object_end(held):
                    return
            else:
                return

    def _read_head(self, held: str) -> bool:
        """Read a call object's head; False: wait for more text (or stopped)."""
        head = held[self._object_start :]
        m = _HEAD.match(head)
        if m is None or m.end() >= len(head):
            if len(head) > _MAX_HEAD or (m is None and self._head_failed(head)):
                self._state = "stopped"  # this call and the ones after it go out whole at the end,
                # in the order written
            return False
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            name = None
        if head[m.end()] != "{" or name is None:  # arguments as a JSON string: whole at the end
            self._state = "stopped"
            return False
        self.calls.open(name)
        self._args = CanonicalJson()
        self._advance(held, self._object_start + m.end() - self._pos)
        self._state = "args"
        return True

    @staticmethod
    def _head_failed(head: str) -> bool:
        """Whether `head` can no longer become `{"name": "...", "arguments": `: another key came
        first (a closed string that is not "name", or text after the name that is not the
        arguments' key)."""
        squeezed = "".join(head.split())
        for prefix in ('{"name":"', '{"name":'):
            if prefix.startswith(squeezed) or squeezed.startswith(prefix):
                break
        else:
            return True
        m = re.match(r'\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*(.*)', head, re.DOTALL)
        if m is None:
            return False
        rest = "".join(m.group(1).split())
        return not any(k.startswith(rest) or rest.startswith(k) for k in (',"arguments":', ',"parameters":'))

    def _to_object_end(self, held: str) -> bool:
        """Skip to the end of the current call object; False: wait for more text."""
        assert self._end is not None
        end = self._end.feed(held[self._pos :])
        if end is None:
            self._pos = len(held)
            return False
        self._pos += end
        self._state = "seek"
        return True

    def _advance(self, held: str, n: int) -> None:
        """Move `n` characters on, through the object-end tracker too."""
        assert self._end is not None
        self._end.feed(held[self._pos : self._pos + n])
        self._pos += n

"""gpt-oss's replies in OpenAI's "harmony" format, split into reasoning, content and tool calls, as
vLLM's `openai_gptoss` reasoning parser and `openai` tool-call parser return them.

The chat template's generation prompt ends with `<|start|>assistant`; the reply is one or more
messages, each a header, `<|message|>`, a body and a terminator:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>          -> reasoning
    <|start|>assistant<|channel|>commentary to=functions.get_weather
        <|constrain|>json<|message|>{"city": "Paris"}<|call|>                -> a tool call
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>      -> content

- `analysis` -> reasoning; `final` -> content; `commentary` to `functions.NAME` -> a call of NAME
  (its arguments: the body, as the model wrote it); `commentary` with no recipient (a preamble
  before calls) -> content, as vLLM streams it; a message to another recipient (the built-in
  `browser` / `python` tools, which this server does not run) -> reasoning, never an answer;
- the recipient may stand in the header before the channel (`assistant to=functions.x<|channel|>`,
  as the chat template renders earlier calls) or after it (as the model writes them);
- `<|call|>` and `<|return|>` are gpt-oss's end-of-sequence tokens, so the engine usually leaves
  them out of the text: a body with no terminator ends with the reply;
- several messages of one kind are joined by a newline;
- a reply cut short by max_tokens (`cut`): the unfinished analysis or final body is kept (so a
  reply cut while thinking is reasoning only), an unfinished call or header is dropped;
- a reply with no harmony marker at all is content, as the model wrote it;
- tools not in the request (`calls=False`): a call's body is content.

Why a text parser and not the `openai-harmony` package: its `StreamableParser` reads token ids
of the `o200k_harmony` vocabulary, which `load_harmony_encoding` downloads on first use (this
server runs offline, and GGUF or renamed vocabularies have other ids); the markers are all this
format needs, and they are exact strings in the detokenized text (special tokens kept).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

from llmserve.server.serving.reasoning import ReasoningStreamSplitter
from llmserve.server.serving.tool_stream import CallDelta, StreamedCalls
from llmserve.server.serving.tools import (
    _COMPACT,
    ToolCall,
    ToolFormat,
    ToolStreamSplitter,
    _lark_literal,
    partial_suffix,
)

if TYPE_CHECKING:
    from llmserve.tokenizer import Tokenizer

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
CONSTRAIN = "<|constrain|>"
TERMINATORS = (END, CALL, RETURN)
FUNCTIONS = "functions."

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def uses_channels(chat_template: str | None) -> bool:
    """A harmony template (gpt-oss's): it writes `<|channel|>` headers."""
    return bool(chat_template) and CHANNEL in chat_template  # type: ignore[operator]


def harmony_on(reasoning_parser: str, tool_call_parser: str, chat_template: str | None) -> bool:
    """Whether replies are read as harmony: either parser named so, or both `auto` with a
    template that writes `<|channel|>`."""
    if reasoning_parser == "openai_gptoss" or tool_call_parser == "openai":
        return True
    return reasoning_parser == tool_call_parser == "auto" and uses_channels(chat_template)


def _kind(header: str, calls: bool) -> tuple[str, str]:
    """What a message's body is, read off its header: ("reasoning" | "content" | "call", the
    called function's name or "")."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        name = recipient.group(1)
        if name.startswith(FUNCTIONS):
            return ("call", name[len(FUNCTIONS) :]) if calls else ("content", "")
        return "reasoning", ""  # a built-in tool's call: the model's own business
    channel = _CHANNEL.search(header)
    return ("reasoning" if channel is not None and channel.group(1) == "analysis" else "content"), ""


class HarmonySplitter:
    """Routes a harmony reply's text, as it streams, to reasoning and content; calls are given
    whole by `finish`, and as deltas while they are written (`call_deltas`: a call opens once
    its header is read, then its body goes out as it comes, without the whitespace around it that
    the parsed call strips). The text of the whole reply fed at once splits the same way as fed
    in any pieces: `parse_harmony` is this class fed once."""

    def __init__(self, calls: bool = True) -> None:
        self.calls_on = calls
        self._buf = ""
        self._state = "header"  # header -> body -> between -> header ...
        self._kind, self._name, self._args = "", "", ""
        self._calls: list[ToolCall] = []
        self._wrote = {"reasoning": False, "content": False}
        self._sep = False  # a newline owed before this body's first text (an earlier message of its kind)
        self._seen_marker = False
        self._streamed = StreamedCalls()
        self._args_sent = 0  # characters of the open call's stripped body sent

    def call_deltas(self) -> list[CallDelta]:
        return self._streamed.take()

    def final_call_deltas(self, calls: list[ToolCall]) -> list[CallDelta]:
        return self._streamed.finish(calls)

    @property
    def streamed_unfinished(self) -> bool:
        return self._streamed.unmatched > 0

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) safe to send now."""
        self._buf += text
        out = {"reasoning": "", "content": ""}
        while True:
            if self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    return out["reasoning"], out["content"]
                self._open(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE) :]
            elif self._state == "body":
                ends = [(at, t) for t in TERMINATORS if (at := self._buf.find(t)) >= 0]
                if not ends:
                    keep = max(partial_suffix(self._buf, t) for t in TERMINATORS)
                    self._write(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out["reasoning"], out["content"]
                at, term = min(ends)
                self._write(out, self._buf[:at])
                self._buf = self._buf[at + len(term) :]
                self._close()
            else:  # between messages: `<|start|>` (after optional whitespace) opens the next header
                head = self._buf.lstrip()
                if head.startswith(START):
                    self._buf, self._state = head[len(START) :], "header"
                elif START.startswith(head):
                    return out["reasoning"], out["content"]  # empty, or a piece of the marker
                else:
                    self._state = "header"  # a header without `<|start|>`: read it all the same

    def finish(self, cut: bool = False) -> tuple[str, str, list[ToolCall]]:
        """What is still held back, and the calls. `cut`: max_tokens ended the reply, so what was
        held (a marker's start, an unfinished header or call) is dropped."""
        out = {"reasoning": "", "content": ""}
        held, self._buf = self._buf, ""
        if self._state == "header" and not self._seen_marker and "<|" not in held:
            self._kind, self._sep = "content", False  # no harmony at all: the text as it came
            self._write(out, held)
        elif self._state == "body" and not cut:  # cut: `held` is a terminator's start, or the call goes
            self._write(out, held)
            self._close()  # <|call|> / <|return|> were the end-of-sequence token, left out of the text
        return out["reasoning"], out["content"], self._calls

    def _open(self, header: str) -> None:
        self._seen_marker = True
        self._kind, self._name = _kind(header, self.calls_on)
        self._args, self._state = "", "body"
        self._sep = self._kind != "call" and self._wrote[self._kind]
        if self._kind == "call":
            self._streamed.open(self._name)
            self._args_sent = 0

    def _write(self, out: dict[str, str], text: str) -> None:
        if self._kind == "call":
            self._args += text
            body = self._args.strip()  # what the parsed call holds; trailing space waits for more
            self._streamed.add(body[self._args_sent :])
            self._args_sent = len(body)
            return
        if not text:
            return
        if self._sep:
            text, self._sep = "\n" + text, False
        out[self._kind] += text
        self._wrote[self._kind] = True

    def _close(self) -> None:
        if self._kind == "call":
            self._calls.append(ToolCall(self._name, self._args.strip()))
        self._state = "between"


def parse_harmony(
    text: str, cut: bool = False, calls: bool = True
) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, calls) of a whole reply; None for an empty part."""
    splitter = HarmonySplitter(calls)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content, found = splitter.finish(cut)
    return (reasoning + more_reasoning) or None, (content + more_content) or None, found


class HarmonyFormat(ToolFormat):
    """gpt-oss's calls (`--tool-call-parser openai`): commentary messages to `functions.NAME`.
    The reply's whole text is harmony, so it is always parsed (`HarmonySplitter`), tools or not.

    The forcing grammar writes each marker as the serving vocabulary has it. gpt-oss's markers
    are special tokens, never text under a grammar (`structured_output/ll_tokenizer.py`): a
    quoted `"<|channel|>"` would make the model spell it in pieces `<`, `|`, `channel`, ... that
    it was never trained on, so a special marker is named as the token (Lark `<|channel|>`); a
    vocabulary without it (a tiny test one) gets the quoted text. Either way the reply, decoded
    with special tokens kept, reads the same to the parser. A marker that ends generation
    (gpt-oss's `<|call|>`, one of its EOS ids) stays out of the grammar: llguidance refuses an
    EOS id the grammar names, and allows every EOS id once the grammar is complete, which is
    where the call ends (the parser reads a body without terminator as ending with the reply)."""

    name = "openai"
    keeps_special_tokens = True
    whole_reply = True
    how_to_call = ""

    def __init__(self, special_tokens: Collection[str] = (), end_tokens: Collection[str] = ()) -> None:
        self.special_tokens = frozenset(special_tokens)
        """Markers that are special tokens of the serving vocabulary: named, not quoted."""
        self.end_tokens = frozenset(end_tokens)
        """Markers that are end-of-sequence ids: left to the engine's stop, out of the grammar."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> HarmonyFormat:
        """The format for a serving vocabulary: which of harmony's markers it has as special
        tokens (added and marked special, as `ll_tokenizer` reads them) and which end a reply."""
        added = tokenizer.backend.get_added_tokens_decoder()
        special = {token.content for token in added.values() if token.special}
        ends = {added[i].content for i in tokenizer.eos_token_ids if i in added}
        markers = {START, CHANNEL, MESSAGE, CONSTRAIN, CALL}
        return cls(special & markers, ends & markers)

    def _lark(self, *pieces: str) -> str:
        """A Lark sequence of text and markers: special markers named, the rest quoted."""
        kept = [p for p in pieces if p not in self.end_tokens]
        return " ".join(p if p in self.special_tokens else _lark_literal(p) for p in kept)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = f" ({self._lark(START, 'assistant')} call)*" if parallel else ""
        rules = [f"start: call{repeat}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            fn = tool["function"]
            params = {
                **(fn.get("parameters") or {"type": "object", "properties": {}}),
                "x-guidance": _COMPACT,
            }
            head = self._lark(CHANNEL, f"commentary to={FUNCTIONS}{fn['name']} ", CONSTRAIN, "json", MESSAGE)
            end = self._lark(CALL)
            rules.append(f"call_{i}: {head} %json {json.dumps(params)}" + (f" {end}" if end else ""))
        return "\n".join(rules)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        _, content, found = parse_harmony(text, cut)
        return content, found


HARMONY = HarmonyFormat()


class ReplySplitter(Protocol):
    """A streamed reply split as it comes: (reasoning, content) now, the calls at the end; and
    for a stream, the calls' deltas as they are written (`call_deltas`) and the rest of them once
    the calls are parsed (`final_call_deltas`)."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self, cut: bool = False) -> tuple[str, str, list[ToolCall]]: ...

    def call_deltas(self) -> list[CallDelta]: ...

    def final_call_deltas(self, calls: list[ToolCall]) -> list[CallDelta]: ...

    @property
    def streamed_unfinished(self) -> bool: ...


class _ThinkThenTools:
    """`<think>` split off first (when `opened` is not None), then tool calls held back from the
    content (when `fmt` is given): the two splitters of the other formats, chained."""

    def __init__(self, opened: bool | None, fmt: ToolFormat | None) -> None:
        self.thinker = ReasoningStreamSplitter(opened) if opened is not None else None
        self.tools = ToolStreamSplitter(fmt) if fmt is not None else None

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, text = self.thinker.feed(text) if self.thinker is not None else ("", text)
        return reasoning, self.tools.feed(text) if self.tools is not None else text

    def call_deltas(self) -> list[CallDelta]:
        return self.tools.call_deltas() if self.tools is not None else []

    def final_call_deltas(self, calls: list[ToolCall]) -> list[CallDelta]:
        return self.tools.final_call_deltas(calls) if self.tools is not None else []

    @property
    def streamed_unfinished(self) -> bool:
        return self.tools is not None and self.tools.streamed_unfinished

    def finish(self, cut: bool = False) -> tuple[str, str, list[ToolCall]]:
        reasoning, text = self.thinker.finish() if self.thinker is not None else ("", "")
        if self.tools is None:
            return reasoning, text, []
        text = self.tools.feed(text)
        rest, found = self.tools.finish(cut)
        return reasoning, text + (rest or ""), found


def reply_splitter(harmony: bool, opened: bool | None, fmt: ToolFormat | None) -> ReplySplitter:
    """The splitter of one streamed reply: harmony's (`fmt` given: calls parsed), or `<think>`
    (`opened` not None) and `fmt`'s calls."""
    if harmony:
        return HarmonySplitter(calls=fmt is not None)
    return _ThinkThenTools(opened, fmt)

"""Tool calling on `/v1/chat/completions`, in the formats open models are trained on:

  hermes       <tool_call>                                  Qwen 2.5/3, Hermes, SmolLM3 and
               {"name": "get_weather", "arguments": {...}}  most templates that render tools
               </tool_call>
  llama3_json  {"name": "get_weather", "parameters": {...}} Llama 3.1-3.3: the whole reply is
               (after an optional <|python_tag|>; several   the call
               calls joined by "; ")
  mistral      [TOOL_CALLS][{"name": "get_weather",         Mistral 7B v0.3, Nemo, Small; the
               "arguments": {...}}]                         newer `[TOOL_CALLS]name[ARGS]{...}`
                                                            is parsed too

- `--tool-call-parser auto` (the default) reads the format off the chat template (the markers
  above; hermes when none is found);
- `tools` reach the chat template as its `tools` variable; a template that never mentions tools
  gets them described in a system message instead, with the format's instructions, as llama.cpp
  does;
- `tool_choice`: "none" (tools neither shown nor parsed), "auto" (the model decides; calls are
  parsed out of its text), "required" and a named function: enforced by a grammar in the
  format (its JSON constrained to a call of one of the tools, arguments to that tool's
  parameters schema), so even a tiny model returns a call whose arguments validate;
- `parallel_tool_calls` false: exactly one call under a grammar;
- the reply: `tool_calls` with `finish_reason: "tool_calls"`, the text around them as content.
  Streamed, content goes out as it comes until a call may be starting; from there each call
  streams as it is written (`ToolStreamSplitter.call_deltas`, tool_stream.py), and what could not
  stream goes out whole when the choice ends;
- a reply cut short by `max_tokens` (`cut`): the calls written in full before the cut are
  returned, with `finish_reason: "tool_calls"` (as vLLM reports whenever it parsed calls); the
  unfinished one, or the start of its marker, is dropped, never returned as content. With no
  call finished the reason stays `length`; a stream that sent part of the cut call ends with
  `length` too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import APIError
from llmserve.server.serving.tool_stream import CallDelta, CallStreamer, Seek, new_call_id

SeekStatus = Literal["found", "wait", "stop"]
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "openai")

# JSON inside a grammar comes compact, as for response_format: no free whitespace to loop on
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's `function.arguments`)."""

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": new_call_id(), "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


def _call_from(value: Any) -> ToolCall | None:
    """A decoded JSON value as a call: an object with a string `name` and `arguments` (or
    `parameters`, Llama's key) that is an object or its JSON text."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(value["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def _call_schemas(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call of any of `tools`: {"name": <const>, args_key: <parameters>}."""
    variants = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        variants.append({"type": "object", "additionalProperties": False, "required": ["name", args_key],
                         "properties": {"name": {"const": fn["name"]}, args_key: params}})  # fmt: skip
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": _COMPACT}


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: double quotes, JSON escapes


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (a marker that may
    be starting where the text ends)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


def _skip(text: str, at: int, chars: str) -> int:
    """The first index from `at` whose character is not in `chars` (len(text) if none)."""
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _complete_items(array: str) -> list[Any]:
    """The items of a JSON array cut short (`[{...}, {..`), up to its last complete one."""
    items: list[Any] = []
    at = 1  # after the "["
    while True:
        while at < len(array) and array[at] in " \t\r\n,":
            at += 1
        try:
            value, at = _JSON.raw_decode(array, at)
        except ValueError:
            return items
        items.append(value)


class ToolFormat:
    """How one family of models writes tool calls: the grammar that forces them, the parser that
    reads them back, and where in a reply they may start (for streaming)."""

    name = ""
    marker = ""
    """Text that opens the calls wherever it appears in a reply (content before it streams)."""
    leading: tuple[str, ...] = ()
    """Or: prefixes that open calls only at the very start of a reply (after whitespace)."""
    keeps_special_tokens = False
    """The marker is a special token of the family's tokenizer: detokenize with it kept."""
    whole_reply = False
    """The format structures every reply, tools or not (harmony's channels): its markers are kept
    even when the request has no tools."""
    stream_seek: Seek | None = None
    """Where the next call object starts in a reply's held-back text, for streaming calls as
    they are written (tool_stream.py); None: the calls go out whole when the reply ends."""

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        raise NotImplementedError

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """Calls out of a whole reply, and the content around them (None when empty). Text that
        does not parse as calls stays content, as the model wrote it. `cut`: max_tokens ended the
        reply, so the call it left unfinished (or the start of its marker) is dropped and the
        calls finished before it are kept: call syntax never comes back as content."""
        raise NotImplementedError

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """Tools described for a template that cannot render them itself."""
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        return f"You may call functions to answer. The functions, as JSON:\n{listing}\n{self.how_to_call}"

    how_to_call = ""


class HermesFormat(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    marker = OPEN
    _BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
    how_to_call = (
        "To call one, reply with one block per call and nothing after it:\n"
        f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}'
    )

    def stream_seek(self, held: str, pos: int, first: bool) -> tuple[SeekStatus, int]:
        at = held.find(self.OPEN, pos)
        if at < 0:
            return "wait", max(pos, len(held) - len(self.OPEN) + 1)  # a marker may be starting
        i = _skip(held, at + len(self.OPEN), " \t\r\n")
        if i == len(held):
            return "wait", at
        return ("found", i) if held[i] == "{" else ("wait", i)  # not a call object: the next block

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f'start: call{repeat}\ncall: "{self.OPEN}\\n" body "\\n{self.CLOSE}"\n'
                f"body: %json {json.dumps(_call_schemas(tools, 'arguments'))}")  # fmt: skip

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        last = None
        if cut:
            text, last = self._without_open_block(text)
        calls: list[ToolCall] = []
        kept: list[str] = []
        at = 0
        for m in self._BLOCK.finditer(text):
            try:
                call = _call_from(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                continue
            kept.append(text[at : m.start()])
            at = m.end()
            calls.append(call)
        kept.append(text[at:])
        calls += [last] if last is not None else []
        if not calls:
            return (text or None), []
        return ("".join(kept).strip() or None), calls

    def _without_open_block(self, text: str) -> tuple[str, ToolCall | None]:
        """`text` without the block that max_tokens left open (or a marker it cut), and that
        block's call when its JSON was already whole (only the closing tag was cut)."""
        at = 0
        while (start := text.find(self.OPEN, at)) >= 0:
            end = text.find(self.CLOSE, start)
            if end < 0:
                body = text[start + len(self.OPEN) :].lstrip()
                try:
                    value, stop = _JSON.raw_decode(body)
                except ValueError:
                    return text[:start], None
                whole = self.CLOSE.startswith(body[stop:].strip())  # nothing but the closing tag's start
                return text[:start], _call_from(value) if whole else None
            at = end + len(self.CLOSE)
        return text[: len(text) - partial_suffix(text, self.OPEN)], None


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1+'s JSON tool calls: the reply is one call object (`parameters` holds the
    arguments), or several joined by ";", optionally after `<|python_tag|>`. A reply that starts
    otherwise, or does not parse whole, is content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    leading = (PYTHON_TAG, "{")
    how_to_call = (
        'To call one, reply with nothing but its JSON, several joined by "; ":\n'
        '{"name": <function name>, "parameters": <arguments as a JSON object>}'
    )
    _OPENING = '{"name"'
    """How a call object starts (the grammar writes `name` first): a cut reply's unfinished tail
    that starts so is a call, any other is content (`{"answer": ...` cut short)."""

    def stream_seek(self, held: str, pos: int, first: bool) -> tuple[SeekStatus, int]:
        i = _skip(held, pos, " \t\r\n" if first else " \t\r\n;")
        if first and held.startswith(self.PYTHON_TAG, i):
            i = _skip(held, i + len(self.PYTHON_TAG), " \t\r\n")
        elif first and self.PYTHON_TAG.startswith(held[i:]):
            return "wait", pos  # the tag may be coming (or nothing yet)
        if i == len(held):
            return "wait", pos
        return ("found", i) if held[i] == "{" else ("stop", i)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: %json {json.dumps(_call_schemas(tools, 'parameters'))}"

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        head = text.strip()
        if cut and head and self.PYTHON_TAG.startswith(head):
            return None, []  # the tag itself, cut short
        body = head.removeprefix(self.PYTHON_TAG).lstrip()
        calls: list[ToolCall] = []
        cut_call = cut and head.startswith(self.PYTHON_TAG)  # after the tag, any cut tail is a call
        at = 0
        while at < len(body):
            try:
                value, end = _JSON.raw_decode(body, at)
            except ValueError:
                if cut_call or (cut and self._opens_call(body[at:])):
                    cut_call = True  # the call max_tokens cut short: dropped
                    break
                return (text or None), []
            call = _call_from(value)
            if call is None:
                return (text or None), []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        if not calls and not cut_call:
            return (text or None), []
        return None, calls

    def _opens_call(self, tail: str) -> bool:
        squeezed = "".join(tail.split())[: len(self._OPENING)]  # `{ "name"` opens one too
        return self._OPENING.startswith(squeezed)


class MistralFormat(ToolFormat):
    """Mistral's `[TOOL_CALLS]` (a special token): a JSON array of calls after it (v3 tokenizers:
    Mistral 7B v0.3, Nemo), or `name[ARGS]{...}` per call (v11+: Small 3.1 and later)."""

    name = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    marker = MARKER
    keeps_special_tokens = True
    how_to_call = (
        f"To call functions, reply with {MARKER} and a JSON array of calls, nothing after it:\n"
        f'{MARKER}[{{"name": <function name>, "arguments": <arguments as a JSON object>}}]'
    )

    def stream_seek(self, held: str, pos: int, first: bool) -> tuple[SeekStatus, int]:
        i = pos
        if first:  # [TOOL_CALLS] then the array's "["; v11's name[ARGS]{...} goes out whole
            at = held.find(self.MARKER, pos)
            if at < 0:
                return "wait", pos
            i = _skip(held, at + len(self.MARKER), " \t\r\n")
            if i == len(held):
                return "wait", pos
            if held[i] != "[":
                return "stop", i
            i += 1
        i = _skip(held, i, " \t\r\n,")
        if i == len(held):
            return "wait", pos
        return ("found", i) if held[i] == "{" else ("stop", i)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = ' (", " call)*' if parallel else ""
        return (f'start: {_lark_literal(self.MARKER + "[")} call{repeat} "]"\n'
                f"call: %json {json.dumps(_call_schemas(tools, 'arguments'))}")  # fmt: skip

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        if cut:
            text = text[: len(text) - partial_suffix(text, self.MARKER)]
        at = text.find(self.MARKER)
        if at < 0:
            return (text or None), []
        content = text[:at]
        pieces = text[at:].split(self.MARKER)[1:]
        calls: list[ToolCall] = []
        for i, piece in enumerate(pieces):
            parsed = self._parse_piece(piece.strip(), cut and i == len(pieces) - 1)
            if parsed is None:
                return (text or None), []
            calls.extend(parsed)
        if not calls:  # only a call cut short: it goes, the content before it stays
            return (content or None), []
        return (content.strip() or None), calls

    def _parse_piece(self, piece: str, cut: bool) -> list[ToolCall] | None:
        """The calls after one marker; None when they do not parse. `cut`: the reply ends inside
        this piece, so a call cut short is left out (and [] is all there may be)."""
        if not piece.startswith(("[", "{")):  # name[ARGS]{...}
            name, _, args = piece.partition(self.ARGS)
            args = args.strip()
            try:
                value, end = _JSON.raw_decode(args)
            except ValueError:
                return [] if cut else None
            call = _call_from({"name": name.strip(), "arguments": value})
            return None if call is None or args[end:].strip() else [call]
        try:
            value, end = _JSON.raw_decode(piece)
        except ValueError:
            if not cut:
                return None
            value, end = (_complete_items(piece) if piece.startswith("[") else []), len(piece)
            if not value:
                return []
        if piece[end:].strip():
            return None
        values = value if isinstance(value, list) else [value]
        calls = [_call_from(v) for v in values]
        return None if not calls or None in calls else calls  # type: ignore[return-value]


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}


def detect_tool_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches its model: its markers, else hermes."""
    template = chat_template or ""
    if MistralFormat.MARKER in template or "[AVAILABLE_TOOLS]" in template:
        return FORMATS["mistral"]
    if HermesFormat.OPEN in template:
        return FORMATS["hermes"]
    if Llama3JsonFormat.PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def tool_format(parser: str, chat_template: str | None) -> ToolFormat:
    """`--tool-call-parser`'s format: a name, or `auto` (read off the template)."""
    if parser == "auto":
        return detect_tool_format(chat_template)
    return FORMATS[parser]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's `tools` and `tool_choice` mean for this request."""

    tools: list[dict[str, Any]]
    """OpenAI's tool objects as given (only those the model may call)."""
    choice: str
    """"none", "auto", "required", or "function" (one named function)."""
    constraint: StructuredOutputsParams | None
    """The grammar of `required` and named choices."""
    fmt: ToolFormat

    @property
    def active(self) -> bool:
        return self.choice != "none"


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None, fmt: ToolFormat | None = None
) -> ToolPlan:
    """Validate `tools` / `tool_choice` (400s naming them) and decide what the request does."""
    fmt = fmt or FORMATS["hermes"]
    tools = tools or []
    names = [_check_tool(i, t) for i, t in enumerate(tools)]
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a function; got {tool_choice!r}",
                           param="tool_choice")  # fmt: skip
        if tool_choice != "none" and not tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        choice, chosen = tool_choice, tools
    else:
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
            raise APIError(400, "tool_choice must name a function: {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", param="tool_choice")  # fmt: skip
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools {names}",
                           param="tool_choice")  # fmt: skip
        choice, chosen = "function", [t for t in tools if t["function"]["name"] == name]
    if choice == "none":
        return ToolPlan([], "none", None, fmt)
    constraint = None
    if choice in ("required", "function"):
        constraint = StructuredOutputsParams(grammar=fmt.grammar(chosen, parallel is not False))
    return ToolPlan(chosen, choice, constraint, fmt)


def with_tools(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """`params` for a request with `plan`: the calls' marker kept in the text when it is a special
    token, and the grammar of `required` and named choices as the output constraint."""
    if (plan.active or plan.fmt.whole_reply) and plan.fmt.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    if plan.constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {plan.choice!r} cannot be combined with another output "
                           "constraint (response_format, structured_outputs, guided_*)", param="tool_choice")  # fmt: skip
        params = dataclasses.replace(params, structured_outputs=plan.constraint)
    return params


def _check_tool(i: int, tool: Any) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, _ . -; got {name!r}",
                       param="tools")  # fmt: skip
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return name


def template_mentions_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


class ToolStreamSplitter:
    """Streams a choice's text as content until calls may be starting (the format's marker, or
    one of its leading prefixes at the start of the reply); from there on the text is held back,
    its calls stream as deltas as they are written (`call_deltas`, for a format with a
    `stream_seek`), and `finish` parses it into calls (and any content left over), whose deltas
    not yet sent `final_call_deltas` gives."""

    def __init__(self, fmt: ToolFormat | None = None) -> None:
        self.fmt = fmt or FORMATS["hermes"]
        self._held = ""
        self._in_calls = False
        self._decided = not self.fmt.leading  # leading formats: until the reply's start is known
        seek = self.fmt.stream_seek
        self._streamer = CallStreamer(seek) if seek is not None else None

    def feed(self, text: str) -> str:
        """The part of `text` that is safe to stream as content now."""
        if self._in_calls:
            self._held += text
            self._scan()
            return ""
        buf = self._held + text
        if not self._decided:
            head = buf.lstrip()
            if any(head.startswith(p) for p in self.fmt.leading):
                self._in_calls, self._held = True, buf
                self._scan()
                return ""
            if not head or any(p.startswith(head) for p in self.fmt.leading):
                self._held = buf  # not decided yet
                return ""
            self._decided = True
        if not self.fmt.marker:
            self._held = ""
            return buf
        marker = self.fmt.marker
        at = buf.find(marker)
        if at >= 0:
            self._in_calls, self._held = True, buf[at:]
            self._scan()
            return buf[:at]
        keep = partial_suffix(buf, marker)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def _scan(self) -> None:
        if self._streamer is not None:
            self._streamer.scan(self._held)

    def call_deltas(self) -> list[CallDelta]:
        """The calls' deltas written since the last call (their openings, argument pieces)."""
        return self._streamer.calls.take() if self._streamer is not None else []

    def final_call_deltas(self, calls: list[ToolCall]) -> list[CallDelta]:
        """The deltas that complete the calls once the reply is parsed (`finish`'s calls): what
        was not streamed of them (tool_stream.py)."""
        if self._streamer is None:
            return whole_call_deltas(calls)
        return self._streamer.calls.finish(calls)

    @property
    def streamed_unfinished(self) -> bool:
        """After `final_call_deltas`: a call went out in part and the reply does not complete it
        (max_tokens cut it); the stream then ends with `length`, never `tool_calls`."""
        return self._streamer is not None and self._streamer.calls.unmatched > 0

    def finish(self, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """Content still held back and the calls found in it. `cut`: max_tokens ended the reply
        (see `ToolFormat.parse`: what is held back may be a call or a marker cut short)."""
        held, self._held = self._held, ""
        # held back outside the calls is a marker's (or leading prefix's) start: no calls in it,
        # and parse keeps it as content unless the reply was cut there
        return self.fmt.parse(held, cut)


def whole_call_deltas(calls: list[ToolCall]) -> list[CallDelta]:
    """Each call as one delta (a format that does not stream its calls)."""
    return [CallDelta(i, call.arguments, new_call_id(), call.name) for i, call in enumerate(calls)]


def finish_reason_with_calls(finish_reason: str | None, calls: list[ToolCall]) -> str | None:
    """A choice's finish_reason once its calls are parsed: "tool_calls" when it has calls and ended
    on its own or was cut by max_tokens after them (the unfinished call is dropped: what comes
    back is whole, as vLLM reports "tool_calls" whenever it parsed calls). "abort", and a choice
    without calls, keep the engine's reason."""
    return "tool_calls" if calls and finish_reason in ("stop", "length") else finish_reason

"""Tool calling on `/v1/chat/completions`, in the Hermes format (Qwen 2.5/3, Hermes, SmolLM3 and
most open models' templates):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

  - `tools` reach the chat template as its `tools` variable; a template that never mentions tools
    gets them described in a system message instead (with the format above), as llama.cpp does;
  - `tool_choice`: "none" (tools neither shown nor parsed), "auto" (the model decides; calls are
    parsed out of its text), "required" and a named function: enforced by a grammar (one
    `<tool_call>` block per call, its JSON constrained to `{"name": <a tool>, "arguments": <that
    tool's parameters schema>}`), so even a tiny model returns a call whose arguments validate;
  - `parallel_tool_calls` false: exactly one call under a grammar;
  - the reply: `tool_calls` with `finish_reason: "tool_calls"`, the text around them as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
# JSON inside a grammar comes compact, as for response_format: no free whitespace to loop on
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's `function.arguments`)."""

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's `tools` and `tool_choice` mean for this request."""

    tools: list[dict[str, Any]]
    """OpenAI's tool objects as given (only those the model may call)."""
    choice: str
    """"none", "auto", "required", or "function" (one named function)."""
    constraint: StructuredOutputsParams | None
    """The grammar of `required` and named choices."""

    @property
    def active(self) -> bool:
        return self.choice != "none"


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Validate `tools` / `tool_choice` (400s naming them) and decide what the request does."""
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
        return ToolPlan([], "none", None)
    constraint = None
    if choice in ("required", "function"):
        constraint = StructuredOutputsParams(grammar=_calls_grammar(chosen, parallel is not False))
    return ToolPlan(chosen, choice, constraint)


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


def _calls_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance) for one or more Hermes blocks whose JSON is a call of `tools`."""
    variants = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        variants.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": fn["name"]}, "arguments": params}})  # fmt: skip
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": _COMPACT}
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}'


def template_mentions_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Tools described for a template that cannot render them itself."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You may call functions to answer. The functions, as JSON:\n"
        f"{listing}\n"
        "To call one, reply with one block per call and nothing after it:\n"
        f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}'
    )


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Calls out of a model's text; the rest is content (None when empty). A block whose JSON does
    not parse, or lacks a string name, stays in the content as the model wrote it."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _BLOCK.finditer(text):
        call = _parse_one(m.group(1))
        if call is None:
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def _parse_one(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolStreamSplitter:
    """Streams a choice's text as content until a `<tool_call>` may be starting; from there on
    the text is held back, and `finish` parses it into calls (and any content left over)."""

    def __init__(self) -> None:
        self._held = ""
        self._in_calls = False

    def feed(self, text: str) -> str:
        """The part of `text` that is safe to stream as content now."""
        if self._in_calls:
            self._held += text
            return ""
        buf = self._held + text
        at = buf.find(OPEN)
        if at >= 0:
            self._in_calls, self._held = True, buf[at:]
            return buf[:at]
        keep = next((k for k in range(min(len(OPEN) - 1, len(buf)), 0, -1) if OPEN.startswith(buf[-k:])), 0)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """Content still held back and the calls found in it."""
        held, self._held = self._held, ""
        return parse_tool_calls(held) if self._in_calls else ((held or None), [])

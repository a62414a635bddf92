"""Request schemas of OpenAI's Responses API (`POST /v1/responses`).

Strict at the top level, as OpenAI is: an unknown field, or a known one of the wrong type, is a
400 naming it, so a client learns at once that a feature it relies on is not here. Input items are
checked one by one against `ITEMS` (a registry by `type`), so a bad item names its own path
(`input.1.call_id: Field required`) and an item llmserve does not serve (files, hosted tools'
calls, item references) is refused by name rather than as a failed union. Images
(`input_image` parts with an `image_url`: a data URL, or a path or URL under the server's media
rules) go in user messages, to models that take them.

Accepted and ignored, because they change nothing about the answer here: `metadata` (echoed),
`user`, `safety_identifier`, `prompt_cache_key` (the engine's prefix cache reuses any repeated
prefix by itself), `service_tier`, `truncation` ("disabled": a prompt too long is a 400 anyway),
`include`, `top_logprobs`, `reasoning.summary`, `text.verbosity`, `stream_options`.
`reasoning.effort` switches a thinking template on ("low" and up) or off ("none", "minimal").
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

from llmserve.server.errors import APIError
from llmserve.server.protocol import parse

Number = StrictFloat | StrictInt


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """`input_text` (user, system), `output_text` (assistant: what a response gave)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: StrictStr


class ImagePart(_Strict):
    """`input_image`: the image at `image_url` (`file_id`, the Files API's, is not served)."""

    type: Literal["input_image"]
    image_url: StrictStr | None = None
    file_id: StrictStr | None = None
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted and ignored: the model's preprocessing decides the resolution."""


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[dict[str, Any]]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self, where: str) -> str:
        """The content as text: a string, or its text parts joined (nothing else is served)."""
        if isinstance(self.content, str):
            return self.content
        parts = [_parse_part(p, f"{where}.content.{j}") for j, p in enumerate(self.content)]
        return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in parts)

    def parts(self, where: str) -> list[TextPart | ImagePart] | None:
        """A user message's parts when it holds an image (`text` otherwise): each image with a URL."""
        if isinstance(self.content, str) or self.role != "user":
            return None
        if not any(isinstance(p, dict) and p.get("type") == "input_image" for p in self.content):
            return None
        parts = [_parse_part(p, f"{where}.content.{j}", _USER_PARTS) for j, p in enumerate(self.content)]
        for j, p in enumerate(parts):
            if isinstance(p, ImagePart) and p.image_url is None:
                field = f"{where}.content.{j}.image_url"
                why = "file_id images are not served here; give" if p.file_id is not None else "needs"
                raise APIError(400, f"{field}: {why} an image_url (a data URL, a path or a URL)", param=field)
        return parts  # type: ignore[return-value]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[dict[str, Any]]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self, where: str) -> str:
        if isinstance(self.output, str):
            return self.output
        parts = [_parse_part(p, f"{where}.output.{j}") for j, p in enumerate(self.output)]
        return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in parts)


class ReasoningItem(_Strict):
    """A past response's reasoning: its text goes to the assistant turn after it."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str | None:
        """The reasoning's text: its `reasoning_text` parts (as this server writes them), else its
        summary's; None when it has neither (an encrypted one)."""
        parts = [p.get("text") for p in self.content or [] if p.get("type") == "reasoning_text"]
        parts = parts or [p.get("text") for p in self.summary if p.get("type") == "summary_text"]
        return "".join(t for t in parts if isinstance(t, str)) or None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEMS: dict[str, type[Item]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}  # fmt: skip
_PARTS: dict[str, type[TextPart | RefusalPart]] = {
    "input_text": TextPart, "output_text": TextPart, "refusal": RefusalPart,
}  # fmt: skip


_USER_PARTS: dict[str, type[TextPart | RefusalPart | ImagePart]] = {**_PARTS, "input_image": ImagePart}


def _parse_part(part: Any, where: str, known: dict[str, Any] = _PARTS) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in known:
        why = "only in user messages" if kind == "input_image" else "not supported by this server (text only)"
        raise APIError(400, f"{where}: content parts of type {kind!r} are {why}", param=where)
    return _parse_at(known[kind], part, where)


def _parse_at(model: type[BaseModel], value: Any, where: str) -> Any:
    try:
        return parse(model, value)
    except APIError as e:  # the item's own path in front of the field
        raise APIError(400, f"{where}.{e.message}", param=where) from None


def parse_item(item: Any, where: str) -> Item:
    """One input item at `where` as its schema (an item without `type` is a message, as OpenAI's
    easy input form has it); a type not served is a 400 naming it."""
    if not isinstance(item, dict):
        raise APIError(400, f"{where}: an input item must be an object", param=where)
    kind = item.get("type", "message")
    if kind not in ITEMS:
        raise APIError(400, f"{where}: input items of type {kind!r} are not supported by this server "
                       f"(only {sorted(ITEMS)})", param=where)  # fmt: skip
    return _parse_at(ITEMS[kind], item, where)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: StrictStr
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None
    description: StrictStr | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", value):
            raise ValueError(f"must be 1-64 letters, digits, _ or -; got {value!r}")
        return value

    def as_openai(self) -> dict[str, Any]:
        """The tool as /v1/chat/completions takes it (what templates and tool formats read)."""
        fn: dict[str, Any] = {
            "name": self.name,
            "parameters": self.parameters or {"type": "object", "properties": {}},
        }
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


def _function_tools(value: Any) -> Any:
    """Only function tools are served: a hosted tool (web_search, file_search, ...) is refused by name."""
    for i, tool in enumerate(value if isinstance(value, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"item {i}: tools of type {kind!r} are not supported (only function tools)")
    return value


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    def constraint(self) -> Any:
        """What the answer must be: a JSON schema (dict), "json" (any object), or None (text)."""
        if self.type == "json_schema":
            if self.schema_ is None:
                raise APIError(
                    400, "text.format.schema: required with type 'json_schema'", param="text.format"
                )
            return self.schema_
        return "json" if self.type == "json_object" else None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: StrictStr
    input: StrictStr | list[Any] = Field(default="")
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    stream: StrictBool = False
    # accepted and ignored (see the module's docstring)
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    service_tier: StrictStr | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    stream_options: dict[str, Any] | None = None
    background: StrictBool | None = None
    """Answer at once (`queued`) and run in the background: GET polls it, cancel stops it
    (needs `store`; not streamed)."""

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        return _function_tools(value)

    def items(self) -> list[Item]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)] if self.input else []
        return [parse_item(item, f"input.{i}") for i, item in enumerate(self.input)]

    def text_constraint(self) -> Any:
        return self.text.format.constraint() if self.text and self.text.format else None

    def choice(self) -> Any:
        """tool_choice as /v1/chat/completions takes it."""
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

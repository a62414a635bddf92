"""Request schemas of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`).

Strict as Anthropic is: an unknown field, or a known one of the wrong type, is a 400
`invalid_request_error` naming it (`messages.0.role: Input should be 'user' or 'assistant'`), so
a client learns at once that a feature it relies on is not here. Content blocks are checked one
by one against `BLOCKS` (a registry by `type`), so a bad block names its own path
(`messages.1.content.0.input: ...`) and a type llmserve does not serve (documents, server tools'
blocks) is refused by name rather than as a failed union. Images (base64 or URL sources) go in
user messages, to models that take them.

Accepted and ignored, because they change nothing about the answer here: `metadata`,
`service_tier`, `output_config.effort`, and `cache_control` (top level, on blocks and tools: the
engine's prefix cache reuses any repeated prompt prefix by itself). `thinking` switches the
template's thinking (`enable_thinking`); `budget_tokens` is checked, not enforced.
`output_config.format` constrains the answer to a JSON schema (structured outputs). The 2.x
`anthropic` client no longer sends temperature, top_p or top_k; older clients and `extra_body` do,
and they are honoured.
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
    model_validator,
)

from llmserve.server.errors import APIError
from llmserve.server.protocol import parse

Probability = Annotated[StrictFloat | StrictInt, Field(ge=0, le=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: StrictStr | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[dict[str, Any]] = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None
    toolset_name: StrictStr | None = None

    def text(self, where: str) -> str:
        """The result as text: a string, or its text blocks joined (nothing else is served)."""
        if isinstance(self.content, str):
            return self.content
        texts = [parse_block(b, f"{where}.content.{i}", ("text",)).text for i, b in enumerate(self.content)]
        return "\n".join(texts)


class Base64ImageSource(_Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: StrictStr


class URLImageSource(_Strict):
    type: Literal["url"]
    url: StrictStr


class ImageBlock(_Strict):
    """An image in a user message: base64 data, or a URL under the server's media rules (a
    remote one only with --allow-remote-media; server/media.py)."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    @property
    def url(self) -> str:
        """The image as the URL the chat path loads: base64 data as a data URL."""
        src = self.source
        return f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64ImageSource) else src.url


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: StrictStr


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock,
}  # fmt: skip


def parse_block(block: dict[str, Any], where: str, allowed: tuple[str, ...]) -> Any:
    """One content block at `where` as its schema; a type not in `allowed` is a 400 naming it."""
    kind = block.get("type")
    if not isinstance(kind, str):
        raise APIError(400, f"{where}.type: Field required (a content block's type, a string)", param=where)
    if kind not in allowed:
        served = kind in ("document", "search_result", "container_upload")
        why = "are not supported by this server (text only)" if served else f"are not allowed here {allowed}"
        raise APIError(400, f"{where}: content blocks of type {kind!r} {why}", param=where)
    try:
        return parse(BLOCKS[kind], block)
    except APIError as e:  # the block's own path in front of the field
        raise APIError(400, f"{where}.{e.message}", param=where) from None


def _blocks_or_text(value: Any) -> Any:
    """Content is a string or a list of blocks (objects); the blocks are read by `parse_block`."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(b, dict) for b in value)):
        return value
    raise ValueError("must be a string or a list of content blocks (objects with a `type`)")


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Any

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _blocks_or_text(value)


class Tool(_Strict):
    """A client tool: a name, a description and the JSON schema of its input. Anthropic's server
    tools (`web_search_...`, `bash_...`: a `type` other than "custom") are refused."""

    type: StrictStr | None = None
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    # accepted and ignored: a forced call follows input_schema anyway (a grammar), as `strict` asks
    strict: StrictBool | None = None
    allowed_callers: list[Any] | None = None
    defer_loading: StrictBool | None = None
    eager_input_streaming: StrictBool | None = None
    input_examples: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tools of type {kind!r} (Anthropic's server tools) are not supported; "
                             "only client tools with an input_schema")  # fmt: skip
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", value):
            raise ValueError(f"must be 1-64 letters, digits, _ or -; got {value!r}")
        return value

    def as_openai(self) -> dict[str, Any]:
        """The tool as /v1/chat/completions takes it (what templates and tool formats read)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("`name` is required with type 'tool', and only there")
        return self

    def as_openai(self) -> tuple[Any, bool | None]:
        """(tool_choice, parallel_tool_calls) as /v1/chat/completions takes them."""
        choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(self.type)
        if self.type == "tool":
            choice = {"type": "function", "function": {"name": self.name}}
        return choice, (False if self.disable_parallel_tool_use else None)


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = Field(default=None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: StrictStr | None = None


class CountTokensRequest(_Strict):
    """What makes the prompt: `/v1/messages/count_tokens` takes these alone."""

    model: StrictStr
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Any = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, value: Any) -> Any:
        return value if value is None else _blocks_or_text(value)


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: Probability | None = None
    top_p: Probability | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    output_config: OutputConfig | None = None
    """`format`: a JSON schema the answer follows (structured outputs); `effort`: ignored."""
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None

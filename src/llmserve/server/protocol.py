"""Request schemas of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types are checked here (a string where a number belongs is a 400 naming the field); value ranges
are checked once, by `SamplingParams`, and the server's caps by the serving layer. Unknown fields
are ignored, as vLLM does, so clients that send newer fields keep working. Responses are plain
dicts built by the serving layer in OpenAI's shapes (validated by the tests with the `openai`
client's own types).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from llmserve.server.errors import APIError

# Token ids are strict integers: `true` or `1.5` in a prompt is an error, not token 1.
TokenIds = list[StrictInt]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: the running usage on every chunk


class JsonSchemaFormat(_Request):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` field: exactly one constraint."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: StrictInt = 0
    # llmserve: llama.cpp-style `timings` in the response (None: the server's default)
    return_timings: StrictBool | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    prompt_logprobs: StrictInt | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Request):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted and ignored: the model's preprocessing decides the resolution."""


class ImageURLPart(_Request):
    """An image: a data URL, a local file under --allowed-local-media-path, or (with
    --allow-remote-media) an http(s) URL."""

    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Request):
    url: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    """The video's frames in order, each an image URL as `image_url` takes them (a string, a video
    file, is refused: this server decodes no video files)."""
    fps: Annotated[StrictFloat | StrictInt, Field(gt=0)] | None = None
    """The frames' rate (an llmserve extension; default 2): Qwen2.5-VL times them by it."""


class VideoURLPart(_Request):
    """vLLM's video part (Qwen2-VL, Qwen2.5-VL), its frames given as image URLs."""

    type: Literal["video_url"]
    video_url: VideoURL


class OtherPart(_Request):
    """Any other content part (images, audio, files): recognized, then refused with a clear 400."""

    type: StrictStr

    @field_validator("type")
    @classmethod
    def _not_text(cls, value: str) -> str:
        if value == "text":  # a text part that failed TextPart: its `text` is missing or not a string
            raise ValueError("a text content part needs `text`, a string")
        if value == "image_url":
            raise ValueError("an image_url content part needs `image_url`, an object with a string `url`")
        if value == "video_url":
            raise ValueError(
                "a video_url content part needs `video_url`, an object with `url` (a list of frame URLs) "
                "and an optional `fps` > 0"
            )
        return value


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart | OtherPart, Field(union_mode="left_to_right")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    """An earlier assistant turn's reasoning, as this server returned it (vLLM's field)."""
    reasoning: StrictStr | None = None
    """The same, under vLLM's newer name."""


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's extras for templates
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(_Request):
    """`POST /v1/embeddings`: one input or several, as text or token ids."""

    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: TokenIds


def parse(model: type[BaseModel], body: Any) -> Any:
    """`body` as `model`; a 400 naming the first bad field when it is not one (for routes that read
    their body themselves, to answer in their own API's error shape)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        message = err["msg"].removeprefix("Value error, ")  # a validator's own words
        raise APIError(400, f"{where}: {message}", param=where) from None

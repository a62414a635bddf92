"""What the second chat APIs (Anthropic's Messages, OpenAI's Responses) share once their request
has become the chat request it means: reading the body, their sampling errors in their own field
names, starting the answer on a native model, and gathering a whole (not streamed) answer.

    body          JSON or a 400 (json_body)
    prompt        the chat template's ids, or with images its text and their bytes, each image's
                  errors naming the API's own field (render_prompt)
    sampling      the engine's ValueError -> a 400 naming the API's field (renamed)
    native model  tools folded into the parameters, thinking split unless the request turned the
                  template's thinking off, a bad constraint named by the field it came in:
                  `tools` for a forced call's grammar, else the API's output format (start_chat)
    whole answer  the pieces gathered; an engine failure under the request is a 500 (whole)

Each API keeps what differs: its request -> messages conversion, its tool plan and template
switch, and how pieces become its reply (anthropic_events.py, responses_events.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatMessage
from llmserve.server.serving.chat import image_urls, render_chat, render_chat_text
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.inputs import load_images
from llmserve.server.serving.pieces import Answer, ImageInputs, Piece, gather, start_answer, thinks
from llmserve.server.serving.streaming import engine_error
from llmserve.server.serving.tools import ToolPlan, with_tools


async def json_body(raw: Request) -> Any:
    try:
        return await raw.json()
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def renamed(e: ValueError, fields: dict[str, str]) -> APIError:
    """A 400 for the engine's check `e`, its parameter spelled as the API's field (`fields`:
    engine parameter -> API field; others keep their name)."""
    param = getattr(e, "param", None)
    field = fields.get(param or "", param)
    return APIError(400, f"{field}: {e}" if field else str(e), param=field)


async def render_prompt(ctx: ServingContext, messages: list[ChatMessage], fields: list[str], field: str,
                        **render: Any) -> tuple[list[int] | str, ImageInputs | None]:  # fmt: skip
    """The chat template's token ids (`render` as `render_chat` takes it); a conversation with
    images: the rendered text (the engine expands each image's marker) and the images, loaded
    under the server's media rules. `fields`: the API's field of each image, in order (images of
    a stored conversation before them are named by `field`, as is a model that takes none)."""
    urls = image_urls(messages)
    if not urls:
        return render_chat(ctx, messages, **render), None
    fields = [field] * (len(urls) - len(fields)) + fields
    data = await load_images(ctx, [(f, url) for f, (_, url) in zip(fields, urls, strict=True)], field)
    return render_chat_text(ctx, messages, **render), ImageInputs(data, fields, add_special_tokens=False)


async def start_chat(ctx: ServingContext, prompt: list[int] | str, params: SamplingParams, plan: ToolPlan,
                     prefix: str, template_kwargs: dict[str, Any] | None, format_field: str,
                     images: ImageInputs | None = None, final_only: bool = False) -> Answer:  # fmt: skip
    """Start the rendered chat prompt (`render_prompt`'s) on a native model (request ids `prefix`-...);
    `final_only`: an answer sent whole (`start_answer`)."""
    split = thinks(ctx) and template_kwargs != {"enable_thinking": False}
    try:
        return await start_answer(ctx, prompt, with_tools(params, plan), prefix, split,
                                  plan.fmt if plan.active else None, images=images, final_only=final_only)  # fmt: skip
    except APIError as e:  # a bad constraint: name the field it came in
        if e.param == "structured_outputs":
            field = "tools" if plan.constraint is not None else format_field
            raise APIError(400, f"{field}: {e.message}", param=field) from None
        raise


async def whole(pieces: AsyncIterator[Piece]) -> Piece:
    """The whole answer as one piece; an engine failure under the request is a 500."""
    try:
        return await gather(pieces)
    except APIError:
        raise
    except Exception as e:  # the engine failed under the request
        raise engine_error(e) from None

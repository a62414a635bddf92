"""What the second chat APIs (Anthropic's Messages, OpenAI's Responses) share once their request
has become the chat request it means: reading the body, their sampling errors in their own field
names, starting the answer on a native model, and gathering a whole (not streamed) answer.

    body          JSON or a 400 (json_body)
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
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.pieces import Answer, Piece, gather, start_answer, thinks
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


async def start_chat(ctx: ServingContext, ids: list[int], params: SamplingParams, plan: ToolPlan, prefix: str,
                     template_kwargs: dict[str, Any] | None, format_field: str) -> Answer:  # fmt: skip
    """Start the rendered chat prompt `ids` on a native model (request ids `prefix`-...)."""
    split = thinks(ctx) and template_kwargs != {"enable_thinking": False}
    try:
        return await start_answer(ctx, ids, with_tools(params, plan), prefix, split,
                                  plan.fmt if plan.active else None)  # fmt: skip
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

"""`POST /v1/chat/completions`: messages through the model's chat template -> assistant messages.

Streaming: the first chunk of each choice carries the role, content follows as deltas, each choice
ends with exactly one chunk that has a `finish_reason`, then an optional usage chunk and [DONE].
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
from starlette.requests import Request

from llmserve.outputs import CompletionOutput, PositionLogprobs
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, ChatMessage, ImageURLPart, TextPart, VideoURLPart
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.harmony import parse_harmony, reply_splitter
from llmserve.server.serving.inputs import (
    check_caps,
    load_images,
    load_videos,
    process_prompt,
    sampling_params,
    start_requests,
)
from llmserve.server.serving.outputs import Choice
from llmserve.server.serving.reasoning import prompt_opens_thinking, split_reasoning, uses_think_tags
from llmserve.server.serving.streaming import ChoiceBuilder, respond
from llmserve.server.serving.tool_stream import CallDelta
from llmserve.server.serving.tools import (
    FORMATS,
    ToolFormat,
    ToolPlan,
    finish_reason_with_calls,
    plan_tools,
    template_mentions_tools,
    with_tools,
)


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(the field it came in, its URL) of each image part, in the order the template renders them."""
    return [
        (f"messages[{i}].content[{j}].image_url", part.image_url.url)
        for i, m in enumerate(messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if isinstance(part, ImageURLPart)
    ]


def video_parts(messages: list[ChatMessage]) -> list[tuple[str, VideoURLPart]]:
    """(the field it came in, the part) of each video part, in the order the template renders them."""
    return [
        (f"messages[{i}].content[{j}].video_url", part)
        for i, m in enumerate(messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if isinstance(part, VideoURLPart)
    ]


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The template's view of the messages: text content parts joined, or, in a message with
    images or videos, the parts as HF's multimodal templates take them ({"type":
    "text"|"image"|"video"}); other parts refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, (TextPart, ImageURLPart, VideoURLPart)):
                    raise APIError(
                        400, f"messages[{i}]: content parts of type {part.type!r} are not supported",
                        param="messages",
                    )  # fmt: skip
            if any(isinstance(part, (ImageURLPart, VideoURLPart)) for part in content):
                kinds = {TextPart: "text", ImageURLPart: "image", VideoURLPart: "video"}
                content = [
                    {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": kinds[type(p)]}
                    for p in content
                ]
            else:
                content = "\n".join(p.text for p in content if isinstance(p, TextPart))
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        for key in ("name", "tool_call_id"):
            value = getattr(m, key)
            if value is not None:
                d[key] = value
        if m.tool_calls is not None:
            d["tool_calls"] = [_with_object_arguments(call) for call in m.tool_calls]
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:  # Qwen3's templates read `reasoning_content`, gpt-oss's `thinking`
            d["reasoning_content"] = d["thinking"] = reasoning
        out.append(d)
    return out


def _with_object_arguments(call: Any) -> Any:
    """A tool call as templates read it: OpenAI's `arguments` JSON text decoded to its object (as
    vLLM hands them over; gpt-oss's template writes `arguments|tojson`, which would quote the
    text again). Arguments that are not a JSON object stay as they came."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool = False, extra: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, fmt: ToolFormat | None = None) -> list[int]:  # fmt: skip
    """Chat template -> token ids (see `render_chat_text`); a conversation with images is a 400
    here (the routes that take images render text and pass the images to the engine)."""
    if image_urls(messages) or video_parts(messages):
        raise APIError(400, "this endpoint takes no images or videos", param="messages")
    text = render_chat_text(ctx, messages, add_generation_prompt, continue_final_message, extra, tools, fmt)
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                     continue_final_message: bool = False, extra: dict[str, Any] | None = None,
                     tools: list[dict[str, Any]] | None = None, fmt: ToolFormat | None = None) -> str:  # fmt: skip
    """Chat template -> text; a template that refuses the conversation is a 400. `tools` reach
    the template as its `tools` variable, or a system message in `fmt` where the template has none."""
    ctx.check_generates()
    if continue_final_message and add_generation_prompt:
        raise APIError(
            400, "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )  # fmt: skip
    if continue_final_message and messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message needs an assistant message last", param="messages")
    reserved = sorted({"messages", "add_generation_prompt", "tools"} & set(extra or {}))
    if reserved:  # they would collide with our own arguments (a TypeError, a 500)
        raise APIError(
            400, f"chat_template_kwargs cannot set {reserved}; use the request fields",
            param="chat_template_kwargs",
        )  # fmt: skip
    dicts = messages_to_dicts(messages)
    extra = dict(extra or {})
    if tools and template_mentions_tools(ctx.tokenizer.chat_template):
        extra["tools"] = tools
    elif tools:
        described = (fmt or FORMATS["hermes"]).instructions(tools)
        if dicts and dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{described}"}
        else:
            dicts.insert(0, {"role": "system", "content": described})
    try:
        text = ctx.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **extra)
    except (ValueError, jinja2.TemplateError) as e:
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if continue_final_message and isinstance(dicts[-1]["content"], str):
        # cut the rendering right after the final message's text, so generation continues it
        final = dicts[-1]["content"]
        cut = text.rfind(final)
        if final and cut >= 0:
            text = text[: cut + len(final)]
    return text


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Any:
        ctx = self.ctx
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        check_caps(ctx, req, top, "top_logprobs")
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_format)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{param_name} must be >= 1; got {max_tokens}", param=param_name)
        urls = image_urls(req.messages)
        images = await load_images(ctx, urls, "messages")
        videos = await load_videos(ctx, video_parts(req.messages))
        text = render_chat_text(
            ctx, req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
            plan.tools, plan.fmt,
        )  # fmt: skip
        params = with_tools(
            sampling_params(req, max_tokens, (top or 0) if req.logprobs else None, None), plan
        )
        try:
            prompt = await process_prompt(
                ctx,
                text,
                params,
                req,
                images,
                add_special_tokens=False,
                image_fields=[f for f, _ in urls],
                videos=videos,
                video_fields=[f for f, _ in video_parts(req.messages)],
            )
        except APIError as e:
            if plan.constraint is not None and e.param == "structured_outputs":
                raise APIError(400, f"tools: {e.message}", param="tools") from None  # a bad parameters schema
            raise
        think = self._reasoning(prompt.token_ids)
        streams = start_requests(ctx, [prompt], req.priority, "chat", final_only=not req.stream)
        return await respond(ctx, raw, req, [prompt], streams, _ChatChoices(ctx, req, plan, think))

    def _reasoning(self, prompt_ids: list[int]) -> bool | None:
        """None: no `<think>` split (none, or harmony's channels instead); else whether the prompt
        already opened `<think>`."""
        ctx = self.ctx
        mode = ctx.config.reasoning_parser
        if (
            ctx.harmony
            or mode == "none"
            or (mode == "auto" and not uses_think_tags(ctx.tokenizer.chat_template))
        ):
            return None
        return prompt_opens_thinking(ctx.tokenizer, prompt_ids)


class _ChatChoices(ChoiceBuilder):
    """Assistant messages: `<think>` (or harmony's analysis channel) split off as
    reasoning_content, tool calls parsed out of the text. Streamed, the first chunk of each
    choice carries the role, content follows as deltas."""

    id_prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(
        self, ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, think: bool | None
    ) -> None:
        super().__init__(req.n)
        self.ctx, self.req, self.plan, self.think = ctx, req, plan, think
        self.k = req.top_logprobs or 0
        # streaming only: what each choice holds back (a possible tool call, an unclosed <think>)
        tools = plan.fmt if plan.active else None
        self.splitters = (
            [reply_splitter(ctx.harmony, think, tools) for _ in range(req.n)]
            if ctx.harmony or think is not None or tools is not None
            else None
        )

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs]) -> dict[str, Any]:
        ctx = self.ctx
        content = []
        for token_id, position in zip(token_ids, positions, strict=True):
            s = ctx.token_str(token_id)
            content.append(
                {
                    "token": s,
                    "logprob": position[token_id][0],
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {"token": (t := ctx.token_str(tid)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                        for tid, lp in ctx.top_logprobs(position, self.k)
                    ],
                }
            )
        return {"content": content, "refusal": None}

    def whole(self, choice: Choice) -> dict[str, Any]:
        text: str | None = choice.text
        message: dict[str, Any] = {"role": "assistant"}
        finish_reason = choice.finish_reason
        if self.ctx.harmony:
            reasoning, message["content"], calls = parse_harmony(
                choice.text, cut=finish_reason == "length", calls=self.plan.active
            )
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.to_dict() for call in calls]
            return self._whole(choice, message, finish_reason_with_calls(finish_reason, calls))
        if self.think is not None:
            reasoning, text = split_reasoning(choice.text, opened=self.think)
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        message["content"] = text
        if self.plan.active and text:
            message["content"], calls = self.plan.fmt.parse(text, cut=finish_reason == "length")
            if calls:
                message["tool_calls"] = [call.to_dict() for call in calls]
            finish_reason = finish_reason_with_calls(finish_reason, calls)
        return self._whole(choice, message, finish_reason)

    def _whole(self, choice: Choice, message: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs) if self.req.logprobs else None,
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def opening(self) -> list[dict[str, Any]]:
        # the role goes first, in its own chunk per choice, before any token is computed
        return [_delta(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

    def chunks(self, index: int, c: CompletionOutput) -> list[dict[str, Any]]:
        logprobs = (
            self._logprobs(c.token_ids, c.logprobs or []) if self.req.logprobs and c.token_ids else None
        )
        text, reasoning, finish_reason = c.text, "", c.finish_reason
        deltas: list[CallDelta] = []
        if self.splitters is not None:  # reasoning split off, tool calls streamed as they are written
            splitter = self.splitters[index]
            reasoning, text = splitter.feed(c.text)
            if c.finished:
                more_reasoning, more_text, calls = splitter.finish(cut=c.finish_reason == "length")
                reasoning, text = reasoning + more_reasoning, text + more_text
                deltas = splitter.final_call_deltas(calls)
                if not splitter.streamed_unfinished:  # a call sent in part and cut: `length`
                    finish_reason = finish_reason_with_calls(finish_reason, calls)
            else:
                deltas = splitter.call_deltas()
        if not text and not reasoning and logprobs is None and not c.finished and not deltas:
            return []
        out = []
        if reasoning:
            out.append(_delta(index, {"reasoning_content": reasoning}, logprobs))
            logprobs = None
            if not text and not c.finished and not deltas:
                return out
        if deltas:
            if text or logprobs is not None:
                out.append(_delta(index, {"content": text}, logprobs))
            text, logprobs = "", None
            out.append(_delta(index, {"tool_calls": [d.to_dict() for d in deltas]}))
            if not c.finished:
                return out
        last = _delta(index, {"content": text} if text or not (c.finished or reasoning) else {}, logprobs)
        return [*out, {**last, "finish_reason": finish_reason, "stop_reason": c.stop_reason}]


def _delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

"""`POST /v1/chat/completions`: messages through the model's chat template -> assistant messages.

Streaming: the first chunk of each choice carries the role, content follows as deltas, each choice
ends with exactly one chunk that has a `finish_reason`, then an optional usage chunk and [DONE].
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.outputs import PositionLogprobs
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, ChatMessage, TextPart
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.inputs import check_caps, process_prompt, sampling_params, start_requests
from llmserve.server.serving.outputs import (
    Choice,
    Timings,
    Usage,
    closing_chunk,
    new_id,
    now,
    sse,
    wants_timings,
)
from llmserve.server.serving.reasoning import OPEN as THINK_OPEN
from llmserve.server.serving.reasoning import ReasoningStreamSplitter, split_reasoning, uses_think_tags
from llmserve.server.serving.streaming import engine_error, merged, run_unless_disconnected, sse_with_errors
from llmserve.server.serving.tools import (
    FORMATS,
    ToolFormat,
    ToolPlan,
    ToolStreamSplitter,
    plan_tools,
    template_mentions_tools,
)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The template's view of the messages: text content parts joined, other parts refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, TextPart):
                    raise APIError(
                        400, f"messages[{i}]: content parts of type {part.type!r} are not supported (text only)",
                        param="messages",
                    )  # fmt: skip
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(m, key)
            if value is not None:
                d[key] = value
        out.append(d)
    return out


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool = False, extra: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, fmt: ToolFormat | None = None) -> list[int]:  # fmt: skip
    """Chat template -> token ids; a template that refuses the conversation is a 400. `tools` reach
    the template as its `tools` variable, or a system message in `fmt` where the template has none."""
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
    if continue_final_message:
        # cut the rendering right after the final message's text, so generation continues it
        final = dicts[-1]["content"]
        cut = text.rfind(final)
        if final and cut >= 0:
            text = text[: cut + len(final)]
    return ctx.tokenizer.encode(text, add_special_tokens=False)


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
        ids = render_chat(
            ctx, req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
            plan.tools, plan.fmt,
        )  # fmt: skip
        params = sampling_params(req, max_tokens, (top or 0) if req.logprobs else None, None)
        if plan.active and plan.fmt.keeps_special_tokens:  # the calls' marker is a special token
            params = dataclasses.replace(params, skip_special_tokens=False)
        if plan.constraint is not None:
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice {plan.choice!r} cannot be combined with another output "
                               "constraint (response_format, structured_outputs, guided_*)", param="tool_choice")  # fmt: skip
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
        try:
            prompt = await process_prompt(ctx, ids, params, req)
        except APIError as e:
            if plan.constraint is not None and e.param == "structured_outputs":
                raise APIError(400, f"tools: {e.message}", param="tools") from None  # a bad parameters schema
            raise
        think = self._reasoning(ids)
        streams = start_requests(ctx, [prompt], req.priority, "chat")
        request_id, created = new_id("chatcmpl"), now()
        if req.stream:
            body = sse_with_errors(self._stream(req, prompt, streams, request_id, created, plan, think))
            return StreamingResponse(body, media_type="text/event-stream")
        return await run_unless_disconnected(
            raw, lambda: self._full(req, prompt, streams, request_id, created, plan, think), streams
        )

    def _reasoning(self, prompt_ids: list[int]) -> bool | None:
        """None: replies are left as they are; else whether the prompt already opened `<think>`."""
        ctx = self.ctx
        mode = ctx.config.reasoning_parser
        if mode == "none" or (mode == "auto" and not uses_think_tags(ctx.tokenizer.chat_template)):
            return None
        tail = ctx.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return tail.rstrip().endswith(THINK_OPEN)

    def _logprobs(
        self, token_ids: list[int], positions: list[PositionLogprobs], k: int
    ) -> list[dict[str, Any]]:
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
                        for tid, lp in ctx.top_logprobs(position, k)
                    ],
                }
            )
        return content

    async def _full(
        self,
        req: ChatCompletionRequest,
        prompt: ProcessedPrompt,
        streams: list,
        request_id: str,
        created: int,
        plan: ToolPlan,
        think: bool | None,
    ) -> JSONResponse:
        choices = [Choice(i) for i in range(req.n)]
        usage = Usage(prompt_tokens=len(prompt.token_ids))
        timings = Timings() if wants_timings(self.ctx, req) else None
        try:
            async for _, out in merged(self.ctx, streams, timings):
                usage.cached_tokens = out.num_cached_tokens
                for c in out.outputs:
                    choices[c.index].add(c)
        except APIError:
            raise
        except Exception as e:
            raise engine_error(e) from None
        k = req.top_logprobs or 0
        body = []
        for choice in choices:
            usage.completion_tokens += len(choice.token_ids)
            text: str | None = choice.text
            message: dict[str, Any] = {"role": "assistant"}
            if think is not None:
                reasoning, text = split_reasoning(choice.text, opened=think)
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
            message["content"] = text
            finish_reason = choice.finish_reason
            if plan.active and text:
                content, calls = plan.fmt.parse(text)
                if calls:
                    message["content"] = content
                    message["tool_calls"] = [call.to_dict() for call in calls]
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            body.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": {
                        "content": self._logprobs(choice.token_ids, choice.logprobs, k),
                        "refusal": None,
                    }
                    if req.logprobs
                    else None,
                    "finish_reason": finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            )
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.ctx.model_name,
            "choices": body,
            "usage": usage.as_dict(),
        }
        if timings is not None:
            response["timings"] = timings.as_dict()
        return JSONResponse(response)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        prompt: ProcessedPrompt,
        streams: list,
        request_id: str,
        created: int,
        plan: ToolPlan,
        think: bool | None,
    ) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        usage = Usage(prompt_tokens=len(prompt.token_ids))
        k = req.top_logprobs or 0
        timings = Timings() if wants_timings(self.ctx, req) else None

        def chunk(choice: dict[str, Any]) -> str:
            payload: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.ctx.model_name,
                "choices": [choice],
            }
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        # the role goes first, in its own chunk per choice, before any token is computed
        for i in range(req.n):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})  # fmt: skip
        finished = [False] * req.n
        splitters = [ToolStreamSplitter(plan.fmt) for _ in range(req.n)] if plan.active else None
        thinkers = (
            [ReasoningStreamSplitter(opened=think) for _ in range(req.n)] if think is not None else None
        )
        async for _, out in merged(self.ctx, streams, timings):
            usage.cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                if finished[c.index] or not (c.text or c.token_ids or c.finished):
                    continue
                usage.completion_tokens += len(c.token_ids)
                logprobs = None
                if req.logprobs and c.token_ids:
                    logprobs = {"content": self._logprobs(c.token_ids, c.logprobs or [], k), "refusal": None}
                text, reasoning, finish_reason, calls = c.text, "", c.finish_reason, []
                if thinkers is not None:  # <think>...</think> goes to reasoning_content
                    reasoning, text = thinkers[c.index].feed(c.text)
                    if c.finished:
                        more_reasoning, more_text = thinkers[c.index].finish()
                        reasoning, text = reasoning + more_reasoning, text + more_text
                if splitters is not None:  # tool calls are held back until the choice ends
                    text = splitters[c.index].feed(text)
                    if c.finished:
                        rest, calls = splitters[c.index].finish()
                        text += rest or ""
                        finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
                if not text and not reasoning and logprobs is None and not c.finished:
                    continue
                finished[c.index] = c.finished
                if reasoning:
                    yield chunk({"index": c.index, "delta": {"reasoning_content": reasoning}, "logprobs": logprobs,
                                 "finish_reason": None})  # fmt: skip
                    logprobs = None
                    if not text and not c.finished:
                        continue
                if calls:
                    if text or logprobs is not None:
                        yield chunk({"index": c.index, "delta": {"content": text}, "logprobs": logprobs,
                                     "finish_reason": None})  # fmt: skip
                    text, logprobs = "", None
                    yield chunk({"index": c.index, "delta": {"tool_calls": [call.to_dict(i) for i, call in enumerate(calls)]},
                                 "logprobs": None, "finish_reason": None})  # fmt: skip
                yield chunk(
                    {
                        "index": c.index,
                        "delta": {"content": text} if text or not (c.finished or reasoning) else {},
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        last = closing_chunk(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.ctx.model_name,
            },
            usage if include_usage else None,
            timings,
        )
        if last is not None:
            yield last

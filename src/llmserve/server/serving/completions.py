"""`POST /v1/completions`: prompts (a string, strings, token ids, lists of token ids) -> choices.

Choice `i * n + j` is sample j of prompt i. `echo` prepends the prompt to the text and, with
`logprobs`, the prompt tokens' logprobs (the first is null: nothing precedes it). `max_tokens: 0`
with `echo` scores a prompt without generating (one token is computed and dropped).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.outputs import PositionLogprobs
from llmserve.server.errors import APIError
from llmserve.server.protocol import CompletionRequest
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
from llmserve.server.serving.streaming import engine_error, merged, run_unless_disconnected, sse_with_errors


class _LogprobsBuilder:
    """OpenAI's legacy logprobs object for one choice: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, ctx: ServingContext, k: int, text_offset: int = 0) -> None:
        self.ctx, self.k = ctx, k
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_ids: list[int], positions: list[PositionLogprobs | None]) -> None:
        ctx = self.ctx
        for token_id, position in zip(token_ids, positions, strict=True):
            s = ctx.token_str(token_id)
            self.tokens.append(s)
            self.text_offset.append(self.offset)
            self.offset += len(s)
            if position is None:
                self.token_logprobs.append(None)
                self.top.append(None)
                continue
            self.token_logprobs.append(position[token_id][0])
            top = {ctx.token_str(t): lp for t, lp in ctx.top_logprobs(position, self.k)}
            top.setdefault(s, position[token_id][0])  # the chosen token is always listed
            self.top.append(top)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.text_offset,
        }

    def take(self) -> dict[str, Any]:
        """What was added since the last take (streaming)."""
        out = self.as_dict()
        self.tokens, self.token_logprobs, self.top, self.text_offset = [], [], [], []
        return out


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw: Request) -> Any:
        ctx = self.ctx
        prompts = self._prompt_list(req)
        check_caps(ctx, req, req.logprobs, "logprobs")
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(
                400, f"best_of must equal n ({req.n}) when given; got {req.best_of}", param="best_of"
            )
        if req.max_tokens is not None and req.max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0; got {req.max_tokens}", param="max_tokens")
        score_only = req.max_tokens == 0
        if score_only and not req.echo:
            raise APIError(
                400, "max_tokens 0 is only allowed with echo (scoring a prompt)", param="max_tokens"
            )
        want_prompt_lp = req.logprobs if req.echo and req.logprobs is not None else req.prompt_logprobs
        params = sampling_params(req, 1 if score_only else req.max_tokens, req.logprobs, want_prompt_lp)
        processed = [await process_prompt(ctx, p, params, req) for p in prompts]
        streams = start_requests(ctx, processed, req.priority, "cmpl")
        request_id, created = new_id("cmpl"), now()
        if req.stream:
            body = sse_with_errors(self._stream(req, processed, streams, request_id, created, score_only))
            return StreamingResponse(body, media_type="text/event-stream")
        return await run_unless_disconnected(
            raw, lambda: self._full(req, processed, streams, request_id, created, score_only), streams
        )

    def _prompt_list(self, req: CompletionRequest) -> list[str | list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]  # type: ignore[list-item]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if len(prompts) > self.ctx.config.max_prompts:
            raise APIError(
                400, f"prompt has {len(prompts)} entries; at most {self.ctx.config.max_prompts} are allowed",
                param="prompt",
            )  # fmt: skip
        return prompts

    def _echo_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    async def _full(
        self,
        req: CompletionRequest,
        prompts: list[ProcessedPrompt],
        streams: list,
        request_id: str,
        created: int,
        score_only: bool,
    ) -> JSONResponse:
        ctx, n = self.ctx, req.n
        choices = [Choice(i) for i in range(len(prompts) * n)]
        prompt_lps: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        cached = [0] * len(prompts)
        timings = Timings() if wants_timings(ctx, req) else None
        try:
            async for i, out in merged(ctx, streams, timings):
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    choices[i * n + c.index].add(c)
        except APIError:
            raise
        except Exception as e:
            raise engine_error(e) from None
        usage.cached_tokens = sum(cached)
        body_choices = []
        for choice in choices:
            prompt = prompts[choice.index // n]
            if score_only:
                choice.text, choice.token_ids, choice.logprobs = "", [], []
                choice.finish_reason, choice.stop_reason = "length", None
            usage.completion_tokens += len(choice.token_ids)
            echo = self._echo_text(prompt) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                builder = _LogprobsBuilder(ctx, req.logprobs)
                if req.echo:
                    builder.add(
                        prompt.token_ids, prompt_lps[choice.index // n] or [None] * len(prompt.token_ids)
                    )
                    builder.offset = len(echo)
                builder.add(choice.token_ids, choice.logprobs)
                logprobs = builder.as_dict()
            body = {
                "index": choice.index,
                "text": echo + choice.text,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if req.prompt_logprobs is not None and not req.echo:
                # vLLM's field: per prompt token, None first, then {token id: logprob, rank, text}
                body["prompt_logprobs"] = [
                    None if pos is None else {
                        str(t): {"logprob": lp, "rank": rank, "decoded_token": ctx.token_str(t)}
                        for t, (lp, rank) in pos.items()
                    }
                    for pos in prompt_lps[choice.index // n] or []
                ]  # fmt: skip
            body_choices.append(body)
        response = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": body_choices,
            "usage": usage.as_dict(),
        }
        if timings is not None:
            response["timings"] = timings.as_dict()
        return JSONResponse(response)

    async def _stream(
        self,
        req: CompletionRequest,
        prompts: list[ProcessedPrompt],
        streams: list,
        request_id: str,
        created: int,
        score_only: bool,
    ) -> AsyncIterator[str]:
        ctx, n = self.ctx, req.n
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        cached = [0] * len(prompts)
        builders = [
            _LogprobsBuilder(ctx, req.logprobs) if req.logprobs is not None else None
            for _ in range(len(prompts) * n)
        ]
        echoed = [not req.echo] * (len(prompts) * n)
        finished = [False] * (len(prompts) * n)
        prompt_lps: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        timings = Timings() if wants_timings(ctx, req) else None

        def chunk(index: int, text: str, logprobs: dict | None, finish: str | None, stop: Any) -> str:
            payload: dict[str, Any] = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": ctx.model_name,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": stop,
                    }
                ],
            }
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        async for i, out in merged(ctx, streams, timings):
            cached[i] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                index = i * n + c.index
                if finished[index] or not (c.token_ids or c.finished):
                    continue  # done, or still in its prompt
                builder = builders[index]
                text = ""
                if not echoed[index]:
                    echoed[index] = True
                    text = self._echo_text(prompts[i])
                    if builder is not None:
                        builder.add(prompts[i].token_ids, prompt_lps[i] or [None] * len(prompts[i].token_ids))
                if score_only:
                    token_ids, positions, piece = [], [], ""
                    finish, stop = ("length", None) if c.finished else (None, None)
                else:
                    token_ids, positions, piece = c.token_ids, c.logprobs or [], c.text
                    finish, stop = c.finish_reason, c.stop_reason
                usage.completion_tokens += len(token_ids)
                text += piece
                if builder is not None and token_ids:
                    builder.add(token_ids, positions)
                elif not text and finish is None:
                    continue  # nothing to show yet (text held back for a possible stop string)
                finished[index] = finish is not None
                yield chunk(index, text, builder.take() if builder is not None else None, finish, stop)
        usage.cached_tokens = sum(cached)
        last = closing_chunk(
            {"id": request_id, "object": "text_completion", "created": created, "model": ctx.model_name},
            usage if include_usage else None,
            timings,
        )
        if last is not None:
            yield last

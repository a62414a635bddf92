"""`POST /v1/completions`: prompts (a string, strings, token ids, lists of token ids) -> choices.

Choice `i * n + j` is sample j of prompt i. `echo` prepends the prompt to the text and, with
`logprobs`, the prompt tokens' logprobs (the first is null: nothing precedes it). `max_tokens: 0`
with `echo` scores a prompt without generating (one token is computed and dropped).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from llmserve.server.errors import APIError
from llmserve.server.protocol import CompletionRequest
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.inputs import check_caps, process_prompt, sampling_params, start_requests
from llmserve.server.serving.outputs import Choice
from llmserve.server.serving.streaming import ChoiceBuilder, respond


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
        streams = start_requests(ctx, processed, req.priority, "cmpl", final_only=not req.stream)
        return await respond(
            ctx, raw, req, processed, streams, _CompletionChoices(ctx, req, processed, score_only)
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


class _CompletionChoices(ChoiceBuilder):
    """Text choices: the prompt echoed in front when asked, OpenAI's legacy logprobs, and vLLM's
    `prompt_logprobs`. Scoring (`max_tokens: 0`) drops the one token computed."""

    id_prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(
        self, ctx: ServingContext, req: CompletionRequest, prompts: list[ProcessedPrompt], score_only: bool
    ) -> None:
        super().__init__(req.n)
        self.ctx, self.req, self.prompts, self.score_only = ctx, req, prompts, score_only
        self.prompt_lps: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        # streaming only: each choice's logprobs since its last chunk, and whether its echo went out
        num_choices = len(prompts) * req.n
        self.builders = [
            _LogprobsBuilder(ctx, req.logprobs) if req.logprobs is not None else None
            for _ in range(num_choices)
        ]
        self.echoed = [not req.echo] * num_choices

    def see(self, prompt_index: int, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_lps[prompt_index] = out.prompt_logprobs

    def delta(self, c: CompletionOutput) -> CompletionOutput:
        if not self.score_only:
            return c
        return CompletionOutput(c.index, "", [], finish_reason="length" if c.finished else None)

    def _echo_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _prompt_positions(self, i: int) -> list[PositionLogprobs | None]:
        return self.prompt_lps[i] or [None] * len(self.prompts[i].token_ids)

    def whole(self, choice: Choice) -> dict[str, Any]:
        ctx, req, i = self.ctx, self.req, choice.index // self.n
        prompt = self.prompts[i]
        echo = self._echo_text(prompt) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            builder = _LogprobsBuilder(ctx, req.logprobs)
            if req.echo:
                builder.add(prompt.token_ids, self._prompt_positions(i))
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
                for pos in self.prompt_lps[i] or []
            ]  # fmt: skip
        return body

    def chunks(self, index: int, c: CompletionOutput) -> list[dict[str, Any]]:
        i, builder = index // self.n, self.builders[index]
        text = ""
        if not self.echoed[index]:
            self.echoed[index] = True
            text = self._echo_text(self.prompts[i])
            if builder is not None:
                builder.add(self.prompts[i].token_ids, self._prompt_positions(i))
        text += c.text
        if builder is not None and c.token_ids:
            builder.add(c.token_ids, c.logprobs or [])
        elif not text and not c.finished:
            return []  # nothing to show yet (text held back for a possible stop string)
        logprobs = builder.take() if builder is not None else None
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason}]  # fmt: skip

"""`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`: the model's tokenizer over HTTP, in
vLLM's shapes, so remote clients (lm-eval's remote tokenizer) count and split tokens exactly as the
server does."""

from __future__ import annotations

from typing import Any

from llmserve.server.errors import APIError
from llmserve.server.protocol import DetokenizeRequest, TokenizeRequest
from llmserve.server.serving.chat import render_chat
from llmserve.server.serving.context import ServingContext


class TokenServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        ctx = self.ctx
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            ids = render_chat(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = ctx.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": ctx.max_model_len,
            "tokens": ids,
            "token_strs": [ctx.token_str(i) for i in ids] if req.return_token_strs else None,
        }

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        ctx = self.ctx
        vocab = ctx.engine.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"token id(s) {bad[:5]} outside the vocabulary (size {vocab})", param="tokens"
            )
        return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def info(self) -> dict[str, Any]:
        tok = self.ctx.tokenizer

        def text(i: int | None) -> str | None:
            return None if i is None else tok.id_to_token(i)

        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": self.ctx.max_model_len,
            "vocab_size": tok.vocab_size,
            "bos_token": text(tok.bos_token_id),
            "eos_token": text(tok.eos_token_id),
            "pad_token": text(tok.pad_token_id),
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "add_bos_token": tok.add_bos_token,
            "chat_template": tok.chat_template,
        }

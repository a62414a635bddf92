"""`ServingContext`: one loaded model's engine, the server's settings, and token strings for
logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from llmserve.config import ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.lora import LoRARequest
from llmserve.outputs import PositionLogprobs
from llmserve.server.errors import APIError
from llmserve.server.serving.harmony import HarmonyFormat, harmony_on
from llmserve.server.serving.tools import ToolFormat, tool_format


@dataclass
class ServingContext:
    """The engine behind the server and the server's own settings."""

    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    _token_strs: dict[int, str] = field(default_factory=dict)
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request's `model` named (then `model_name` is the adapter's name)."""

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def model_impl(self) -> str:
        """Whose modelling code runs the model: "native" or "transformers"."""
        return self.engine.engine.loaded.model_impl

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_generates(self) -> None:
        """A 400 naming the model when it serves embeddings only (an encoder such as BERT, a decoder
        saved without its LM head): every generation path (completions, chat and the second APIs'
        chat requests) asks here first."""
        engine = self.engine.engine
        if engine.embedding_only:
            raise APIError(400, engine.embedding_only_message(), param="model")

    @cached_property
    def harmony(self) -> bool:
        """Whether this model's replies are gpt-oss's harmony (`harmony_on`), decided once."""
        return harmony_on(
            self.config.reasoning_parser, self.config.tool_call_parser, self.tokenizer.chat_template
        )

    @cached_property
    def tool_format(self) -> ToolFormat:
        """How tool calls are written for this model: `--tool-call-parser`, or read off the chat
        template once (`auto`); harmony's markers as this vocabulary has them."""
        if self.harmony:
            return HarmonyFormat.for_tokenizer(self.tokenizer)
        return tool_format(self.config.tool_call_parser, self.tokenizer.chat_template)

    def token_str(self, token_id: int) -> str:
        """A token's own text, as logprobs show it (special tokens spelled out)."""
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def top_logprobs(self, position: PositionLogprobs, k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of a position, most likely first."""
        ranked = sorted((rank, tid, lp) for tid, (lp, rank) in position.items() if rank <= k)
        return [(tid, lp) for _, tid, lp in ranked[:k]]

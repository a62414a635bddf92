"""The routing key of a request: the hash of its prompt's first KV blocks.

Two requests can share cached KV blocks on a replica only if their prompts agree token for token
from the start (core/kv_cache/block_hash.py), so the key is the engine's own chained block hash of
the first `num_blocks` full blocks of the prompt's token ids:

    prompt ids [t0 ... t(B-1)] [tB ... t(2B-1)] ... -> h0 -> h1 -> ... -> h(num_blocks-1) = the key

The ingress tokenizes with the model's tokenizer (a chat request rendered with its chat template
first), so the key is exactly the hash the replica's prefix cache will look up. A prompt shorter
than the blocks hashes what full blocks it has; one shorter than a block has no key (nothing to
share: it is routed by load alone). Only the prompt's head is encoded, and a head's key is kept
(an LRU of `HEAD_CACHE_SIZE`): encoding is most of a long prompt's key (about 110 us for the
1 KB head of the embedded model's defaults), and a shared prefix longer than the head is encoded
once. The direct front's router keys the raw body (`body_key`) without the request's pydantic
model where the prompt is plain (docs/benchmarks.md, "The direct front's router").

`rendezvous_order` maps a key onto the live replicas (highest random weight hashing): every
ingress replica computes the same home for a key without sharing state, and when a replica joins
or leaves only the keys whose home it is move.

Knows tokenizers and block hashes; nothing of Ray.
"""

from __future__ import annotations

import functools
import hashlib
import json
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from llmserve.core.kv_cache.block_hash import BlockHash, hash_block_tokens
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from llmserve.server.serving.chat import messages_to_dicts
from llmserve.tokenizer import Tokenizer

ROLES = frozenset(typing.get_args(ChatMessage.model_fields["role"].annotation))
"""`ChatMessage.role`'s values: a plain message with one of them is keyed without pydantic."""
CHARS_PER_TOKEN_BOUND = 16
"""How many characters of the prompt's head are encoded per token needed: generous (English
averages about 4 characters a token), so the head always yields the blocks it has."""
HEAD_CACHE_SIZE = 4096
"""Prompt heads whose key is kept (about 1 KB of text each with the defaults): a prefix shared by
many requests, longer than the head, is encoded once (encoding is most of a long prompt's key)."""


class PrefixKeyer:
    """Routing keys from validated requests (the ingress) or raw bodies (the direct front's
    router), with the served model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, block_size: int, num_blocks: int) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size ({block_size}) and num_blocks ({num_blocks}) must be >= 1")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.num_blocks = num_blocks
        # (head, add_special_tokens) -> key; per keyer: the key depends on its tokenizer and blocks
        self._head_key = functools.lru_cache(maxsize=HEAD_CACHE_SIZE)(self._encoded_key)

    @property
    def num_tokens(self) -> int:
        """How many of the prompt's tokens the key covers at most."""
        return self.block_size * self.num_blocks

    def body_key(self, body: bytes) -> BlockHash | None:
        """The key of a request's raw JSON body, as `completion_key`/`chat_key` give it for the
        validated request, without building the request's pydantic model (the direct front's
        router keys every POST: a model costs more than a short prompt's key). None: not JSON, no
        prompt or messages, or a prompt of the wrong type (routed by load; the replica refuses
        what is invalid). Only the prompt is checked: a body invalid elsewhere still gets its
        prompt's key, which routes it where a valid one would go before the replica refuses it.

        Fast paths: `prompt` as text, token ids or a batch of either (checked as the schema's
        strict types would), and `messages` of plain {"role", "content": text} objects; any other
        message (content parts, tool calls, names) goes through `ChatCompletionRequest`, which
        renders it exactly as the replica will."""
        try:
            data = json.loads(body)
        except ValueError:  # not JSON, or not UTF-8 (a body HAProxy cut mid-character)
            return None
        if not isinstance(data, dict):
            return None
        if "messages" in data:
            return self._messages_key(data)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            # a batch: the first prompt's replica serves them all (`completion_key`)
            if not all(type(p) is type(prompt[0]) for p in prompt):
                return None
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.text_key(prompt)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):  # StrictInt: no bools
            return self.ids_key(prompt)
        return None

    def _messages_key(self, data: dict[str, Any]) -> BlockHash | None:
        messages = data["messages"]
        add_generation_prompt = data.get("add_generation_prompt", True)
        plain = (
            isinstance(messages, list)
            and isinstance(add_generation_prompt, bool)
            and all(
                type(m) is dict and m.keys() == {"role", "content"}
                and m["role"] in ROLES and isinstance(m["content"], str)
                for m in messages
            )
        )  # fmt: skip
        if not plain:  # the schema's model renders the rest as the replica's chat route does
            try:
                return self.chat_key(ChatCompletionRequest.model_validate(data))
            except ValidationError:
                return None
        return self._rendered_key(messages, add_generation_prompt)

    def completion_key(self, req: CompletionRequest) -> BlockHash | None:
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: the first one's replica serves them all
        if isinstance(prompt, str):
            return self.text_key(prompt)
        return self.ids_key(prompt)

    def chat_key(self, req: ChatCompletionRequest) -> BlockHash | None:
        """The key of the rendered conversation; None when the template cannot render it (the
        replica answers that request's error itself)."""
        try:
            messages = messages_to_dicts(req.messages)
        except APIError:  # a content part the chat route refuses
            return None
        return self._rendered_key(messages, req.add_generation_prompt)

    def _rendered_key(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> BlockHash | None:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except Exception:  # any template failure is the replica's to report
            return None
        return self.text_key(text, add_special_tokens=False)

    def text_key(self, text: str, add_special_tokens: bool = True) -> BlockHash | None:
        return self._head_key(text[: self.num_tokens * CHARS_PER_TOKEN_BOUND], add_special_tokens)

    def _encoded_key(self, head: str, add_special_tokens: bool) -> BlockHash | None:
        return self.ids_key(self.tokenizer.encode(head, add_special_tokens=add_special_tokens))

    def ids_key(self, token_ids: Sequence[int]) -> BlockHash | None:
        num_full = min(len(token_ids) // self.block_size, self.num_blocks)
        key: BlockHash | None = None
        for i in range(num_full):
            key = hash_block_tokens(key, token_ids[i * self.block_size : (i + 1) * self.block_size])
        return key


def rendezvous_order(key: BlockHash, replica_ids: Sequence[str]) -> list[str]:
    """`replica_ids` by decreasing weight for `key`; the first is the key's home."""

    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{key}:{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)

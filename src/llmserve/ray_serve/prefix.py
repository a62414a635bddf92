"""The routing key of a request: the hash of its prompt's first KV blocks.

Two requests can share cached KV blocks on a replica only if their prompts agree token for token
from the start (core/kv_cache/block_hash.py), so the key is the engine's own chained block hash of
the first `num_blocks` full blocks of the prompt's token ids:

    prompt ids [t0 ... t(B-1)] [tB ... t(2B-1)] ... -> h0 -> h1 -> ... -> h(num_blocks-1) = the key

The ingress tokenizes with the model's tokenizer (a chat request rendered with its chat template
first), so the key is exactly the hash the replica's prefix cache will look up. A prompt shorter
than the blocks hashes what full blocks it has; one shorter than a block has no key (nothing to
share: it is routed by load alone). Tokenizing costs the ingress a few tens of microseconds for the
few hundred characters it needs: only the prompt's head is encoded.

`rendezvous_order` maps a key onto the live replicas (highest random weight hashing): every
ingress replica computes the same home for a key without sharing state, and when a replica joins
or leaves only the keys whose home it is move.

Knows tokenizers and block hashes; nothing of Ray.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from llmserve.core.kv_cache.block_hash import BlockHash, hash_block_tokens
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.server.serving.chat import messages_to_dicts
from llmserve.tokenizer import Tokenizer

CHARS_PER_TOKEN_BOUND = 16
"""How many characters of the prompt's head are encoded per token needed: generous (English
averages about 4 characters a token), so the head always yields the blocks it has."""


class PrefixKeyer:
    """Routing keys from validated requests, with the served model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, block_size: int, num_blocks: int) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size ({block_size}) and num_blocks ({num_blocks}) must be >= 1")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def num_tokens(self) -> int:
        """How many of the prompt's tokens the key covers at most."""
        return self.block_size * self.num_blocks

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
            text = self.tokenizer.apply_chat_template(
                messages_to_dicts(req.messages), add_generation_prompt=req.add_generation_prompt
            )
        except Exception:  # any template failure is the replica's to report
            return None
        return self.text_key(text, add_special_tokens=False)

    def text_key(self, text: str, add_special_tokens: bool = True) -> BlockHash | None:
        head = text[: self.num_tokens * CHARS_PER_TOKEN_BOUND]
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

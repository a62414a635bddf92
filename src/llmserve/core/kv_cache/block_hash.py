"""Block hashes for prefix caching: the identity of a full block of tokens *and everything before it*.

A block's K/V depend on every earlier token, so its hash chains in its parent's hash:

    h0 = H(None, tokens[0:B])    h1 = H(h0, tokens[B:2B])    h2 = H(h1, tokens[2B:3B])  ...

Two requests share block i only if they agree on all tokens [0, (i+1)*B) (and on `extra_keys`,
e.g. a LoRA adapter). Only full blocks are hashed: a partial block is still being written.

The hash is sha256 of an explicit little-endian encoding, truncated to 64 bits, so it is the same in
every process and on every machine (Python's `hash()` is salted per process). 64 bits make a
collision negligible for any realistic number of cached blocks (birthday bound ~2^32 blocks).

This module knows token ids and block sizes only; which blocks hold which hash is `BlockPool`'s job.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from llmserve.core.multimodal import block_extra_keys
from llmserve.core.request import Request

BlockHash = int

_NO_PARENT = b"\x00" + bytes(8)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Chained hash of one block: parent hash (None for the first block), its tokens, extra keys.

    `extra_keys` must have a stable `repr` (ints, strings, tuples of them), since that is what is
    hashed; it tells apart blocks whose K/V differ for the same tokens (adapters, media inputs).
    """
    # Layout: [has-parent flag][parent u64][num tokens u32][tokens i64 ...][repr(extra_keys)].
    # The length prefix keeps the token part and the extra-key part from running into each other.
    head = _NO_PARENT if parent is None else b"\x01" + struct.pack("<Q", parent)
    body = struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)
    h = hashlib.sha256(head + body)
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[:8], "little")


def request_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens (prompt + output).

    Incremental: only blocks completed since the last call are hashed, so a decoding request pays for
    one hash every `block_size` tokens. Tokens are only ever appended, so old hashes stay valid (also
    across a preemption, which keeps the outputs). Returns `request.block_hashes` itself.
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    parent = hashes[-1] if hashes else None
    # An adapter changes every layer's K/V: its id joins each block's identity (the chain alone
    # would carry it from the first block; every block keeps it so no block is ever ambiguous).
    extra = (("lora", request.lora_id),) if request.lora_id else ()
    for i in range(len(hashes), num_full_blocks):
        start, end = i * block_size, (i + 1) * block_size
        tokens = _token_slice(request, start, end)
        # An image's placeholder ids say nothing of the image: its hash joins every block that
        # holds its tokens (and, through the chain, every block after).
        keys = extra + block_extra_keys(request.mm_inputs, start, end) if request.mm_inputs else extra
        parent = hash_block_tokens(parent, tokens, keys)
        hashes.append(parent)
    return hashes


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without concatenating the two whole lists."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n : end - n]
    return prompt[start:] + request.output_token_ids[: end - n]

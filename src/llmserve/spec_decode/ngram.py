"""The n-gram proposer (prompt lookup decoding): when the context's last n tokens occurred earlier
in the prompt or the output, propose the tokens that followed that occurrence.

    context  ... a b c d ... x a b c          last 3 tokens "a b c" occur earlier
    proposal              d ...               the k tokens after that occurrence

n runs from `prompt_lookup_max` down to `prompt_lookup_min` (a longer match predicts better);
among occurrences the latest wins (a summary or an edit follows the nearest passage it is
copying). Input-grounded tasks (summaries, rewrites, code edits, extraction) repeat their input
and are where this pays; open-ended text rarely matches, and then nothing is proposed.

Each request's tokens are kept in a growing int32 buffer (appended, never rebuilt), and the search
is a numba loop: a few microseconds for thousands of tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.request import Request
from llmserve.layers.numba_jit import jit


@jit()
def _find(
    tokens: np.ndarray, length: int, min_n: int, max_n: int, k: int
) -> tuple[int, int]:  # pragma: no cover
    """(start, count) of the proposal in `tokens[:length]`; count 0 when nothing matches."""
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = length - n
        for i in range(suffix - 1, -1, -1):  # latest occurrence first, never the suffix itself
            j = 0
            while j < n and tokens[i + j] == tokens[suffix + j]:
                j += 1
            if j == n:
                start = i + n
                return start, min(k, length - start)
    return 0, 0


class _Context:
    __slots__ = ("length", "tokens")

    def __init__(self) -> None:
        self.tokens = np.empty(256, dtype=np.int32)
        self.length = 0

    def sync(self, request: Request) -> None:
        """Append the request's tokens this buffer has not seen (it only ever grows)."""
        total = request.num_tokens
        if total > len(self.tokens):
            grown = np.empty(max(total, 2 * len(self.tokens)), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        for i in range(self.length, total):
            self.tokens[i] = request.token_id(i)
        self.length = total


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._contexts: dict[str, _Context] = {}

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to `k` tokens to follow `request`'s last one ([] when its context has no match)."""
        context = self._contexts.get(request.request_id)
        if context is None or context.length > request.num_tokens:  # new, or preempted and reset
            context = self._contexts[request.request_id] = _Context()
        context.sync(request)
        start, count = _find(context.tokens, context.length, self.min_n, self.max_n, k)
        return context.tokens[start : start + count].tolist()

    def propose_batch(self, requests: list[Request], k: int) -> dict[str, list[int]]:
        """Up to `k` tokens for each of `requests` that has a match."""
        out = {}
        for request in requests:
            proposal = self.propose(request, k)
            if proposal:
                out[request.request_id] = proposal
        return out

    def retain(self, live: Mapping[str, object]) -> None:
        """Drop the buffers of requests no longer in `live` (finished or aborted)."""
        if len(self._contexts) > len(live):
            self._contexts = {rid: c for rid, c in self._contexts.items() if rid in live}

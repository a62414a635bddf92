"""Logprobs of chosen tokens plus their top alternatives, as tensors and as the runner's lists.

    logprobs = log_softmax(float32(logits))             [N, V]
    chosen   = logprobs[i, token_ids[i]]                [N]
    rank     = 1 + #{v : logprobs[i, v] > chosen[i]}    [N]   (1 = most likely; ties share the best rank)
    top      = topk(logprobs, k)                        [N, k]

Used for the sampled tokens (of the raw, unprocessed logits) and by the runner for prompt logprobs
(logits at positions 0..n-2 scored against prompt tokens 1..n-1). Knows nothing of sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.core.sched_output import Logprobs


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [N, k+1] int64: the chosen token first, then the top-k in descending order
    logprobs: torch.Tensor  # [N, k+1] fp32
    ranks: torch.Tensor  # [N] int64: rank of the chosen token (1 = most likely)
    _host: tuple[list[list[int]], list[list[float]], list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def to_lists(self, row: int, num: int) -> Logprobs:
        """Row `row` with `num` alternatives (num <= k) as one-position `Logprobs` of Python lists."""
        return self.rows_to_lists(row, row + 1, num)

    def rows_to_lists(self, start: int, stop: int, num: int) -> Logprobs:
        """Rows [start, stop) with `num` alternatives each: e.g. one request's prompt logprobs."""
        assert 0 <= num < self.token_ids.shape[1], (
            f"asked for {num} alternatives of {self.token_ids.shape[1] - 1}"
        )
        token_ids, logprobs, ranks = self._to_host()
        return Logprobs(
            token_ids=[ids[: num + 1] for ids in token_ids[start:stop]],
            logprobs=[lps[: num + 1] for lps in logprobs[start:stop]],
            ranks=ranks[start:stop],
        )

    def _to_host(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        # Copied to Python lists once, on first use, so a step's rows cost one transfer, not one each.
        if self._host is None:
            self._host = (self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())
        return self._host


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_alternatives: int) -> LogprobsTensors:
    """Logprobs of `token_ids` [N] under `logits` [N, V] (any float dtype), with ranks and top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    token_ids = token_ids.to(torch.int64).unsqueeze(1)  # [N, 1]
    chosen = logprobs.gather(-1, token_ids)  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    if num_alternatives > 0:
        top_logprobs, top_ids = logprobs.topk(num_alternatives, dim=-1)  # [N, k] each
        token_ids = torch.cat([token_ids, top_ids], dim=1)  # [N, k+1]
        chosen = torch.cat([chosen, top_logprobs], dim=1)  # [N, k+1]
    return LogprobsTensors(token_ids=token_ids, logprobs=chosen, ranks=ranks)

"""`Sampler`: one step's logits [B, V] -> one token per row, plus logprobs when asked.

Order of operations (vLLM's defaults, which OpenAI clients and lm-eval expect):

    1. logprobs    of the RAW model distribution: log_softmax of the logits as they come in, before
                   any processing (what lm-eval's loglikelihood needs); the chosen token is the one
                   sampled below                                          -> logprobs.py
    2. min_tokens  while len(output) < min_tokens: stop_token_ids, and the EOS ids unless ignore_eos,
                   get -inf (ignore_eos alone bans nothing: EOS may be sampled, it just doesn't stop)
    3. logit_bias  added
    4. penalties   repetition (prompt or output tokens), then frequency and presence (output tokens)
                                                                          -> processing.py
    5. greedy rows (temperature 0 or top_k 1): argmax of the processed logits
    6. random rows: / temperature, top-k, top-p, min-p, then the exponential race with per-row
                   seeded generators                                      -> random_sampling.py

Fast path: a batch of only greedy rows with nothing to process costs one argmax (plus logprobs if
asked), with no copy of the logits. Steps 2-6 work on one float32 copy; the input is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmserve.sample.logprobs import LogprobsTensors, compute_logprobs
from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.processing import apply_logits_processing
from llmserve.sample.random_sampling import sample_random

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "compute_logprobs"]


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # [B, k+1] with k = max_num_logprobs, when any row asked for logprobs

    def to_host(self) -> tuple[list[int], LogprobsTensors | None]:
        """The sampled ids as a list, and the logprobs as host tensors: one device->host copy.

        int32 [ ids B | ranks B | alternatives B(k+1) | logprobs B(k+1), float32 bits ]
        """
        ids = self.sampled_token_ids
        if self.logprobs is None:
            return ids.tolist(), None
        lp = self.logprobs
        shape = lp.token_ids.shape  # [B, k+1]
        parts = (ids, lp.ranks, lp.token_ids.flatten(), lp.logprobs.flatten().view(torch.int32))
        host = torch.cat([p.to(torch.int32) for p in parts]).cpu()  # the copy
        ids_h, ranks, token_ids, logprobs = host.split([len(ids), len(ids), shape.numel(), shape.numel()])
        return ids_h.tolist(), LogprobsTensors(
            token_ids=token_ids.view(shape).to(torch.int64),
            logprobs=logprobs.view(torch.float32).view(shape),
            ranks=ranks.to(torch.int64),
        )


class Sampler(nn.Module):
    """Stateless: everything per request arrives in `SamplingMetadata` (generators included)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """`logits` [B, V] fp32 or lower precision; row i belongs to the i-th state of `metadata`."""
        if metadata.all_greedy and not metadata.needs_logits_processing:
            sampled = logits.argmax(dim=-1)  # [B]: the fast path
        else:
            x = logits.to(torch.float32, copy=True)  # [B, V]; the raw logits stay intact for step 1
            apply_logits_processing(x, metadata)
            sampled = self._sample(x, metadata)

        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 5-6 on processed fp32 logits `x` [B, V], which the random path overwrites."""
        if metadata.all_greedy:
            return x.argmax(dim=-1)
        # Greedy ids must be taken before sample_random divides and filters `x` in place.
        greedy = None if metadata.all_random else x.argmax(dim=-1)  # [B]
        sampled = sample_random(x, metadata)  # [B]
        if greedy is None:
            return sampled
        assert metadata.greedy_mask is not None
        return torch.where(metadata.greedy_mask, greedy, sampled)

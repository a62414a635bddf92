"""Token embedding and the output projection (LM head).

The LM head is the biggest matmul at batch 1, so its weight is stored input-major ([hidden,
vocab], see linear.py). When embeddings are tied, the embedding lookup reads columns of that same
tensor instead of keeping a second [vocab, hidden] copy.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.load_errors import WeightShapeError


class VocabEmbedding(nn.Module):
    """Embedding table stored as [hidden, vocab] so it doubles as a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight_t = nn.Parameter(torch.empty(hidden_size, vocab_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.weight_t.index_select(1, input_ids).t()

    def load(self, name: str, loaded: torch.Tensor) -> None:
        """Copy a checkpoint embedding ([vocab, hidden])."""
        expected = (self.vocab_size, self.hidden_size)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(name, expected, tuple(loaded.shape))
        self.weight_t.data.copy_(loaded.t())


class LMHead(nn.Module):
    """logits = hidden @ W, with W [hidden, vocab]; shares the embedding's tensor when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied_to = tied_to is not None
        if tied_to is not None:
            self.weight_t = tied_to.weight_t
        else:
            self.weight_t = nn.Parameter(torch.empty(hidden_size, vocab_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return hidden @ self.weight_t

    def load(self, name: str, loaded: torch.Tensor) -> None:
        expected = (self.vocab_size, self.hidden_size)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(name, expected, tuple(loaded.shape))
        self.weight_t.data.copy_(loaded.t())

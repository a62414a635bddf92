"""Token embedding and the output projection (LM head).

The LM head is the biggest matmul at batch 1, so its weight uses the chunked input-major layout of
linear.py ([C, hidden, vocab / C]). When embeddings are tied, the embedding lookup gathers
columns of that same tensor instead of keeping a second [vocab, hidden] copy.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.linear import chunked_matmul, copy_columns, num_weight_chunks
from llmserve.load_errors import WeightShapeError


def _chunked_table(vocab_size: int, hidden_size: int) -> nn.Parameter:
    C = num_weight_chunks(vocab_size)
    return nn.Parameter(torch.empty(C, hidden_size, vocab_size // C), requires_grad=False)


def _load_table(
    table: torch.Tensor, name: str, loaded: torch.Tensor, vocab_size: int, hidden_size: int
) -> None:
    """Copy a checkpoint [vocab, hidden] matrix into a chunked [C, hidden, vocab / C] table."""
    expected = (vocab_size, hidden_size)
    if tuple(loaded.shape) != expected:
        raise WeightShapeError(name, expected, tuple(loaded.shape))
    copy_columns(table.data, 0, loaded.t())


class VocabEmbedding(nn.Module):
    """Embedding table stored column-chunked as [C, hidden, vocab / C] so it doubles as a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight_t = _chunked_table(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        Vc = self.weight_t.shape[2]
        return self.weight_t[input_ids // Vc, :, input_ids % Vc]

    def load(self, name: str, loaded: torch.Tensor) -> None:
        _load_table(self.weight_t, name, loaded, self.vocab_size, self.hidden_size)


class LMHead(nn.Module):
    """logits = hidden @ W, with W [hidden, vocab] chunked; shares the embedding's tensor when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied_to = tied_to is not None
        self.weight_t = tied_to.weight_t if tied_to is not None else _chunked_table(vocab_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return chunked_matmul(hidden, self.weight_t)

    def load(self, name: str, loaded: torch.Tensor) -> None:
        _load_table(self.weight_t, name, loaded, self.vocab_size, self.hidden_size)

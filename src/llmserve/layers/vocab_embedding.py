"""Token embedding and the output projection (LM head).

The LM head is the biggest matmul at batch 1, so its weight uses the chunked input-major layout of
linear.py ([C, hidden, vocab / C]). When embeddings are tied, the embedding lookup gathers
columns of that same tensor instead of keeping a second [vocab, hidden] copy.

With oneDNN (linear.py's `use_onednn`), the embedding turns its table into plain rows
[vocab, hidden], which a lookup reads contiguously; a tied LM head multiplies by those same rows
(oneDNN's matmul takes a plain [out, in] weight too), so tying still costs no second copy. An untied
LM head is packed like any linear layer.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers import onednn
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


def _rows(table: torch.Tensor) -> torch.Tensor:
    """A chunked [C, hidden, vocab / C] table as contiguous rows [vocab, hidden]."""
    C, H, Vc = table.shape
    return table.permute(0, 2, 1).reshape(C * Vc, H).contiguous()


class VocabEmbedding(nn.Module):
    """Embedding table stored column-chunked as [C, hidden, vocab / C] so it doubles as a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight_t = _chunked_table(vocab_size, hidden_size)
        self.weight: nn.Parameter | None = None  # [vocab, hidden] rows after use_rows()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.weight is not None:
            return self.weight.index_select(0, input_ids)
        Vc = self.weight_t.shape[2]
        return self.weight_t[input_ids // Vc, :, input_ids % Vc]

    def use_rows(self) -> None:
        """Keep the table as plain rows [vocab, hidden] (`weight`) instead of chunked columns."""
        if self.weight is None:
            self.weight = nn.Parameter(_rows(self.weight_t), requires_grad=False)
            self.weight_t = None

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
        self.weight: nn.Parameter | None = None  # [vocab, hidden] for oneDNN, after use_onednn()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        if self.weight is not None:
            return onednn.linear(hidden, self.weight)
        return chunked_matmul(hidden, self.weight_t)

    def use_onednn(self, tied_to: VocabEmbedding | None) -> None:
        """Multiply with oneDNN: by the rows of `tied_to` (after its `use_rows`) when tied, else by
        a packed copy of this head's own table."""
        if self.weight is not None:
            return
        if self.tied_to:
            assert tied_to is not None and tied_to.weight is not None, "the tied embedding uses rows first"
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(onednn.pack(_rows(self.weight_t)), requires_grad=False)
        self.weight_t = None

    def load(self, name: str, loaded: torch.Tensor) -> None:
        _load_table(self.weight_t, name, loaded, self.vocab_size, self.hidden_size)


class PositionEmbedding(nn.Module):
    """A table read by row: learned absolute positions (GPT-2, BERT), BERT's token types.
    ids [T] -> [T, hidden]."""

    def __init__(self, max_positions: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions, hidden_size), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, positions)

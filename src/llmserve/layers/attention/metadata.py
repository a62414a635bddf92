"""The data one forward pass gives attention: where each sequence's tokens sit in the flat batch,
how long each context is, and where its K/V live in the paged cache.

KV cache layout, one tensor per layer, head-major so that one KV head's context is contiguous
block by block (a gather of whole blocks lands directly in [heads, tokens, head_dim] order):

    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]
               |                '-------------------' slot = block_id * block_size + offset
               '-- 0 = K, 1 = V

A sequence's block table lists its block ids in order; token i of the sequence lives in block
`block_table[i // block_size]` at offset `i % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one layer's KV cache; the runner allocates, the backend reads and writes."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def shape(self) -> tuple[int, ...]:
        return (2, self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)

    def bytes_per_token(self) -> int:
        """K and V for one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass(slots=True)
class AttentionMetadata:
    """Per-forward attention inputs for a flat batch of `num_tokens` tokens from `num_seqs` sequences.

    Sequence i owns tokens `query_start_loc[i]:query_start_loc[i+1]` of the batch; they are the
    last `query_lens[i]` tokens of a context of `seq_lens[i]` tokens (cached + new).
    """

    query_lens: list[int]
    """New tokens per sequence in this step (a prefill chunk, or 1 for a decode)."""
    seq_lens: list[int]
    """Context length per sequence after this step's tokens are written."""
    query_start_loc: list[int]
    """Prefix sums of `query_lens`, length num_seqs + 1."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot each new token's K/V is written to."""
    block_tables: torch.Tensor
    """[num_seqs, max_num_blocks_per_seq] int64 (padded with 0 past a sequence's last block)."""
    block_size: int
    derived: dict[object, object] = field(default_factory=dict)
    """Backend-private values computed once per forward and shared by every layer (masks, indices)."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Derive the slot mapping and padded block table from per-sequence lengths and block lists."""
        assert len(query_lens) == len(seq_lens) == len(block_tables)
        query_start_loc = [0]
        slots: list[int] = []
        for q_len, s_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
            assert 0 < q_len <= s_len <= len(blocks) * block_size, (q_len, s_len, len(blocks))
            query_start_loc.append(query_start_loc[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        width = max(len(b) for b in block_tables)
        padded = [b + [0] * (width - len(b)) for b in block_tables]
        return cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            query_start_loc=query_start_loc,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            block_size=block_size,
        )

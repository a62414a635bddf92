"""Bidirectional attention without a KV cache, for encoder-only models (BERT).

An encoder's token attends to every token of its own sequence, before and after it, and nothing
is kept once the forward pass ends: there is no cache to page, so the paged backends do not apply.
The flat batch [T] (sequences back to back, as the scheduler sends them) is scattered into a
padded [B, L] grid, attended with torch's `scaled_dot_product_attention` under a key-padding mask,
and gathered back:

    flat rows   | a0 a1 a2 | b0 b1 | c0 c1 c2 c3 |          T = 9
    grid        a0 a1 a2 .            row b * L + i holds token i of sequence b
                b0 b1 .  .            (`pad_index` [T] says where each flat row goes;
                c0 c1 c2 c3            `key_mask` [B, 1, 1, L] hides the '.' keys)

Padding rows are computed and dropped; with mixed lengths that costs up to (B * L - T) rows of
attention, small next to the linear layers at BERT's lengths (<= 512).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class EncoderMetadata:
    """One forward pass's sequence layout, built by the runner before the model runs."""

    num_seqs: int  # B
    max_len: int  # L
    pad_index: torch.Tensor  # [T] int64: flat row -> b * L + i
    key_mask: torch.Tensor  # [B, 1, 1, L] bool: True where the key is a real token
    token_types: torch.Tensor | None = None
    """[T] int64: each token's segment (BERT's token type: 1 from the second text of a pair on);
    None when every sequence is one segment (type 0)."""

    @staticmethod
    def build(
        seq_lens: Sequence[int], device: torch.device, second_segments: Sequence[int | None] = ()
    ) -> EncoderMetadata:
        """`second_segments`: per sequence, the position where its second segment starts (a text
        pair's second text), or None for one segment; empty: every sequence is one segment."""
        assert seq_lens and min(seq_lens) >= 1, f"empty sequence in an encoder batch: {seq_lens}"
        B, L = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        offsets = torch.arange(B, dtype=torch.int64) * L
        pad_index = torch.cat(
            [torch.arange(n, dtype=torch.int64) + o for n, o in zip(seq_lens, offsets.tolist(), strict=True)]
        )
        key_mask = (torch.arange(L)[None, :] < lens[:, None]).view(B, 1, 1, L)
        token_types = None
        if any(s is not None for s in second_segments):
            assert len(second_segments) == B, "one second-segment start per sequence"
            token_types = torch.cat([
                (torch.arange(n) >= (n if s is None else s)).to(torch.int64)
                for n, s in zip(seq_lens, second_segments, strict=True)
            ]).to(device)  # fmt: skip
        return EncoderMetadata(B, L, pad_index.to(device), key_mask.to(device), token_types)


def bidirectional_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: EncoderMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q, k, v [T, n_heads, head_dim] -> [T, n_heads * head_dim], each sequence attending to itself;
    `window` w: a token sees the positions at most w from its own, both sides (ModernBERT's local layers)."""
    n_heads, D = q.shape[1:]
    B, L = md.num_seqs, md.max_len
    mask = md.key_mask
    if window is not None and window < L - 1:
        pos = torch.arange(L, device=mask.device)
        mask = mask & ((pos[:, None] - pos[None, :]).abs() <= window)  # [B, 1, L, L]

    def grid(x: torch.Tensor) -> torch.Tensor:  # [T, nh, D] -> [B, nh, L, D]
        padded = x.new_zeros(B * L, n_heads, D).index_copy_(0, md.pad_index, x)
        return padded.view(B, L, n_heads, D).transpose(1, 2)

    out = F.scaled_dot_product_attention(grid(q), grid(k), grid(v), attn_mask=mask, scale=scale)
    out = out.transpose(1, 2).reshape(B * L, n_heads * D)  # [B*L, nh*D]
    return out.index_select(0, md.pad_index)

"""The data one forward pass gives attention: where each sequence's tokens sit in the flat batch,
how long each context is, and where its K/V live in the paged cache.

KV cache layout, one tensor per layer, head-major so that one KV head's context is contiguous
block by block (a gather of whole blocks lands directly in [heads, tokens, head_dim] order):

    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]
               |                '-------------------' slot = block_id * block_size + offset
               '-- 0 = K, 1 = V

An int8 cache (`kv_cache_dtype` int8) keeps each row's scales beside its values, so the layout and
the indexing stay the same with a row of head_dim + 2 * ceil(head_dim / 32) bytes (GGUF Q8_0's
blocks, as llama.cpp's q8_0 cache stores them):

    row: [head_dim x int8 q | one float16 scale per 32 values]   value = scale * q,
                                                                  scale = max|its 32 values| / 127

K and V may have types of their own (`kv_cache_dtype` "int8,float16", llama.cpp's
`--cache-type-k/-v`). Such a layer's cache is a `KVPair`: the same allocation, cut into a K half
and a V half of their own dtypes and row sizes, each indexed as one half above:

    KVPair.k: [num_kv_heads, num_blocks, block_size, row_k]   |  one buffer per layer,
    KVPair.v: [num_kv_heads, num_blocks, block_size, row_v]   |  K's bytes then V's

`kv_cache[0]` and `kv_cache[1]` are K and V for both kinds, so a backend that reads each half
through its own dtype takes either; one type keeps the single tensor (the same tensors and
outputs as before pairs existed).

A sequence's block table lists its block ids in order; token i of the sequence lives in block
`block_table[i // block_size]` at offset `i % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

INT8_GROUP = 32
"""Values per scale in an int8 cache row."""


def int8_row_size(head_dim: int) -> int:
    """Bytes of an int8 cache row: the values, then a float16 scale per group of 32."""
    return head_dim + 2 * -(-head_dim // INT8_GROUP)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [N, D] (any float dtype) -> int8 cache rows [N, int8_row_size(D)]: each group of 32
    values rounded to the nearest multiple of its scale, max|group| / 127 rounded to float16."""
    N, D = x.shape
    G = -(-D // INT8_GROUP)
    xf = torch.zeros(N, G * INT8_GROUP, dtype=torch.float32, device=x.device)
    xf[:, :D] = x.float()
    groups = xf.view(N, G, INT8_GROUP)
    scale = (groups.abs().amax(-1) / 127).half()  # [N, G]
    div = torch.where(scale > 0, scale.float(), torch.ones((), device=x.device))
    q = torch.round(groups / div[..., None]).clamp_(-127, 127).to(torch.int8).view(N, -1)[:, :D]
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 cache rows [..., int8_row_size(D)] -> values [..., D] in `dtype`."""
    R = rows.shape[-1]
    G = R // (INT8_GROUP + 2) + (R % (INT8_GROUP + 2) != 0)  # R = D + 2 ceil(D / 32)
    D = R - 2 * G
    scale = rows[..., D:].contiguous().view(torch.float16).float()  # [..., G]
    q = rows[..., :D].float()
    pad = G * INT8_GROUP - D
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    out = (q.unflatten(-1, (G, INT8_GROUP)) * scale[..., None]).flatten(-2)[..., :D]
    return out.to(dtype)


@dataclass(frozen=True, slots=True)
class KVDtypes:
    """What the cache stores keys and values in (the same type for both, unless asked apart)."""

    k: torch.dtype
    v: torch.dtype

    @classmethod
    def of(cls, dtype: torch.dtype | KVDtypes) -> KVDtypes:
        return dtype if isinstance(dtype, KVDtypes) else cls(dtype, dtype)

    @property
    def mixed(self) -> bool:
        return self.k != self.v

    @property
    def name(self) -> str:
        """`float16`, or `int8,float16` when K and V differ (the spelling `kv_cache_dtype` takes)."""
        k, v = (str(d).removeprefix("torch.") for d in (self.k, self.v))
        return f"{k},{v}" if self.mixed else k


@dataclass(frozen=True, slots=True)
class KVPair:
    """One layer's cache when K and V have dtypes of their own: `[0]` is K, `[1]` is V, as for
    the single [2, ...] tensor."""

    k: torch.Tensor  # [num_kv_heads, num_blocks, block_size, row_k]
    v: torch.Tensor  # [num_kv_heads, num_blocks, block_size, row_v]

    def __getitem__(self, half: int) -> torch.Tensor:
        return self.v if half else self.k

    @property
    def device(self) -> torch.device:
        return self.k.device

    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in (self.k, self.v))


LayerKVCache = torch.Tensor | KVPair
"""One layer's cache: [2, num_kv_heads, num_blocks, block_size, row] of one dtype, or a `KVPair`."""


def _row_size(dtype: torch.dtype, head_dim: int) -> int:
    return int8_row_size(head_dim) if dtype == torch.int8 else head_dim


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one layer's KV cache; the runner allocates, the backend reads and writes."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """K's dtype, and V's unless `v_dtype` is given."""
    v_dtype: torch.dtype | None = None
    """V's dtype when it differs from K's (the cache is then a `KVPair` per layer)."""

    @classmethod
    def build(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtypes: torch.dtype | KVDtypes,
    ) -> KVCacheSpec:
        d = KVDtypes.of(dtypes)
        return cls(num_blocks, block_size, num_kv_heads, head_dim, d.k, d.v if d.mixed else None)

    @property
    def dtypes(self) -> KVDtypes:
        return KVDtypes(self.dtype, self.v_dtype or self.dtype)

    def shape(self) -> tuple[int, ...]:
        """The single tensor's shape (K and V of one dtype)."""
        assert not self.dtypes.mixed, "a mixed cache has a shape per half (half_shape)"
        return (2, self.num_kv_heads, self.num_blocks, self.block_size, self.row_size)

    def half_shape(self, half: int) -> tuple[int, ...]:
        """[num_kv_heads, num_blocks, block_size, row] of K (0) or V (1)."""
        dtype = self.dtypes.v if half else self.dtypes.k
        return (self.num_kv_heads, self.num_blocks, self.block_size, _row_size(dtype, self.head_dim))

    @property
    def row_size(self) -> int:
        """Elements of one cached K row: head_dim values (int8: plus their float16 scales)."""
        return _row_size(self.dtype, self.head_dim)

    def half_bytes_per_token(self, half: int) -> int:
        dtype = self.dtypes.v if half else self.dtypes.k
        return self.num_kv_heads * _row_size(dtype, self.head_dim) * dtype.itemsize

    def bytes_per_token(self) -> int:
        """K and V for one token in one layer (each half at its own dtype's row bytes)."""
        return self.half_bytes_per_token(0) + self.half_bytes_per_token(1)


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
    seq_lens_tensor: torch.Tensor | None = None
    """[num_seqs] int32 on the device: `seq_lens` for kernels that read lengths on the device
    (the Triton backend; a CUDA graph replays with new values in the same buffer)."""
    query_start_loc_tensor: torch.Tensor | None = None
    """[num_seqs + 1] int32 on the device: `query_start_loc` for kernels."""
    max_query_len: int = 0
    """Longest `query_lens` entry (1 for a batch of decodes): kernels size their grids by it."""
    bidirectional: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Sequence index -> position spans [start, end) whose tokens attend to each other both ways
    (a Gemma 3 image's tokens; causal elsewhere). Only the backends with `bidirectional_spans`
    read it."""
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
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
        )

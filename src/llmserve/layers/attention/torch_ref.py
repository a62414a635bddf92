"""The reference attention backend: plain torch, any device.

  1. scatter the batch's new K/V rows into the cache at `slot_mapping` (one index_copy per half);
  2. every sequence that runs a single token (a decode) is computed in one batched pass: its
     blocks are gathered into [H_kv, B, S, D], padded to the longest context and masked;
  3. every other sequence (a prefill chunk) reads its context through its block table (or, for a
     prefill that starts at position 0, uses the new K/V directly) and runs scaled dot-product
     attention with a causal mask aligned to the END of the context, optionally limited to a
     sliding window.

A layer with sink logits (gpt-oss, `AttentionParams.sinks`) adds each head's sink as one more
column of its softmax, then drops it; a layer with a soft cap (Gemma 2, `AttentionParams.softcap`)
passes its scaled scores through c * tanh(s / c) first. Their prefills run in plain matmuls
(SDPA has neither term).

Gathers index dim 0 of a flat [H_kv * num_blocks, block_size, D] view: indexing any other dim
of a multi-GiB cache tensor is an order of magnitude slower in torch.

K and V are read and written as two halves, `kv_cache[0]` and `kv_cache[1]`, each through its
own dtype and row size, so a `KVPair` (K and V of different types) runs the same code as the
single tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.layers.attention.backend import AttentionParams, register_attention_backend
from llmserve.layers.attention.metadata import (
    AttentionMetadata,
    KVCacheSpec,
    KVDtypes,
    LayerKVCache,
    dequantize_rows,
    quantize_rows,
)

CAUSAL = "causal"
"""Mask marker: queries and keys are the same positions, plain causal attention."""


def _context_mask(
    metadata: AttentionMetadata, seq_idx: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | str | None:
    """Boolean [query_len, seq_len] mask (True = attend), CAUSAL, or None when no mask is needed.

    Query j sits at absolute position `p = seq_len - query_len + j` and may see keys t with
    `t <= p` and, with a window w, `t > p - w`. Built once per forward and shared by all layers.
    """
    key = ("mask", seq_idx, sliding_window)
    if key in metadata.derived:
        return metadata.derived[key]  # type: ignore[return-value]
    q_len, s_len = metadata.query_lens[seq_idx], metadata.seq_lens[seq_idx]
    spans = metadata.bidirectional.get(seq_idx)
    mask: torch.Tensor | str | None = None
    if spans:
        mask = _span_mask(q_len, s_len, sliding_window, spans, device)
    elif q_len == s_len > 1 and (sliding_window is None or s_len <= sliding_window):
        mask = CAUSAL  # a fresh prompt: SDPA's own causal kernel, no mask tensor
    elif q_len > 1 or (sliding_window is not None and s_len > sliding_window):
        pos = torch.arange(s_len - q_len, s_len, device=device)[:, None]  # [q_len, 1]
        keys = torch.arange(s_len, device=device)[None, :]  # [1, s_len]
        mask = keys <= pos
        if sliding_window is not None:
            mask &= keys > pos - sliding_window
    metadata.derived[key] = mask
    return mask


def _span_mask(
    q_len: int, s_len: int, window: int | None, spans: list[tuple[int, int]], device: torch.device
) -> torch.Tensor:
    """[q_len, s_len]: causal, OR both ways inside each span, AND the sliding window (the order
    transformers composes Gemma 3's image masks in: a window still cuts an image's far tokens)."""
    pos = torch.arange(s_len - q_len, s_len, device=device)[:, None]  # [q_len, 1]
    keys = torch.arange(s_len, device=device)[None, :]  # [1, s_len]
    mask = keys <= pos
    for start, end in spans:
        mask |= (pos >= start) & (pos < end) & (keys >= start) & (keys < end)
    if window is not None:
        mask &= keys > pos - window
    return mask


def _attend_one_query(
    params: AttentionParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Decode: q [H, 1, D], k/v [H_kv, s_len, D] -> [H, 1, D].

    The query heads that share a KV head are stacked into one matrix, so GQA is two batched
    matmuls over H_kv with no K/V repetition; several times faster than SDPA at this size.
    """
    H, H_kv, D = params.num_heads, params.num_kv_heads, params.head_dim
    q = q.reshape(H_kv, H // H_kv, D)  # [H_kv, group, D]
    scores = _capped(torch.bmm(q, k.transpose(1, 2)).mul_(params.scale), params)  # [H_kv, group, s_len]
    probs = _softmax(scores, _sinks(params, H_kv, H // H_kv, 1)).to(q.dtype)
    return torch.bmm(probs, v).view(H, 1, D)


def _capped(scores: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """Scaled scores through the layer's soft cap c * tanh(s / c) (in place), as they are without."""
    if params.softcap is None:
        return scores
    return scores.div_(params.softcap).tanh_().mul_(params.softcap)


def _sinks(params: AttentionParams, *shape: int) -> torch.Tensor | None:
    """The layer's sink logits viewed as `shape` (query head h = KV head * group + j), or None."""
    return None if params.sinks is None else params.sinks.view(*shape)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim in float32; with sinks (broadcast to scores[..., :1]), each row's
    sink logit joins the denominator as one more column, which is then dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]


def _attend_plain(
    params: AttentionParams,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | str | None,
) -> torch.Tensor:
    """`_attend` for a layer with sinks or a soft cap, in plain matmuls (SDPA has neither term):
    q [H, q_len, D], k/v [H_kv, s_len, D] -> [H, q_len, D]."""
    H, H_kv, D = params.num_heads, params.num_kv_heads, params.head_dim
    G, q_len, s_len = H // H_kv, q.shape[1], k.shape[1]
    scores = torch.bmm(q.reshape(H_kv, G * q_len, D), k.transpose(1, 2)).mul_(params.scale)
    scores = _capped(scores, params).view(H_kv, G, q_len, s_len)
    if isinstance(mask, str):  # CAUSAL: q_len == s_len
        mask = torch.ones(q_len, s_len, dtype=torch.bool, device=q.device).tril_()
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = _softmax(scores, _sinks(params, H_kv, G, 1, 1)).to(q.dtype)
    return torch.bmm(probs.view(H_kv, G * q_len, s_len), v).view(H, q_len, D)


def _attend(
    params: AttentionParams,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | str | None,
) -> torch.Tensor:
    """q: [H, q_len, D], k/v: [H_kv, s_len, D] -> [H, q_len, D]."""
    if mask is None and q.shape[1] == 1:
        return _attend_one_query(params, q, k, v)
    if params.sinks is not None or params.softcap is not None:
        return _attend_plain(params, q, k, v, mask)
    causal = isinstance(mask, str)
    # 4-D inputs: on CPU only those reach SDPA's flash kernel (3x faster than the 3-D math path).
    return F.scaled_dot_product_attention(
        q[None],
        k[None],
        v[None],
        attn_mask=None if causal else mask,
        is_causal=causal,
        scale=params.scale,
        enable_gqa=params.num_heads != params.num_kv_heads,
    )[0]


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Decode sequences of similar length, padded to the longest of them."""

    rows: torch.Tensor  # [B] flat-batch row of each decode token
    block_index: torch.Tensor  # [H_kv, B, max_blocks] rows of the flat cache view, padded with block 0
    bias: torch.Tensor  # [B, max_blocks * block_size] 0 where a key is visible, -inf elsewhere


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    """The decode sequences of one forward (shared by all layers), and the others."""

    groups: list[_DecodeGroup]
    others: list[int]  # sequences with more than one new token


# Decodes are split by context length into groups of at least this many sequences, at most
# _MAX_GROUPS of them: padding every context to the batch's longest wasted up to half the
# gather and matmul work when lengths spread widely, and each group costs a few more ops.
_MIN_GROUP = 8
_MAX_GROUPS = 4


def _decode_group(
    metadata: AttentionMetadata,
    seqs: list[int],
    sliding_window: int | None,
    num_kv_heads: int,
    num_blocks: int,
    device: torch.device,
) -> _DecodeGroup:
    bs = metadata.block_size
    seq_lens = torch.tensor([metadata.seq_lens[i] for i in seqs], device=device)
    max_blocks = (max(metadata.seq_lens[i] for i in seqs) + bs - 1) // bs
    pos = torch.arange(max_blocks * bs, device=device)[None, :]  # [1, S]
    visible = pos < seq_lens[:, None]
    if sliding_window is not None:
        visible &= pos >= seq_lens[:, None] - sliding_window
    tables = metadata.block_tables.index_select(0, torch.tensor(seqs, device=device))[:, :max_blocks]
    return _DecodeGroup(
        rows=torch.tensor([metadata.query_start_loc[i] for i in seqs], device=device),
        block_index=_flat_block_index(tables, num_kv_heads, num_blocks),
        bias=torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf")),
    )


def _decode_plan(
    metadata: AttentionMetadata,
    sliding_window: int | None,
    num_kv_heads: int,
    num_blocks: int,
    device: torch.device,
) -> _DecodePlan | None:
    """Batch the sequences that run one token this step, when there are at least two."""
    key = ("decode", sliding_window, num_kv_heads, num_blocks)
    if key in metadata.derived:
        return metadata.derived[key]  # type: ignore[return-value]
    decodes = sorted(
        (i for i, q in enumerate(metadata.query_lens) if q == 1), key=lambda i: metadata.seq_lens[i]
    )
    plan = None
    if len(decodes) >= 2:
        n_groups = max(1, min(_MAX_GROUPS, len(decodes) // _MIN_GROUP))
        size = -(-len(decodes) // n_groups)
        plan = _DecodePlan(
            groups=[
                _decode_group(
                    metadata, decodes[g : g + size], sliding_window, num_kv_heads, num_blocks, device
                )
                for g in range(0, len(decodes), size)
            ],
            others=[i for i, q in enumerate(metadata.query_lens) if q != 1],
        )
    metadata.derived[key] = plan
    return plan


def _flat_block_index(blocks: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Block ids [...] -> rows of the flat [H_kv * num_blocks, ...] cache view, [H_kv, ...]."""
    heads = torch.arange(num_kv_heads, device=blocks.device).view(-1, *([1] * blocks.dim()))
    return heads * num_blocks + blocks


def _as_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as K/V values in `dtype` (int8 rows carry their scale)."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


def _gather(cache: torch.Tensor, flat_index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One half of the cache [H_kv, num_blocks, bs, D] at `_flat_block_index` rows [H_kv, ...]
    -> [H_kv, ..., bs, D] (into `out`, a flat buffer of at least that size, when given)."""
    H_kv, NB, bs, D = cache.shape
    flat = cache.view(H_kv * NB, bs, D)
    if out is None:
        gathered = flat.index_select(0, flat_index.view(-1))
    else:
        gathered = torch.index_select(
            flat, 0, flat_index.view(-1), out=out[: flat_index.numel() * bs * D].view(-1, bs, D)
        )
    return gathered.view(*flat_index.shape, bs, D)


class _Workspace:
    """Reusable flat buffers. The decode gather copies tens of MB per layer; writing into memory
    that was just freed and handed back by the OS page by page costs 3x the copy itself."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(int(numel * 1.25), dtype=dtype, device=device)
        return buf


def _write_rows(metadata: AttentionMetadata, num_kv_heads: int, num_slots: int) -> torch.Tensor:
    """[H_kv * T]: head h of slot s is row h * num_slots + s of the flat [H_kv * num_slots, D] view."""
    return _derived(
        metadata,
        ("write", num_kv_heads, num_slots),
        lambda: _flat_block_index(metadata.slot_mapping, num_kv_heads, num_slots).view(-1),
    )


def _read_index(metadata: AttentionMetadata, i: int, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Sequence i's context blocks as rows of the flat cache view, [H_kv, its blocks]."""
    num = (metadata.seq_lens[i] + metadata.block_size - 1) // metadata.block_size
    return _derived(
        metadata,
        ("read", i, num_kv_heads, num_blocks),
        lambda: _flat_block_index(metadata.block_tables[i, :num], num_kv_heads, num_blocks),
    )


def _derived(metadata: AttentionMetadata, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A per-forward value shared by every layer (the same for all layers of one geometry)."""
    value = metadata.derived.get(key)
    if value is None:
        value = metadata.derived[key] = make()
    return value  # type: ignore[return-value]


def _decode_batch(
    params: AttentionParams, query: torch.Tensor, kv_cache: LayerKVCache, plan: _DecodeGroup, ws: _Workspace
) -> torch.Tensor:
    """One query token per sequence, B sequences at once -> [B, H, D].

    The query heads sharing a KV head form one matrix, as in `_attend_one_query`; the batch dims
    (H_kv, B) of the gathered K/V are contiguous, so both matmuls run without copies.
    """
    H, H_kv, D = params.num_heads, params.num_kv_heads, params.head_dim
    B = plan.rows.shape[0]
    k, v = (
        _gather_values(kv_cache[h], plan.block_index, ws, name, query.dtype) for h, name in enumerate("kv")
    )
    k, v = k.reshape(H_kv, B, -1, D), v.reshape(H_kv, B, -1, D)  # [H_kv, B, S, D]
    q = query.index_select(0, plan.rows).view(B, H_kv, H // H_kv, D).transpose(0, 1)  # [H_kv, B, g, D]
    scores = _capped(torch.matmul(q, k.transpose(-1, -2)).mul_(params.scale), params)  # [H_kv, B, g, S]
    scores += plan.bias.to(scores.dtype)[None, :, None, :]
    probs = _softmax(scores, _sinks(params, H_kv, 1, H // H_kv, 1)).to(q.dtype)
    out = torch.matmul(probs, v)  # [H_kv, B, g, D]
    return out.transpose(0, 1).reshape(B, H, D)


def _gather_values(
    half: torch.Tensor, flat_index: torch.Tensor, ws: _Workspace, name: str, dtype: torch.dtype
) -> torch.Tensor:
    """One cache half [H_kv, num_blocks, bs, R] at `flat_index` [H_kv, n] through a workspace
    buffer -> values [H_kv, n * bs, D] in `dtype` (R: D, or D + 2 ceil(D / 32) for int8 rows)."""
    H_kv, _, bs, R = half.shape
    buf = ws.get(name, flat_index.numel() * bs * R, half.dtype, half.device)
    return _as_values(_gather(half, flat_index, buf).view(H_kv, -1, R), dtype)


class TorchAttentionBackend:
    name = "torch"
    bidirectional_spans = True
    """Reads `AttentionMetadata.bidirectional` (prefill masks are built here, also for "cpu")."""

    def __init__(self) -> None:
        self._workspace = _Workspace()

    def prepare(self, kv_cache_dtype: torch.dtype | KVDtypes) -> None:
        pass

    def build_metadata(
        self, metadata: AttentionMetadata, layers: Sequence[AttentionParams], spec: KVCacheSpec
    ) -> None:
        """This forward's shared values (write rows, decode plans, masks, context indices) for
        every layer geometry, built before the forward runs rather than lazily by layer 0."""
        device = metadata.slot_mapping.device
        for p in layers:
            _write_rows(metadata, p.num_kv_heads, spec.num_blocks * spec.block_size)
            plan = _decode_plan(metadata, p.sliding_window, p.num_kv_heads, spec.num_blocks, device)
            self._build_sequences(
                metadata, p, spec, range(metadata.num_seqs) if plan is None else plan.others
            )

    @staticmethod
    def _build_sequences(
        metadata: AttentionMetadata, p: AttentionParams, spec: KVCacheSpec, seqs: Iterable[int]
    ) -> None:
        """The masks and context indices of the sequences attended one by one."""
        device = metadata.slot_mapping.device
        for i in seqs:
            _context_mask(metadata, i, p.sliding_window, device)
            if metadata.query_lens[i] != metadata.seq_lens[i]:
                _read_index(metadata, i, p.num_kv_heads, spec.num_blocks)

    def forward(
        self,
        params: AttentionParams,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self._write_kv(params, key, value, kv_cache, metadata)
        return self._attend_batch(params, query, key, value, kv_cache, metadata)

    @staticmethod
    def _write_kv(
        params: AttentionParams,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> None:
        """Scatter the batch's new K/V rows into the cache at `slot_mapping`."""
        H_kv, D = params.num_kv_heads, params.head_dim
        k_half, v_half = kv_cache[0], kv_cache[1]  # [H_kv, num_blocks, bs, R] each, own dtypes
        rows = _write_rows(metadata, H_kv, k_half.shape[1] * k_half.shape[2])
        for cache, x in ((k_half, key), (v_half, value)):
            dtype, R = cache.dtype, cache.shape[-1]  # a narrower KV-cache dtype rounds here
            x = x.transpose(0, 1).reshape(-1, D)
            cache.view(-1, R).index_copy_(0, rows, quantize_rows(x) if dtype == torch.int8 else x.to(dtype))

    def _attend_batch(
        self,
        params: AttentionParams,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention for every sequence of the batch, its new K/V already in the cache."""
        H_kv = params.num_kv_heads
        plan = _decode_plan(metadata, params.sliding_window, H_kv, kv_cache[0].shape[1], query.device)
        if plan is None:
            outs = [
                self._sequence(params, i, query, key, value, kv_cache, metadata)
                for i in range(metadata.num_seqs)
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        # Every single-token (decode) sequence in one batched computation; prefills one by one.
        out = torch.empty_like(query)
        for group in plan.groups:
            out.index_copy_(0, group.rows, _decode_batch(params, query, kv_cache, group, self._workspace))
        for i in plan.others:
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            out[start:end] = self._sequence(params, i, query, key, value, kv_cache, metadata)
        return out

    @staticmethod
    def _sequence(
        params: AttentionParams,
        i: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention output [q_len, H, D] of sequence i."""
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        q_len, s_len = metadata.query_lens[i], metadata.seq_lens[i]
        if q_len == s_len and kv_cache[0].dtype == kv_cache[1].dtype == query.dtype:
            # The whole context is new: read it from the batch, not the cache. A narrower cache
            # (16-bit or int8 under a float32 model) is read back instead, rounded as decode steps
            # and the fused C++ path see it, so a prompt's logits do not depend on its chunking.
            k_ctx, v_ctx = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            mask = _context_mask(metadata, i, params.sliding_window, query.device)
            o = _attend(params, query[start:end].transpose(0, 1), k_ctx, v_ctx, mask)  # q: [H, q_len, D]
            return o.transpose(0, 1)
        return attend_from_cache(params, i, query, kv_cache, metadata)


def attend_from_cache(
    params: AttentionParams, i: int, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
) -> torch.Tensor:
    """Attention output [q_len, H, D] of sequence i, its context (new K/V included) read from the
    cache, with its mask (`AttentionMetadata.bidirectional` spans included). The Triton backend
    runs the sequences with images through it."""
    H_kv = params.num_kv_heads
    start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
    s_len = metadata.seq_lens[i]
    idx = _read_index(metadata, i, H_kv, kv_cache[0].shape[1])
    k_ctx, v_ctx = (
        _as_values(_gather(h, idx).view(H_kv, -1, h.shape[-1])[:, :s_len], query.dtype)
        for h in (kv_cache[0], kv_cache[1])
    )  # [H_kv, s_len, D] each
    mask = _context_mask(metadata, i, params.sliding_window, query.device)
    o = _attend(params, query[start:end].transpose(0, 1), k_ctx, v_ctx, mask)  # q: [H, q_len, D]
    return o.transpose(0, 1)


def build_span_metadata(
    metadata: AttentionMetadata, layers: Sequence[AttentionParams], num_blocks: int
) -> None:
    """The masks and read indices `attend_from_cache` needs for the sequences with spans."""
    device = metadata.slot_mapping.device
    for p in layers:
        for i in metadata.bidirectional:
            _context_mask(metadata, i, p.sliding_window, device)
            _read_index(metadata, i, p.num_kv_heads, num_blocks)


@register_attention_backend("torch")
def _make_torch_backend() -> TorchAttentionBackend:
    return TorchAttentionBackend()

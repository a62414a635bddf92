"""The Triton attention backend ("triton"): the KV-cache write (fused with RoPE through
`forward_rope`) and paged attention that reads K/V in place through the block table, for CUDA
(and for the CPU under Triton's interpreter, which is how CI tests it).

  1. write: `triton_cache_ops` stores this step's K/V at `slot_mapping` (in `forward_rope`, k is
     rotated on its way to the cache and q into a new tensor; the caller's q is left unchanged);
  2. attend: a batch of decodes only (`max_query_len == 1`) runs the split-K decode kernel, any
     other batch the varlen kernel (triton_kernels.py says why two).

No step syncs with the host: lengths are read on the device (`seq_lens_tensor`,
`query_start_loc_tensor`), grids depend only on batch sizes, and the split-K workspace persists
across calls (sized by `build_metadata` before each forward, or by `reserve` for every batch size
before CUDA graphs are captured). Caches hold float32, float16 or bfloat16; an int8 cache stays
with the torch reference backend.

Importing this module needs no triton: the kernels are imported when a backend is created.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.layers.attention import torch_ref
from llmserve.layers.attention.backend import AttentionParams, register_attention_backend
from llmserve.layers.attention.metadata import AttentionMetadata, KVCacheSpec, KVDtypes

SUPPORTED_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

INTERPRETER_NUM_SMS = 4
"""The "SM count" the split policy assumes off CUDA (the interpreter): few programs, and the
split-K path still taken at batch 1."""


def check_cache_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_CACHE_DTYPES:
        raise ValueError(
            f"the triton attention backend does not support a {dtype} KV cache "
            f"(int8 caches run on the 'torch' backend); use float32, float16 or bfloat16"
        )


class TritonAttentionBackend:
    name = "triton"
    fuses_rope = True
    bidirectional_spans = True
    """Sequences with `AttentionMetadata.bidirectional` spans run on the torch reference."""
    supports_cuda_graphs = True

    def __init__(self, decode_splits: int | None = None) -> None:
        """`decode_splits` fixes the split-K factor of decode steps (a power of two up to
        MAX_DECODE_SPLITS); None picks it from the batch size and the device's SM count."""
        # Here, not at module import: llmserve imports where triton is missing.
        from llmserve.layers.attention import triton_cache_ops, triton_kernels

        self._ops = triton_cache_ops
        self._kernels = triton_kernels
        self._decode_splits = decode_splits
        self._num_sms: dict[torch.device, int] = {}
        self._workspace: dict[torch.device, torch.Tensor] = {}

    def prepare(self, kv_cache_dtype: torch.dtype | KVDtypes) -> None:
        # The kernels take one cache tensor per layer with K at index 0 and V at 1 (one element
        # type, one set of strides); K and V of different types would need a second pointer,
        # stride set and load conversion in every kernel: refused here, at start-up.
        dtypes = KVDtypes.of(kv_cache_dtype)
        if dtypes.mixed:
            raise ValueError(
                f"the triton attention backend takes one KV cache type for K and V; got kv_cache_dtype "
                f"{dtypes.name!r} (K and V apart run on the 'torch' and 'cpu' backends)"
            )
        check_cache_dtype(dtypes.k)

    def build_metadata(
        self, metadata: AttentionMetadata, layers: Sequence[AttentionParams], spec: KVCacheSpec
    ) -> None:
        """Before the forward: the device lengths (when the runner gave none) and, for a decode
        step, a split-K workspace that fits every layer geometry, so that no layer allocates."""
        device = metadata.slot_mapping.device
        _device_lens(metadata, device)
        if metadata.bidirectional:
            torch_ref.build_span_metadata(metadata, layers, spec.num_blocks)
        if (metadata.max_query_len or max(metadata.query_lens)) == 1:
            numel = max(
                self._workspace_numel(metadata.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim, device)
                for p in layers
            )
            self._get_workspace(numel, device)

    def reserve(
        self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
    ) -> None:
        """Allocate the split-K workspace for every decode batch up to `max_num_seqs` now, so that
        no call allocates while a CUDA graph is captured."""
        numel = max(
            self._workspace_numel(b, num_heads, num_kv_heads, head_dim, device)
            for b in range(1, max_num_seqs + 1)
        )
        self._get_workspace(numel, torch.device(device))

    def forward(
        self,
        params: AttentionParams,
        query: torch.Tensor,  # [T, num_heads, head_dim], already rotated
        key: torch.Tensor,  # [T, num_kv_heads, head_dim], already rotated
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        check_cache_dtype(kv_cache.dtype)
        self._ops.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return self._attend(params, query, kv_cache, metadata)

    def forward_rope(
        self,
        params: AttentionParams,
        query: torch.Tensor,  # [T, num_heads, head_dim], before RoPE (left unchanged)
        key: torch.Tensor,  # [T, num_kv_heads, head_dim], before RoPE
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        positions: torch.Tensor,  # [T] int64
        cos_sin_table: torch.Tensor,  # RotaryEmbedding.cos_sin_table: [max_position, rotary_dim]
        rotary_dim: int,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """`forward` of the rotated q and k, with RoPE applied in the cache-write kernel."""
        check_cache_dtype(kv_cache.dtype)
        q = self._ops.rope_and_write_kv_cache(
            query, key, value, positions, cos_sin_table, rotary_dim, kv_cache, metadata.slot_mapping
        )
        return self._attend(params, q, kv_cache, metadata)

    def _attend(
        self,
        params: AttentionParams,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        seq_lens, query_start_loc = _device_lens(metadata, query.device)
        max_query_len = metadata.max_query_len or max(metadata.query_lens)
        tables, scale, window = metadata.block_tables, params.scale, params.sliding_window
        if max_query_len > 1:
            out = self._kernels.varlen_paged_attention(
                query,
                kv_cache,
                tables,
                seq_lens,
                query_start_loc,
                scale,
                window,
                sinks=params.sinks,
                softcap=params.softcap,
            )
            # Sequences with images (their tokens attend both ways, which the kernel's causal mask
            # does not do) rerun on the torch reference, reading the K/V just written: prefill
            # steps with images only, never a decode or a graph replay.
            for i in metadata.bidirectional:
                start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
                out[start:end] = torch_ref.attend_from_cache(params, i, query, kv_cache, metadata)
            return out
        num_seqs, H, D = query.shape  # one token per sequence: query_start_loc is 0, 1, ..., num_seqs
        splits = self._splits(num_seqs, params.num_kv_heads, query.device)
        numel = self._kernels.decode_workspace_numel(num_seqs, H, D, splits)
        workspace = self._get_workspace(numel, query.device) if numel else None
        return self._kernels.paged_decode_attention(
            query,
            kv_cache,
            tables,
            seq_lens,
            scale,
            window,
            num_splits=splits,
            workspace=workspace,
            sinks=params.sinks,
            softcap=params.softcap,
        )

    def _splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        if self._decode_splits is not None:
            return self._decode_splits
        num_sms = self._num_sms.get(device)
        if num_sms is None:
            num_sms = self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else INTERPRETER_NUM_SMS
            )
        return self._kernels.pick_decode_splits(num_seqs, num_kv_heads, num_sms)

    def _workspace_numel(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
    ) -> int:
        splits = self._splits(num_seqs, num_kv_heads, torch.device(device))
        return self._kernels.decode_workspace_numel(num_seqs, num_heads, head_dim, splits)

    def _get_workspace(self, numel: int, device: torch.device) -> torch.Tensor:
        """The persistent float32 split-K workspace, grown (never shrunk) to `numel`."""
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one buffer
            device = torch.device("cuda", torch.cuda.current_device())
        buf = self._workspace.get(device)
        if buf is None or buf.numel() < numel:
            buf = self._workspace[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf


def _device_lens(metadata: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`seq_lens_tensor` and `query_start_loc_tensor`, built once per forward from the host lists
    when the runner did not provide them (a copy to the device, not a sync)."""
    seq_lens, query_start_loc = metadata.seq_lens_tensor, metadata.query_start_loc_tensor
    if seq_lens is None or query_start_loc is None:
        key = ("triton_lens", device)
        if key not in metadata.derived:
            metadata.derived[key] = (
                torch.tensor(metadata.seq_lens, dtype=torch.int32, device=device),
                torch.tensor(metadata.query_start_loc, dtype=torch.int32, device=device),
            )
        seq_lens, query_start_loc = metadata.derived[key]  # type: ignore[misc]
    return seq_lens, query_start_loc


@register_attention_backend("triton")
def _make_triton_backend() -> TritonAttentionBackend:
    return TritonAttentionBackend()

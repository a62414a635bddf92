"""The q6 format: GGUF Q6_K's 6-bit super-blocks held as they are, tiled for the CPU kernels
(csrc/qgemm_q6_avx512.cpp, qgemm_q6_avx2.cpp).

    w[n, k] = d[n, s] * sc[n, j] * (q[n, k] - 32)     q in 0..63, s = k // 256, j = k // 16

with d a half float per super-block of 256 columns and sc an int8 per sub-block of 16, exactly
the file's weights (llama.cpp and gguf's `dequantize` compute them so: d sc is exact in float32,
11 + 8 significant bits, and so is its product with q). Nothing is rounded a second time, where
the q8 format that Q6_K tensors used to become (8.5 bits a weight against 6.5625) rounded every
weight again onto its own scale.

`QuantizedRows` (logical): q uint8 [N, K] (0..63), d float16 [N, K / 256], scales int8
[N, K / 16]. K is a multiple of 256 (a Q6_K tensor's rows are whole super-blocks: nothing else
reaches this format). `PackedWeight` (tiled), one record per tile of 16 rows and super-block:

    data [tiles, super-blocks, 3328] uint8:
      scales  [16 sub-blocks j][16 rows]                          256 bytes, int8
      then per sub-block j (16 columns, 8 pairs p = columns 2p, 2p + 1), 192 bytes:
        low   [2 groups g][16 rows][2 lanes i]  16-bit lanes     128 bytes: lane (g, r, i) holds
              the low 4 bits of column 8g + 2s + i in bits 4s..4s + 3 (s = 0..3: q4's tile layout)
        high  [16 rows][2 lanes i]              16-bit lanes      64 bytes: lane (r, i) holds the
              top 2 bits of column 2p + i in bits 2p..2p + 1 (p = 0..7)
    d    [tiles, super-blocks, 16 rows] float16

so that, as for q4, one 64-byte load gives 16 rows' column pairs and the kernel's shifts and masks
make each pair's int16 lanes for VNNI's vpdpwssd: 6.5 bits a weight and 1/8 bit of scales, the
file's 6.5625. Rows are padded to a multiple of 16 with zero weights.
"""

from __future__ import annotations

import torch

from llmserve.layers.quantization.formats import TILE, PackedWeight, QuantizedRows

SUPER = 256
"""Input columns per super-block (one half `d`)."""
SUB = 16
"""Input columns per sub-block (one int8 scale)."""
RECORD_BYTES = SUB * TILE + (SUPER // SUB) * 192
"""Bytes of one tile's super-block: its 256 scales, then 16 sub-blocks of 192 bytes."""


def check_width(in_features: int) -> None:
    if in_features % SUPER:
        raise ValueError(
            f"q6 rows have whole super-blocks of {SUPER} columns (GGUF Q6_K); in_features is {in_features}"
        )


def dequantize_q6(rows: QuantizedRows) -> torch.Tensor:
    """[N, K] float32: (d sc) (q - 32), in gguf's order of operations (both products exact)."""
    assert rows.scales is not None
    N, K = rows.q.shape
    scale = rows.d.float().repeat_interleave(SUPER // SUB, dim=1) * rows.scales.float()  # [N, K / 16]
    q = rows.q.view(N, K // SUB, SUB).float() - 32
    return (scale.unsqueeze(-1) * q).view(N, K)


def pack_q6(rows: QuantizedRows) -> PackedWeight:
    """Tile q6 rows (the layout above)."""
    assert rows.scales is not None
    check_width(rows.in_features)
    N, K = rows.q.shape
    T, ns = -(-N // TILE), K // SUPER
    pad = T * TILE - N
    q, d, sc = rows.q, rows.d, rows.scales
    if pad:
        q = torch.cat([q, q.new_zeros(pad, K)])
        d = torch.cat([d, d.new_zeros(pad, ns)])
        sc = torch.cat([sc, sc.new_zeros(pad, K // SUB)])
    lo, hi = q & 0x0F, q >> 4
    # low nibbles: column 16 j + 8 g + 2 s + i -> lane (g, row, i), nibble s
    lg = lo.view(T, TILE, ns, SUPER // SUB, 2, 4, 2)  # [T, row, s-block, j, g, s, i]
    low = torch.stack([lg[..., 0, :] | (lg[..., 1, :] << 4), lg[..., 2, :] | (lg[..., 3, :] << 4)], -1)
    low = low.permute(0, 2, 3, 4, 1, 5, 6).reshape(T, ns, SUPER // SUB, 128)  # [.., j, g, row, i, byte]
    # top bits: column 16 j + 2 p + i -> lane (row, i), bits 2p: p = 0..3 low byte, 4..7 high byte
    hg = hi.view(T, TILE, ns, SUPER // SUB, 2, 4, 2)  # [T, row, s-block, j, byte, p % 4, i]
    # uint8 throughout (2-bit values shifted at most 6): no wider copy of the whole matrix (a
    # tied 49,152-row embedding would need 400 MB per int32 temporary while loading)
    high = hg[..., 0, :] | (hg[..., 1, :] << 2) | (hg[..., 2, :] << 4) | (hg[..., 3, :] << 6)
    high = high.permute(0, 2, 3, 1, 5, 4).reshape(T, ns, SUPER // SUB, 64)  # [.., j, row, i, byte]
    scales = sc.view(T, TILE, ns, SUPER // SUB).permute(0, 2, 3, 1).reshape(T, ns, SUB * TILE)
    data = torch.cat([scales.view(torch.uint8), torch.cat([low, high], -1).view(T, ns, -1)], -1)
    d_tiles = d.view(T, TILE, ns).permute(0, 2, 1).contiguous()
    return PackedWeight("q6", data.contiguous(), d_tiles, None, N, rows.in_features)


def unpack_q6(w: PackedWeight) -> QuantizedRows:
    """The inverse of `pack_q6`."""
    T, ns = w.d.shape[:2]
    nj = SUPER // SUB
    scales = w.data[..., : SUB * TILE].view(torch.int8).reshape(T, ns, nj, TILE).permute(0, 3, 1, 2)
    body = w.data[..., SUB * TILE :].reshape(T, ns, nj, 192)
    low = body[..., :128].reshape(T, ns, nj, 2, TILE, 2, 2)  # [.., j, g, row, i, byte]
    lo = torch.stack([low[..., 0] & 0x0F, low[..., 0] >> 4, low[..., 1] & 0x0F, low[..., 1] >> 4], -1)
    lo = lo.permute(0, 4, 1, 2, 3, 6, 5)  # [T, row, s-block, j, g, s, i]
    high = body[..., 128:].reshape(T, ns, nj, TILE, 2, 2).to(torch.int32)  # [.., j, row, i, byte]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    hi = (high.unsqueeze(-1) >> shifts) & 3  # [.., j, row, i, byte, p % 4]
    hi = hi.permute(0, 3, 1, 2, 5, 6, 4).to(torch.uint8)  # [T, row, s-block, j, byte, p % 4, i]
    K = ns * SUPER
    q = (lo.reshape(T * TILE, K) | (hi.reshape(T * TILE, K) << 4))[: w.out_features]
    d = w.d.permute(0, 2, 1).reshape(T * TILE, ns)[: w.out_features]
    sc = scales.reshape(T * TILE, ns * nj)[: w.out_features]
    return QuantizedRows("q6", q.contiguous(), d, None, w.in_features, sc.contiguous())

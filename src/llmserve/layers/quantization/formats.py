"""Block-quantized weights: quantizing float rows, packing them for the CPU kernels, and the torch
reference that dequantizes them again.

Three formats, in blocks of 32 input columns with IEEE half scales (GGUF's own math, so
Q8_0, Q4_0, Q4_1 and Q4_K tensors move over without rounding their values again), and GGUF
Q6_K's own super-blocks (formats_q6.py):

    q8   w[n, k] = d[n, b] * q[n, k] (+ m[n, b])  q int8 in [-127, 127]; a minimum only where
                                                  the rows came from 4-bit data (kept exactly)
    q4   w[n, k] = d[n, b] * q[n, k] + m[n, b]    q in [0, 15]            (b = k // 32)
         m = None: symmetric blocks, m = -8 d     (GGUF Q4_0: 18 bytes a block, not 20)
    q6   w[n, k] = d[n, s] * sc[n, j] * (q[n, k] - 32)   q in [0, 63], sc int8 per 16 columns
         (j = k // 16), d half per 256 (s = k // 256): GGUF Q6_K's math, 6.5625 bits a weight

    q4k  GGUF Q4_K's own scales, per row and super-block of 256 columns (s = k // 256): d, dmin
         (half floats) and per block of 32 its 6-bit multipliers sc, mn (a byte each):
             w[n, k] = half(d[n, s] * sc[n, b]) * q[n, k] + half(-dmin[n, s] * mn[n, b])
         q4's values computed in the kernels, rounded as the loader rounds them for q4 (one
         float32 product, exact for a half times a 6-bit integer, rounded to nearest even):
         the same bits as q4 from 18.5 bytes a block instead of 20. K a multiple of 256.

A symmetric q4 weight stores no minimum: every consumer (the C++ kernels, `dequantize`) computes
-8 d from the half scale, which is exact in float32 and equal to the half -8 d converted, so the
results are the same bits as with the minimum stored.

`QuantizedRows` is the logical form, one row per output feature (what loading produces and what
the fused layers collect shard by shard); `PackedWeight` is the kernels' tiled form (see
csrc/qgemm.h for the byte layout):

    PackedWeight.data  q8: int8  [tiles, blocks, 16 pairs, 16 rows, 2]
                       q4: uint8 [tiles, blocks, 4 groups, 16 rows, 2 lanes, 2 bytes]: a
                           little-endian 16-bit lane holds four 4-bit values, columns 8g + 2s + j
    PackedWeight.d, m  float16   [tiles, blocks, 16 rows]  (m absent: q8 without minimums,
                                                           symmetric q4)
                       q4k: d float16 [tiles, super-blocks, (d, dmin), 16 rows],
                            m uint8   [tiles, super-blocks, (sc, mn), 8 blocks, 16 rows]

Rows are padded to a multiple of 16 (tiles) and columns to a multiple of 32 (blocks) with zero
weights; the padding is never read back into results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

BLOCK = 32
"""Input columns per scale block."""
TILE = 16
"""Output rows per packed tile."""
SUPER_BLOCK = 256
"""Input columns per q4k super-block (GGUF's K types)."""

QuantFormat = Literal["q8", "q4", "q6", "q4k"]
BITS: dict[str, int] = {"q8": 8, "q4": 4, "q6": 6, "q4k": 4}
KERNEL_CODES: dict[str, int] = {"q8": 8, "q4": 4, "q6": 6, "q4k": 46}
"""What the C++ kernels are told a matrix is (csrc/qgemm.h's kQ8, kQ4, kQ6, kQ4K)."""


def num_blocks(k: int) -> int:
    return -(-k // BLOCK)


@dataclass(slots=True)
class QuantizedRows:
    """Rows of a block-quantized matrix [N, K] in logical order."""

    fmt: QuantFormat
    q: torch.Tensor
    """[N, blocks * 32]: int8 (q8) or uint8 in 0..15 (q4); columns past K are 0."""
    d: torch.Tensor
    """[N, blocks] float16 scales."""
    m: torch.Tensor | None
    """[N, blocks] float16 minimums (q4; q8 rows converted from q4). None: q8 without minimums,
    or symmetric q4 blocks whose minimum is -8 d (`minimums`)."""
    in_features: int
    """K, the logical number of columns."""
    scales: torch.Tensor | None = None
    """The K formats' sub-block multipliers. q6: [N, K / 16] int8 sub-block scales, `d` then
    [N, K / 256] (formats_q6.py). q4k: [N, blocks, 2] uint8, each block's 6-bit sc and mn (d and
    m then [N, super-blocks]: d and dmin)."""

    @property
    def num_rows(self) -> int:
        return self.q.shape[0]

    def minimums(self) -> torch.Tensor | None:
        """[N, blocks] float16: m, or -8 d for symmetric q4 (exact: a half times a power of two,
        unless |d| > 8188, weights past the half-float range); None for q8 without."""
        assert self.fmt != "q4k", "q4k rows: as_q4() first"
        if self.m is None and self.fmt == "q4":
            return -8 * self.d
        return self.m

    def as_q4(self) -> QuantizedRows:
        """q4k rows as q4 (half scale and minimum per block, `k_scales`); other rows as they are."""
        if self.fmt != "q4k":
            return self
        assert self.m is not None and self.scales is not None
        scale, minimum = k_scales(self.d, self.m, self.scales)
        return QuantizedRows("q4", self.q, scale, minimum, self.in_features)

    def select_rows(self, index: torch.Tensor) -> QuantizedRows:
        """The rows `index` (a row permutation, e.g. undoing llama.cpp's q/k reordering)."""
        m = None if self.m is None else self.m[index]
        sc = None if self.scales is None else self.scales[index]
        return QuantizedRows(self.fmt, self.q[index], self.d[index], m, self.in_features, sc)

    def row_range(self, start: int, end: int) -> QuantizedRows:
        """Rows start..end-1 (a part of a fused matrix stored whole, e.g. Phi-3's qkv)."""
        m = None if self.m is None else self.m[start:end]
        sc = None if self.scales is None else self.scales[start:end]
        return QuantizedRows(self.fmt, self.q[start:end], self.d[start:end], m, self.in_features, sc)

    @staticmethod
    def concat(parts: list[QuantizedRows]) -> QuantizedRows | None:
        """The parts' rows one after another (a fused layer's shards stored apart), or None
        when they differ in format, width or whether they carry minimums."""
        first = parts[0]
        if any(
            (r.fmt, r.in_features, r.m is None) != (first.fmt, first.in_features, first.m is None)
            for r in parts
        ):
            return None
        m = None if first.m is None else torch.cat([r.m for r in parts])  # type: ignore[misc]
        sc = None if first.scales is None else torch.cat([r.scales for r in parts])  # type: ignore[misc]
        q, d = torch.cat([r.q for r in parts]), torch.cat([r.d for r in parts])
        return QuantizedRows(first.fmt, q, d, m, first.in_features, sc)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        if self.fmt == "q6":
            from llmserve.layers.quantization.formats_q6 import dequantize_q6

            return dequantize_q6(self)
        if self.fmt == "q4k":
            return self.as_q4().dequantize()
        N, nb = self.d.shape
        q = self.q.view(N, nb, BLOCK).float()
        w = q * self.d.float().unsqueeze(-1)
        m = self.minimums()
        if m is not None:
            w = w + m.float().unsqueeze(-1)
        return w.view(N, nb * BLOCK)[:, : self.in_features]


def k_scales(d: torch.Tensor, dmin: torch.Tensor, sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF K-type super-blocks' per-block scale half(d sc) and minimum half(-dmin mn), [N, blocks]
    float16, from d, dmin [N, super-blocks] float16 and sub [N, blocks, 2] (sc, mn) uint8. The
    float32 product of a half and a 6-bit integer is exact, so each is one rounding to nearest
    even of the exact value: what the q4k kernels compute (csrc/qgemm.h)."""
    per = sub.shape[1] // d.shape[1]  # blocks per super-block (8)
    df = d.float().repeat_interleave(per, dim=1)
    dminf = dmin.float().repeat_interleave(per, dim=1)
    return (df * sub[..., 0].float()).half(), (-dminf * sub[..., 1].float()).half()


@dataclass(frozen=True, slots=True)
class PermutedRows:
    """Rows whose columns are the input's columns in the order `perm` (GPTQ act-order, made
    contiguous by group): column j of `rows` multiplies x[..., perm[j]], so the layer gathers
    its input by `perm` before the matmul."""

    rows: QuantizedRows
    perm: torch.Tensor
    """[K] int64, a permutation of the input columns."""


QUANTIZE_CHUNK_ELEMENTS = 1 << 22
"""`quantize` works on row chunks of about this many elements (16 MiB of float32 per temporary):
the rows are independent, and a whole 49,152 x 2,048 embedding at once made ~1.6 GB of float32
temporaries at load, above everything the loaded model then holds."""


def quantize(w: torch.Tensor, fmt: QuantFormat) -> QuantizedRows:
    """Block-quantize float rows w [N, K] (round to nearest; q4 spans each block's min..max)."""
    if fmt == "q6":
        raise ValueError(
            "block format 'q6' holds GGUF Q6_K blocks as they are; float rows quantize to q8 or q4"
        )
    if fmt not in ("q8", "q4"):
        raise ValueError(f"unknown block format {fmt!r}; known: q8, q4")
    N, K = w.shape
    nb = num_blocks(K)
    q = torch.empty(N, nb * BLOCK, dtype=torch.int8 if fmt == "q8" else torch.uint8)
    d = torch.empty(N, nb, dtype=torch.float16)
    m = torch.empty(N, nb, dtype=torch.float16) if fmt == "q4" else None
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // (nb * BLOCK))
    for r in range(0, N, step):
        rows = slice(r, min(N, r + step))
        _quantize_chunk(w[rows], K, fmt, q[rows], d[rows], None if m is None else m[rows])
    return QuantizedRows(fmt, q, d, m, K)


def _quantize_chunk(
    w: torch.Tensor,
    K: int,
    fmt: QuantFormat,
    q_out: torch.Tensor,
    d_out: torch.Tensor,
    m_out: torch.Tensor | None,
) -> None:
    """`quantize` on rows w [n, K], written into the output rows given."""
    N = w.shape[0]
    nb = d_out.shape[1]
    x = torch.zeros(N, nb * BLOCK, dtype=torch.float32)
    x[:, :K] = w.float()
    blocks = x.view(N, nb, BLOCK)
    if fmt == "q8":
        d = (blocks.abs().amax(-1) / 127.0).half()  # rounded first: q is chosen for the stored scale
        inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
        q_out.copy_(torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127).view(N, nb * BLOCK))
        d_out.copy_(d)
        return
    assert m_out is not None
    if K % BLOCK:
        # Padding columns would widen a block's range (they are 0): quantize the real ones only.
        lo = torch.where(torch.arange(nb * BLOCK) < K, x, torch.inf).view(N, nb, BLOCK).amin(-1)
        hi = torch.where(torch.arange(nb * BLOCK) < K, x, -torch.inf).view(N, nb, BLOCK).amax(-1)
    else:
        lo, hi = blocks.amin(-1), blocks.amax(-1)
    m = lo.half()
    d = ((hi - m.float()) / 15.0).half()
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round((blocks - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15).view(N, nb * BLOCK)
    q[:, K:] = 0
    q_out.copy_(q)
    d_out.copy_(d)
    m_out.copy_(m)


@dataclass(slots=True)
class PackedWeight:
    """A block-quantized [out_features, in_features] matrix in the kernels' tiled layout."""

    fmt: QuantFormat
    data: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def bits(self) -> int:
        return BITS[self.fmt]

    @property
    def code(self) -> int:
        """The format as the C++ kernels take it (KERNEL_CODES)."""
        return KERNEL_CODES[self.fmt]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.d, self.m) if t is not None)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.d, self.m) if t is not None]


def pack(rows: QuantizedRows) -> PackedWeight:
    """Tile logical rows for the kernels (csrc/qgemm.h)."""
    if rows.fmt == "q6":
        from llmserve.layers.quantization.formats_q6 import pack_q6

        return pack_q6(rows)
    N, nb = rows.d.shape
    T = -(-N // TILE)
    pad = T * TILE - N
    q, d, m = rows.q, rows.d, rows.m
    if pad:
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        d = torch.cat([d, d.new_zeros(pad, nb)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, nb)])
    if rows.fmt == "q4k":
        return _pack_q4k(rows, q, d, m, T)
    if rows.fmt == "q8":
        # [T, 16 rows, nb, 16 pairs, 2] -> [T, nb, 16 pairs, 16 rows, 2]
        data = q.view(T, TILE, nb, BLOCK // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
    else:
        # column k = 32 b + 8 g + 2 s + j; lane (g, row, j) holds the four values s = 0..3,
        # s = 0, 1 in its low byte and s = 2, 3 in its high byte.
        qg = q.view(T, TILE, nb, BLOCK // 8, 4, 2)
        lo, hi = qg[..., 0, :] | (qg[..., 1, :] << 4), qg[..., 2, :] | (qg[..., 3, :] << 4)
        lanes = torch.stack([lo, hi], dim=-1)  # [T, 16 rows, nb, 4 groups, 2 lanes, 2 bytes]
        data = lanes.permute(0, 2, 3, 1, 4, 5).contiguous()
    tile_major = lambda s: s.view(T, TILE, nb).permute(0, 2, 1).contiguous()  # noqa: E731
    return PackedWeight(
        rows.fmt, data, tile_major(d), None if m is None else tile_major(m), N, rows.in_features
    )


def _pack_q4k(
    rows: QuantizedRows, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, T: int
) -> PackedWeight:
    """q4k: q4's nibble tiles, d and dmin [T, S, 2, 16 rows], sc and mn [T, S, 2, 8, 16 rows]."""
    assert m is not None and rows.scales is not None and rows.in_features % SUPER_BLOCK == 0
    S = d.shape[1]
    sub = rows.scales
    if sub.shape[0] < T * TILE:
        sub = torch.cat([sub, sub.new_zeros(T * TILE - sub.shape[0], *sub.shape[1:])])
    nibbles = pack(
        QuantizedRows("q4", q, torch.zeros(T * TILE, S * 8, dtype=torch.float16), None, S * SUPER_BLOCK)
    )
    scales = torch.stack([d, m], dim=1).view(T, TILE, 2, S).permute(0, 3, 2, 1).contiguous()
    subs = sub.view(T, TILE, S, 8, 2).permute(0, 2, 4, 3, 1).contiguous()  # [T, S, 2, 8, 16]
    return PackedWeight("q4k", nibbles.data, scales, subs, rows.num_rows, rows.in_features)


def unpack(w: PackedWeight) -> QuantizedRows:
    """The inverse of `pack` (tests, and the torch fallback's dequantization)."""
    if w.fmt == "q6":
        from llmserve.layers.quantization.formats_q6 import unpack_q6

        return unpack_q6(w)
    if w.fmt == "q4k":
        assert w.m is not None
        T, S = w.d.shape[:2]
        q = unpack(
            PackedWeight("q4", w.data, w.d.new_zeros(T, S * 8, TILE), None, w.out_features, w.in_features)
        ).q
        d = w.d.permute(0, 3, 2, 1).reshape(T * TILE, 2, S)[: w.out_features]
        sub = w.m.permute(0, 4, 1, 3, 2).reshape(T * TILE, S * 8, 2)[: w.out_features]
        return QuantizedRows(
            "q4k", q, d[:, 0].contiguous(), d[:, 1].contiguous(), w.in_features, sub.contiguous()
        )
    T, nb = w.d.shape[:2]
    if w.fmt == "q8":
        q = w.data.permute(0, 3, 1, 2, 4).reshape(T * TILE, nb * BLOCK)
    else:
        lanes = w.data.permute(0, 3, 1, 2, 4, 5)  # [T, 16 rows, nb, 4 groups, 2 lanes, 2 bytes]
        lo, hi = lanes[..., 0], lanes[..., 1]
        q = torch.stack([lo & 0x0F, lo >> 4, hi & 0x0F, hi >> 4], dim=-2).reshape(T * TILE, nb * BLOCK)
    rows = lambda s: s.permute(0, 2, 1).reshape(T * TILE, nb)[: w.out_features]  # noqa: E731
    m = None if w.m is None else rows(w.m)
    return QuantizedRows(w.fmt, q[: w.out_features], rows(w.d), m, w.in_features)

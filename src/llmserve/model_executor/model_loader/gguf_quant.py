"""GGUF's block-quantized tensors read as `QuantizedRows`, without a round trip through float.

    Q8_0   34-byte blocks:  d (f16), 32 x int8                       w = d q           -> q8
    Q4_0   18-byte blocks:  d (f16), 16 bytes of nibbles              w = d (q - 8)     -> q4 (m = None)
    Q4_1   20-byte blocks:  d, m (f16), 16 bytes of nibbles           w = d q + m       -> q4
    Q5_0   22-byte blocks:  d (f16), 4 bytes of fifth bits, nibbles   w = d (q - 16)    -> q8
    Q5_1   24-byte blocks:  d, m (f16), fifth bits, nibbles           w = d q + m       -> q8 (+ m)
    Q4_K  144-byte super-blocks of 256: d, dmin (f16), twelve bytes of 6-bit sub-scales and
          sub-minimums for 8 sub-blocks of 32, 128 bytes of nibbles   w = d sc_j q - dmin m_j  -> q4k
    Q5_K  176-byte super-blocks: Q4_K's fields plus 32 bytes of fifth bits                 -> q8 (+ m)
    IQ4_NL  18-byte blocks: d (f16), 16 bytes of nibbles    w = d T[q], T a 16-entry int8 table -> q8
    IQ4_XS  136-byte super-blocks of 256: d (f16), 6-bit sub-scales ls_j of 8 sub-blocks (low
          nibbles in 4 bytes, high bit pairs in a u16), 128 bytes of nibbles
                                                            w = d (ls_j - 32) T[q]              -> q8
    MXFP4   17-byte blocks: e (an E8M0 exponent), 16 bytes of FP4 (E2M1) codes
                                                            w = 2^(e - 128) F[q], F = 2 x E2M1  -> q8
    Q6_K  210-byte super-blocks of 256: 128 bytes of low nibbles, 64 of top bit pairs, 16 int8
          sub-scales (one per 16 values), d (f16)           w = d sc_j (q - 32)  -> q6 (exact)

In the 32-element blocks, byte i holds element i in its low nibble and element i + 16 in its high
one (the fifth bit of element i is bit i of qh); in the K types each 32-byte run of nibbles holds
two sub-blocks the same way, low nibbles first, and the fifth bits of the 64 values of run j are
bits 2j and 2j + 1 of the 32 qh bytes. The 5-bit types fit int8 with their own scale (and minimum),
so they are kept exactly too. Q4_K keeps d, dmin and the 6-bit multipliers (q4k: the kernels
round d * sc_j and -dmin * m_j to half floats as q4 would). Q5_K's per-sub-block scale d * sc_j and minimum -dmin * m_j
are rounded to half floats (a relative error of at most 2^-11 on each, far below a quantization
step); IQ4_XS's d (ls_j - 32) likewise. IQ4_NL's and MXFP4's values are exact: their tables are
int8 (MXFP4's E2M1 values doubled, its scale halved: a power of two, exact in a half float for
exponents 2^-24 .. 2^15; a block outside that range sends the tensor to the float path). Other
types (Q2_K, Q3_K, floats) return None: the caller dequantizes them with `gguf`.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from llmserve.layers.quantization.formats import SUPER_BLOCK, QuantizedRows, k_scales
from llmserve.layers.quantization.mxfp4 import MXFP4_VALUES

_Q = GGMLQuantizationType

EXACT_TYPES = (
    _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q4_K, _Q.Q5_0, _Q.Q5_1, _Q.Q5_K, _Q.IQ4_NL, _Q.IQ4_XS, _Q.MXFP4, _Q.Q6_K,
)  # fmt: skip
"""GGUF types read directly into a block format."""


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
"""IQ4_NL's and IQ4_XS's non-linear levels (llama.cpp's kvalues_iq4nl)."""


def _halves(raw: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float16 (little-endian)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(raw: np.ndarray, n: int) -> np.ndarray:
    """[..., n / 8] little-endian bytes -> [..., n] bits (bit i of the little-endian integer)."""
    return np.unpackbits(np.ascontiguousarray(raw), axis=-1, bitorder="little")[..., :n]


def _k_fields(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K-type super-blocks [rows, n, bytes] -> d, dmin [rows, n] float16 and the 8 sub-blocks'
    6-bit scale and minimum multipliers [rows, n * 8, 2] uint8 (QuantizedRows.scales)."""
    rows, n = b.shape[:2]
    s = b[..., 4:16].astype(np.uint8)  # [rows, n, 12]
    # 6-bit scale and minimum of sub-block j: the low 6 bits of bytes j and j + 4 for j < 4;
    # for j >= 4 a low nibble of byte j + 4 plus the top two bits of byte j - 4 (scale) or j (min).
    sub = np.empty((rows, n, 8, 2), np.uint8)
    sub[..., :4, 0], sub[..., :4, 1] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sub[..., 4:, 0] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    sub[..., 4:, 1] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return _halves(b[..., 0:2]), _halves(b[..., 2:4]), torch.from_numpy(sub.reshape(rows, n * 8, 2))


def _k_scales(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-blocks' scales d * sc_j and minimums -dmin * m_j of K-type super-blocks
    [rows, n, bytes], as half floats [rows, n * 8] (formats.k_scales)."""
    return k_scales(*_k_fields(b))


def read_rows(data: np.ndarray, qtype: GGMLQuantizationType, in_features: int) -> QuantizedRows | None:
    """A GGUF tensor's raw bytes [rows, row_bytes] as block-quantized rows, or None for a type
    that does not map onto q8 / q4."""
    rows = data.shape[0]
    if qtype == _Q.Q8_0:
        b = data.reshape(rows, -1, 34)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1).copy())
        return QuantizedRows("q8", q, _halves(b[..., :2]), None, in_features)
    if qtype in (_Q.Q4_0, _Q.Q4_1):
        size = 18 if qtype == _Q.Q4_0 else 20
        b = data.reshape(rows, -1, size)
        d = _halves(b[..., :2])
        # Q4_0 is symmetric: no minimum is stored, the kernels take -8 d (formats.py), 18 bytes a block
        m = None if qtype == _Q.Q4_0 else _halves(b[..., 2:4])
        q = torch.from_numpy(_nibbles16(b[..., size - 16 :]).reshape(rows, -1))
        return QuantizedRows("q4", q, d, m, in_features)
    if qtype in (_Q.Q5_0, _Q.Q5_1):
        size = 22 if qtype == _Q.Q5_0 else 24
        b = data.reshape(rows, -1, size)
        q = _nibbles16(b[..., size - 16 :]) | (_bits(b[..., size - 20 : size - 16], 32) << 4)  # 0..31
        d = _halves(b[..., :2])
        if qtype == _Q.Q5_0:  # symmetric: q - 16 in [-16, 15] is int8 with the same scale
            q8 = torch.from_numpy(q.astype(np.int8) - 16).reshape(rows, -1)
            return QuantizedRows("q8", q8, d, None, in_features)
        q8 = torch.from_numpy(q.astype(np.int8)).reshape(rows, -1)
        return QuantizedRows("q8", q8, d, _halves(b[..., 2:4]), in_features)
    if qtype == _Q.Q4_K:
        b = data.reshape(rows, -1, 144)
        qs = b[..., 16:].reshape(rows, -1, 4, 32)  # 4 runs of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1)
        if in_features % SUPER_BLOCK:  # (ggml's K types are whole super-blocks; kept general)
            return QuantizedRows("q4", torch.from_numpy(q), *_k_scales(b), in_features)
        d, dmin, sub = _k_fields(b)
        return QuantizedRows("q4k", torch.from_numpy(q), d, dmin, in_features, sub)
    if qtype == _Q.Q5_K:
        b = data.reshape(rows, -1, 176)
        qs = b[..., 48:].reshape(rows, -1, 4, 32)
        high = _bits(b[..., 16:48, None], 8)  # [rows, n, 32 bytes, 8 bits]: bit j of byte l
        high = np.moveaxis(high, 3, 2).reshape(rows, -1, 4, 2, 32)  # run c: bits 2c (low), 2c + 1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3) | (high << 4)
        q8 = torch.from_numpy(q.astype(np.int8).reshape(rows, -1))
        return QuantizedRows("q8", q8, *_k_scales(b), in_features)
    if qtype == _Q.IQ4_NL:
        b = data.reshape(rows, -1, 18)
        q8 = torch.from_numpy(IQ4_VALUES[_nibbles16(b[..., 2:])].reshape(rows, -1))
        return QuantizedRows("q8", q8, _halves(b[..., :2]), None, in_features)
    if qtype == _Q.IQ4_XS:
        b = data.reshape(rows, -1, 136)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [rows, n]
        high = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0]  # 2 bits per sub-block
        low = b[..., 4:8]  # a nibble per sub-block: j even low, j odd high nibble of byte j // 2
        j = np.arange(8)
        ls = ((low[..., j // 2] >> (4 * (j % 2))) & 0x0F) | (((high[..., None] >> (2 * j)) & 3) << 4)
        scale = torch.from_numpy((d[..., None] * (ls.astype(np.float32) - 32)).reshape(rows, -1)).half()
        qs = b[..., 8:].reshape(rows, -1, 8, 16)  # sub-block j: 16 bytes, elements i and i + 16
        q8 = torch.from_numpy(IQ4_VALUES[_nibbles16(qs)].reshape(rows, -1))
        return QuantizedRows("q8", q8, scale, None, in_features)
    if qtype == _Q.MXFP4:
        b = data.reshape(rows, -1, 17)
        e = b[..., 0].astype(np.int32) - 128
        if e.size and (e.min() < -24 or e.max() > 15):  # 2^e not a (sub)normal half float
            return None
        q8 = torch.from_numpy(MXFP4_VALUES[_nibbles16(b[..., 1:])].reshape(rows, -1))
        return QuantizedRows(
            "q8", q8, torch.from_numpy(np.ldexp(np.float32(1), e).astype(np.float16)), None, in_features
        )
    if qtype == _Q.Q6_K:
        return _q6_k_rows(data.reshape(rows, -1, 210), in_features)
    return None


def _q6_k_rows(b: np.ndarray, in_features: int) -> QuantizedRows:
    """Q6_K super-blocks [rows, n, 210] as q6 rows. Each half of 128 values takes 64 bytes of
    nibbles (ql) and 32 of bit pairs (qh): value 32 k + l (k = 0..3, l = 0..31) is the low (k < 2)
    or high (k >= 2) nibble of ql[l + 32 (k % 2)], with bits 2k, 2k + 1 of qh[l] on top."""
    rows, n = b.shape[:2]
    ql = b[..., :128].reshape(rows, n, 2, 2, 32)  # [half, k % 2, l]
    qh = b[..., 128:192].reshape(rows, n, 2, 1, 32)  # [half, -, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [half, k, l]: k = 0, 1 low nibbles; 2, 3 high
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [half, k, l]
    q = torch.from_numpy((low | (high << 4)).reshape(rows, n * 256))
    scales = torch.from_numpy(
        np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(rows, n * 16).copy()
    )
    return QuantizedRows("q6", q, _halves(b[..., 208:210]), None, in_features, scales)

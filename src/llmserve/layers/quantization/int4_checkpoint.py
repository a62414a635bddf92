"""GPTQ and AWQ 4-bit checkpoint tensors read into q4 rows (formats.py), without a float round trip.

Both formats store, per linear layer [N out, K in], 4-bit codes q, a zero point z and an fp16
scale s per (group of input columns, output column):

    w[n, k] = s[g(k), n] * (q[n, k] - z[g(k), n])

    GPTQ  qweight int32 [K / 8, N]  word (i, n) holds q[n, 8i + j] in bits 4j..4j+3
          qzeros  int32 [G, N / 8]  word (g, c) holds z[g, 8c + j] in bits 4j..4j+3
          scales  fp16  [G, N]      g_idx int32 [K]: g(k) (k // group_size, or any order
                                    with act-order, `desc_act`)
          AutoGPTQ's v1 format (`checkpoint_format` "gptq", the default) stores z - 1 (its kernels
          add 1 back, and a zero of 0 wraps to 15 + 1 = 16); "gptq_v2" stores z itself.
    AWQ   qweight int32 [K, N / 8]  word (k, c) holds q[8c + AWQ_ORDER[j], k] in bits 4j..4j+3
          qzeros  int32 [G, N / 8]  the same interleaving; z stored as it is
          scales  fp16  [G, N]      g(k) = k // group_size

Onto q4 blocks of 32 columns (w = d q + m): each block lies inside one group (group sizes are
multiples of 32), so it takes its group's values, d = s exactly, and

    z = 8 in every group of the layer   m = None (symmetric q4, -8 d): exact
    otherwise                           m = -z d rounded to fp16: the only rounding; a weight moves
                                        by at most 2^-11 |z d| (a 128th of a step for z <= 16),
                                        the same for the whole block

and as q8 blocks (`--quantization int8`): q - z in -16..15 as int8, d = s: exact for every
layer, at twice the bytes of q4's codes.

Act-order (g_idx not grouped): the columns are sorted by group (a stable sort) so each group is
contiguous, and the layer gathers its input by the same permutation (`PermutedRows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.layers.quantization.formats import BLOCK, PermutedRows, QuantFormat, QuantizedRows, num_blocks
from llmserve.load_errors import ModelLoadError, WeightShapeError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's nibble j of a word holds output column 8c + AWQ_ORDER[j]."""
_AWQ_UNDO = [AWQ_ORDER.index(c) for c in range(8)]  # column c is nibble _AWQ_UNDO[c]


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of 8 nibbles (nibble j in bits 4j..4j+3) -> uint8 values, the 8 of a word
    consecutive along `dim` (0: [R, C] -> [8 R, C]; 1: [R, C] -> [R, 8 C])."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    x = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # [R, C, 8]
    if dim == 0:
        return x.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return x.reshape(packed.shape[0], -1)


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """A 4-bit grouped layer in logical order: w[n, k] = s[g(k), n] (q[n, k] - z[g(k), n])."""

    name: str
    """The checkpoint prefix, for messages."""
    q: torch.Tensor
    """[N, K] uint8 codes 0..15."""
    zeros: torch.Tensor
    """[G, N] int32 zero points (0..16)."""
    scales: torch.Tensor
    """[G, N] float16."""
    g_idx: torch.Tensor
    """[K] int64: each input column's group."""

    @property
    def act_order(self) -> bool:
        return bool((self.g_idx[1:] < self.g_idx[:-1]).any())

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, the format's own formula (exact: a half times an integer <= 16)."""
        z, s = self.zeros[self.g_idx].T.float(), self.scales[self.g_idx].T.float()  # [N, K]
        return (self.q.float() - z) * s

    def to_rows(self, fmt: QuantFormat = "q4") -> QuantizedRows | PermutedRows:
        """Rows in `fmt` (columns regrouped and the permutation attached under act-order). q8 holds
        q - z in int8 with d = s and no minimum: exact for asymmetric layers too."""
        N, K = self.q.shape
        q, g, perm = self.q, self.g_idx, None
        if self.act_order:
            perm = torch.sort(g, stable=True).indices
            q, g = q[:, perm], g[perm]
        nb = num_blocks(K)
        g_blocks = torch.cat([g, g[-1:].expand(nb * BLOCK - K)]).view(nb, BLOCK)  # padding: last group
        if (g_blocks != g_blocks[:, :1]).any():
            raise ModelLoadError(
                f"{self.name}: its groups are not whole blocks of {BLOCK} input columns (g_idx); "
                f"group sizes must be multiples of {BLOCK}"
            )
        block_group = g_blocks[:, 0]  # [nb]
        d = self.scales[block_group].T.contiguous()  # [N, nb]
        z = self.zeros[block_group].T  # [N, nb]
        if fmt == "q8":
            codes = torch.zeros(N, nb * BLOCK, dtype=torch.int8)
            z_cols = z.repeat_interleave(BLOCK, dim=1)[:, :K]  # [N, K]: each column's zero
            codes[:, :K] = (q.to(torch.int16) - z_cols).to(torch.int8)  # in -16..15
            rows = QuantizedRows("q8", codes, d, None, K)
        else:
            m = None if bool((z == 8).all()) else (-z.float() * d.float()).half()
            codes = torch.zeros(N, nb * BLOCK, dtype=torch.uint8)
            codes[:, :K] = q
            rows = QuantizedRows("q4", codes, d, m, K)
        return rows if perm is None else PermutedRows(rows, perm)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != shape:
        raise WeightShapeError(name, shape, tuple(t.shape))
    if t.dtype not in dtypes:
        raise ModelLoadError(f"{name}: dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")


def _scales(name: str, scales: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """fp16 scales [G, N] (bf16 / fp32 ones rounded to fp16), and G."""
    if scales.dim() != 2 or scales.shape[1] != N:
        raise WeightShapeError(f"{name}.scales", (-1, N), tuple(scales.shape))
    if not scales.is_floating_point():
        raise ModelLoadError(f"{name}.scales: dtype {scales.dtype}, expected float16")
    return scales.half(), scales.shape[0]


def gptq_groups(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
) -> Int4Groups:
    """A GPTQ layer's tensors (prefix `name`); `zero_offset` 1 for the v1 format, 0 for v2;
    g_idx None: k // group_size (group_size -1: one group)."""
    if qweight.dim() != 2:
        raise WeightShapeError(f"{name}.qweight", (-1, -1), tuple(qweight.shape))
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    s, G = _scales(name, scales, N)
    _check(f"{name}.qweight", qweight, (K // 8, N), (torch.int32,))
    _check(f"{name}.qzeros", qzeros, (G, -(-N // 8)), (torch.int32,))
    if g_idx is None:
        g = torch.arange(K) // (K if group_size == -1 else group_size)
    else:
        _check(f"{name}.g_idx", g_idx, (K,), (torch.int32, torch.int64))
        g = g_idx.long()
    if g.numel() and (g.min() < 0 or g.max() >= G):
        raise ModelLoadError(f"{name}.g_idx: group indices must lie in 0..{G - 1} ({G} groups of scales)")
    q = unpack_nibbles(qweight, 0).T.contiguous()  # [N, K]
    z = unpack_nibbles(qzeros, 1)[:, :N].int() + zero_offset  # [G, N]
    return Int4Groups(name, q, z, s, g)


def awq_groups(
    name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> Int4Groups:
    """An AWQ (GEMM) layer's tensors (prefix `name`)."""
    if qweight.dim() != 2:
        raise WeightShapeError(f"{name}.qweight", (-1, -1), tuple(qweight.shape))
    K, N = qweight.shape[0], qweight.shape[1] * 8
    s, G = _scales(name, scales, N)
    _check(f"{name}.qweight", qweight, (K, N // 8), (torch.int32,))
    _check(f"{name}.qzeros", qzeros, (G, N // 8), (torch.int32,))
    g = torch.arange(K) // (K if group_size == -1 else group_size)
    if int(g.max()) + 1 != G:
        raise ModelLoadError(
            f"{name}.scales: {G} groups, but {K} inputs in groups of {group_size} make {int(g.max()) + 1}"
        )

    def undo(packed: torch.Tensor) -> torch.Tensor:  # [R, N / 8] words -> [R, N] in column order
        return (
            unpack_nibbles(packed, 1)
            .view(packed.shape[0], -1, 8)[..., _AWQ_UNDO]
            .reshape(packed.shape[0], -1)
        )

    return Int4Groups(name, undo(qweight).T.contiguous(), undo(qzeros).int(), s, g)

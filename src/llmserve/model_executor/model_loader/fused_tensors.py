"""Fused checkpoint tensors cut into the parts a model loads (`CausalLM.checkpoint_splits`).

Phi-3 stores q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj`. llmserve's layers
are fused too, but load shard by shard (layers/linear.py), which is also how tensor parallelism
cuts them (each part by heads or columns) and how a GGUF file that stores the parts apart arrives.
Cutting the fused tensor by rows as it streams in gives every one of those paths the same input:

    qkv_proj.weight [q + 2 kv, H]  ->  q_proj.weight [q, H], k_proj.weight [kv, H], v_proj.weight [kv, H]

A GGUF tensor kept quantized (`QuantizedRows`), or a pre-quantized checkpoint's layer once read
(GPTQ, AWQ, FP8), is cut the same way: its rows are output channels, each with its own scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from llmserve.layers.quantization.formats import PermutedRows, QuantizedRows
from llmserve.layers.quantization.fp8 import Fp8Weight
from llmserve.load_errors import ModelLoadError, WeightShapeError

Weights = Iterable[tuple[str, Any, str]]
"""(checkpoint name, tensor, file) as the loaders yield them."""


def split_fused(
    weights: Weights, splits: dict[str, tuple[tuple[str, int], ...]]
) -> Iterator[tuple[str, Any, str]]:
    """`weights` with each tensor named `<prefix>.<fused>.weight` (or `.bias`), for a `<fused>`
    in `splits`, replaced by its parts in order; the other tensors as they come."""
    for name, tensor, file in weights:
        head, _, suffix = name.rpartition(".")
        key = next((k for k in splits if head == k or head.endswith(f".{k}")), None)
        if key is None:
            yield name, tensor, file
            continue
        if suffix not in ("weight", "bias"):  # (pre-quantized layers arrive read: P.weight)
            raise ModelLoadError(
                f"{file}: {name}: a fused {key.rpartition('.')[2]}'s {suffix!r} cannot be cut into its parts"
            )
        prefix = head[: len(head) - len(key)]
        parts = splits[key]
        shape = _shape(tensor)
        if shape[0] != sum(n for _, n in parts):
            raise WeightShapeError(name, (sum(n for _, n in parts), *shape[1:]), shape, file)
        start = 0
        for part, n in parts:
            yield f"{prefix}{part}.{suffix}", _rows(tensor, start, start + n), file
            start += n


def _shape(tensor: Any) -> tuple[int, ...]:
    if isinstance(tensor, PermutedRows):
        tensor = tensor.rows
    if isinstance(tensor, QuantizedRows):
        return (tensor.num_rows, tensor.in_features)
    if isinstance(tensor, Fp8Weight):
        tensor = tensor.q
    if isinstance(tensor, torch.Tensor):
        return tuple(int(n) for n in tensor.shape)
    raise ModelLoadError(f"cannot cut a {type(tensor).__name__} into a fused layer's parts")


def _rows(tensor: Any, start: int, end: int) -> Any:
    """Rows start..end-1 of any weight a loader yields: rows are output channels, each with its
    own scales (an FP8 per-tensor scale is held repeated per row), so a slice is exact."""
    if isinstance(tensor, PermutedRows):  # GPTQ act-order: the column order is the whole layer's
        return PermutedRows(tensor.rows.row_range(start, end), tensor.perm)
    if isinstance(tensor, QuantizedRows):
        return tensor.row_range(start, end)
    if isinstance(tensor, Fp8Weight):
        return Fp8Weight(tensor.q[start:end], tensor.scale[start:end])
    return tensor[start:end]

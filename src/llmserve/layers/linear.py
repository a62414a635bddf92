"""Linear layers: weights loaded input-major and column-chunked, optionally repacked for oneDNN.

A weight W (logically [in, out]) is stored as `num_chunks` contiguous column blocks:

    weight: [num_chunks, in_features, out_features / num_chunks]
             chunk c holds logical columns c*Nc .. (c+1)*Nc - 1

and applied as one batched matmul, `bmm(x, weight)`, whose batch dimension is the chunk. On a CPU
there is one chunk per thread, so each thread streams its own contiguous block of memory; at
batch 1 this reads SmolLM2's 538 MB of weights at ~33 GB/s where `x @ W` reaches ~21 GB/s and
`F.linear` ~16 GB/s (benchmarks/bench_linear.py, figures in docs/benchmarks.md). On CUDA there is one chunk and it is `x @ W`.

Checkpoints store [out, in]; `load_shard` transposes while copying into the model's tensor, so a
weight is materialised exactly once. A fused layer (qkv, gate_up) is one matmul whose output
columns are the concatenation of `output_sizes`; each checkpoint tensor fills one shard.

On CPUs where torch has oneDNN, the loader then calls `use_onednn()` on every layer: the weight is
turned back into its logical [out, in] matrix and reordered into oneDNN's blocked layout (onednn.py),
which runs the same matmuls 1.7-2.4x faster than MKL's bmm on the chunked layout at every batch size
from 4 up. The chunked layout stays as the path for CUDA and for torch builds without oneDNN.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers import onednn
from llmserve.load_errors import WeightShapeError

MIN_CHUNK_COLUMNS = 64


def num_weight_chunks(out_features: int) -> int:
    """Column chunks for a weight created on the current default device: one per CPU thread
    (fewer if `out_features` does not divide evenly), one on accelerators."""
    if torch.get_default_device().type != "cpu":
        return 1
    # Below ~64 columns per chunk the per-chunk matmuls get too thin to stream well.
    n = max(1, min(torch.get_num_threads(), out_features // MIN_CHUNK_COLUMNS))
    while out_features % n:
        n -= 1
    return n


def chunked_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times a chunked weight [C, K, Nc] (+ bias [C * Nc]) -> [M, C * Nc]."""
    C, K, Nc = weight.shape
    M = x.shape[0]
    if C == 1:
        w = weight[0]
        return x @ w if bias is None else torch.addmm(bias, x, w)
    xb = x.expand(C, M, K)
    # [C, M, Nc]: chunk c computed by its own thread from its own contiguous weight block
    out = torch.bmm(xb, weight) if bias is None else torch.baddbmm(bias.view(C, 1, Nc), xb, weight)
    if M == 1:
        return out.view(1, C * Nc)  # [C, 1, Nc] is already [1, C * Nc] in memory
    return out.transpose(0, 1).reshape(M, C * Nc)


def copy_columns(weight: torch.Tensor, start: int, src: torch.Tensor) -> None:
    """Write src [K, n] into logical columns start .. start + n of a chunked weight [C, K, Nc]."""
    Nc = weight.shape[2]
    end = start + src.shape[1]
    col = start
    while col < end:
        c, off = divmod(col, Nc)
        take = min(end - col, Nc - off)
        weight[c, :, off : off + take].copy_(src[:, col - start : col - start + take])
        col += take


class Linear(nn.Module):
    packed = False
    """True once `use_onednn` replaced the chunked weight by oneDNN's packed [out, in] copy."""

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        C = num_weight_chunks(self.out_features)
        self.weight = nn.Parameter(torch.empty(C, in_features, self.out_features // C), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed:
            return onednn.linear(x, self.weight, self.bias)
        if x.dim() == 2:  # the model's flat [T, in] batch: no reshapes
            return chunked_matmul(x, self.weight, self.bias)
        lead = x.shape[:-1]
        out = chunked_matmul(x.reshape(-1, self.in_features), self.weight, self.bias)
        return out.view(*lead, self.out_features)

    def logical_weight(self) -> torch.Tensor:
        """The weight as checkpoints store it, [out, in] (a strided view of the chunked tensor)."""
        C, K, Nc = self.weight.shape
        return self.weight.permute(1, 0, 2).reshape(K, C * Nc).t()

    def logical_bias(self) -> torch.Tensor | None:
        """The bias in output-column order, [out]."""
        return self.bias

    def use_onednn(self) -> None:
        """Replace the chunked weight by oneDNN's packed copy of [out, in]; `forward` then runs
        oneDNN's matmul. One layer's weight is copied twice at most while this runs."""
        if self.packed:
            return
        weight = onednn.pack(self.logical_weight())
        bias = self.logical_bias()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.packed = True

    def _shard_range(self, shard: int) -> tuple[int, int]:
        start = sum(self.output_sizes[:shard])
        return start, start + self.output_sizes[shard]

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0, is_bias: bool = False) -> None:
        """Copy a checkpoint tensor ([out, in] for a weight, [out] for a bias) into `shard`."""
        start, end = self._shard_range(shard)
        if is_bias:
            assert self.bias is not None, f"{name}: this layer has no bias"
            if tuple(loaded.shape) != (end - start,):
                raise WeightShapeError(name, (end - start,), tuple(loaded.shape))
            self.bias.data[start:end].copy_(loaded)
            return
        expected = (end - start, self.in_features)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(name, expected, tuple(loaded.shape))
        copy_columns(self.weight.data, start, loaded.t())

    def extra_repr(self) -> str:
        layout = "onednn" if self.packed else f"{self.weight.shape[0]} chunks"
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, {layout}"

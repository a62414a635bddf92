"""The gated MLP (SwiGLU / GeGLU) of Llama-family and Gemma models, laid out so that each CPU
thread owns a slice of the intermediate dimension from end to end.

    out = down_proj(act(x @ W_gate) * (x @ W_up))

This is the tensor-parallel split of Megatron-style MLPs, applied to the threads of one CPU:

    gate_up: [C, H, 2 * I/C]   chunk c = [gate columns of slice c | up columns of slice c]
    down:    [C, I/C, H]       chunk c = the down_proj rows of slice c  (same memory as [I, H])

    x [M, H] --bmm--> [C, M, 2I/C] --act(gate)*up--> [C, M, I/C] --bmm--> [C, M, H] --sum(0)--> [M, H]

Each bmm streams one contiguous weight block per thread and nothing is transposed between the two
matmuls; the only extra work is summing C partial outputs of size [M, H].

After `use_onednn()` (linear.py) both projections hold oneDNN-packed [out, in] weights and the MLP is
two plain matmuls: x -> [M, gate | up] -> act(gate) * up -> [M, H].
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.activation import GatedActivation, gated_kernel, get_activation
from llmserve.layers.linear import Linear, num_weight_chunks
from llmserve.load_errors import WeightShapeError


class GateUpLinear(Linear):
    """The fused [gate | up] projection, each chunk holding matching slices of both."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_chunks: int, bias: bool = False) -> None:
        nn.Module.__init__(self)
        self.in_features, self.intermediate_size = hidden_size, intermediate_size
        self.output_sizes = [intermediate_size, intermediate_size]
        self.out_features = 2 * intermediate_size
        C, Ic = num_chunks, intermediate_size // num_chunks
        self.weight = nn.Parameter(torch.empty(C, hidden_size, 2 * Ic), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(C, 1, 2 * Ic), requires_grad=False) if bias else None

    def forward_chunks(self, x: torch.Tensor) -> torch.Tensor:  # [M, H] -> [C, M, 2 * I/C]
        C, H, _ = self.weight.shape
        xb = x.expand(C, x.shape[0], H)
        return torch.bmm(xb, self.weight) if self.bias is None else torch.baddbmm(self.bias, xb, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logical [M, 2I] output as [gate | up] (for callers that want the plain layout)."""
        if self.packed:
            return super().forward(x)
        out = self.forward_chunks(x)
        Ic = out.shape[-1] // 2
        gate = out[..., :Ic].transpose(0, 1).reshape(x.shape[0], -1)
        up = out[..., Ic:].transpose(0, 1).reshape(x.shape[0], -1)
        return torch.cat([gate, up], dim=-1)

    def _halves(self, chunked: torch.Tensor) -> torch.Tensor:
        """[C, rows, 2 * I/C] -> [rows, 2I] as [gate | up]."""
        C, rows, two_ic = chunked.shape
        Ic = two_ic // 2
        gate = chunked[..., :Ic].permute(1, 0, 2).reshape(rows, C * Ic)
        up = chunked[..., Ic:].permute(1, 0, 2).reshape(rows, C * Ic)
        return torch.cat([gate, up], dim=1)

    def logical_weight(self) -> torch.Tensor:  # [2I, H]: gate_proj's rows, then up_proj's
        return self._halves(self.weight).t()

    def logical_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self._halves(self.bias)[0]

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0, is_bias: bool = False) -> None:
        """shard 0 = gate_proj, 1 = up_proj; a weight is [I, H], a bias [I]."""
        inner, H = self.intermediate_size, self.in_features
        expected = (inner,) if is_bias else (inner, H)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(name, expected, tuple(loaded.shape))
        C, Ic = self.weight.shape[0], inner // self.weight.shape[0]
        target = self.bias.data if is_bias else self.weight.data  # type: ignore[union-attr]
        for c in range(C):
            rows = loaded[c * Ic : (c + 1) * Ic]  # this slice's [Ic, H] (or [Ic])
            cols = slice(shard * Ic, (shard + 1) * Ic)
            target[c, :, cols].copy_(rows.t() if not is_bias else rows)


class DownLinear(Linear):
    """down_proj split along its input: chunk c multiplies slice c of the intermediate activation."""

    def __init__(self, intermediate_size: int, hidden_size: int, num_chunks: int, bias: bool = False) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = intermediate_size, hidden_size
        self.output_sizes = [hidden_size]
        C = num_chunks
        self.weight = nn.Parameter(torch.empty(C, intermediate_size // C, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None

    def forward_chunks(self, h: torch.Tensor) -> torch.Tensor:  # [C, M, I/C] -> [M, H]
        partial = torch.bmm(h, self.weight)  # [C, M, H]
        out = partial[0] if partial.shape[0] == 1 else partial.sum(0)
        return out if self.bias is None else out + self.bias

    def logical_weight(self) -> torch.Tensor:  # [H, I]
        return self.weight.view(self.in_features, self.out_features).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, I] -> [M, H]
        if self.packed:
            return super().forward(x)
        # [C, I/C, H] is [I, H] in memory.
        out = x @ self.weight.view(self.in_features, self.out_features)
        return out if self.bias is None else out + self.bias

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0, is_bias: bool = False) -> None:
        expected = (self.out_features,) if is_bias else (self.out_features, self.in_features)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(name, expected, tuple(loaded.shape))
        if is_bias:
            self.bias.data.copy_(loaded)  # type: ignore[union-attr]
        else:
            self.weight.data.view(self.in_features, self.out_features).copy_(loaded.t())


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); checkpoint names gate_proj / up_proj / down_proj (models map
    gate_proj and up_proj to shards 0 and 1 of `gate_up_proj`). `glu` replaces act(gate) * up
    with glu(gate, up) (gpt-oss's clamped SwiGLU)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool = False,
        glu: GatedActivation | None = None,
    ) -> None:
        super().__init__()
        self.glu = glu
        C = num_weight_chunks(intermediate_size)
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, C, bias)
        self.down_proj = DownLinear(intermediate_size, hidden_size, C, bias)
        self.act = get_activation(act)
        self.act_name = act

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up if self.glu is None else self.glu(gate, up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, H]
        if x.is_cuda and self.glu is None and (fused := gated_kernel(self.act_name)) is not None:
            if self.gate_up_proj.packed:  # fp8 layers: the plain [M, gate | up] layout
                return self.down_proj(fused(self.gate_up_proj(x)))
            # One chunk on a GPU: [1, M, gate | up], act(gate) * up in one kernel
            return self.down_proj.forward_chunks(fused(self.gate_up_proj.forward_chunks(x)))
        if self.gate_up_proj.packed:
            gate_up = self.gate_up_proj(x)  # [M, gate | up]
            inner = gate_up.shape[-1] // 2
            return self.down_proj(self.gated(gate_up[..., :inner], gate_up[..., inner:]))
        gate_up = self.gate_up_proj.forward_chunks(x)  # [C, M, 2 * I/C]
        Ic = gate_up.shape[-1] // 2
        return self.down_proj.forward_chunks(self.gated(gate_up[..., :Ic], gate_up[..., Ic:]))

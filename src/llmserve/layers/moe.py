"""Sparse mixture-of-experts MLP blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): a router picks
`top_k` of `num_experts` gated MLPs per token, and the token's output is their weighted sum.

    probs  = softmax(x @ W_router.T)                  [T, E], in float32
    w, ids = top_k(probs)                             [T, k]  (w / sum(w) where the model normalises)
    (gpt-oss: logits = x @ W_router.T + b; w, ids = top_k(logits); w = softmax(w), over the k chosen)
    out[t] = sum_j w[t, j] * expert[ids[t, j]](x[t])   (+ sigmoid(x @ g) * shared_expert(x), Qwen2-MoE)

Experts run grouped by expert: the T * k (token, expert) pairs are sorted by expert, and each
expert that any token chose runs once over the rows of the tokens that chose it, never once per
token. At batch 1 that is `top_k` small MLPs, and only their weights are read: decode costs what
the active parameters cost (benchmarks/bench_moe.py measures it against a dense model of that size).

Each expert is a `GatedMLP` (its `gate_up_proj` and `down_proj` are ordinary linear layers), so
quantized experts are the same q8 / q4 layers as a dense model's, built by the same plan and loaded
from the same checkpoint names (`experts.<e>.gate_proj`...). The router stays float: it is tiny,
and rounding it would move tokens between experts.

How the experts run is the device profile's choice (`DeviceProfile.moe_kernel`, applied by the
loader through `use_moe_kernel`):

    grouped   the CPU: grouping needs the chosen experts on the host (one `tolist()` per layer),
              free on the CPU
    triton    CUDA: the same grouping on the device, in two Triton kernels (triton_moe.py), with
              no host sync, so decode steps replay in CUDA graphs; the experts' weights stacked
              into [E, H, 2I] / [E, I, H] tensors that the experts' own parameters then view.
              Eager steps of `GROUPED_FROM_TOKENS` tokens or more (long prefill chunks) run
              `grouped` instead: there cuBLAS per expert beats the kernel's tiles
    dense     CUDA without triton, experts the kernel does not take (fp8 or quantized layers,
              activations other than SiLU / GELU-tanh, gpt-oss's biased experts with the clamped
              SwiGLU), layers offloaded to the host, and experts
              wrapped for LoRA: every expert over every token, weighted by a routing matrix that is
              zero for unchosen experts. Same result, sync-free, and E / k times the expert FLOPs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.activation import GatedActivation, fused_gated_name
from llmserve.layers.mlp import DownLinear, GatedMLP, GateUpLinear

MoEKernel = Literal["grouped", "triton", "dense"]

GROUPED_FROM_TOKENS = 1024
"""Under the `triton` kernel, a step of at least this many tokens that is not being captured into
a CUDA graph runs `grouped` (cuBLAS per expert, one host sync per layer, nothing at this size). On
an H100 at Mixtral-8x7B's width in bf16 (benchmarks/gpu/moe_kernel.py, eager, ms): 2,048 tokens
3.35 grouped against the kernel's 5.32 (2026-11-26); 1,024 tokens 2.12 against 2.98, 512 tokens
1.85 against 2.10, 256 tokens 2.90 against 1.76 (2026-11-27). Eager grouped times move by a
tenth or more from run to run, so the switch sits at 1,024, where the gap is widest."""


class Router(nn.Module):
    """The expert-choice logits x @ W.T (+ b) (W [num_experts, hidden], as checkpoints store it).
    Plain parameters, not a `Linear`: quantization plans only replace linear layers."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        return F.linear(x, self.weight, self.bias)


class SparseMoE(nn.Module):
    """A top-k routed set of gated MLP experts, with an optional gated shared expert."""

    kernel: MoEKernel
    """How the experts run (module docstring); `use_kernel` sets it."""
    w13: torch.Tensor | None = None
    """"triton": the experts' gate_up weights stacked, [E, H, 2I] (the kernel reads these)."""
    w2: torch.Tensor | None = None
    """"triton": the experts' down weights stacked, [E, I, H]."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_intermediate_size: int,
        act: str,
        renormalize: bool,
        shared_intermediate_size: int = 0,
        softmax_after_top_k: bool = False,
        bias: bool = False,
        glu: GatedActivation | None = None,
    ) -> None:
        """`softmax_after_top_k`: the softmax runs over the k chosen logits (gpt-oss) instead of
        over all experts before choosing; `bias`: the router and the experts' projections have
        biases; `glu`: the experts' gating (mlp.GatedMLP)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # until the loader applies the device profile's choice (`use_moe_kernel`): the host-synced
        # grouping only where it is free, as `num_weight_chunks` reads the device being built on
        self.kernel = "grouped" if torch.get_default_device().type == "cpu" else "dense"
        self.softmax_after_top_k = softmax_after_top_k
        self.gate = Router(hidden_size, num_experts, bias)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, expert_intermediate_size, act, bias, glu) for _ in range(num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Router | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act)
            self.shared_expert_gate = Router(hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) for each token."""
        if self.softmax_after_top_k:
            logits, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1, dtype=torch.float32).to(x.dtype), ids
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.route(x)
        if self.kernel == "grouped":
            out = self.grouped_forward(x, weights, ids)
        elif self.kernel == "triton" and type(self.experts[0].gate_up_proj) is GateUpLinear:
            # (LoRA wraps every linear layer after loading: wrapped experts take the dense path,
            # whose expert calls add the adapters' deltas)
            from llmserve.layers.triton_moe import fused_moe

            assert self.w13 is not None and self.w2 is not None
            if x.shape[0] >= GROUPED_FROM_TOKENS and not _capturing(x):
                out = self.grouped_forward(x, weights, ids)
            else:
                out = fused_moe(x, self.w13, self.w2, weights, ids, self.experts[0].act_name)
        else:
            out = self.dense_forward(x, weights, ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def use_kernel(self, kernel: MoEKernel) -> MoEKernel:
        """Run the experts with `kernel` from now on; "triton" stacks their weights first, or
        falls back to "dense" for experts it does not take (module docstring). Returns the kernel
        set."""
        if kernel == "triton" and not self._stack_experts():
            kernel = "dense"
        self.kernel = kernel
        return kernel

    def _stack_experts(self) -> bool:
        """w13 / w2 from the experts' float weights, which then become views of them: one copy of
        the weights stays (where a weight is one chunk, as on every accelerator; the CPU's
        per-thread chunks, under Triton's interpreter in tests, keep their own copy)."""
        for m in self.experts:
            up, down = m.gate_up_proj, m.down_proj
            if type(up) is not GateUpLinear or type(down) is not DownLinear or up.packed or down.packed:
                return False  # quantized, fp8 or oneDNN-packed layers
            if up.bias is not None or down.bias is not None or m.glu is not None:
                return False  # gpt-oss's biased experts and clamped SwiGLU
            if fused_gated_name(m.act_name) is None:
                return False
        # [E, H, 2I]: each expert's [gate | up] columns, input-major as `Linear` stores them
        self.w13 = torch.stack([m.gate_up_proj.logical_weight().t() for m in self.experts]).contiguous()
        # [E, I, H]: each expert's down_proj, input-major
        self.w2 = torch.stack([m.down_proj.logical_weight().t() for m in self.experts]).contiguous()
        for e, m in enumerate(self.experts):
            if m.gate_up_proj.weight.shape[0] == 1:  # [1, H, 2I] and [1, I, H]: the same layouts
                m.gate_up_proj.weight = nn.Parameter(self.w13[e : e + 1], requires_grad=False)
                m.down_proj.weight = nn.Parameter(self.w2[e : e + 1], requires_grad=False)
        return True

    def grouped_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once, over the tokens that chose it (their outputs added in expert
        order, so a token's result does not depend on the rest of the batch's choices)."""
        T, k = ids.shape
        flat = ids.reshape(T * k)
        order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # host: which experts run
        pair_weights = weights.reshape(T * k, 1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = pairs // k
            rows = x if n == T and T == 1 else x.index_select(0, tokens)  # [n, H]
            out.index_add_(0, tokens, self.experts[e](rows) * pair_weights[pairs])
        return out

    def dense_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, scaled by its routing weight (0 where not chosen):
        no host sync, fixed shapes (see the module docstring for when this runs)."""
        T = x.shape[0]
        dense = torch.zeros(T, self.num_experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, ids, weights)  # [T, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * dense[:, e : e + 1]
        return out


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def use_moe_kernel(model: nn.Module, kernel: MoEKernel) -> str:
    """Every MoE block of `model` runs `kernel` (the device profile's `moe_kernel`; blocks whose
    experts the Triton kernel does not take run "dense"). Returns what ran, for the load report:
    "" for a dense model, else e.g. "experts run triton"."""
    kernels = sorted({m.use_kernel(kernel) for m in model.modules() if isinstance(m, SparseMoE)})
    return f"experts run {' / '.join(kernels)}" if kernels else ""


def describe_moe(model: nn.Module) -> str:
    """For the load report: "24 MoE layers, 8 experts (2 active), 1.2B of 4.1B parameters active
    per token", or "" for a dense model. Parameters count logical weights (quantized ones too)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not blocks:
        return ""

    def size(module: nn.Module) -> int:
        total = sum(p.numel() for p in module.parameters())
        for m in module.modules():  # quantized layers keep their weight outside parameters
            weights = m.packed_weights() if hasattr(m, "packed_weights") else [getattr(m, "qweight", None)]
            total += sum(w.out_features * w.in_features for w in weights if w is not None)
        return total

    idle = sum((b.num_experts - b.top_k) * size(b.experts[0]) for b in blocks)
    total = size(model)
    kinds = sorted({(b.num_experts, b.top_k) for b in blocks})
    experts = ", ".join(f"{e} experts ({k} active)" for e, k in kinds)
    return (
        f"{len(blocks)} MoE layers, {experts}, {(total - idle) / 1e9:.2f}B of {total / 1e9:.2f}B "
        f"parameters active per token"
    )

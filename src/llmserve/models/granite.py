"""IBM Granite 3.x dense (`GraniteForCausalLM`): the Llama architecture with four multipliers
from its config, each read where llama.py applies it: `embedding_multiplier` (the embeddings),
`attention_multiplier` (the attention scale, in place of 1 / sqrt(head_dim)),
`residual_multiplier` (each sublayer's output before the residual add; the fused CPU decoder's
`residual_scale`), and here `logits_scaling`, which divides the logits. Granite MoE (below) adds
a mixture of experts."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmserve.layers.attention import AttentionBackend
from llmserve.layers.moe import SparseMoE
from llmserve.load_errors import ModelLoadError
from llmserve.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        logits = super().compute_logits(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling


# The experts stacked as one tensor each, under transformers' names (>= 5) or the original
# checkpoints' (input_linear / output_linear): gate_up [E, 2I, H] (gate rows, then up), down [E, H, I].
_STACKED = re.compile(
    r"^(.*\.block_sparse_moe)\.(experts\.gate_up_proj|input_linear\.weight|experts\.down_proj|output_linear\.weight)$"
)


def split_experts(weights: Iterable[tuple[str, Any, str]]) -> Iterator[tuple[str, Any, str]]:
    """Granite MoE's stacked expert tensors as one (gate, up, down) per expert, the names the
    dense MLPs load; everything else as it comes."""
    for name, tensor, file in weights:
        m = _STACKED.match(name)
        if m is None:
            yield name, tensor, file
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise ModelLoadError(f"{file}: {name}: expected a float [experts, out, in] tensor")
        prefix = f"{m.group(1)}.experts"
        if "gate_up" in m.group(2) or "input" in m.group(2):
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter], file
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, inter:], file
        else:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e], file


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite 3.x MoE (1B-A400M, 3B-A800M): Granite's multipliers, and a mixture of experts in
    every layer whose router softmaxes the k chosen logits (as gpt-oss's). The fused CPU decoder
    runs it as its renormalised full softmax (the same weights: fused_decoder.py `_moe`)."""

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        return SparseMoE(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            getattr(config, "hidden_act", "silu"),
            renormalize=False,
            softmax_after_top_k=True,
        )

    def map_weight_name(self, name: str) -> str | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"\.mlp\.router(\.layer)?\.weight$", ".mlp.gate.weight", name)
        return super().map_weight_name(name)

    regroups_checkpoint = True

    @classmethod
    def regroup_checkpoint(cls, weights: Iterable[tuple[str, Any, str]]) -> Iterable[tuple[str, Any, str]]:
        return split_experts(weights)

"""Qwen2-MoE and Qwen3-MoE: Qwen2 / Qwen3 attention with sparse mixture-of-experts MLPs.

A layer is sparse unless it is listed in `mlp_only_layers` or falls between `decoder_sparse_step`s;
the others keep a dense MLP of `intermediate_size`. Experts are `moe_intermediate_size` wide; the
top-k weights are renormalised only where `norm_topk_prob` says so (Qwen3-MoE checkpoints set it,
Qwen2-MoE's do not). Qwen2-MoE adds a shared expert to every sparse block, scaled per token by
sigmoid(x @ shared_expert_gate).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmserve.layers.moe import SparseMoE
from llmserve.models.llama import ArchFlags, dense_mlp
from llmserve.models.qwen2 import Qwen2ForCausalLM
from llmserve.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' rule for which Qwen MoE layers route to experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


def qwen_moe_mlp(config: Any, layer_idx: int, renormalize: bool | None = None) -> nn.Module:
    """`renormalize`: whether the top-k weights sum to one (None: the config's `norm_topk_prob`)."""
    if not is_sparse_layer(config, layer_idx):
        return dense_mlp(config, layer_idx)
    return SparseMoE(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        getattr(config, "hidden_act", "silu"),
        renormalize=bool(getattr(config, "norm_topk_prob", False)) if renormalize is None else renormalize,
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        return ArchFlags(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, qk_norm=False)

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_idx)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_idx)

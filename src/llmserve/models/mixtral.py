"""Mixtral: the Mistral architecture with a sparse mixture-of-experts MLP in every layer (a router
picks 2 of 8 gated experts per token and weights them by their renormalised softmax).

Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and
w2 (down); they are mapped onto the `mlp.experts.<e>.gate_up_proj` / `down_proj` layers that the
dense models use, so quantization and loading treat an expert like any MLP.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from llmserve.layers.moe import SparseMoE
from llmserve.models.llama import LlamaForCausalLM

_EXPERT_PROJ = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJ_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        return SparseMoE(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            getattr(config, "hidden_act", "silu"),
            renormalize=True,
        )

    def map_weight_name(self, name: str) -> str | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _EXPERT_PROJ.sub(lambda m: f".experts.{m.group(1)}.{_PROJ_NAMES[m.group(2)]}.", name)
        return super().map_weight_name(name)

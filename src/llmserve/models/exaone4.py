"""EXAONE 4.0 (`Exaone4ForCausalLM`, LG AI Research's 1.2B and 32B): OLMo 2's post-norm layers
(olmo2.py) with q and k normalised per head, as Qwen3's, and the 32B's hybrid attention: three
sliding-window layers with RoPE, then one global layer without positions (NoPE), as the config's
`layer_types` say. A model without a sliding window rotates q and k in every layer."""

from __future__ import annotations

from typing import Any

from llmserve.layers.attention import AttentionBackend
from llmserve.models.llama import ArchFlags, LlamaAttention
from llmserve.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM, Olmo2Model


class Exaone4Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, backend: AttentionBackend, arch: ArchFlags):
        super().__init__(config, layer_idx, backend, arch)
        layer_types = getattr(config, "layer_types", None)
        sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
        self.use_rope = getattr(config, "sliding_window", None) is None or sliding  # global NoPE


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attn_cls = Exaone4Attention


class Exaone4Model(Olmo2Model):
    layer_cls = Exaone4DecoderLayer


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    backbone_cls = Exaone4Model

    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)

"""Qwen3: the Llama architecture with a per-head RMSNorm on q and k before RoPE, and an explicit
`head_dim` (not hidden_size / num_heads)."""

from __future__ import annotations

from typing import Any

from llmserve.models.llama import ArchFlags, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)

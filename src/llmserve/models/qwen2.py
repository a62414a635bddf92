"""Qwen2 / Qwen2.5: the Llama architecture with biases on the q, k and v projections (not on o)."""

from __future__ import annotations

from typing import Any

from llmserve.models.llama import ArchFlags, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        return ArchFlags(qkv_bias=True, o_bias=False, qk_norm=False)

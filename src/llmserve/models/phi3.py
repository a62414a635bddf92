"""Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini (`Phi3ForCausalLM`): the Llama architecture with
q, k and v stored as one `qkv_proj` and gate and up as one `gate_up_proj`, LongRoPE on the 128k
models (layers/rotary_embedding.py, `rope_for_context`), a partial rotary factor on Phi-4-mini,
and a sliding window on every layer where the config sets one (Phi-3-mini-4k: 2047).

llmserve's layers are fused the same way, but they load their parts (q, k, v; gate, up) one by
one, so that tensor parallelism, quantized formats and GGUF files that store the parts apart take
one path: the fused checkpoint tensors are cut into their parts as they stream in
(`checkpoint_splits`)."""

from __future__ import annotations

from typing import Any

from llmserve.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def checkpoint_splits(cls, config: Any) -> dict[str, tuple[tuple[str, int], ...]]:
        D = head_dim_of(config)
        q, kv, inter = (
            config.num_attention_heads * D,
            config.num_key_value_heads * D,
            config.intermediate_size,
        )
        return {
            "self_attn.qkv_proj": (
                ("self_attn.q_proj", q),
                ("self_attn.k_proj", kv),
                ("self_attn.v_proj", kv),
            ),
            "mlp.gate_up_proj": (("mlp.gate_proj", inter), ("mlp.up_proj", inter)),
        }

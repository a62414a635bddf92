"""OLMo 2 (`Olmo2ForCausalLM`, AllenAI's 1B-32B): the Llama layers with the norms moved after
each sublayer, and q and k normalised over all their heads at once before RoPE:

x = embed(ids)
for each layer:
    h = x + rms_norm(o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v)))    q_norm over [Hq * D]
    x = h + rms_norm(down_proj(silu(gate) * up))
logits = lm_head(rms_norm(x))

The stack returns (MLP output, residual) as llama.py's layers do, so `LlamaModel.forward` runs it
and its final norm adds the two. The fused CPU decoder runs it too: no input or pre-MLP norms, the
two output norms (Gemma's `post_attn_norm`, `post_mlp_norm`), q and k normed whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.layers.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.quantization.fused_decoder import DecoderLayerSpec
from llmserve.layers.rotary_embedding import RotaryInputs
from llmserve.models.llama import ArchFlags, LlamaAttention, LlamaForCausalLM, LlamaModel, MLPBuilder


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, backend: AttentionBackend, arch: ArchFlags):
        super().__init__(config, layer_idx, backend, arch)  # (arch.qk_norm False: no per-head norms)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)  # over all heads' q
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.norms_span_heads = True  # (tensor parallelism sums their squares over the ranks)

    def forward(
        self, x: torch.Tensor, rotary: RotaryInputs, kv_cache: LayerKVCache, md: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        q, k, v = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size], qkv[:, qk_size:]
        return self.o_proj(self.attn(self.q_norm(q), self.k_norm(k), v, kv_cache, md, rotary))


class Olmo2DecoderLayer(nn.Module):
    attn_cls: type[LlamaAttention] = Olmo2Attention
    """The attention (exaone4.py's normalises q and k per head, as Qwen3)."""

    def __init__(
        self, config: Any, layer_idx: int, backend: AttentionBackend, arch: ArchFlags, build_mlp: MLPBuilder
    ):
        super().__init__()
        self.self_attn = self.attn_cls(config, layer_idx, backend, arch)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer_idx)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rotary, kv_cache, md) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normalised MLP output, the stream before it), as llama.py's layers."""
        if residual is not None:
            x = residual + x  # the previous layer's sum, as transformers adds it
        h = x + self.post_attention_layernorm(self.self_attn(x, rotary, kv_cache, md))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer

    def layer_spec(self, layer: nn.Module) -> DecoderLayerSpec:
        attn = layer.self_attn
        return DecoderLayerSpec(
            input_norm=None,  # each sublayer reads the stream itself, its output normed
            qkv=attn.qkv_proj,
            q_norm=attn.q_norm,
            k_norm=attn.k_norm,
            o=attn.o_proj,
            post_norm=None,
            gate_up=layer.mlp.gate_up_proj,
            down=layer.mlp.down_proj,
            sliding_window=attn.attn.params.sliding_window,
            rope=attn.use_rope,
            post_attn_norm=layer.post_attention_layernorm,
            post_mlp_norm=layer.post_feedforward_layernorm,
            qk_norm_whole=isinstance(attn, Olmo2Attention),  # EXAONE 4.0's are per head
        )


class Olmo2ForCausalLM(LlamaForCausalLM):
    backbone_cls = Olmo2Model

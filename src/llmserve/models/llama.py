"""Llama family (Llama 2/3, Mistral, SmolLM, SmolLM3; Qwen2/Qwen3 subclass it).

x = embed(ids)
for each layer:
    h = x + o_proj(attn(rope(q), rope(k), v))      q, k, v = split(qkv_proj(rms_norm(x)))
    x = h + down_proj(silu(gate) * up)             gate, up = split(gate_up_proj(rms_norm(h)))
logits = lm_head(rms_norm(x))

Each residual add is fused into the norm that follows it (`RMSNorm(x, residual)`), so a layer
returns its MLP output and the residual stream separately.

`decoder_spec()` describes the stack for the fused CPU decoder (`FusedDecoder`, the same math in
one C++ call), which the forward runner uses for quantized weights on the CPU; the model itself
only knows the layer-by-layer forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmserve.layers.attention import Attention, AttentionBackend, AttentionMetadata, LayerKVCache
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.linear import Linear
from llmserve.layers.mlp import GatedMLP
from llmserve.layers.moe import SparseMoE
from llmserve.layers.quantization.fused_decoder import DecoderLayerSpec, DecoderSpec
from llmserve.layers.rotary_embedding import RotaryEmbedding, RotaryInputs, rope_parameters
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.models.base import QKV_GATE_UP_STACKING, CausalLM, KVCacheShape


@dataclass(frozen=True, slots=True)
class ArchFlags:
    """Where the Llama-shaped architectures differ from each other."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sinks: bool = False
    """Learned per-head attention sink logits (gpt-oss)."""


MLPBuilder = Callable[[Any, int], nn.Module]
"""(config, layer index) -> that layer's MLP: dense here, a sparse MoE block in mixtral.py / qwen_moe.py."""


def dense_mlp(config: Any, layer_idx: int) -> nn.Module:
    return GatedMLP(
        config.hidden_size,
        config.intermediate_size,
        getattr(config, "hidden_act", "silu"),
        bias=getattr(config, "mlp_bias", False),
    )


def uses_rope(config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` rotates q and k: SmolLM3's `no_rope_layers` (1: RoPE, 0: none,
    every fourth layer) leaves some without positions (NoPE); every layer of the others rotates."""
    flags = getattr(config, "no_rope_layers", None)
    return True if flags is None else bool(flags[layer_idx])


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The window of layer `layer_idx`, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, backend: AttentionBackend, arch: ArchFlags):
        super().__init__()
        H, D = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            D,
        )
        self.q_size, self.kv_size = self.num_heads * D, self.num_kv_heads * D
        self.use_rope = uses_rope(config, layer_idx)
        self.qkv_proj = Linear(H, [self.q_size, self.kv_size, self.kv_size], bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, H, bias=arch.o_bias)
        # Qwen3 normalises each head's q and k before RoPE.
        self.q_norm = RMSNorm(D, config.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps) if arch.qk_norm else None
        self.attn = Attention(
            self.num_heads,
            D,
            self.num_kv_heads,
            scale=getattr(config, "attention_multiplier", None) or D**-0.5,  # Granite sets its own
            backend=backend,
            sliding_window=sliding_window_of(config, layer_idx),
            sinks=arch.sinks,
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rotary: RotaryInputs,
        kv_cache: LayerKVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        q, k, v = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size], qkv[:, qk_size:]
        if self.q_norm is not None:  # Qwen3: per head, before RoPE
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        if not self.use_rope:  # a NoPE layer (SmolLM3): q and k not rotated
            return self.o_proj(self.attn(q, k, v, kv_cache, md))
        if self.q_norm is None and rotary.cos is not None:
            # q and k are adjacent columns: rotate all their heads in one call (half the
            # elementwise launches of rotating them apart; the attention layer gets them rotated).
            qk = rotary.rotate(qkv[:, :qk_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim))
            qk = qk.view(T, qk_size)
            return self.o_proj(self.attn(qk[:, : self.q_size], qk[:, self.q_size :], v, kv_cache, md))
        return self.o_proj(self.attn(q, k, v, kv_cache, md, rotary))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, backend: AttentionBackend, arch: ArchFlags, build_mlp: MLPBuilder
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, backend, arch)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer_idx)
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))
        """Granite scales each sublayer's output before it joins the residual stream (1: the others)."""

    def forward(self, x, residual, rotary, kv_cache, md) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two (the
        next layer's input norm does, fused)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, kv_cache, md)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        return (h if self.residual_multiplier == 1.0 else h * self.residual_multiplier), residual


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    """The decoder layer (olmo2.py's post-norm layer; same signature, same (output, residual))."""

    def __init__(
        self, config: Any, backend: AttentionBackend, arch: ArchFlags, build_mlp: MLPBuilder = dense_mlp
    ):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, backend, arch, build_mlp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))  # Granite's
        D = head_dim_of(config)
        rotary_dim = int(D * getattr(config, "partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(
            D, rotary_dim, config.max_position_embeddings, rope_parameters(config)
        )

    def forward(
        self, input_ids, positions, kv_caches, md, inputs_embeds=None, deepstack=None
    ) -> torch.Tensor:
        """`inputs_embeds` [T, H]: the stack's input instead of `input_ids`' embeddings (images'
        rows in place, qwen2_5_vl.py); `positions` [T], or [3, T] under M-RoPE. `deepstack`
        [k, T, H]: added to the hidden states after each of the first k layers (Qwen3-VL)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        in_backend = self.layers[0].self_attn.attn.rope_in_backend
        rotary = RotaryInputs.make(self.rotary_emb, positions, x.dtype, in_backend)  # shared by every layer
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, rotary, kv_cache, md)
            if deepstack is not None and i < deepstack.shape[0]:
                # the stream whole (as transformers sums it), then the layer's deep vectors
                x, residual = x + residual + deepstack[i], None
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        x = self.embed_tokens(input_ids)
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier

    def layer_spec(self, layer: nn.Module) -> DecoderLayerSpec:
        """One layer as the fused CPU decoder takes it (its MLP dense or a mixture of experts)."""
        attn, moe = layer.self_attn, layer.mlp if isinstance(layer.mlp, SparseMoE) else None
        return DecoderLayerSpec(
            input_norm=layer.input_layernorm,
            qkv=attn.qkv_proj,
            q_norm=attn.q_norm,
            k_norm=attn.k_norm,
            o=attn.o_proj,
            post_norm=layer.post_attention_layernorm,
            gate_up=None if moe is not None else layer.mlp.gate_up_proj,
            down=None if moe is not None else layer.mlp.down_proj,
            sliding_window=attn.attn.params.sliding_window,
            rope=attn.use_rope,
            moe=moe,
        )

    def decoder_spec(self) -> DecoderSpec | None:
        """The stack for the fused CPU decoder."""
        c = self.config
        attn0 = self.layers[0].self_attn
        layers = [self.layer_spec(layer) for layer in self.layers]
        return DecoderSpec(
            layers=layers,
            final_norm=self.norm,
            rotary=self.rotary_emb,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=attn0.num_heads,
            num_kv_heads=attn0.num_kv_heads,
            head_dim=attn0.head_dim,
            scale=attn0.attn.params.scale,
            eps=c.rms_norm_eps,
            activation=getattr(c, "hidden_act", "silu"),
            residual_scale=getattr(self.layers[0], "residual_multiplier", 1.0),
        )


class LlamaForCausalLM(CausalLM):
    stacked_params = QKV_GATE_UP_STACKING
    backbone_cls: type[LlamaModel] = LlamaModel

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP (the MoE subclasses build sparse blocks for some or all layers)."""
        return dense_mlp(config, layer_idx)

    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=False)

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config)
        self.model = self.backbone_cls(config, backend, self.arch_flags(config), self.build_mlp)
        tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = LMHead(
            config.vocab_size, config.hidden_size, self.model.embed_tokens if tied else None
        )

    def kv_cache_shape(self) -> KVCacheShape:
        c = self.config
        return KVCacheShape(c.num_hidden_layers, c.num_key_value_heads, head_dim_of(c))

    def decoder_spec(self) -> DecoderSpec | None:
        return self.model.decoder_spec()

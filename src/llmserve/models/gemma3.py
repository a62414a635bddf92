"""Gemma 3 text models (Gemma3ForCausalLM: 270M, 1B, and the text half of the larger ones), and
Gemma 2 (Gemma2ForCausalLM: 2B, 9B, 27B), the same stack without q/k norms, with one RoPE for
both layer types and its attention scores soft-capped (c * tanh(s / c), `attn_logit_softcapping`).

    x = embed(ids) * sqrt(hidden)                  the scale rounded to the activation dtype, as HF does
    for each layer (sliding or full attention, each type with its own RoPE base):
        q, k, v = split(qkv_proj(norm_in(x)));  q, k = rope(q_norm(q)), rope(k_norm(k))   (per head)
        x = x + norm_post_attn(o_proj(attn(q, k, v)))      scale = query_pre_attn_scalar ** -0.5
        x = x + norm_post_ff(down_proj(gelu_tanh(gate) * up))   gate, up = split(gate_up_proj(norm_pre_ff(x)))
    logits = softcap(embed^T @ norm(x))            softcap only if final_logit_softcapping is set

Every norm is Gemma's RMSNorm: x / rms(x) * (1 + w), computed in float32. Sliding layers see the
last `sliding_window` positions (the current one included). This file owns the architecture only:
which layer is which type comes from the HF config (`layer_types`, or the older
`sliding_window_pattern`); the KV cache keeps every layer's full context.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.layers.attention import Attention, AttentionBackend, AttentionMetadata, LayerKVCache
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.linear import Linear
from llmserve.layers.mlp import GatedMLP
from llmserve.layers.quantization.fused_decoder import DecoderLayerSpec, DecoderSpec
from llmserve.layers.rotary_embedding import RotaryEmbedding, RotaryInputs, rope_parameters
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.models.base import QKV_GATE_UP_STACKING, CausalLM, KVCacheShape
from llmserve.models.llama import head_dim_of

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types_of(config: Any) -> list[str]:
    """Each layer's attention type. transformers >= 4.53 lists them; older configs give a period
    (every `sliding_window_pattern`-th layer is full attention, the others sliding)."""
    types = getattr(config, "layer_types", None)
    if not types:
        pattern = int(getattr(config, "sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"Gemma 3: unsupported layer types {unknown}; supported: {SLIDING}, {FULL}")
    return list(types)


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """RoPE settings of one layer type. transformers 5 keeps one dict per type in
    `rope_parameters`; transformers 4 had `rope_theta` + `rope_scaling` for full attention and an
    unscaled `rope_local_base_freq` for sliding attention."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        return rope_parameters(config, layer_type)
    if is_gemma2(config):  # one RoPE for both layer types
        return rope_parameters(config)
    if layer_type == SLIDING:
        return {"rope_type": "default", "rope_theta": float(getattr(config, "rope_local_base_freq", 10000.0))}
    return rope_parameters(config)


def hidden_act_of(config: Any) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")


def is_gemma2(config: Any) -> bool:
    return getattr(config, "model_type", "") == "gemma2"


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_type: str, backend: AttentionBackend | None) -> None:
        """`backend` None: no paged attention layer (the encoder's subclass attends without a cache)."""
        super().__init__()
        H, D = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            D,
        )
        self.q_size, self.kv_size = self.num_heads * D, self.num_kv_heads * D
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(H, [self.q_size, self.kv_size, self.kv_size], bias=bias)
        self.o_proj = Linear(self.q_size, H, bias=bias)
        gemma2 = is_gemma2(config)
        self.q_norm = None if gemma2 else RMSNorm(D, config.rms_norm_eps, weight_offset=1.0)
        self.k_norm = None if gemma2 else RMSNorm(D, config.rms_norm_eps, weight_offset=1.0)
        # Gemma 2 soft-caps its attention scores; Gemma 3 replaced that with q/k norms, and its
        # config's `attn_logit_softcapping` is never applied by transformers (nor here).
        softcap = getattr(config, "attn_logit_softcapping", None) if gemma2 else None
        window = getattr(config, "sliding_window", None)
        if backend is None:
            return
        self.attn = Attention(
            self.num_heads,
            D,
            self.num_kv_heads,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            backend=backend,
            sliding_window=int(window) if layer_type == SLIDING and window else None,
            softcap=float(softcap) if softcap else None,
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rotary: RotaryInputs,
        kv_cache: LayerKVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :]
        if self.q_norm is not None:  # norm per head (Gemma 3), then the attention layer rotates
            q, k = self.q_norm(q), self.k_norm(k)  # (or its backend does, writing K/V)
        out = self.attn(q, k, v, kv_cache, md, rotary)
        return self.o_proj(out)


class Gemma3DecoderLayer(nn.Module):
    attention_cls: type[Gemma3Attention] = Gemma3Attention

    def __init__(self, config: Any, layer_type: str, backend: AttentionBackend | None) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(H, eps, weight_offset=1.0)
        self.self_attn = self.attention_cls(config, layer_type, backend)
        self.post_attention_layernorm = RMSNorm(H, eps, weight_offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(H, eps, weight_offset=1.0)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, hidden_act_of(config))
        self.post_feedforward_layernorm = RMSNorm(H, eps, weight_offset=1.0)

    def forward(self, x: torch.Tensor, *attn_inputs: Any) -> torch.Tensor:
        """`attn_inputs`: the attention's other inputs, (rotary, kv_cache, md) in the decoder,
        (cos_sin, rope, md) in the encoder (gemma3_embedding.py)."""
        # Gemma normalises both the input and the output of each sublayer ("sandwich" norms).
        h = self.self_attn(self.input_layernorm(x), *attn_inputs)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention (an embedding model) is not a causal LM"
            )
        H = config.hidden_size
        self.hidden_size, self.intermediate_size = H, config.intermediate_size
        self.hidden_act = hidden_act_of(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, H)
        # HF multiplies by this fp32 scalar cast to the weight dtype: sqrt(640) = 25.298 becomes
        # 25.25 in bf16, and the model was trained with the rounded value.
        self.register_buffer("embed_scale", torch.tensor(H**0.5, dtype=torch.float32), persistent=False)
        self.layer_types = layer_types_of(config)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t, backend) for t in self.layer_types)
        self.norm = RMSNorm(H, config.rms_norm_eps, weight_offset=1.0)
        D = head_dim_of(config)
        self.rotary_emb = nn.ModuleDict(
            {
                t: RotaryEmbedding(D, D, config.max_position_embeddings, gemma3_rope_parameters(config, t))
                for t in sorted(set(self.layer_types))
            }
        )

    def embed_scaled(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    embed = embed_scaled  # what the fused CPU decoder's runner starts the stack from (CausalLM.embed)

    def decoder_spec(self) -> DecoderSpec:
        """The stack for the fused CPU decoder: sandwich norms, each layer type's own RoPE, the tanh
        GELU, and Gemma 2's soft cap on the attention scores."""
        attn0 = self.layers[0].self_attn
        layers = [
            DecoderLayerSpec(
                input_norm=layer.input_layernorm,
                qkv=layer.self_attn.qkv_proj,
                q_norm=layer.self_attn.q_norm,
                k_norm=layer.self_attn.k_norm,
                o=layer.self_attn.o_proj,
                post_norm=layer.pre_feedforward_layernorm,
                gate_up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj,
                sliding_window=layer.self_attn.attn.params.sliding_window,
                post_attn_norm=layer.post_attention_layernorm,
                post_mlp_norm=layer.post_feedforward_layernorm,
                rotary=self.rotary_emb[layer.layer_type],
            )
            for layer in self.layers
        ]
        return DecoderSpec(
            layers=layers,
            final_norm=self.norm,
            rotary=self.rotary_emb[self.layer_types[0]],
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=attn0.num_heads,
            num_kv_heads=attn0.num_kv_heads,
            head_dim=attn0.head_dim,
            scale=attn0.attn.params.scale,
            eps=self.norm.eps,
            activation=self.hidden_act,
            softcap=attn0.attn.params.softcap,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKVCache],
        md: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H]: scaled, images' rows in place
    ) -> torch.Tensor:  # [T, H]
        x = self.embed_scaled(input_ids) if inputs_embeds is None else inputs_embeds
        # One cos/sin per layer type, shared by every layer of that type.
        in_backend = self.layers[0].self_attn.attn.rope_in_backend
        rotary = {
            t: RotaryInputs.make(rope, positions, x.dtype, in_backend) for t, rope in self.rotary_emb.items()
        }
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rotary[layer.layer_type], kv_cache, md)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    stacked_params = QKV_GATE_UP_STACKING
    # Where the text weights sit in multimodal Gemma 3 checkpoints (new and old transformers).
    _TEXT_PREFIXES = ("model.language_model.", "language_model.model.")

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config)
        self.model = Gemma3Model(config, backend)
        tied = getattr(config, "tie_word_embeddings", True)
        self.lm_head = LMHead(
            config.vocab_size, config.hidden_size, self.model.embed_tokens if tied else None
        )
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, vocab]
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def kv_cache_shape(self) -> KVCacheShape:
        c = self.config
        return KVCacheShape(c.num_hidden_layers, c.num_key_value_heads, head_dim_of(c))

    def decoder_spec(self) -> DecoderSpec | None:
        return self.model.decoder_spec()

    def map_weight_name(self, name: str) -> str | None:
        for prefix in self._TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name.removeprefix(prefix)
                break
        return super().map_weight_name(name)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: `is_gemma2` configs build the variant (no q/k norms, soft-capped attention scores,
    one RoPE); the final logits are soft-capped as Gemma 3's may be (`final_logit_softcapping`)."""

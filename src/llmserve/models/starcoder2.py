"""StarCoder2 (`Starcoder2ForCausalLM`, BigCode's 3B / 7B / 15B code models): pre-LayerNorm
blocks with biases everywhere, GQA attention with RoPE over a sliding window (every layer), and
a plain (ungated) MLP:

    x = embed(ids)
    for each layer:
        x = x + o_proj(attn(rope(q), rope(k), v))     q, k, v = split(qkv_proj(layer_norm_1(x)))
        x = x + c_proj(gelu_tanh(c_fc(layer_norm_2(x))))
    logits = lm_head(layer_norm(x))                   (tied to the embedding unless the config says)

The fused CPU decoder runs it too (`decoder_spec`): LayerNorms with biases for the stream's norms,
a plain MLP (`gated` False: c_fc as its up projection), the linear layers' biases in the kernels.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from llmserve.layers.activation import get_activation
from llmserve.layers.attention import Attention, AttentionBackend, AttentionMetadata, LayerKVCache
from llmserve.layers.layernorm import LayerNorm
from llmserve.layers.linear import Linear
from llmserve.layers.quantization.fused_decoder import DecoderLayerSpec, DecoderSpec
from llmserve.layers.rotary_embedding import RotaryEmbedding, RotaryInputs, rope_parameters
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.models.base import QKV_GATE_UP_STACKING, CausalLM, KVCacheShape
from llmserve.models.llama import head_dim_of


class Starcoder2Attention(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        H, D = config.hidden_size, head_dim_of(config)
        self.q_size, self.kv_size = config.num_attention_heads * D, config.num_key_value_heads * D
        bias = bool(getattr(config, "use_bias", True))
        self.qkv_proj = Linear(H, [self.q_size, self.kv_size, self.kv_size], bias=bias)
        self.o_proj = Linear(self.q_size, H, bias=bias)
        window = getattr(config, "sliding_window", None)
        self.attn = Attention(
            config.num_attention_heads,
            D,
            config.num_key_value_heads,
            scale=D**-0.5,
            backend=backend,
            sliding_window=int(window) if window else None,
        )

    def forward(
        self, x: torch.Tensor, rotary: RotaryInputs, kv_cache: LayerKVCache, md: AttentionMetadata
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        q, k, v = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size], qkv[:, qk_size:]
        return self.o_proj(self.attn(q, k, v, kv_cache, md, rotary))


class Starcoder2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "use_bias", True))
        self.c_fc = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = get_activation(getattr(config, "hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.norm_epsilon
        self.input_layernorm = LayerNorm(H, eps)
        self.self_attn = Starcoder2Attention(config, backend)
        self.post_attention_layernorm = LayerNorm(H, eps)
        self.mlp = Starcoder2MLP(config)

    def forward(
        self, x: torch.Tensor, rotary: RotaryInputs, kv_cache: LayerKVCache, md: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, md)
        return x + self.mlp(self.post_attention_layernorm(x))


class Starcoder2Model(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Starcoder2DecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = LayerNorm(config.hidden_size, config.norm_epsilon)
        D = head_dim_of(config)
        self.rotary_emb = RotaryEmbedding(D, D, config.max_position_embeddings, rope_parameters(config))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKVCache],
        md: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H]
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        in_backend = self.layers[0].self_attn.attn.rope_in_backend
        rotary = RotaryInputs.make(self.rotary_emb, positions, x.dtype, in_backend)  # shared by every layer
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rotary, kv_cache, md)
        return self.norm(x)

    def decoder_spec(self) -> DecoderSpec | None:
        """The stack for the fused CPU decoder (its LayerNorm and plain-MLP forms); None for an
        activation it lacks (the tanh GELU is StarCoder2's)."""
        attn0 = self.layers[0].self_attn.attn
        layers = [
            DecoderLayerSpec(
                input_norm=layer.input_layernorm,
                qkv=layer.self_attn.qkv_proj,
                q_norm=None,
                k_norm=None,
                o=layer.self_attn.o_proj,
                post_norm=layer.post_attention_layernorm,
                gate_up=layer.mlp.c_fc,
                down=layer.mlp.c_proj,
                sliding_window=layer.self_attn.attn.params.sliding_window,
                gated=False,
            )
            for layer in self.layers
        ]
        return DecoderSpec(
            layers=layers,
            final_norm=self.norm,
            rotary=self.rotary_emb,
            hidden_size=self.config.hidden_size,
            intermediate_size=self.config.intermediate_size,
            num_heads=self.config.num_attention_heads,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=head_dim_of(self.config),
            scale=attn0.params.scale,
            eps=self.config.norm_epsilon,
            activation=getattr(self.config, "hidden_act", "gelu_pytorch_tanh"),
            layer_norm=True,
        )


class Starcoder2ForCausalLM(CausalLM):
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        k: v for k, v in QKV_GATE_UP_STACKING.items() if v[0] == "qkv_proj"
    }

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config)
        self.model = Starcoder2Model(config, backend)
        tied = getattr(config, "tie_word_embeddings", True)
        self.lm_head = LMHead(
            config.vocab_size, config.hidden_size, self.model.embed_tokens if tied else None
        )

    def kv_cache_shape(self) -> KVCacheShape:
        c = self.config
        return KVCacheShape(c.num_hidden_layers, c.num_key_value_heads, head_dim_of(c))

    def decoder_spec(self) -> DecoderSpec | None:
        return self.model.decoder_spec()

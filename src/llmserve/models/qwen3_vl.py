"""Qwen3-VL (Qwen3VLForConditionalGeneration: 2B to 32B): Qwen2.5-VL's prompts, M-RoPE positions and
checkpoint layout (qwen2_5_vl.py) with the Qwen3 language model (q/k norms), interleaved M-RoPE
(layers/mrope.py) and its own vision tower (qwen3_vl_vision.py), whose DeepStack vectors reach the
language model's first layers:

    image -> ViT -> [main | deep_0 | ... | deep_k-1]   per image token, [tokens, H * (1 + k)]
    stack input [T, H * (1 + k)]: text rows  [embed(id) | 0 | ... | 0]
                                  image rows [main      | deep_0 | ...]
    x = input[:, :H];  after layer i < k:  x += input[:, H * (1 + i) : H * (2 + i)]

The deep vectors travel as extra columns of the stack's input, so they follow each image token
wherever the runner puts it: a chunk that ends inside an image takes its rows' slices, a
recomputed (preempted) prompt re-encodes them, and text rows add zeros (the same sums). Steps
without image rows run the plain stack. Videos (timestamped frames) are not taken here.
Qwen3-VL-MoE: the same with the Qwen3-MoE stack (`Qwen3VLMoeForConditionalGeneration`).
Architecture only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from llmserve.layers.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from llmserve.layers.mrope import MRotaryEmbedding
from llmserve.models.gpt_oss import STACKED_EXPERTS, per_expert
from llmserve.models.llama import ArchFlags, head_dim_of
from llmserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, mrope_settings
from llmserve.models.qwen3 import Qwen3ForCausalLM
from llmserve.models.qwen3_vl_vision import Qwen3VisionTransformer
from llmserve.models.qwen_moe import qwen_moe_mlp

DEFAULT_MROPE_SECTION = (24, 20, 20)
"""transformers' section when the text config names none (Qwen3-VL's head_dim 128)."""


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    image_prompt_format: ClassVar[str] = "qwen3_vl"
    vision_tower: ClassVar[type[torch.nn.Module]] = Qwen3VisionTransformer

    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        return Qwen3ForCausalLM.arch_flags(config)

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.hidden_size = int(config.get_text_config().hidden_size)
        self.num_deepstack = self.visual.num_deepstack

    @classmethod
    def make_rotary(cls, text_config: Any) -> MRotaryEmbedding:
        """Interleaved M-RoPE, whatever `mrope_interleaved` says (transformers' Qwen3-VL too)."""
        params, section = mrope_settings(text_config, DEFAULT_MROPE_SECTION)
        head_dim = head_dim_of(text_config)
        return MRotaryEmbedding(
            head_dim, text_config.max_position_embeddings, params, section, interleaved=True
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[LayerKVCache],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H * (1 + k)] (`embed_with_images`)
    ) -> torch.Tensor:
        if inputs_embeds is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        T, H = inputs_embeds.shape[0], self.hidden_size
        deepstack = inputs_embeds[:, H:].view(T, self.num_deepstack, H).transpose(0, 1)  # [k, T, H]
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds[:, :H], deepstack)

    def embed_with_images(
        self, input_ids: torch.Tensor, rows: torch.Tensor, image_embeds: torch.Tensor
    ) -> torch.Tensor:
        """The stack's input [T, H * (1 + k)]: token embeddings and zeros, with rows `rows` [R]
        replaced by `image_embeds` [R, H * (1 + k)] (the tower's main and deep vectors)."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        wide = torch.zeros(x.shape[0], image_embeds.shape[1], dtype=x.dtype, device=x.device)
        wide[:, : x.shape[1]] = x
        return wide.index_copy(0, rows, image_embeds.to(x.dtype))

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith(self._VISION_PREFIXES):
            # Qwen3-VL's tower names its MLPs' and mergers' layers `linear_fc*`, a merger's norm `norm`
            name = name.replace(".linear_fc", ".fc").replace("merger.norm.", "merger.ln_q.")
            name = name.replace(".norm.", ".ln_q.") if "deepstack_merger_list." in name else name
        return super().map_weight_name(name)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE (30B-A3B, 235B-A22B): Qwen3-VL with the Qwen3-MoE stack (`SparseMoE` layers,
    the top-k weights always renormalised: its config has no `norm_topk_prob`). Its checkpoints
    stack each layer's experts:

        mlp.experts.gate_up_proj  [E, H, 2I]  gate units, then up units (released checkpoints)
        mlp.experts.down_proj     [E, I, H]

    or out-major, [E, 2I, H] and [E, H, I], as transformers' `save_pretrained` writes them;
    like transformers, a tensor whose shape is the out-major one is taken as is, any other
    transposed. `load_weights` cuts them into the per-expert tensors `SparseMoE` loads."""

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_idx, renormalize=True)

    def load_weights(self, weights: Iterable[tuple[str, Any, str]]) -> None:
        super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[tuple[str, Any, str]]) -> Iterator[tuple[str, Any, str]]:
        c = self.config
        out_major = {
            "gate_up_proj": (2 * c.moe_intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.moe_intermediate_size),
        }
        for name, tensor, file in weights:
            m = STACKED_EXPERTS.match(name)
            if m is None or m.group(3):
                yield name, tensor, file
                continue
            prefix, proj = m.group(1), m.group(2)
            stacked = (
                tensor.transpose(1, 2) if tuple(tensor.shape[1:]) == out_major[proj] else tensor
            )  # [E, in, out]
            for item in per_expert(prefix, proj, "", stacked, interleaved=False):
                yield (*item, file)

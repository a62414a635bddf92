"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration: 3B, 7B, 32B, 72B): the Qwen2 language model
with M-RoPE (layers/mrope.py), fed by its vision transformer (qwen2_5_vl_vision.py).

    image -> patches [L, 3*T*P*P] (multimodal/qwen_vl.py) -> ViT + merger -> [L / m^2, H]

The prompt holds one `<|image_pad|>` per output vector of each image (between <|vision_start|>
and <|vision_end|>); their rows of the token embeddings are replaced by the image's vectors and
the stack runs as usual, causally (an image's tokens attend like text). Position ids are three
per token: the runner takes a prompt's from `rope_positions` and its later tokens' from the
prompt's delta, and hands the model positions [3, T].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from llmserve.core.multimodal import MultiModalInput
from llmserve.layers.attention import AttentionBackend
from llmserve.layers.mrope import MRotaryEmbedding, mrope_prompt_positions
from llmserve.layers.rotary_embedding import rope_parameters
from llmserve.layers.vocab_embedding import LMHead
from llmserve.models.llama import head_dim_of
from llmserve.models.qwen2 import Qwen2ForCausalLM
from llmserve.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer

if TYPE_CHECKING:
    from llmserve.multimodal.qwen_vl import ImagePatches
    from llmserve.multimodal.qwen_vl_video import VideoPatches


def mrope_settings(
    text_config: Any, default_section: Sequence[int] | None = None
) -> tuple[dict[str, Any], list[int]]:
    """The language model's RoPE parameters and `mrope_section` (transformers 5 keeps it in
    `rope_parameters`; older configs in `rope_scaling`, with type "mrope"); `default_section` where
    the config names none (else a ValueError)."""
    params = rope_parameters(text_config)
    section = params.pop("mrope_section", None) or default_section
    params.pop("mrope_interleaved", None)  # Qwen3-VL's flag: its model class decides the layout
    if section is None:
        raise ValueError("Qwen2-VL / Qwen2.5-VL: the text config has no mrope_section")
    if params.get("rope_type") in ("mrope", None):
        params["rope_type"] = "default"
    return params, list(section)


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    supports_images: ClassVar[bool] = True
    image_prompt_format: ClassVar[str] = "qwen2_vl"
    rope_axes: ClassVar[int] = 3
    _TEXT_PREFIXES = ("model.language_model.",)  # older checkpoints: the text stack under `model.`
    _VISION_PREFIXES = ("model.visual.", "visual.")
    vision_tower: ClassVar[type[torch.nn.Module]] = Qwen2_5_VisionTransformer

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        text = config.get_text_config()
        super().__init__(text, backend)
        self.mm_config = config
        tied = getattr(config, "tie_word_embeddings", None)
        if tied is not None and bool(tied) != bool(self.lm_head.tied_to):
            # the top-level config decides, as in transformers (Qwen2.5-VL 3B: tied, its text
            # config silent; Qwen3-VL-MoE's text config defaults to tied where the model is not)
            embed = self.model.embed_tokens if tied else None
            self.lm_head = LMHead(text.vocab_size, text.hidden_size, embed)
        self.model.rotary_emb = self.make_rotary(text)
        self.visual = self.vision_tower(config.vision_config)
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        # a video's temporal M-RoPE ids advance tokens_per_second x its seconds a grid frame
        self.tokens_per_second = getattr(config.vision_config, "tokens_per_second", None)

    @classmethod
    def make_rotary(cls, text_config: Any) -> MRotaryEmbedding:
        params, section = mrope_settings(text_config)
        return MRotaryEmbedding(
            head_dim_of(text_config), text_config.max_position_embeddings, params, section
        )

    @torch.inference_mode()
    def encode_image(self, image: ImagePatches | VideoPatches) -> torch.Tensor:  # -> [tokens, H]
        device = self.visual.patch_embed.proj.weight.device
        return self.visual(image.pixels.to(device), image.grid)

    def embed_with_images(
        self, input_ids: torch.Tensor, rows: torch.Tensor, image_embeds: torch.Tensor
    ) -> torch.Tensor:
        """The stack's input [T, H]: token embeddings with rows `rows` [R] replaced by
        `image_embeds` [R, H]."""
        x = self.model.embed_tokens(input_ids)
        return x.index_copy(0, rows, image_embeds.to(x.dtype))

    def rope_positions(
        self, num_prompt_tokens: int, images: Sequence[MultiModalInput]
    ) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions [3, num_prompt_tokens] and the delta of its later tokens
        (`images`: its images and videos in prompt order)."""
        grids = []
        for m in images:
            t, h, w = m.data.grid  # type: ignore[attr-defined]
            seconds = getattr(m.data, "second_per_grid_t", None)  # a video's
            if seconds is None or self.tokens_per_second is None:  # Qwen2-VL: one id a grid frame
                grids.append((m.offset, t, h // self.merge, w // self.merge))
            else:
                interval = self.tokens_per_second * seconds
                grids.append((m.offset, t, h // self.merge, w // self.merge, interval))
        return mrope_prompt_positions(num_prompt_tokens, grids)

    def map_weight_name(self, name: str) -> str | None:
        for prefix in self._VISION_PREFIXES:
            if name.startswith(prefix):
                inner = name.removeprefix(prefix)
                inner = inner.replace("merger.mlp.0.", "merger.fc1.").replace("merger.mlp.2.", "merger.fc2.")
                return "visual." + inner
        for prefix in self._TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name.removeprefix(prefix)
        return super().map_weight_name(name)

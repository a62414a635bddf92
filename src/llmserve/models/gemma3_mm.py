"""Gemma 3 with images (Gemma3ForConditionalGeneration: 4B, 12B, 27B): the Gemma 3 language model
(gemma3.py) fed by a SigLIP image encoder (siglip.py) through Gemma 3's projector.

    image [3, S, S] -> SigLIP -> [P*P, C_v]           P = image_size / patch_size patches a side
        -> avg-pool k x k over the patch grid          k = P / sqrt(mm_tokens_per_image)
        -> RMSNorm (Gemma's 1 + w) -> @ W [C_v, H]     -> [mm_tokens_per_image, H]

The prompt holds `mm_tokens_per_image` placeholder tokens per image (between <start_of_image> and
<end_of_image>, as the processor writes them); their rows of the scaled token embeddings are
replaced by the image's vectors (unscaled, as transformers does), and the stack runs as usual.
An image's tokens attend to each other both ways in every layer (within the sliding window on
sliding layers): the runner passes each image's span in `AttentionMetadata.bidirectional`, so the
model needs an attention backend that reads it (`bidirectional_spans`: torch, cpu, triton).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.attention import AttentionBackend
from llmserve.layers.layernorm import RMSNorm
from llmserve.models.gemma3 import Gemma3ForCausalLM
from llmserve.models.siglip import SiglipVisionModel


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image**0.5)
        if tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"Gemma 3: mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side "
                f"divides the {self.patches_per_side} patches a side of the image"
            )
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, weight_offset=1.0)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, text.hidden_size), requires_grad=False
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, P*P, C_v] -> [N, tokens, H]
        N, _, C = patches.shape
        P = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(N, C, P, P)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [N, tokens, C_v]
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    supports_images: ClassVar[bool] = True
    image_prompt_format: ClassVar[str] = "gemma3"
    _VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
    _PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config.text_config, backend)
        self.mm_config = config
        self.vision_tower = SiglipVisionModel(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.image_token_id = int(config.image_token_id)
        self.mm_tokens_per_image = int(config.mm_tokens_per_image)
        self.bidirectional_images = bool(getattr(backend, "bidirectional_spans", False))
        """Whether the backend can attend an image's tokens both ways (else images are refused)."""

    @torch.inference_mode()
    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, tokens, H]
        return self.multi_modal_projector(self.vision_tower(pixels))

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:  # [3, S, S] -> [tokens, H]
        """One preprocessed image (multimodal/image.py) -> the vectors of its placeholder tokens."""
        return self.embed_images(pixels.to(self.mm_input_device)[None])[0]

    @property
    def mm_input_device(self) -> torch.device:
        return self.multi_modal_projector.mm_input_projection_weight.device

    def embed_with_images(
        self, input_ids: torch.Tensor, rows: torch.Tensor, image_embeds: torch.Tensor
    ) -> torch.Tensor:
        """The stack's input [T, H]: scaled token embeddings with rows `rows` [R] replaced by
        `image_embeds` [R, H]. A placeholder id past the vocabulary embeds as id 0 first (its row is
        replaced anyway), as transformers does."""
        ids = input_ids.masked_fill(input_ids >= self.config.vocab_size, 0)
        x = self.model.embed_scaled(ids)
        return x.index_copy(0, rows, image_embeds.to(x.dtype))

    def map_weight_name(self, name: str) -> str | None:
        for prefix in self._VISION_PREFIXES:
            if name.startswith(prefix):
                inner = SiglipVisionModel.map_weight_name(name.removeprefix(prefix))
                return None if inner is None else "vision_tower." + inner
        for prefix in self._PROJECTOR_PREFIXES:
            if name.startswith(prefix):
                return "multi_modal_projector." + name.removeprefix(prefix)
        return super().map_weight_name(name)

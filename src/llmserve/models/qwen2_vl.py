"""Qwen2-VL (Qwen2VLForConditionalGeneration: 2B, 7B, 72B and their fine-tunes): Qwen2.5-VL's
language model, prompts and checkpoint layout (qwen2_5_vl.py) with its own vision tower
(qwen2_vl_vision.py); a video's temporal M-RoPE ids step by one a grid frame (its config has no
`tokens_per_second`). Architecture only.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from llmserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from llmserve.models.qwen2_vl_vision import Qwen2VisionTransformer


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    vision_tower: ClassVar[type[torch.nn.Module]] = Qwen2VisionTransformer

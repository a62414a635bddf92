"""Qwen2-VL / Qwen2.5-VL images: preprocessing as transformers' Qwen2VL image processor (its Pillow
backend) does it, and prompts with images as its processor writes them.

    image (H x W) -> smart_resize: the size nearest H x W with both sides multiples of
                     patch * merge and min_pixels <= h * w <= max_pixels (aspect ratio kept)
                  -> resize (bicubic, 8-bit) -> x / 255 -> (x - mean) / std       [3, h, w]
                  -> patches [h/P * w/P, 3 * T * P * P] in merge-block order, each patch repeated
                     over the T temporal slots (a still image is a clip of T equal frames)

The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` for each image; each
`<|image_pad|>` becomes as many pads as the image has tokens after the merger (h/P * w/P / m^2),
so images of different sizes take different numbers of tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.core.multimodal import MultiModalInput
from llmserve.multimodal.image import decode_image, image_hash, resize_and_normalize
from llmserve.multimodal.processor import (
    ImageSource,
    PlaceholderCheck,
    PreparedImage,
    check_markers,
    place_images,
    preprocess_one,
    repeat_marker,
    token_name,
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class ImagePatches:
    """One preprocessed image: what the vision tower takes."""

    pixels: torch.Tensor  # [t * h * w, 3 * T * P * P] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) transformers resizes an image to (see the module docstring)."""
    if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image of {width}x{height} pixels: the aspect ratio must be under {MAX_ASPECT_RATIO}"
        )
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True, slots=True)
class QwenVLImagePreprocessor:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC

    @classmethod
    def for_model(
        cls, folder: Path | None, vision_config: Any, preprocessing: dict[str, Any] | None = None
    ) -> QwenVLImagePreprocessor:
        """From the checkpoint's preprocessor_config.json (`min_pixels`/`max_pixels` or, newer,
        `size.shortest_edge`/`longest_edge`) or `preprocessing` (its keys, from a GGUF vision
        projector's metadata), else the vision config and transformers' defaults."""
        path = None if folder is None else Path(folder) / "preprocessor_config.json"
        cfg: dict[str, Any] = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        cfg = preprocessing if preprocessing is not None else cfg
        size = cfg.get("size") or {}
        return cls(
            patch_size=int(cfg.get("patch_size", vision_config.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", vision_config.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", vision_config.spatial_merge_size)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)),  # type: ignore[arg-type]
            std=tuple(cfg.get("image_std", CLIP_STD)),  # type: ignore[arg-type]
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            resample=int(cfg.get("resample", 3)),
        )

    def __call__(self, image: Any) -> ImagePatches:
        image = decode_image(image)
        P, T, m = self.patch_size, self.temporal_patch_size, self.merge_size
        h, w = smart_resize(image.height, image.width, P * m, self.min_pixels, self.max_pixels)
        x = resize_and_normalize(image, h, w, self)  # [3, h, w]
        gh, gw = h // P, w // P
        x = x.reshape(3, gh // m, m, P, gw // m, m, P)  # [3, gh/m, m, P, gw/m, m, P]
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, P, P]: merge blocks, then patches
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, P, P))  # the T frames: copies
        pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3 * T * P * P))
        return ImagePatches(pixels, (1, gh, gw))


class QwenVLPromptProcessor(PlaceholderCheck):
    """Qwen2-VL / Qwen2.5-VL: images of any size (within min/max pixels), attended causally."""

    both_ways = False

    def __init__(self, model: Any, mm_config: Any, token_text: Any, source: ImageSource) -> None:
        if source.do_pan_and_scan:
            raise ValueError("do_pan_and_scan is Gemma 3's; the Qwen VL models take images at their own size")
        self.image_token_id = int(mm_config.image_token_id)
        self.image_pad = token_name(token_text, self.image_token_id, "image")
        self.preprocess = QwenVLImagePreprocessor.for_model(
            source.folder, mm_config.vision_config, source.preprocessing
        )

    def expand(self, prompt: str, images: Sequence[Any]) -> tuple[str, list[PreparedImage]]:
        """Each `<|image_pad|>` repeated to its image's number of tokens; the images preprocessed."""
        check_markers(prompt, self.image_pad, len(images))
        prepared = []
        for i, image in enumerate(images):
            patches = preprocess_one(self.preprocess, image, i)
            t, h, w = patches.grid
            identity = f"{image_hash(patches.pixels)}:{t}x{h}x{w}"  # the same bytes on another grid differ
            prepared.append(PreparedImage(patches, identity, t * h * w // self.preprocess.merge_size**2))
        return repeat_marker(prompt, self.image_pad, [im.num_tokens for im in prepared]), prepared

    def inputs(
        self, token_ids: Sequence[int], images: Sequence[PreparedImage]
    ) -> tuple[MultiModalInput, ...]:
        return place_images(token_ids, self.image_token_id, images, both_ways=False)

"""Images in, pixel tensors out: decoding (Pillow), a model's preprocessing, and the hash that
identifies an image in the prefix cache.

Preprocessing follows the checkpoint's `preprocessor_config.json` where it has one (else the
vision config's `image_size` and SigLIP's defaults), the steps transformers' Gemma 3 image
processor takes (its Pillow backend):

    RGB -> resize to (height, width), bilinear, on the 8-bit image -> x / 255 -> (x - mean) / std

With pan-and-scan (`do_pan_and_scan`, opt-in as in transformers) a wide or tall image also gives
crops, each preprocessed as an image of its own after the original (`PanAndScan`).

Bad input raises `ValueError` naming what was wrong (the server turns it into a 400).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAX_IMAGE_PIXELS = 64 * 2**20
"""Decoded images larger than this many pixels are refused (a small file can decode to gigabytes)."""


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the `vision` extra brings it
        raise ValueError("images need Pillow (pip install 'llmserve[vision]')") from None
    return Image


def decode_image(data: bytes | Any) -> Any:
    """Encoded bytes (PNG, JPEG, WebP, ...) or a PIL image -> a PIL image in RGB."""
    Image = _pil()
    if isinstance(data, Image.Image):
        image = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        try:
            image = Image.open(io.BytesIO(bytes(data)))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"image of {image.width}x{image.height} pixels exceeds {MAX_IMAGE_PIXELS}")
            image.load()
        except ValueError:
            raise
        except Exception as e:  # PIL raises many types for corrupt data
            raise ValueError(f"not a readable image ({type(e).__name__}: {e})") from None
    else:
        raise ValueError(f"an image must be encoded bytes or a PIL image, not {type(data).__name__}")
    return image.convert("RGB") if image.mode != "RGB" else image


@dataclass(frozen=True, slots=True)
class PanAndScan:
    """Gemma 3's pan-and-scan: an image whose long side is at least `min_ratio_to_activate` times
    its short side is cut along the long side into 2..`max_num_crops` equal crops (about one per
    aspect-ratio unit, each side at least `min_crop_size`), which the model sees after the whole
    image. transformers' Gemma3ImageProcessor.pan_and_scan; defaults are Gemma3Processor's."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def crops(self, image: Any) -> list[Any]:  # a PIL image -> its crops (none: not worth cutting)
        width, height = image.size
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio_to_activate:
            return []
        n = math.floor(long / short + 0.5)  # half rounds up
        n = min(self.max_num_crops, max(2, min(math.floor(long / self.min_crop_size), n)))
        num_w, num_h = (n, 1) if width >= height else (1, n)
        crop_w, crop_h = math.ceil(width / num_w), math.ceil(height / num_h)
        if min(crop_w, crop_h) < self.min_crop_size:
            return []
        # row by row; the last crop stops at the image's edge (transformers slices an array)
        return [
            image.crop((x, y, min(x + crop_w, width), min(y + crop_h, height)))
            for y, x in itertools.product(range(0, crop_h * num_h, crop_h), range(0, crop_w * num_w, crop_w))
        ]


@dataclass(frozen=True, slots=True)
class ImagePreprocessor:
    """One model's preprocessing (resize, rescale, normalize; pan-and-scan crops when asked)."""

    height: int
    width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    resample: int = 2  # PIL's BILINEAR
    pan_and_scan: PanAndScan | None = None

    @classmethod
    def for_model(
        cls,
        folder: Path | None,
        vision_config: Any,
        config: dict[str, Any] | None = None,
        do_pan_and_scan: bool | None = None,
    ) -> ImagePreprocessor:
        """From `config` (preprocessor_config.json's keys: a GGUF projector's metadata), else the
        checkpoint's preprocessor_config.json, else the vision config's image size with SigLIP's
        mean and std (0.5). `do_pan_and_scan`: None takes the config's value (off where unset)."""
        side = int(vision_config.image_size)
        cfg: dict[str, Any] = dict(config or {})
        path = None if folder is None else Path(folder) / "preprocessor_config.json"
        if config is None and path is not None and path.is_file():
            cfg = json.loads(path.read_text())
        pan_and_scan = None
        if cfg.get("do_pan_and_scan") if do_pan_and_scan is None else do_pan_and_scan:
            given = {
                k: cfg.get(f"pan_and_scan_{k}")
                for k in ("min_crop_size", "max_num_crops", "min_ratio_to_activate")
            }
            pan_and_scan = PanAndScan(
                **{k: v for k, v in given.items() if v is not None}
            )  # null: the default
        size = cfg.get("size") or {}
        return cls(
            height=int(size.get("height", side)),
            width=int(size.get("width", side)),
            mean=tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            std=tuple(cfg.get("image_std", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            resample=int(cfg.get("resample", 2)),
            pan_and_scan=pan_and_scan,
        )

    def split(self, image: Any) -> list[Any]:
        """An image (bytes or PIL) -> the images the model sees: it, then its pan-and-scan crops."""
        image = decode_image(image)
        return [image, *(self.pan_and_scan.crops(image) if self.pan_and_scan is not None else ())]

    def __call__(self, image: Any) -> torch.Tensor:  # PIL image -> [3, height, width] float32
        x = resize_and_normalize(decode_image(image), self.height, self.width, self)
        return torch.from_numpy(np.ascontiguousarray(x))


def resize_and_normalize(image: Any, height: int, width: int, norm: Any) -> np.ndarray:
    """An RGB PIL image -> [3, height, width] float32: resized on the 8-bit image (`norm.resample`),
    x * `norm.rescale_factor`, then (x - `norm.mean`) / `norm.std` per channel."""
    resized = image.resize((width, height), resample=norm.resample)
    x = np.asarray(resized, dtype=np.float32) * np.float32(norm.rescale_factor)  # [h, w, 3]
    x = (x - np.asarray(norm.mean, dtype=np.float32)) / np.asarray(norm.std, dtype=np.float32)
    return x.transpose(2, 0, 1)


def image_hash(pixels: torch.Tensor) -> str:
    """Hex sha256 of the preprocessed pixels: the same picture in another file format (or resized
    from another size to the same pixels) shares its cached blocks."""
    return hashlib.sha256(pixels.contiguous().numpy().tobytes()).hexdigest()

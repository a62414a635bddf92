"""Images in, pixel tensors out: decoding (Pillow), a model's preprocessing, and the hash that
identifies an image in the prefix cache.

Preprocessing follows the checkpoint's `preprocessor_config.json` where it has one (else the
vision config's `image_size` and SigLIP's defaults), the steps transformers' Gemma 3 image
processor takes (its Pillow backend):

    RGB -> resize to (height, width), bilinear, on the 8-bit image -> x / 255 -> (x - mean) / std

Bad input raises `ValueError` naming what was wrong (the server turns it into a 400).
"""

from __future__ import annotations

import hashlib
import io
import json
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
class ImagePreprocessor:
    """One model's preprocessing (resize, rescale, normalize)."""

    height: int
    width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    resample: int = 2  # PIL's BILINEAR

    @classmethod
    def for_model(cls, folder: Path | None, vision_config: Any) -> ImagePreprocessor:
        """From the checkpoint's preprocessor_config.json, else the vision config's image size with
        SigLIP's mean and std (0.5)."""
        side = int(vision_config.image_size)
        cfg: dict[str, Any] = {}
        path = None if folder is None else Path(folder) / "preprocessor_config.json"
        if path is not None and path.is_file():
            cfg = json.loads(path.read_text())
        if cfg.get("do_pan_and_scan"):
            raise ValueError(f"{path}: do_pan_and_scan is not supported")
        size = cfg.get("size") or {}
        return cls(
            height=int(size.get("height", side)),
            width=int(size.get("width", side)),
            mean=tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            std=tuple(cfg.get("image_std", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            resample=int(cfg.get("resample", 2)),
        )

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

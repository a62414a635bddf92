"""Qwen2-VL / Qwen2.5-VL videos: preprocessing as transformers' Qwen2VL video processor does it,
and prompts with videos (and images) as its processor writes them.

    frames F x (H x W x 3)  -> each frame: smart_resize (the video config's min/max pixels), resize
                               (bicubic, 8-bit, Pillow), x / 255, (x - mean) / std
                            -> F padded to a multiple of T (temporal_patch_size) with the last frame
                            -> patches [F/T * h/P * w/P, 3 * T * P * P]: grid frame by grid frame,
                               merge blocks as an image's, each patch's T frames side by side

A grid frame (a pair of video frames at T = 2) is `second_per_grid_t = T / fps` seconds long;
Qwen2.5-VL's M-RoPE spaces its frames' temporal ids by `tokens_per_second` x that (Qwen2-VL by 1).
The chat template writes `<|vision_start|><|video_pad|><|vision_end|>` for each video; each
`<|video_pad|>` becomes as many pads as the video has tokens after the merger (F/T * h/P * w/P /
m^2). Frames come decoded (PIL images, encoded images, or a [F, H, W, 3] uint8 array): decoding a
video file is left to the caller. transformers resizes frames with torchvision, this with Pillow
(the same as its images): frames already at a multiple of P * m within the pixel limits are
bit-identical, resized ones may differ in the last bits.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.core.multimodal import MultiModalInput
from llmserve.errors import ParameterError
from llmserve.multimodal.image import decode_image, image_hash, resize_and_normalize
from llmserve.multimodal.processor import (
    ImageSource,
    PreparedImage,
    check_markers,
    place_images,
    repeat_marker,
    token_name,
)
from llmserve.multimodal.qwen_vl import QwenVLImagePreprocessor, QwenVLPromptProcessor, smart_resize

DEFAULT_FPS = 2.0
"""The frame rate a video is taken to have when its caller gives none (Qwen's sampling rate)."""


@dataclass(frozen=True, slots=True)
class VideoPatches:
    """One preprocessed video: what the vision tower takes, and how long each grid frame lasts."""

    pixels: torch.Tensor  # [t * h * w, 3 * T * P * P] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches, t = frames / T
    second_per_grid_t: float


@dataclass(frozen=True, slots=True)
class Video:
    """A video as given: its frames and frame rate."""

    frames: Any
    fps: float = DEFAULT_FPS


@dataclass(frozen=True, slots=True)
class QwenVLVideoPreprocessor:
    frame: QwenVLImagePreprocessor
    """How each frame is resized and normalized: the image preprocessing with the video config's
    values (its min/max pixels above all)."""
    max_frames: int
    max_pixels_in: int

    @classmethod
    def for_model(cls, source: ImageSource, vision_config: Any) -> QwenVLVideoPreprocessor:
        """The image preprocessing, overridden by the checkpoint's video_preprocessor_config.json
        (`size.shortest_edge` / `longest_edge` or `min_pixels` / `max_pixels`) or, without one,
        transformers' video defaults for the pixel limits."""
        image = QwenVLImagePreprocessor.for_model(source.folder, vision_config)
        path = None if source.folder is None else Path(source.folder) / "video_preprocessor_config.json"
        cfg: dict[str, Any] = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        size = cfg.get("size") or {}
        names = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
                 "merge_size": "merge_size", "image_mean": "mean", "image_std": "std",
                 "rescale_factor": "rescale_factor", "resample": "resample"}  # fmt: skip
        frame = dataclasses.replace(
            image,
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or 128 * 28 * 28),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 768),
            **{
                ours: tuple(cfg[key]) if key.startswith("image_") else cfg[key]
                for key, ours in names.items()
                if key in cfg
            },
        )
        return cls(frame, source.max_video_frames, source.max_video_pixels)

    def __call__(self, video: Video | Any) -> VideoPatches:
        video = video if isinstance(video, Video) else Video(video)
        frames = self._frames(video.frames)
        prep = self.frame
        P, T, m = prep.patch_size, prep.temporal_patch_size, prep.merge_size
        first = frames[0]
        h, w = smart_resize(first.height, first.width, P * m, prep.min_pixels, prep.max_pixels)
        x = np.stack([resize_and_normalize(f, h, w, prep) for f in frames])  # [F, 3, h, w]
        if pad := -len(frames) % T:  # as transformers: the last frame repeated
            x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        gt, gh, gw = len(x) // T, h // P, w // P
        x = x.reshape(gt, T, 3, gh // m, m, P, gw // m, m, P)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, 3, T, P, P]
        pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(gt * gh * gw, 3 * T * P * P))
        return VideoPatches(pixels, (gt, gh, gw), T / video.fps)

    def _frames(self, frames: Any) -> list[Any]:
        """PIL frames of one size, within the frame and pixel limits; ValueError naming the fault."""
        if isinstance(frames, np.ndarray):
            if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
                raise ValueError(
                    f"a video array must be [frames, height, width, 3] uint8; got {list(frames.shape)} {frames.dtype}"
                )
            frames = list(frames)
        elif not isinstance(frames, (list, tuple)):
            raise ValueError(
                f"a video is a list of frames or a [frames, height, width, 3] array, not {type(frames).__name__}"
            )
        if not frames:
            raise ValueError("a video has no frames")
        if len(frames) > self.max_frames:
            raise ValueError(f"a video of {len(frames)} frames exceeds max_video_frames ({self.max_frames})")
        out = [_pil_frame(f) for f in frames]
        sizes = {f.size for f in out}
        if len(sizes) > 1:
            raise ValueError(f"a video's frames must share one size; got {sorted(sizes)}")
        (width, height) = out[0].size
        if len(out) * width * height > self.max_pixels_in:
            raise ValueError(
                f"a video of {len(out)} frames of {width}x{height} pixels exceeds max_video_pixels "
                f"({self.max_pixels_in})"
            )
        return out


def _pil_frame(frame: Any) -> Any:
    if isinstance(frame, np.ndarray):
        from PIL import Image

        if frame.ndim != 3 or frame.shape[-1] != 3 or frame.dtype != np.uint8:
            raise ValueError(
                f"a video frame must be [height, width, 3] uint8; got {list(frame.shape)} {frame.dtype}"
            )
        return Image.fromarray(frame)
    return decode_image(frame)


def videos_of(data: Any) -> tuple[Video, ...]:
    """vLLM's `multi_modal_data["video"]` -> its videos. One video: a [F, H, W, 3] array, a list of
    frames (PIL images, encoded images, [H, W, 3] arrays), or (frames, metadata) with metadata's
    "fps"; several: a list of those."""
    if _is_one_video(data):
        return (_video(data),)
    if (
        isinstance(data, (list, tuple))
        and data
        and all(_is_one_video(v) or isinstance(v, list) for v in data)
    ):
        return tuple(_video(v) for v in data)
    return (_video(data),)  # a list of frames (its faults reported when it is preprocessed)


def _is_one_video(x: Any) -> bool:
    return (
        isinstance(x, Video)
        or (isinstance(x, np.ndarray) and x.ndim == 4)
        or (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], dict))
    )


def _video(x: Any) -> Video:
    if isinstance(x, Video):
        return x
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], dict):
        fps = x[1].get("fps", DEFAULT_FPS)
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0:
            raise ValueError(f"a video's metadata fps must be a number > 0; got {fps!r}")
        return Video(x[0], float(fps))
    return Video(x)


class QwenVLMediaPromptProcessor(QwenVLPromptProcessor):
    """Qwen2-VL / Qwen2.5-VL's prompts with images and videos."""

    def __init__(self, model: Any, mm_config: Any, token_text: Any, source: ImageSource) -> None:
        super().__init__(model, mm_config, token_text, source)
        self.video_token_id = int(mm_config.video_token_id)
        self.video_pad = token_name(token_text, self.video_token_id, "video")
        self.preprocess_video = QwenVLVideoPreprocessor.for_model(source, mm_config.vision_config)

    def expand_videos(self, prompt: str, videos: Sequence[Any]) -> tuple[str, list[PreparedImage]]:
        """Each `<|video_pad|>` repeated to its video's number of tokens; the videos preprocessed."""
        check_markers(prompt, self.video_pad, len(videos), kind="video")
        prepared = []
        for i, video in enumerate(videos):
            try:
                patches = self.preprocess_video(video)
            except ValueError as e:
                raise ParameterError(f"video {i}: {e}", param=f"videos[{i}]") from None
            t, h, w = patches.grid
            # the time scale is part of the identity: it moves the frames' positions (their K)
            identity = f"video:{image_hash(patches.pixels)}:{t}x{h}x{w}:{patches.second_per_grid_t!r}"
            prepared.append(
                PreparedImage(patches, identity, t * h * w // self.preprocess_video.frame.merge_size**2)
            )
        return repeat_marker(prompt, self.video_pad, [v.num_tokens for v in prepared]), prepared

    def media_inputs(
        self, token_ids: Sequence[int], images: Sequence[PreparedImage], videos: Sequence[PreparedImage]
    ) -> tuple[MultiModalInput, ...]:
        """The images' and videos' inputs, in prompt order (M-RoPE positions follow it)."""
        found = self.inputs(token_ids, images) + place_images(token_ids, self.video_token_id, videos, False)
        return tuple(sorted(found, key=lambda m: m.offset))

    def check_no_placeholders(self, token_ids: Sequence[int]) -> None:
        """Neither placeholder typed in a prompt without media (with media, `media_inputs`
        refuses pads that do not match them)."""
        super().check_no_placeholders(token_ids)
        if self.video_token_id in token_ids:
            raise ParameterError(
                f"the prompt holds the video placeholder token {self.video_token_id} but no video was "
                f"given (a video part adds it; do not type it)",
                param="prompt",
            )

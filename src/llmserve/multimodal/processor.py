"""A prompt with images -> token ids with each image's placeholder tokens, and the images' inputs.

Gemma 3's chat template writes `<start_of_image>` where an image goes; its processor replaces each
one by the image's full sequence before tokenizing:

    "<start_of_image>"  ->  "\\n\\n<start_of_image>" + "<image_soft_token>" x mm_tokens_per_image
                            + "<end_of_image>\\n\\n"

and so does this (the same text, so the same tokens). An image with pan-and-scan crops becomes
"Here is the original image " + its sequence + " and here are some crops to help you see better "
+ the crops' sequences joined by spaces, as transformers' Gemma3Processor writes it; each crop is
an image input of its own. After tokenization each run of placeholder ids is one image: its offset, length and hash go to the scheduler as `MultiModalInput`s, with the
preprocessed pixels the model runner encodes. Qwen2.5-VL's processor (qwen_vl.py) shares the
helpers below; `make_prompt_processor` picks one by the model's `image_prompt_format`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmserve.core.multimodal import MultiModalInput
from llmserve.errors import ParameterError
from llmserve.multimodal.image import ImagePreprocessor, image_hash


class PromptProcessor(Protocol):
    """A model's prompts with images: markers expanded, images preprocessed and placed."""

    both_ways: bool
    """Whether an image's tokens attend to each other both ways (then a chunk never splits one)."""

    def expand(self, prompt: str, images: Sequence[Any]) -> tuple[str, list[PreparedImage]]: ...

    def inputs(
        self, token_ids: Sequence[int], images: Sequence[PreparedImage]
    ) -> tuple[MultiModalInput, ...]: ...

    def check_no_placeholders(self, token_ids: Sequence[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class ImageSource:
    """Where a model's image preprocessing comes from."""

    folder: Path | None
    """The checkpoint's folder (its preprocessor_config.json); None for a GGUF file."""
    preprocessing: dict[str, Any] | None = None
    """preprocessor_config.json's values from elsewhere (a GGUF vision projector's metadata)."""
    do_pan_and_scan: bool | None = None
    """Gemma 3's pan-and-scan crops; None takes the preprocessing config's value."""
    max_video_frames: int = 768
    """Qwen VL videos: the most frames one video may have (more: a ValueError)."""
    max_video_pixels: int = 256 * 2**20
    """Qwen VL videos: the most pixels one video's frames may hold together, as given."""


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """One image of a prompt, preprocessed: what the model encodes, its identity, its token count."""

    data: Any
    identifier: str
    num_tokens: int


class PlaceholderCheck:
    image_token_id: int

    def check_no_placeholders(self, token_ids: Sequence[int]) -> None:
        """A prompt without images must not hold the image placeholder (transformers refuses it
        too: the model would read the placeholder's own embedding as an image)."""
        if self.image_token_id in token_ids:
            raise ParameterError(
                f"the prompt holds the image placeholder token {self.image_token_id} but no image was "
                f"given (an image part adds it; do not type it)",
                param="prompt",
            )


class ImagePromptProcessor(PlaceholderCheck):
    """Gemma 3's: a fixed number of tokens per image, which attend to each other both ways."""

    both_ways = True

    def __init__(self, model: Any, mm_config: Any, token_text: Any, source: ImageSource) -> None:
        """`mm_config`: the checkpoint's multimodal config (its image, boi and eoi token ids);
        `token_text`: id -> the token's text (the tokenizer's `id_to_token`)."""
        tokens_per_image = int(model.mm_tokens_per_image)
        self.image_token_id = int(_first(mm_config, "image_token_id", "image_token_index"))
        names = {}
        for key, attrs in {"image": ("image_token_id", "image_token_index"),
                           "boi": ("boi_token_id", "boi_token_index"),
                           "eoi": ("eoi_token_id", "eoi_token_index")}.items():  # fmt: skip
            names[key] = token_name(token_text, int(_first(mm_config, *attrs)), key)
        self.tokens_per_image = tokens_per_image
        self.boi_token = names["boi"]
        self.full_image_sequence = f"\n\n{names['boi']}{names['image'] * tokens_per_image}{names['eoi']}\n\n"
        self.preprocess = ImagePreprocessor.for_model(
            source.folder, mm_config.vision_config, source.preprocessing, source.do_pan_and_scan
        )

    def expand(self, prompt: str, images: Sequence[Any]) -> tuple[str, list[PreparedImage]]:
        """The prompt text with each image marker replaced by the image's full sequence (and its
        pan-and-scan crops'), and the images preprocessed, each followed by its crops."""
        check_markers(prompt, self.boi_token, len(images))
        prepared, num_crops = [], []
        for i, image in enumerate(images):
            parts = preprocess_one(self.preprocess.split, image, i)
            for part in parts:
                pixels = preprocess_one(self.preprocess, part, i)
                prepared.append(PreparedImage(pixels, image_hash(pixels), self.tokens_per_image))
            num_crops.append(len(parts) - 1)
        text, *after = prompt.split(self.boi_token)
        for n, piece in zip(num_crops, after, strict=True):
            text += self._image_text(n) + piece
        return text, prepared

    def _image_text(self, num_crops: int) -> str:
        full = self.full_image_sequence
        if not num_crops:
            return full
        crops = " ".join([full] * num_crops)
        return f"Here is the original image {full} and here are some crops to help you see better {crops}"

    def inputs(
        self, token_ids: Sequence[int], images: Sequence[PreparedImage]
    ) -> tuple[MultiModalInput, ...]:
        """Each image placed at its run of placeholder ids."""
        return place_images(token_ids, self.image_token_id, images, both_ways=True)


def token_name(token_text: Any, token_id: int, key: str) -> str:
    """The text of the config's `key` token, or a ValueError when the tokenizer lacks it."""
    text = token_text(token_id)
    if not text:
        raise ValueError(f"the tokenizer has no token {token_id} (the config's {key} token)")
    return text


def check_markers(prompt: str, marker: str, num_images: int, kind: str = "image") -> None:
    found = prompt.count(marker)
    if found != num_images:
        raise ParameterError(
            f"the prompt has {found} {kind} marker(s) ({marker!r}) for {num_images} {kind}(s)", param="prompt"
        )


def repeat_marker(prompt: str, marker: str, counts: Sequence[int]) -> str:
    """`prompt` with its i-th `marker` repeated counts[i] times (one marker per item, checked)."""
    pieces = prompt.split(marker)
    out = [pieces[0]]
    for n, piece in zip(counts, pieces[1:], strict=True):
        out += [marker * n, piece]
    return "".join(out)


def preprocess_one(preprocess: Any, image: Any, index: int) -> Any:
    """`preprocess(image)`, its ValueError a ParameterError naming `images[index]`."""
    try:
        return preprocess(image)
    except ValueError as e:
        raise ParameterError(f"image {index}: {e}", param=f"images[{index}]") from None


def place_images(
    token_ids: Sequence[int], image_token_id: int, images: Sequence[PreparedImage], both_ways: bool
) -> tuple[MultiModalInput, ...]:
    """Each image at its run of placeholder ids (one run an image, in order, of its length)."""
    runs = _runs(token_ids, image_token_id)
    if [n for _, n in runs] != [im.num_tokens for im in images]:
        raise ParameterError(
            f"the prompt's image placeholder tokens ({[n for _, n in runs]}) do not match "
            f"{len(images)} image(s) of {[im.num_tokens for im in images]} tokens",
            param="prompt",
        )
    return tuple(
        MultiModalInput(offset, n, im.identifier, im.data, bidirectional=both_ways)
        for (offset, n), im in zip(runs, images, strict=True)
    )


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"the multimodal config has none of {names}")


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


_PROCESSORS: dict[str, tuple[str, str]] = {
    "gemma3": ("processor", "ImagePromptProcessor"),
    "qwen2_vl": ("qwen_vl_video", "QwenVLMediaPromptProcessor"),
    "qwen3_vl": ("qwen_vl", "QwenVLPromptProcessor"),  # images only: its videos are timestamped frames
}
"""A model's `image_prompt_format` -> (module under multimodal/, class)."""


def make_prompt_processor(
    model: Any, mm_config: Any, token_text: Any, source: ImageSource
) -> PromptProcessor:
    """The prompt processor of a model that takes images (`supports_images`)."""
    module, name = _PROCESSORS[model.image_prompt_format]
    cls = getattr(importlib.import_module(f"llmserve.multimodal.{module}"), name)
    return cls(model, mm_config, token_text, source)

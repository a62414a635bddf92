"""A prompt with images -> token ids with each image's placeholder tokens, and the images' inputs.

Gemma 3's chat template writes `<start_of_image>` where an image goes; its processor replaces each
one by the image's full sequence before tokenizing:

    "<start_of_image>"  ->  "\\n\\n<start_of_image>" + "<image_soft_token>" x mm_tokens_per_image
                            + "<end_of_image>\\n\\n"

and so does this (the same text, so the same tokens). An image with pan-and-scan crops becomes
"Here is the original image " + its sequence + " and here are some crops to help you see better "
+ the crops' sequences joined by spaces, as transformers' Gemma3Processor writes it. After tokenization each run of placeholder
ids is one image: its offset, length and hash go to the scheduler as `MultiModalInput`s, with the
preprocessed pixels the model runner encodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmserve.core.multimodal import MultiModalInput
from llmserve.errors import ParameterError
from llmserve.multimodal.image import ImagePreprocessor, image_hash


class ImagePromptProcessor:
    def __init__(
        self,
        mm_config: Any,
        tokens_per_image: int,
        token_text: Any,
        folder: Path | None,
        preprocessing: dict[str, Any] | None = None,
        do_pan_and_scan: bool | None = None,
    ) -> None:
        """`mm_config`: the checkpoint's multimodal config (its image, boi and eoi token ids);
        `token_text`: id -> the token's text (the tokenizer's `id_to_token`); `preprocessing`:
        preprocessor_config.json's values where they do not come from `folder` (a GGUF projector);
        `do_pan_and_scan`: None takes the preprocessing config's value."""
        self.image_token_id = int(_first(mm_config, "image_token_id", "image_token_index"))
        names = {}
        for key, attrs in {"image": ("image_token_id", "image_token_index"),
                           "boi": ("boi_token_id", "boi_token_index"),
                           "eoi": ("eoi_token_id", "eoi_token_index")}.items():  # fmt: skip
            token_id = int(_first(mm_config, *attrs))
            text = token_text(token_id)
            if not text:
                raise ValueError(f"the tokenizer has no token {token_id} (the config's {key} token)")
            names[key] = text
        self.tokens_per_image = tokens_per_image
        self.boi_token = names["boi"]
        self.full_image_sequence = f"\n\n{names['boi']}{names['image'] * tokens_per_image}{names['eoi']}\n\n"
        self.preprocess = ImagePreprocessor.for_model(
            folder, mm_config.vision_config, preprocessing, do_pan_and_scan
        )

    def split(self, images: Sequence[Any]) -> tuple[list[Any], list[int]]:
        """The images decoded, each followed by its pan-and-scan crops, and each one's number of crops."""
        flat, num_crops = [], []
        for i, image in enumerate(images):
            try:
                parts = self.preprocess.split(image)
            except ValueError as e:
                raise ParameterError(f"image {i}: {e}", param=f"images[{i}]") from None
            flat += parts
            num_crops.append(len(parts) - 1)
        return flat, num_crops

    def expand(self, prompt: str, num_crops: Sequence[int]) -> str:
        """The prompt text with each image marker replaced by the image's full sequence (and its
        crops'); `num_crops`: each image's number of crops (`split`'s)."""
        found = prompt.count(self.boi_token)
        if found != len(num_crops):
            raise ParameterError(
                f"the prompt has {found} image marker(s) ({self.boi_token!r}) for {len(num_crops)} image(s)",
                param="prompt",
            )
        text, *after = prompt.split(self.boi_token)
        for n, piece in zip(num_crops, after, strict=True):
            text += self._image_text(n) + piece
        return text

    def _image_text(self, num_crops: int) -> str:
        full = self.full_image_sequence
        if not num_crops:
            return full
        crops = " ".join([full] * num_crops)
        return f"Here is the original image {full} and here are some crops to help you see better {crops}"

    def check_no_placeholders(self, token_ids: Sequence[int]) -> None:
        """A prompt without images must not hold the image placeholder (transformers refuses it
        too: the model would read the placeholder's own embedding as an image)."""
        if self.image_token_id in token_ids:
            raise ParameterError(
                f"the prompt holds the image placeholder token {self.image_token_id} but no image was "
                f"given (an image part adds it; do not type it)",
                param="prompt",
            )

    def inputs(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[MultiModalInput, ...]:
        """Each image (`split`'s: crops are images of their own) preprocessed, hashed and placed at
        its run of placeholder ids."""
        runs = _runs(token_ids, self.image_token_id)
        if len(runs) != len(images) or any(n != self.tokens_per_image for _, n in runs):
            raise ParameterError(
                f"the prompt's image placeholder tokens ({[n for _, n in runs]}) do not match "
                f"{len(images)} image(s) of {self.tokens_per_image} tokens",
                param="prompt",
            )
        out = []
        for i, ((offset, n), image) in enumerate(zip(runs, images, strict=True)):
            try:
                pixels = self.preprocess(image)
            except ValueError as e:
                raise ParameterError(f"image {i}: {e}", param=f"images[{i}]") from None
            out.append(MultiModalInput(offset, n, image_hash(pixels), pixels))
        return tuple(out)


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

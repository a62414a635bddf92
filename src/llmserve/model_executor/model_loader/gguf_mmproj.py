"""A GGUF language model plus llama.cpp's vision projector file (`--mmproj mmproj-*.gguf`) as one
multimodal checkpoint: Gemma 3's text GGUF + its `clip` GGUF = Gemma3ForConditionalGeneration.

What an HF folder keeps in config.json, preprocessor_config.json and tokenizer.json comes from the
two files' metadata here (names as llama.cpp's convert_hf_to_gguf.py writes them):

    text file   gemma3.*                      -> text_config (gguf_config.gemma3_config)
                tokenizer.ggml.tokens         -> boi/eoi ids (<start_of_image>, <end_of_image>)
    mmproj      clip.vision.*                 -> vision_config (gguf_config.clip_vision_config)
                clip.vision.projector.scale_factor (default 4, clip.cpp's n_merge)
                                              -> mm_tokens_per_image = (image_size / patch / k)^2
                clip.vision.image_mean/_std   -> the preprocessing (resize to image_size, bilinear)

Gemma 3's GGUF vocabulary stops at 262144 tokens, without the image placeholder
`<image_soft_token>` that transformers' tokenizer adds as id 262144: it is added here with the
next free id, which is transformers' id for it (the placeholder's embedding row is never read:
the image's vectors replace it). Does not know tokenizers: it says which token to add.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers

from llmserve.model_executor.model_loader.errors import ModelLoadError
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<image_soft_token>", "<start_of_image>", "<end_of_image>"


@dataclass(frozen=True, slots=True)
class GGUFVision:
    """What a vision projector file adds to a GGUF model, beyond its weights."""

    hf_config: transformers.PretrainedConfig
    """Gemma3Config: the text file's config as `text_config`, the projector's as `vision_config`."""
    added_tokens: tuple[tuple[int, str], ...]
    """(id, text) of tokens the prompts need that the GGUF vocabulary lacks (the image placeholder)."""
    preprocessing: dict[str, Any]
    """The image preprocessing, in preprocessor_config.json's keys (multimodal/image.py reads it)."""


def open_mmproj(path: str) -> GGUFCheckpoint:
    """The projector file, checked to be one (`general.architecture` clip)."""
    ckpt = GGUFCheckpoint([Path(path)])
    if ckpt.architecture != "clip":
        raise ModelLoadError(
            f"{path}: not a vision projector (general.architecture {ckpt.architecture!r}, expected 'clip')"
        )
    return ckpt


def gemma3_vision(text: GGUFCheckpoint, proj: GGUFCheckpoint) -> GGUFVision:
    """Gemma 3's text GGUF and its projector GGUF as one Gemma3ForConditionalGeneration config."""
    if text.architecture != "gemma3":
        raise ModelLoadError(
            f"{proj.parts[0]}: a Gemma 3 vision projector needs a Gemma 3 language model; "
            f"{text.parts[0]} is {text.architecture!r}"
        )
    text_config, vision_config = text.hf_config(), proj.hf_config()
    width = proj.require("vision.projection_dim")
    if width != text_config.hidden_size:
        raise ModelLoadError(
            f"{proj.parts[0]}: the projector's output width {width} is not the language model's "
            f"hidden size {text_config.hidden_size} (a projector for another model size?)"
        )
    patches_per_side = vision_config.image_size // vision_config.patch_size
    tokens_per_side = patches_per_side // proj.arch_field("vision.projector.scale_factor", 4)
    tokens = text.field("tokenizer.ggml.tokens") or []
    ids, added = _image_token_ids(tokens, str(text.parts[0]))
    config = transformers.Gemma3Config(
        text_config=text_config.to_dict(),
        vision_config=vision_config.to_dict(),
        mm_tokens_per_image=tokens_per_side**2,
        image_token_index=ids[IMAGE_TOKEN],
        boi_token_index=ids[BOI_TOKEN],
        eoi_token_index=ids[EOI_TOKEN],
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    side = int(vision_config.image_size)
    preprocessing = {
        "size": {"height": side, "width": side},
        "image_mean": [float(x) for x in proj.require("vision.image_mean")],
        "image_std": [float(x) for x in proj.require("vision.image_std")],
        "resample": 2,  # clip.cpp resizes Gemma 3's images bilinearly, as its HF processor does
    }
    return GGUFVision(config, added, preprocessing)


def _image_token_ids(tokens: list[str], file: str) -> tuple[dict[str, int], tuple[tuple[int, str], ...]]:
    """The three image tokens' ids in the vocabulary; the placeholder, where absent, gets the id
    after the last token (and is returned as a token to add)."""
    ids: dict[str, int] = {}
    for text in (IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN):
        if text in tokens:
            ids[text] = tokens.index(text)
    for text in (BOI_TOKEN, EOI_TOKEN):
        if text not in ids:
            raise ModelLoadError(f"{file}: the vocabulary has no {text} token, which Gemma 3's images need")
    if IMAGE_TOKEN in ids:
        return ids, ()
    ids[IMAGE_TOKEN] = len(tokens)
    return ids, ((len(tokens), IMAGE_TOKEN),)

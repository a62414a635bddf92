"""A GGUF language model plus llama.cpp's vision projector file (`--mmproj mmproj-*.gguf`) as one
multimodal checkpoint, by the projector's `clip.projector_type` (gguf_clip.PROJECTORS):

    gemma3             Gemma 3's text GGUF + its projector = Gemma3ForConditionalGeneration
    qwen2.5vl_merger   a `qwen2vl` text GGUF + its projector = Qwen2_5_VLForConditionalGeneration
    qwen2vl_merger     a `qwen2vl` text GGUF + its projector = Qwen2VLForConditionalGeneration

What an HF folder keeps in config.json, preprocessor_config.json and tokenizer.json comes from the
two files' metadata here (names as llama.cpp's convert_hf_to_gguf.py writes them):

    text file   <arch>.*                      -> text_config (gguf_config)
                tokenizer.ggml.tokens         -> the image tokens' ids
    mmproj      clip.vision.*                 -> vision_config (gguf_config.clip_vision_config)
                clip.vision.image_mean/_std   -> the preprocessing
    Gemma 3     clip.vision.projector.scale_factor (default 4, clip.cpp's n_merge)
                                              -> mm_tokens_per_image = (image_size / patch / k)^2;
                                                 images resized to image_size, bilinear
    Qwen2(.5)-VL clip.vision.spatial_merge_size (default 2), patch_size
                                              -> images of any size between clip.cpp's limits,
                                                 8 and 4096 tokens (bicubic, as HF's processor)

Gemma 3's GGUF vocabulary stops at 262144 tokens, without the image placeholder
`<image_soft_token>` that transformers' tokenizer adds as id 262144: it is added here with the
next free id, which is transformers' id for it (the placeholder's embedding row is never read:
the image's vectors replace it). Does not know tokenizers: it says which token to add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import transformers

from llmserve.model_executor.model_loader import gguf_clip, gguf_config
from llmserve.model_executor.model_loader.errors import ModelLoadError
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<image_soft_token>", "<start_of_image>", "<end_of_image>"


@dataclass(frozen=True, slots=True)
class GGUFVision:
    """What a vision projector file adds to a GGUF model, beyond its weights."""

    hf_config: transformers.PretrainedConfig
    """The multimodal config: the text file's config as `text_config`, the projector's as
    `vision_config`."""
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


def gguf_vision(text: GGUFCheckpoint, proj: GGUFCheckpoint) -> GGUFVision:
    """The text GGUF and its projector GGUF as one multimodal config, checked to belong together
    (the projector's type to the text model's architecture, its output width to the hidden
    size, every tensor the projector type needs present). ValueErrors name the file and key."""
    kind = gguf_clip.projector_type(proj)
    projector = gguf_clip.PROJECTORS[kind]
    if text.architecture not in projector.text_architectures:
        raise ModelLoadError(
            f"{proj.parts[0]}: a {kind!r} vision projector (clip.projector_type) is for a "
            f"{' or '.join(projector.text_architectures)} language model; {text.parts[0]} is "
            f"{text.architecture!r} (general.architecture)"
        )
    _check_tensors(proj, projector)
    text_config_of, build = _BUILDERS[kind]
    text_config = text_config_of(text)
    width = proj.require("vision.projection_dim")
    if width != text_config.hidden_size:
        raise ModelLoadError(
            f"{proj.parts[0]}: the projector's output width {width} (clip.vision.projection_dim) is not "
            f"the language model's hidden size {text_config.hidden_size} (a projector for another model size?)"
        )
    return build(text, proj, text_config, proj.hf_config())


def _check_tensors(proj: GGUFCheckpoint, projector: gguf_clip.ClipProjector) -> None:
    """Every weight and bias the projector type's table names (each block's, up to
    clip.vision.block_count) and every part of a join is in the file."""
    blocks = range(int(proj.require("vision.block_count")))
    wanted = [f"{key}.weight" for key in projector.names] + [f"{key}.bias" for key in projector.biases]
    wanted += [part for join in projector.joins.values() for part in join.parts]
    names = [n.format(bid=b) for n in wanted for b in (blocks if "{bid}" in n else [None])]
    missing = [n for n in dict.fromkeys(names) if not proj.has_tensor(n)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{proj.parts[0]}: the {proj.field('clip.projector_type')!r} vision projector lacks tensor "
            f"{missing[0]!r}{more}"
        )


def _gemma3_vision(
    text: GGUFCheckpoint, proj: GGUFCheckpoint, text_config: Any, vision_config: Any
) -> GGUFVision:
    """Gemma 3's text GGUF and its projector GGUF as one Gemma3ForConditionalGeneration config."""
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


QWEN_IMAGE_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
_QWEN_TOKENS_PER_IMAGE = (8, 4096)
"""clip.cpp's bounds on a Qwen2-VL or Qwen2.5-VL image's tokens (after the merger): its min and
max pixels."""


def _qwen_vl_vision(
    config_cls: type[transformers.PretrainedConfig],
    text: GGUFCheckpoint,
    proj: GGUFCheckpoint,
    text_config: Any,
    vision_config: Any,
) -> GGUFVision:
    """A `qwen2vl` text GGUF and a Qwen2-VL or Qwen2.5-VL projector as one `config_cls` config.
    The image tokens are the vocabulary's (Qwen's GGUF vocabularies hold them)."""
    architecture = gguf_clip.PROJECTORS[gguf_clip.projector_type(proj)].hf_architecture
    tokens = text.field("tokenizer.ggml.tokens") or []
    ids = {}
    for name in QWEN_IMAGE_TOKENS:
        if name not in tokens:
            raise ModelLoadError(
                f"{text.parts[0]}: the vocabulary (tokenizer.ggml.tokens) has no {name} token, which "
                f"{architecture}'s images need"
            )
        ids[name] = tokens.index(name)
    extra = {"video_token_id": tokens.index("<|video_pad|>")} if "<|video_pad|>" in tokens else {}
    config = config_cls(
        text_config=text_config.to_dict(),
        vision_config=vision_config.to_dict(),
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=text_config.tie_word_embeddings,
        **extra,
    )
    config.architectures = [architecture]
    cell = (vision_config.patch_size * vision_config.spatial_merge_size) ** 2  # pixels a token
    low, high = _QWEN_TOKENS_PER_IMAGE
    preprocessing = {
        "patch_size": vision_config.patch_size,
        "temporal_patch_size": vision_config.temporal_patch_size,
        "merge_size": vision_config.spatial_merge_size,
        "min_pixels": low * cell,
        "max_pixels": high * cell,
        "image_mean": [float(x) for x in proj.require("vision.image_mean")],
        "image_std": [float(x) for x in proj.require("vision.image_std")],
        "resample": 3,  # bicubic, as clip.cpp and HF's processor resize Qwen's images
    }
    return GGUFVision(config, (), preprocessing)


_BUILDERS: dict[str, tuple[Callable[[GGUFCheckpoint], Any], Callable[..., GGUFVision]]] = {
    "gemma3": (GGUFCheckpoint.hf_config, _gemma3_vision),
    # the text config with M-RoPE
    "qwen2.5vl_merger": (
        gguf_config.qwen2vl_text_config,
        partial(_qwen_vl_vision, transformers.Qwen2_5_VLConfig),
    ),
    "qwen2vl_merger": (gguf_config.qwen2vl_text_config, partial(_qwen_vl_vision, transformers.Qwen2VLConfig)),
}
"""`clip.projector_type` -> (the text file's config, the multimodal config from both files')."""


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

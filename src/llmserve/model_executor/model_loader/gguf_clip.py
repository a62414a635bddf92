"""llama.cpp's vision projector files (`mmproj-*.gguf`, `general.architecture` clip): for each
`clip.projector_type` read here, the HF model it belongs to and its tensors' HF names.

The names are what convert_hf_to_gguf.py's MmprojModel subclasses write through gguf's
MODEL_ARCH.MMPROJ name map (clip.cpp's TN_* names). Two kinds of change are undone on loading:
a `Fix` (a tensor's values, e.g. Gemma's norms stored as 1 + w) and a `Join` (one HF tensor the
converter wrote as several):

    qwen2.5vl_merger   visual.blocks.N.attn.qkv [3C, C]      -> v.blk.N.attn_q / attn_k / attn_v [C, C]
                       visual.patch_embed.proj [C, 3, T, P, P] -> v.patch_embd.weight   [C, 3, P, P] (t = 0)
                                                                  v.patch_embd.weight.1 [C, 3, P, P] (t = 1)
                       visual.merger.ln_q                      -> v.post_ln (the merger's RMSNorm)
                       visual.merger.mlp.0 / mlp.2             -> mm.0 / mm.2
    qwen2vl_merger     as qwen2.5vl_merger, with LayerNorms (weight and bias: ln1, ln2, post_ln)
                       and a two-layer MLP: visual.blocks.N.mlp.fc1 / fc2 -> v.blk.N.ffn_up / ffn_down

Does not know the metadata (gguf_config.py, gguf_mmproj.py) or how tensors are read (gguf_loader.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.model_executor.model_loader.errors import ModelLoadError

# A fix takes the tensor (float32, GGUF layout) and the checkpoint, and returns the HF tensor.
Fix = Callable[[torch.Tensor, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Join:
    """One HF tensor that the converter wrote as several GGUF tensors: their names in order
    (`{bid}` for the block), put back with `torch.cat` (or `torch.stack`, `stack`) along `dim`."""

    parts: tuple[str, ...]
    dim: int
    stack: bool = False

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return (torch.stack if self.stack else torch.cat)(tensors, dim=self.dim)


@dataclass(frozen=True, slots=True)
class ClipProjector:
    """How one `clip.projector_type` maps onto its HF checkpoint."""

    hf_architecture: str
    text_architectures: tuple[str, ...]
    """The language-model GGUF architectures it can be paired with."""
    names: dict[str, str]
    fixes: dict[str, Fix]
    joins: dict[str, Join]
    biases: frozenset[str]
    """The `names` keys that have a bias beside their weight (what a complete file holds)."""


# Gemma 3: SigLIP and the projector under Gemma3ForConditionalGeneration's checkpoint names
# (Gemma3VisionModel in the converter).
_SIGLIP = "model.vision_tower.vision_model."
_GEMMA3_NAMES = {
    "v.patch_embd": _SIGLIP + "embeddings.patch_embedding",
    "v.position_embd": _SIGLIP + "embeddings.position_embedding",
    "v.blk.{bid}.attn_q": _SIGLIP + "encoder.layers.{bid}.self_attn.q_proj",
    "v.blk.{bid}.attn_k": _SIGLIP + "encoder.layers.{bid}.self_attn.k_proj",
    "v.blk.{bid}.attn_v": _SIGLIP + "encoder.layers.{bid}.self_attn.v_proj",
    "v.blk.{bid}.attn_out": _SIGLIP + "encoder.layers.{bid}.self_attn.out_proj",
    "v.blk.{bid}.ln1": _SIGLIP + "encoder.layers.{bid}.layer_norm1",
    "v.blk.{bid}.ln2": _SIGLIP + "encoder.layers.{bid}.layer_norm2",
    "v.blk.{bid}.ffn_up": _SIGLIP + "encoder.layers.{bid}.mlp.fc1",
    "v.blk.{bid}.ffn_down": _SIGLIP + "encoder.layers.{bid}.mlp.fc2",
    "v.post_ln": _SIGLIP + "post_layernorm",
    # HF's bare parameter `mm_input_projection_weight` [C_v, H] (a name ending in `_weight` is
    # taken whole): the converter renamed it `.weight` and wrote the array as it is (clip.cpp
    # transposes it in its graph)
    "mm.input_projection": "model.multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm": "model.multi_modal_projector.mm_soft_emb_norm",
}
# Only the projector's RMSNorm is Gemma's (1 + w), stored as 1 + w; SigLIP's LayerNorms are plain.
_GEMMA3_FIXES: dict[str, Fix] = {"mm.soft_emb_norm": lambda w, c: w - 1.0}

# Qwen2.5-VL: the vision transformer and merger under Qwen2_5_VLForConditionalGeneration's names
# (Qwen2VLVisionModel in the converter). q, k and v name one HF tensor, the fused qkv.
_QWEN_VIT = "model.visual."
_QWEN25VL_NAMES = {
    "v.patch_embd": _QWEN_VIT + "patch_embed.proj",
    "v.blk.{bid}.attn_q": _QWEN_VIT + "blocks.{bid}.attn.qkv",
    "v.blk.{bid}.attn_out": _QWEN_VIT + "blocks.{bid}.attn.proj",
    "v.blk.{bid}.ln1": _QWEN_VIT + "blocks.{bid}.norm1",
    "v.blk.{bid}.ln2": _QWEN_VIT + "blocks.{bid}.norm2",
    "v.blk.{bid}.ffn_gate": _QWEN_VIT + "blocks.{bid}.mlp.gate_proj",
    "v.blk.{bid}.ffn_up": _QWEN_VIT + "blocks.{bid}.mlp.up_proj",
    "v.blk.{bid}.ffn_down": _QWEN_VIT + "blocks.{bid}.mlp.down_proj",
    "v.post_ln": _QWEN_VIT + "merger.ln_q",
    "mm.0": _QWEN_VIT + "merger.mlp.0",
    "mm.2": _QWEN_VIT + "merger.mlp.2",
}
# Qwen2-VL: the same tower with LayerNorms and a fc1 / fc2 MLP (Qwen2VLForConditionalGeneration).
_QWEN2VL_NAMES = {k: v for k, v in _QWEN25VL_NAMES.items() if ".ffn_" not in k} | {
    "v.blk.{bid}.ffn_up": _QWEN_VIT + "blocks.{bid}.mlp.fc1",
    "v.blk.{bid}.ffn_down": _QWEN_VIT + "blocks.{bid}.mlp.fc2",
}
_QWEN_VL_JOINS = {
    f"v.blk.{{bid}}.attn_q.{suffix}": Join(tuple(f"v.blk.{{bid}}.attn_{x}.{suffix}" for x in "qkv"), dim=0)
    for suffix in ("weight", "bias")
} | {"v.patch_embd.weight": Join(("v.patch_embd.weight", "v.patch_embd.weight.1"), dim=2, stack=True)}

PROJECTORS: dict[str, ClipProjector] = {
    "gemma3": ClipProjector(
        "Gemma3ForConditionalGeneration",
        ("gemma3",),
        _GEMMA3_NAMES,
        _GEMMA3_FIXES,
        {},
        frozenset(k for k in _GEMMA3_NAMES if k.startswith(("v.patch", "v.blk", "v.post"))),
    ),
    # (the converter writes Qwen2.5-VL's language model as `qwen2vl`, as Qwen2-VL's)
    "qwen2.5vl_merger": ClipProjector(
        "Qwen2_5_VLForConditionalGeneration",
        ("qwen2vl",),
        _QWEN25VL_NAMES,
        {},
        _QWEN_VL_JOINS,
        frozenset(k for k in _QWEN25VL_NAMES if not k.startswith(("v.patch", "v.post")) and "ln" not in k),
    ),
    "qwen2vl_merger": ClipProjector(
        "Qwen2VLForConditionalGeneration",
        ("qwen2vl",),
        _QWEN2VL_NAMES,
        {},
        _QWEN_VL_JOINS,
        frozenset(k for k in _QWEN2VL_NAMES if k != "v.patch_embd"),  # LayerNorms have biases
    ),
}
"""`clip.projector_type` -> its tables."""


def projector_type(ckpt: Any) -> str:
    """The projector file's `clip.projector_type`, checked to be one read here (ValueError naming
    the file and the key otherwise)."""
    kind = ckpt.field("clip.projector_type")
    if kind not in PROJECTORS:
        raise ModelLoadError(
            f"{ckpt.parts[0]}: vision projector type {kind!r} (clip.projector_type) is not supported; "
            f"supported: {', '.join(PROJECTORS)}"
        )
    return kind

"""What every native model provides, and the shared logic that copies checkpoint tensors into it.

A model takes a flat batch of tokens from many sequences:

    input_ids [T], positions [T], kv_caches (one per layer), AttentionMetadata  ->  hidden [T, H]

and `compute_logits` maps selected hidden rows to vocabulary logits. Checkpoint tensors arrive
under their HF names; `load_weights` routes each to its parameter (or to a shard of a fused one).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from llmserve.layers.attention import AttentionMetadata, LayerKVCache
from llmserve.layers.linear import Linear
from llmserve.layers.quantization.fused_decoder import DecoderSpec
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.load_errors import (
    MissingWeightsError,
    UnexpectedWeightError,
    WeightShapeError,
)

# The fused projections of Llama-shaped attention and gated MLPs.
QKV_GATE_UP_STACKING: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """Per-layer KV geometry the runner needs to allocate the cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class CausalLM(nn.Module):
    """Base class of native decoder-only models."""

    # Checkpoint sub-name -> (fused sub-name, shard index). E.g. "q_proj" -> ("qkv_proj", 0).
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {}

    # Checkpoint names (regex-free substrings) that carry nothing we need (old rotary buffers...).
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    is_encoder: ClassVar[bool] = False
    """An encoder-only model (BERT): bidirectional attention, no KV cache, no LM head; the engine
    runs it through `EncoderForwardRunner` and serves embeddings only."""
    supports_images: ClassVar[bool] = False
    """Whether it takes images (then it has `encode_image` (one image's preprocessed data -> its
    tokens' vectors), `embed_with_images` and `image_prompt_format`, the multimodal/ processor
    that writes its prompts; the runner feeds the vectors in, see gemma3_mm.py, qwen2_5_vl.py)."""
    pooling_only: bool = False
    """A decoder stack without an LM head of its own (a backbone checkpoint: an embedding model
    such as Qwen3-Embedding or gte-Qwen2): it serves embeddings, and generation is refused."""
    unprefixed_checkpoint: bool = False
    """The checkpoint names the stack's tensors without `backbone_name` (HF's `XModel` saves
    `layers.0...`, not `model.layers.0...`): `route_weight` adds it."""
    rope_axes: ClassVar[int] = 1
    """Position ids per token its forward takes: 3 for M-RoPE (positions [3, T], layers/mrope.py,
    with `rope_positions` giving a prompt's), else 1 (positions [T])."""

    @classmethod
    def checkpoint_splits(cls, config: Any) -> dict[str, tuple[tuple[str, int], ...]]:
        """Fused tensors the checkpoint stores whole and the model loads as parts: a sub-name
        (`self_attn.qkv_proj`) -> its parts' sub-names and numbers of rows, in order
        (model_loader/fused_tensors.py cuts them as they stream in). Phi-3's; none by default."""
        return {}

    regroups_checkpoint: ClassVar[bool] = False
    """Whether `regroup_checkpoint` changes the stream (tensor parallelism then cuts a rank's part
    after it, from the tensors the model loads, not from the checkpoint's)."""

    @classmethod
    def regroup_checkpoint(cls, weights: Iterable[tuple[str, Any, str]]) -> Iterable[tuple[str, Any, str]]:
        """The checkpoint's tensors as the model loads them, where it stores some otherwise (Granite
        MoE's stacked experts, one tensor for all); as they come by default."""
        return weights

    backbone_name: ClassVar[str] = "model"
    """The attribute holding the decoder stack (its name is the checkpoint's prefix)."""
    lm_head: LMHead

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKVCache],  # one per layer
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: a model with images' (`embed_with_images`)
    ) -> torch.Tensor:  # [T, hidden]
        backbone = getattr(self, self.backbone_name)
        if inputs_embeds is None:
            return backbone(input_ids, positions, kv_caches, attn_metadata)
        return backbone(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return self.lm_head(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The token embeddings the decoder stack starts from (scaled where the stack scales them)."""
        backbone = getattr(self, self.backbone_name)
        return backbone.embed(input_ids) if hasattr(backbone, "embed") else backbone.embed_tokens(input_ids)

    def decoder_spec(self) -> DecoderSpec | None:
        """The stack as the fused CPU decoder takes it (`layers/quantization/fused_decoder.py`),
        or None for an architecture it cannot run. Whether it runs is the forward runner's call."""
        return None

    def kv_cache_shape(self) -> KVCacheShape:
        raise NotImplementedError

    def use_onednn(self) -> None:
        """Move every linear layer and the LM head onto oneDNN's matmul (CPU, once weights are
        loaded; see layers/onednn.py). Outputs agree with the chunked layout to fp32 rounding."""
        head = self.lm_head.weight_t
        tied_to = next(
            (m for m in self.modules() if isinstance(m, VocabEmbedding) and m.weight_t is head), None
        )
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_onednn()
            elif isinstance(module, VocabEmbedding):
                module.use_rows()
        self.lm_head.use_onednn(tied_to)

    def map_weight_name(self, name: str) -> str | None:
        """HF checkpoint name -> this module's parameter name (None: skip the tensor)."""
        if name == "lm_head.weight" and self.lm_head.tied_to:
            return None  # some tied checkpoints still store a copy
        return name

    # -- weight loading -------------------------------------------------------------------------

    def route_weight(self, ckpt_name: str) -> tuple[str, str, int] | None:
        """Where a checkpoint tensor goes: (module path, attribute, shard of a fused layer), or
        None for a tensor the model does not use."""
        if any(s in ckpt_name for s in self.ignored_weights):
            return None
        if self.unprefixed_checkpoint and not ckpt_name.startswith(f"{self.backbone_name}."):
            ckpt_name = f"{self.backbone_name}.{ckpt_name}"
        name = self.map_weight_name(ckpt_name)
        if name is None:
            return None
        module_path, _, attr = name.rpartition(".")
        shard = 0
        leaf, _, sub = module_path.rpartition(".")
        if sub in self.stacked_params:
            fused, shard = self.stacked_params[sub]
            module_path = f"{leaf}.{fused}" if leaf else fused
        return module_path, attr, shard

    def load_weights(self, weights: Iterable[tuple[str, Any, str]]) -> None:
        """Copy every (name, tensor, file) into its parameter; raise if a tensor is unknown or
        misshapen (naming its file) or if the checkpoint lacks one the model needs. A tensor is a
        float torch.Tensor, or `QuantizedRows` for a layer that `quantize_modules` made quantized."""
        loaded: set[tuple[str, int]] = set()
        for ckpt_name, tensor, file in weights:
            route = self.route_weight(ckpt_name)
            if route is None:
                continue
            try:
                loaded.add(self._load_one(ckpt_name, route, tensor))
            except WeightShapeError as e:
                raise e.with_file(file) from None
            except UnexpectedWeightError as e:
                raise UnexpectedWeightError(f"{file}: {e}") from None
        missing = sorted(f"{n}" + (f"[shard {s}]" if s else "") for n, s in self._expected() - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise MissingWeightsError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")

    def _load_one(self, ckpt_name: str, route: tuple[str, str, int], tensor: Any) -> tuple[str, int]:
        module_path, attr, shard = route
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            raise UnexpectedWeightError(
                f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}"
            ) from None
        if isinstance(module, Linear) and attr in ("weight", "bias"):
            module.load_shard(ckpt_name, tensor, shard, is_bias=attr == "bias")
        elif isinstance(module, (VocabEmbedding, LMHead)) and attr == "weight":
            module.load(ckpt_name, tensor)
        else:
            param = getattr(module, attr, None)
            if not isinstance(param, torch.Tensor) or not isinstance(tensor, torch.Tensor):
                raise UnexpectedWeightError(
                    f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}"
                )
            if tuple(param.shape) != tuple(tensor.shape):
                raise WeightShapeError(ckpt_name, tuple(param.shape), tuple(tensor.shape))
            param.data.copy_(tensor)
        return f"{module_path}.{attr}", shard

    def _expected(self) -> set[tuple[str, int]]:
        """Every (parameter, shard) a checkpoint must provide."""
        expected: set[tuple[str, int]] = set()
        for mod_name, module in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            if isinstance(module, Linear):
                for shard in range(len(module.output_sizes)):
                    expected.add((f"{prefix}weight", shard))
                    if module.bias is not None:
                        expected.add((f"{prefix}bias", shard))
            elif isinstance(module, LMHead):
                if not module.tied_to:
                    expected.add((f"{prefix}weight", 0))
            elif isinstance(module, VocabEmbedding):
                expected.add((f"{prefix}weight", 0))
            else:
                for p_name, _ in module.named_parameters(recurse=False):
                    expected.add((f"{prefix}{p_name}", 0))
        return expected

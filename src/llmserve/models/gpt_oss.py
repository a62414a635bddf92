"""gpt-oss (OpenAI's open-weight MoE): the Llama-shaped stack with three differences.

    attention: q/k/v/o biases, learned per-head sink logits in each softmax's denominator, sliding
               and full layers alternating (`layer_types`), YaRN RoPE
    MLP:       router logits x @ W.T + b; the top k chosen, softmax over those k; experts with
               biases and the clamped SwiGLU: (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g),
               g = clamp(gate, max=l)
    norms:     RMSNorm as Llama's

transformers stores the experts stacked, input-major, with gate and up columns interleaved:

    mlp.experts.gate_up_proj       [E, H, 2I]   column 2i is gate unit i, column 2i + 1 up unit i
    mlp.experts.gate_up_proj_bias  [E, 2I]      the same interleaving
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]

`load_weights` cuts them into the per-expert `gate_proj` / `up_proj` / `down_proj` tensors that
`SparseMoE`'s `GatedMLP` experts load (so int8 / int4 plans quantize experts as any MLP), and
dequantizes OpenAI's MXFP4 `*_blocks` / `*_scales` pairs first (layers/quantization/mxfp4.py). GGUF
files arrive per expert already (gguf_loader.py). The fused CPU decoder has no sinks, biases on
experts or clamped SwiGLU: `decoder_spec` is None and the layers run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmserve.layers.activation import clamped_swiglu
from llmserve.layers.moe import SparseMoE
from llmserve.layers.quantization.fused_decoder import DecoderSpec
from llmserve.layers.quantization.mxfp4 import dequantize_mxfp4
from llmserve.models.llama import ArchFlags, LlamaForCausalLM

STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")

# The clamped SwiGLU's alpha and limit where a config lacks them: OpenAI's reference code fixes
# alpha, and transformers 5.17's GptOssConfig has neither field (later ones default to these).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def per_expert(
    prefix: str, proj: str, kind: str, t: torch.Tensor, interleaved: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked tensor (`kind`: "" weight, "_bias") -> (HF per-expert name, tensor) items; a
    weight [E, in, out] becomes each expert's [out, in]. `interleaved`: gate_up's gate and up
    units alternate (gpt-oss), else its gate units come first, then its up units (Qwen3-VL-MoE)."""
    suffix = "bias" if kind == "_bias" else "weight"
    for e in range(t.shape[0]):
        x = t[e] if kind == "_bias" else t[e].t()  # [2I] / [H] or [out, in]
        if proj != "gate_up_proj":
            yield f"{prefix}.{e}.down_proj.{suffix}", x.contiguous()
            continue
        # interleaved: rows 0, 2, 4 ... are gate units, 1, 3, 5 ... up units; else two halves
        gate, up = (x[0::2], x[1::2]) if interleaved else x.chunk(2)
        yield f"{prefix}.{e}.gate_proj.{suffix}", gate.contiguous()
        yield f"{prefix}.{e}.up_proj.{suffix}", up.contiguous()


def split_experts(weights: Iterable[tuple[str, Any, str]]) -> Iterator[tuple[str, Any, str]]:
    """transformers' stacked expert tensors (and OpenAI's MXFP4 block / scale pairs, dequantized)
    as per-expert tensors; everything else passes through."""
    blocks: dict[str, torch.Tensor] = {}
    for name, tensor, file in weights:
        m = STACKED_EXPERTS.match(name)
        if m is None:
            yield name, tensor, file
            continue
        prefix, proj, kind = m.group(1), m.group(2), m.group(3) or ""
        key = f"{prefix}.{proj}"
        if kind in ("_blocks", "_scales"):  # MXFP4 [E, out, in / 32, 16] codes + [E, out, in / 32] exponents
            blocks[key + kind] = tensor
            if key + "_blocks" not in blocks or key + "_scales" not in blocks:
                continue  # its other half comes later
            w = dequantize_mxfp4(blocks.pop(key + "_blocks"), blocks.pop(key + "_scales"))  # [E, out, in]
            tensor, kind = w.transpose(1, 2), ""  # as transformers stacks float weights: [E, in, out]
        for item in per_expert(prefix, proj, kind, tensor):
            yield (*item, file)
    if blocks:
        raise ValueError(f"MXFP4 tensors without their other half: {', '.join(sorted(blocks))}")


class GptOssForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        bias = bool(getattr(config, "attention_bias", True))
        return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=False, sinks=True)

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        return SparseMoE(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            "silu",  # unused: `glu` gates
            renormalize=False,
            softmax_after_top_k=True,
            bias=True,
            glu=clamped_swiglu(
                float(getattr(config, "swiglu_alpha", SWIGLU_ALPHA)),
                float(getattr(config, "swiglu_limit", SWIGLU_LIMIT)),
            ),
        )

    def map_weight_name(self, name: str) -> str | None:
        # (GGUF files name the sinks `self_attn.sinks.weight`)
        name = re.sub(r"\.self_attn\.sinks(\.weight)?$", ".self_attn.attn.sinks", name)
        name = name.replace(".mlp.router.", ".mlp.gate.")
        return super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, Any, str]]) -> None:
        super().load_weights(split_experts(weights))

    def decoder_spec(self) -> DecoderSpec | None:
        """None: the fused CPU decoder has no attention sinks, expert biases or clamped SwiGLU."""
        return None

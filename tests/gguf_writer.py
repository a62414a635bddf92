"""Test helper: write GGUF files the way llama.cpp's `convert_hf_to_gguf.py` and `gguf-split` do.

Independent of the loader under test: GGUF tensor names come from the gguf package's own
HF -> GGUF name map, and the converter's changes are re-done here from llama.cpp's description:

    llama   q_proj / k_proj rows permuted per head: (x0..x_{h-1}, y0..y_{h-1}) -> (x0, y0, x1, y1, ...)
            (smollm3 and granite likewise: llama.cpp converts them with LlamaModel subclasses)
    gemma2, gemma3  every `*norm.weight` stored as (w + 1)
    phi3    nothing permuted (GPT-NeoX rotation); LongRoPE's factor sets written as tensors
    gpt2    Conv1D weights ([in, out] in HF) stored transposed; the causal-mask buffers dropped
    gpt-oss the stacked [experts, in, out] gate_up split (interleaved columns) into gate and up
            stacks [experts, out, in], down transposed likewise, biases split the same way;
            the sinks named `.weight`

Also ggml's reference dequantization of one block per type, written from ggml's C reference
(`dequantize_row_*`), so that tests do not check the gguf package's numpy code against itself.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import GGMLQuantizationType as Q

_LLAMA_CONVERTED = ("llama", "smollm3", "granite")
"""Architectures llama.cpp converts with its LlamaModel (or a subclass): q / k permuted."""

# (array, type): the array is float32 (written as F32 / F16) or already-quantized uint8 blocks.
GGUFTensor = tuple[np.ndarray, GGMLQuantizationType]


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: [n_head, 2, half, ...] -> [n_head, half, 2, ...]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def _stack_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`...experts.<e>.<proj>.weight`) stacked into one
    [experts, out, in] tensor per projection (`...experts.<proj>.weight`), as llama.cpp's
    converter merges them; everything else as it is."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in state_dict.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = w
        else:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = w
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[e] for e in range(len(by_index))])
    return out


def _gpt_oss_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llama.cpp's GptOssModel.modify_tensors on float checkpoints."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state_dict.items():
        if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            bias = name.endswith("_bias")
            w = w if bias else w.transpose(-1, -2)  # [E, 2I, H]: row 2i gate unit i, 2i + 1 up unit i
            base, suffix = (
                name.removesuffix("_bias").removesuffix(".gate_up_proj"),
                "bias" if bias else "weight",
            )
            out[f"{base}.gate_proj.{suffix}"] = w[:, 0::2]
            out[f"{base}.up_proj.{suffix}"] = w[:, 1::2]
        elif name.endswith("experts.down_proj"):
            out[f"{name}.weight"] = w.transpose(-1, -2)
        elif name.endswith("experts.down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = w
        elif name.endswith("self_attn.sinks"):
            out[f"{name}.weight"] = w
        else:
            out[name] = w
    return out


def convert_state_dict(arch: str, config: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """HF state dict -> {GGUF name: float32 array}, as llama.cpp's converter writes it."""
    n_layer = config.n_layer if arch == "gpt2" else config.num_hidden_layers
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], n_layer)
    out: dict[str, np.ndarray] = {}
    if arch == "gpt-oss":
        state_dict = _gpt_oss_tensors(state_dict)
    for name, w in _stack_experts(state_dict).items():
        w = w.detach().float().clone()
        if arch == "gpt2":
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
                w = w.T
        if arch in _LLAMA_CONVERTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _permute(w, config.num_attention_heads)
        if arch in _LLAMA_CONVERTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _permute(w, config.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp's tensor is a vector, {n_embd}
            w = w.reshape(-1)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf has no name for {name}"
        out[gguf_name] = np.ascontiguousarray(w.numpy())
    return out


def hf_metadata(arch: str, config: Any) -> Callable[[GGUFWriter], None]:
    """The metadata llama.cpp writes for `config` (plus a token list and bos/eos ids)."""

    def write(w: GGUFWriter) -> None:
        if arch == "gpt2":
            w.add_block_count(config.n_layer)
            w.add_context_length(config.n_positions)
            w.add_embedding_length(config.n_embd)
            w.add_feed_forward_length(4 * config.n_embd)
            w.add_head_count(config.n_head)
            w.add_layer_norm_eps(config.layer_norm_epsilon)
        else:
            w.add_block_count(config.num_hidden_layers)
            w.add_context_length(config.max_position_embeddings)
            w.add_embedding_length(config.hidden_size)
            w.add_feed_forward_length(config.intermediate_size)
            w.add_head_count(config.num_attention_heads)
            w.add_head_count_kv(config.num_key_value_heads)
            if arch == "starcoder2":  # LayerNorm's epsilon (and no sliding window: TextModel's keys)
                w.add_layer_norm_eps(config.norm_epsilon)
            else:
                w.add_layer_norm_rms_eps(config.rms_norm_eps)
            rope = config.rope_parameters
            w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            if (
                arch in ("qwen3", "gemma2", "gemma3", "gpt-oss")
                or head_dim != config.hidden_size // config.num_attention_heads
            ):
                w.add_key_length(head_dim)
                w.add_value_length(head_dim)
            if arch in _LLAMA_CONVERTED:  # LlamaModel (and its subclasses) also writes these
                w.add_vocab_size(config.vocab_size)
                w.add_rope_dimension_count(head_dim)
            if arch in ("gemma2", "gemma3", "gpt-oss"):
                w.add_sliding_window(config.sliding_window)
            if arch == "exaone4" and config.sliding_window is not None:  # Exaone4Model's keys
                w.add_sliding_window(config.sliding_window)
                w.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
            if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
                w.add_attn_logit_softcapping(config.attn_logit_softcapping)
                w.add_final_logit_softcapping(config.final_logit_softcapping)
            if arch == "phi3":  # llama.cpp's Phi3MiniModel.set_gguf_parameters
                _phi3_metadata(w, config)
            if arch == "granite":  # GraniteModel.set_gguf_parameters: the multipliers as "scales"
                w.add_attention_scale(config.attention_multiplier)
                w.add_embedding_scale(config.embedding_multiplier)
                w.add_residual_scale(config.residual_multiplier)
                w.add_logit_scale(config.logits_scaling)
            if arch == "gpt-oss":  # llama.cpp's GptOssModel.set_gguf_parameters
                w.add_expert_feed_forward_length(config.intermediate_size)
                w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
                w.add_rope_scaling_factor(rope["factor"])
                w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            _moe_metadata(w, config)
        # Only the token list tells the vocabulary size when `<arch>.vocab_size` is absent.
        w.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    return write


def _phi3_metadata(w: GGUFWriter, config: Any) -> None:
    """Phi-3's rotary dims (a fraction of the hidden size, per head), original context, a window of
    0 for none, and LongRoPE's attention factor (its factor sets are tensors: `phi3_rope_tensors`)."""
    rope = config.rope_parameters
    rotary = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads
    w.add_rope_dimension_count(rotary)
    original = rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(config.sliding_window or 0)
    if rope.get("long_factor"):
        scale = config.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )


def phi3_rope_tensors(config: Any) -> dict[str, np.ndarray]:
    """LongRoPE's factor sets as the converter writes them (none for a model without)."""
    rope = config.rope_parameters
    if not rope.get("long_factor"):
        return {}
    return {
        "rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32),
    }


def _moe_metadata(w: GGUFWriter, config: Any) -> None:
    """The expert keys llama.cpp's converter writes for Mixtral and the Qwen MoE models."""
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not num_experts:
        return
    w.add_expert_count(num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def hf_vocab(folder: Path) -> tuple[list[str], list[int], list[str]]:
    """An HF folder's tokenizer.json as the converter's gpt2 vocabulary: tokens in id order
    (added ones after the model's), their types (added ones CONTROL or USER_DEFINED), merges."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokens = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    added = {t["id"]: t for t in tokenizer["added_tokens"]}
    for i in sorted(added):
        if i >= len(tokens):
            tokens.append(added[i]["content"])
    types = [
        int(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        if i in added
        else int(gguf.TokenType.NORMAL)
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    return tokens, types, merges


def add_encoder_metadata(w: GGUFWriter, config: Any, context_length: int, pooling: gguf.PoolingType) -> None:
    """A BERT-shaped encoder's sizes as llama.cpp's converter writes them (`bert` and its kin)."""
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_layer_norm_eps(config.layer_norm_eps)
    w.add_causal_attention(False)
    w.add_pooling_type(pooling)


def add_bpe_vocab(w: GGUFWriter, vocab: tuple[list[str], list[int], list[str]], pre: str) -> None:
    """Put a byte-level BPE vocabulary (`hf_vocab`'s tokens, types and merges) in place of the
    placeholder tokens `hf_metadata` writes, with `pre` as `tokenizer.ggml.pre`, EOS 0 and no BOS."""
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        w.kv_data[0].pop(key, None)
    tokens, types, merges = vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray | GGUFTensor],
    metadata: Callable[[GGUFWriter], None] | None = None,
    num_parts: int = 1,
) -> list[Path]:
    """Write `tensors` as one GGUF, or as `num_parts` gguf-split parts `<stem>-0000i-of-0000n.gguf`.

    Like gguf-split, every part carries split.no / split.count / split.tensors.count and only the
    first carries the model metadata. Returns the files in order."""
    names = list(tensors)
    chunks = [names[i::num_parts] for i in range(num_parts)]  # round-robin, so every part has tensors
    if num_parts == 1:
        paths = [path]
    else:
        paths = [path.with_name(f"{path.stem}-{i + 1:05d}-of-{num_parts:05d}.gguf") for i in range(num_parts)]
    for i, (part, chunk) in enumerate(zip(paths, chunks, strict=True)):
        w = GGUFWriter(part, arch)
        if i > 0:
            w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)  # gguf-split: split keys only
        elif metadata is not None:
            metadata(w)
        if num_parts > 1:
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, i)
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, num_parts)
            w.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(names))
        for name in chunk:
            value = tensors[name]
            arr, qtype = value if isinstance(value, tuple) else (value, GGMLQuantizationType.F32)
            if arr.dtype == np.uint8:  # pre-quantized blocks: the writer derives the logical shape
                w.add_tensor(name, arr, raw_dtype=qtype)
            else:
                w.add_tensor(name, quantize_blocks(arr.astype(np.float32), qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths


def quantize_blocks(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [..., K] -> GGUF blocks: gguf's own quantizers, plus Q4_K / Q5_K (which it lacks)."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        return _quantize_k(x.reshape(-1, x.shape[-1]), 15 if qtype == Q.Q4_K else 31).reshape(
            *x.shape[:-1], -1
        )
    return gguf.quants.quantize(x, qtype)


def _quantize_k(x: np.ndarray, qmax: int) -> np.ndarray:
    """A plain min/max Q4_K (qmax 15) or Q5_K (qmax 31) encoder, from the block layout in
    llama.cpp's ggml-common.h (not its search for the best scales, nor its choice of d): per
    super-block of 256, eight sub-blocks with 6-bit scale and minimum multipliers of d and dmin,
    w = d sc q - dmin m."""
    rows, k = x.shape
    sub = x.reshape(rows, k // 256, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0.0), sub.max(-1)  # the minimum is subtracted: m >= 0
    scale, minimum = (hi - lo) / qmax, -lo
    # Powers of two for d and dmin: d * sc and dmin * m (6-bit multipliers) are then exact in half
    # floats, so a reader that keeps them as half floats can be checked for exact values.
    pow2 = lambda v: np.exp2(np.ceil(np.log2(np.maximum(v, 1e-8) / 63))).astype(np.float16)  # noqa: E731
    d, dmin = pow2(scale.max(-1)), pow2(minimum.max(-1))
    sc = np.clip(np.round(scale / d[..., None].astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(minimum / dmin[..., None].astype(np.float32)), 0, 63).astype(np.uint8)
    eff_scale = d[..., None].astype(np.float32) * sc
    eff_min = dmin[..., None].astype(np.float32) * mn
    q = np.clip(np.round((sub + eff_min[..., None]) / eff_scale[..., None]), 0, qmax).astype(np.uint8)
    # scales: bytes j, j + 4 hold sc_j, m_j (j < 4) in their low 6 bits and sc_{j+4}, m_{j+4} >> 4
    # in their top 2; byte j + 8 holds the low nibbles of sc_{j+4} (low) and m_{j+4} (high).
    scales = np.empty((rows, k // 256, 12), np.uint8)
    scales[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    pairs = q.reshape(rows, k // 256, 4, 2, 32)  # run c: sub-blocks 2c and 2c + 1
    qs = (pairs[:, :, :, 0] & 0x0F) | ((pairs[:, :, :, 1] & 0x0F) << 4)  # [rows, n, 4, 32]
    head = [d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2), scales]
    if qmax == 31:  # fifth bits: bit 2c (+1) of qh byte l is that of element l of sub-block 2c (+1)
        high = (q >> 4).reshape(rows, k // 256, 8, 32).astype(np.uint16)
        qh = (high << np.arange(8, dtype=np.uint16)[:, None]).sum(axis=2).astype(np.uint8)
        head.append(qh)
    return np.concatenate([*head, qs.reshape(rows, k // 256, 128)], axis=-1).reshape(rows, -1)


def write_hf_model(
    path: Path, arch: str, config: Any, state_dict: dict[str, torch.Tensor], num_parts: int = 1
) -> list[Path]:
    """A tiny HF model as llama.cpp would convert it (F32 storage)."""
    tensors = convert_state_dict(arch, config, state_dict)
    if arch == "phi3":
        tensors |= phi3_rope_tensors(config)
    return write_gguf(path, arch, dict(tensors), hf_metadata(arch, config), num_parts)


RANDOM_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
"""The types gguf has no quantizer for: written as random valid blocks."""


def requantized(
    path: Path,
    qtype_of: Callable[[str, np.ndarray], GGMLQuantizationType],
    random_types: tuple[GGMLQuantizationType, ...] = RANDOM_TYPES,
) -> dict[str, Any]:
    """The tensors of an F32 GGUF file (`write_hf_model`'s), each weight as the type
    `qtype_of(name, array)` picks (F32: left float) for `write_gguf`; random valid blocks for the
    types gguf cannot quantize (and any other of `random_types`)."""
    tensors: dict[str, Any] = {}
    for i, t in enumerate(gguf.GGUFReader(path).tensors):
        arr = np.array(t.data).reshape(list(reversed(t.shape.tolist())))
        qtype = qtype_of(t.name, arr) if t.name.endswith("weight") else Q.F32
        if qtype in random_types:
            arr = random_blocks(qtype, *arr.shape, seed=i)
        tensors[t.name] = arr if qtype == Q.F32 else (arr, qtype)
    return tensors


def tiny_llama_config() -> Any:
    """`tiny_llama_gguf`'s transformers config (hidden 256: K-quant super-blocks are 256 wide)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=True,
    )  # fmt: skip


def tiny_llama_gguf(
    tmp: Path,
    types: dict[str, GGMLQuantizationType],
    tokenizer: bool = False,
    random_types: tuple[GGMLQuantizationType, ...] = RANDOM_TYPES,
) -> Path:
    """A tiny Llama (hidden 256: K-quant super-blocks are 256 wide) as a GGUF file whose weights
    take `types` by tensor kind ("attn_q", "ffn_down", "token_embd", ...; F32 where not named).
    `tokenizer`: also a SentencePiece-style vocabulary of placeholder tokens, for an engine.
    `random_types`: written as random valid blocks (`requantized`)."""
    import transformers

    config = tiny_llama_config()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    config.architectures = ["LlamaForCausalLM"]
    path = write_hf_model(tmp / "f32.gguf", "llama", config, hf.state_dict())[0]
    # Re-write with quantized types: read the float tensors back and quantize with gguf.
    tensors = requantized(path, lambda name, _arr: types.get(name.split(".")[-2], Q.F32), random_types)
    metadata = hf_metadata("llama", config)
    if tokenizer:
        metadata = with_placeholder_tokenizer(metadata, config.vocab_size)
    return write_gguf(tmp / "quantized.gguf", "llama", tensors, metadata)[0]


def with_placeholder_tokenizer(
    metadata: Callable[[GGUFWriter], None], vocab_size: int
) -> Callable[[GGUFWriter], None]:
    """`metadata` plus a SentencePiece-style vocabulary of `vocab_size` placeholder tokens (what
    an engine needs to start; tests prompt with token ids)."""

    def write(w: GGUFWriter) -> None:
        metadata(w)
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0] * vocab_size)
        w.add_token_types([1] * vocab_size)

    return write


# -- ggml's reference dequantization, one block at a time ------------------------------------------


def _f16(b: bytes, o: int) -> float:
    return float(np.frombuffer(b[o : o + 2], np.float16)[0])


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    """ggml's get_scale_min_k4: 6-bit scale and min j of a K-quant super-block."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _ref_q8_0(b: bytes) -> list[float]:
    return [_f16(b, 0) * q for q in np.frombuffer(b[2:34], np.int8).tolist()]


def _ref_q4_0(b: bytes) -> list[float]:
    d, qs = _f16(b, 0), b[2:18]
    return [d * ((q & 0xF) - 8) for q in qs] + [d * ((q >> 4) - 8) for q in qs]


def _ref_q4_1(b: bytes) -> list[float]:
    d, m, qs = _f16(b, 0), _f16(b, 2), b[4:20]
    return [d * (q & 0xF) + m for q in qs] + [d * (q >> 4) + m for q in qs]


def _ref_q5(b: bytes, has_min: bool) -> list[float]:
    d, m = _f16(b, 0), (_f16(b, 2) if has_min else 0.0)
    o = 4 if has_min else 2
    qh, qs, off = int.from_bytes(b[o : o + 4], "little"), b[o + 4 : o + 20], 0 if has_min else 16
    lo = [d * (((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - off) + m for j in range(16)]
    return lo + [d * (((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off) + m for j in range(16)]


def _ref_q45_k(b: bytes, five_bit: bool) -> list[float]:
    d, dmin, scales = _f16(b, 0), _f16(b, 2), b[4:16]
    qh, ql = (b[16:48], b[48:176]) if five_bit else (bytes(32), b[16:144])
    y: list[float] = []
    for i in range(4):  # 64 values per step: low nibbles with scale 2i, high nibbles with 2i + 1
        (s1, m1), (s2, m2) = _scale_min_k4(2 * i, scales), _scale_min_k4(2 * i + 1, scales)
        q = ql[32 * i : 32 * i + 32]
        y += [
            d * s1 * ((v & 0xF) + 16 * ((h >> (2 * i)) & 1)) - dmin * m1 for v, h in zip(q, qh, strict=True)
        ]
        y += [
            d * s2 * ((v >> 4) + 16 * ((h >> (2 * i + 1)) & 1)) - dmin * m2
            for v, h in zip(q, qh, strict=True)
        ]
    return y


def _ref_q6_k(b: bytes) -> list[float]:
    ql, qh, sc, d = b[0:128], b[128:192], np.frombuffer(b[192:208], np.int8).tolist(), _f16(b, 208)
    y = [0.0] * 256
    for n in range(2):  # two halves of 128 values
        L, H, S = ql[64 * n :], qh[32 * n :], sc[8 * n :]
        for i in range(32):
            qs = [(L[i] & 0xF) | ((H[i] & 3) << 4), (L[i + 32] & 0xF) | (((H[i] >> 2) & 3) << 4),
                  (L[i] >> 4) | (((H[i] >> 4) & 3) << 4), (L[i + 32] >> 4) | (((H[i] >> 6) & 3) << 4)]  # fmt: skip
            for k, q in enumerate(qs):
                y[128 * n + 32 * k + i] = d * S[i // 16 + 2 * k] * (q - 32)
    return y


# type -> (dequantization of one block, byte offsets of its f16 scale fields)
REFERENCE_DEQUANT: dict[GGMLQuantizationType, tuple[Callable[[bytes], list[float]], tuple[int, ...]]] = {
    Q.Q8_0: (_ref_q8_0, (0,)), Q.Q4_0: (_ref_q4_0, (0,)), Q.Q4_1: (_ref_q4_1, (0, 2)),
    Q.Q5_0: (lambda b: _ref_q5(b, False), (0,)), Q.Q5_1: (lambda b: _ref_q5(b, True), (0, 2)),
    Q.Q4_K: (lambda b: _ref_q45_k(b, False), (0, 2)), Q.Q5_K: (lambda b: _ref_q45_k(b, True), (0, 2)),
    Q.Q6_K: (_ref_q6_k, (208,)),
}  # fmt: skip


# Random valid blocks of types gguf cannot quantize to: byte offset of each half-float scale field
# and a value that keeps the weights within ~0.1 (the other bytes are random quants and sub-scales).
_RANDOM_SCALES: dict[GGMLQuantizationType, dict[int, float]] = {
    Q.Q2_K: {80: 0.003, 82: 0.003},  # d sc q - dmin m, sc, m < 16, q < 4
    Q.Q3_K: {108: 0.0008},  # d (sc - 32) q, |q| <= 4
    Q.Q4_K: {0: 1e-4, 2: 1e-4},  # d sc q - dmin m, sc, m < 64, q < 16: d, dmin not powers of two
    Q.IQ4_NL: {0: 0.0008},  # d T[q], |T| <= 127
    Q.IQ4_XS: {0: 2e-5},  # d (ls - 32) T[q]
    Q.Q6_K: {208: 5e-5},  # d sc (q - 32), |sc| <= 128, |q - 32| <= 32
}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row bytes] of random valid `qtype` blocks: random quants and sub-scales, finite
    scales that keep |w| ~0.1 (MXFP4: exponents 2^-8 .. 2^-6)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    if qtype == Q.MXFP4:
        raw[:, 0] = rng.integers(120, 123, size=len(raw))
    for offset, scale in _RANDOM_SCALES.get(qtype, {}).items():
        d = rng.uniform(0.5, 1.0, size=(len(raw), 1)) * scale
        raw[:, offset : offset + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)

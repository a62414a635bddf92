"""GGUF metadata -> a transformers config for the matching HF architecture.

llama.cpp stores hyperparameters as `{arch}.*` keys; each builder here reads them into the config
class transformers would use for the original checkpoint, and restores what llama.cpp hard-codes
instead of storing (Gemma 3's layer pattern and local RoPE base, Llama 3's RoPE scaling curve,
which only survives as the `rope_freqs` tensor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import transformers

from llmserve.model_executor.model_loader import gguf_clip
from llmserve.model_executor.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

# transformers 5 describes RoPE with one `rope_parameters` dict; 4.x with rope_theta + rope_scaling.
_HF_ROPE_PARAMETERS = int(transformers.__version__.split(".")[0]) >= 5


def _rope_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """One RoPE dict ({"rope_type", "rope_theta", ...}) as the installed transformers wants it."""
    if _HF_ROPE_PARAMETERS:
        return {"rope_parameters": params}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling if len(scaling) > 1 else None}


def _llama3_rope(factors: np.ndarray, theta: float, orig_ctx: int) -> dict[str, Any]:
    """HF's `llama3` RoPE parameters from llama.cpp's `rope_freqs` tensor (per-frequency divisors f_i).

    HF's curve: f = 1 for short wavelengths, `factor` for long ones, and between them
        1 / f = (1 - s) / factor + s,   s = (L / wavelen - low) / (high - low),   clamped to [0, 1].
    s is linear in 1 / wavelen, so in-between points fix its slope a = L / (high - low) and intercept
    b = -low / (high - low); every L gives the same curve, so L is the stored original context (or 8192).
    The recovered parameters are checked by recomputing the divisors.
    """
    dim = 2 * len(factors)
    inv_wavelen = theta ** -(np.arange(0, dim, 2, dtype=np.float64) / dim) / (2 * np.pi)
    f = factors.astype(np.float64)
    factor = float(f.max())
    mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if mid.sum() >= 2:
        s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv_wavelen[mid], s, 1)
        low, high = float(-b * orig_ctx / a), float((1 - b) * orig_ctx / a)
    else:  # too few points to fit: try Llama 3.1's published values
        low, high = 1.0, 4.0
    s = np.clip((orig_ctx * inv_wavelen - low) / (high - low), 0.0, 1.0)
    if not np.allclose(1 / ((1 - s) / factor + s), f, rtol=1e-3):
        raise ModelLoadError("the GGUF's rope_freqs tensor does not describe a llama3 RoPE scaling")
    return {
        "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": round(low, 6),
        "high_freq_factor": round(high, 6), "original_max_position_embeddings": orig_ctx,
    }  # fmt: skip


def _rope(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """The model's (global) RoPE as one dict: base frequency plus any `rope.scaling.*` keys."""
    theta = ckpt.arch_field("rope.freq_base", 10000.0)
    kind = ckpt.arch_field("rope.scaling.type", "none")
    orig_ctx = ckpt.arch_field("rope.scaling.original_context_length")
    if ckpt.has_tensor("rope_freqs.weight") and kind == "none":
        return _llama3_rope(ckpt.tensor_data("rope_freqs.weight"), theta, orig_ctx or 8192)
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": kind, "rope_theta": theta, "factor": ckpt.arch_field("rope.scaling.factor")}
    extra = {"original_max_position_embeddings": orig_ctx} | {
        k: ckpt.arch_field(f"rope.scaling.yarn_{k}") for k in ("beta_fast", "beta_slow")
    }
    return params | {k: v for k, v in extra.items() if v is not None}


def _common_kwargs(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """What every config here takes under the same name."""
    return {
        "architectures": [ckpt.hf_architecture],
        "vocab_size": ckpt.vocab_size(),
        "tie_word_embeddings": not ckpt.has_tensor("output.weight"),
        "bos_token_id": ckpt.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": ckpt.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": ckpt.field("tokenizer.ggml.padding_token_id"),
    }


def _decoder_kwargs(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """Llama-shaped decoders (llama, qwen2, qwen3, gemma3) name their hyperparameters alike."""
    hidden, n_head = ckpt.require("embedding_length"), ckpt.require("attention.head_count")
    # key_length is written when head_dim != hidden / heads (Qwen3, Gemma 3, Mistral Nemo...).
    head_dim = ckpt.arch_field("attention.key_length") or ckpt.arch_field("rope.dimension_count")
    return _common_kwargs(ckpt) | {
        "hidden_size": hidden,
        # (MoE files: the dense width, or the experts' where every layer is sparse and none is written)
        "intermediate_size": ckpt.arch_field("feed_forward_length")
        or ckpt.require("expert_feed_forward_length"),
        "num_hidden_layers": ckpt.require("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": ckpt.arch_field("attention.head_count_kv", n_head),
        "head_dim": head_dim or hidden // n_head,
        "max_position_embeddings": ckpt.require("context_length"),
        "rms_norm_eps": ckpt.require("attention.layer_norm_rms_epsilon"),
    }


def _moe_kwargs(ckpt: GGUFCheckpoint, experts_key: str, renormalize: bool) -> dict[str, Any]:
    """Router and expert sizes of a mixture-of-experts file. Whether the top-k weights are
    renormalised is `expert_weights_norm` where the file says, else what llama.cpp assumes for the
    architecture (Mixtral and Qwen3-MoE renormalise, Qwen2-MoE does not)."""
    kw: dict[str, Any] = {
        experts_key: ckpt.require("expert_count"),
        "num_experts_per_tok": ckpt.require("expert_used_count"),
    }
    if experts_key == "num_experts":  # the Qwen MoE configs
        kw["norm_topk_prob"] = bool(ckpt.arch_field("expert_weights_norm", renormalize))
        kw["moe_intermediate_size"] = ckpt.require("expert_feed_forward_length")
    return kw


def llama_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Llama, Mistral, and Mixtral (llama.cpp writes Mixtral as `llama` with experts)."""
    if ckpt.arch_field("expert_count"):
        return transformers.MixtralConfig(
            **_decoder_kwargs(ckpt),
            **_rope_kwargs(_rope(ckpt)),
            **_moe_kwargs(ckpt, "num_local_experts", True),
            sliding_window=ckpt.arch_field("attention.sliding_window"),
        )
    return transformers.LlamaConfig(
        **_decoder_kwargs(ckpt),
        **_rope_kwargs(_rope(ckpt)),
        attention_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
        mlp_bias=ckpt.has_tensor("blk.0.ffn_up.bias"),
    )


def qwen2_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**_decoder_kwargs(ckpt), **_rope_kwargs(_rope(ckpt)))


def qwen2vl_text_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Qwen2-VL's and Qwen2.5-VL's language model (`qwen2vl`) with its M-RoPE: the converter
    writes `mrope_section` as `rope.dimension_sections`, padded with zeros to four."""
    sections = [int(x) for x in ckpt.require("rope.dimension_sections")]
    while sections and sections[-1] == 0:
        sections.pop()
    kw = _decoder_kwargs(ckpt)
    if 2 * sum(sections) != kw["head_dim"]:
        raise ModelLoadError(
            f"{ckpt.parts[0]}: {ckpt.architecture}.rope.dimension_sections {sections} do not cover the "
            f"head dimension {kw['head_dim']} (twice their sum)"
        )
    rope = _rope(ckpt) | {"mrope_section": sections}
    return transformers.Qwen2_5_VLTextConfig(**kw, **_rope_kwargs(rope))


def qwen2moe_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Every layer sparse (llama.cpp keeps no dense layers for this architecture), each with a
    shared expert."""
    kw = _decoder_kwargs(ckpt)
    return transformers.Qwen2MoeConfig(
        **kw,
        **_rope_kwargs(_rope(ckpt)),
        **_moe_kwargs(ckpt, "num_experts", False),
        shared_expert_intermediate_size=ckpt.arch_field("expert_shared_feed_forward_length", 0),
        qkv_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def qwen3moe_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        **_decoder_kwargs(ckpt),
        **_rope_kwargs(_rope(ckpt)),
        **_moe_kwargs(ckpt, "num_experts", True),
        attention_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def qwen3_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Qwen3, or a Qwen3-Reranker as llama.cpp's converter writes it (`pooling_type` RANK and a
    `cls.output` head of the "yes" and "no" rows): a one-label `Qwen3ForSequenceClassification`
    whose score is P(yes), with the file's `rerank` prompt template (`rerank_template`)."""
    config = transformers.Qwen3Config(
        **_decoder_kwargs(ckpt),
        **_rope_kwargs(_rope(ckpt)),
        attention_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
    )
    if ckpt.has_tensor("cls.output.weight"):
        config.architectures = ["Qwen3ForSequenceClassification"]
        config.num_labels = 1
        labels = ckpt.arch_field("classifier.output_labels") or ["yes"]
        config.id2label, config.label2id = {0: str(labels[0])}, {str(labels[0]): 0}
        config.rerank_template = ckpt.field("tokenizer.chat_template.rerank")
    return config


def gemma3_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Gemma 3 (text). llama.cpp hard-codes what the GGUF leaves out; so do we, with the same values."""
    kw = _decoder_kwargs(ckpt)
    n_layer, head_dim = kw["num_hidden_layers"], kw["head_dim"]
    # Five local (sliding-window) layers, then one global: every 6th layer is global.
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layer)]
    # Queries are scaled by 1/sqrt(query_pre_attn_scalar): head_dim, except in 27B (62 layers),
    # which uses hidden / heads (llama.cpp's rule, from Google's gemma_pytorch config).
    scalar = kw["hidden_size"] // kw["num_attention_heads"] if n_layer == 62 else head_dim
    global_rope = _rope(ckpt)
    local_rope = {"rope_type": "default", "rope_theta": ckpt.arch_field("rope.freq_base_swa", 10000.0)}
    if _HF_ROPE_PARAMETERS:
        rope = {"rope_parameters": {"full_attention": global_rope, "sliding_attention": local_rope}}
    else:
        rope = _rope_kwargs(global_rope) | {"rope_local_base_freq": local_rope["rope_theta"]}
    return transformers.Gemma3TextConfig(
        **kw,
        **rope,
        layer_types=layer_types,
        sliding_window=ckpt.require("attention.sliding_window"),
        query_pre_attn_scalar=scalar,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=ckpt.arch_field("final_logit_softcapping"),
        attn_logit_softcapping=None,
    )


def gemma_embedding_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """EmbeddingGemma (llama.cpp's `gemma-embedding`): Gemma 3's config, attending both ways. The
    file keeps config.json's window (llama.cpp masks |i - j| > window / 2); transformers' config
    holds window / 2 + 1 for the same mask (|i - j| < that), so that is what it gets here. Its
    Dense layers, `dense_2` and `dense_3`, are read apart (st_dense.gguf_dense_stack)."""
    config = gemma3_config(ckpt)
    config.architectures = ["Gemma3TextModel"]
    config.use_bidirectional_attention = True
    config.sliding_window = int(ckpt.require("attention.sliding_window")) // 2 + 1
    return config


def gemma2_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Gemma 2, with llama.cpp's rules for what the GGUF leaves out: every other layer sliding
    (the first one), a window of 4096, and queries scaled by 1/sqrt(head_dim) except in 27B (46
    layers), which uses hidden / heads (Google's gemma_pytorch config)."""
    kw = _decoder_kwargs(ckpt)
    n_layer = kw["num_hidden_layers"]
    scalar = kw["hidden_size"] // kw["num_attention_heads"] if n_layer == 46 else kw["head_dim"]
    return transformers.Gemma2Config(
        **kw,
        **_rope_kwargs(_rope(ckpt)),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)],
        sliding_window=ckpt.arch_field("attention.sliding_window", 4096),
        query_pre_attn_scalar=scalar,
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=ckpt.arch_field("attn_logit_softcapping"),
        final_logit_softcapping=ckpt.arch_field("final_logit_softcapping"),
    )


def gpt_oss_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """gpt-oss. llama.cpp hard-codes the rest, and so do we: sliding attention on even layers, the
    clamped SwiGLU's alpha 1.702 and limit 7, and YaRN without truncating its ramp's ends (as
    OpenAI's model and transformers' config have it)."""
    kw = _decoder_kwargs(ckpt)
    rope = _rope(ckpt)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    return transformers.GptOssConfig(
        **kw,
        **_rope_kwargs(rope),
        **_moe_kwargs(ckpt, "num_local_experts", False),
        sliding_window=ckpt.require("attention.sliding_window"),
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(kw["num_hidden_layers"])
        ],
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        attention_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
    )


def granite_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Granite 3.x, dense or MoE (`expert_count`): Llama's keys and its four multipliers, which
    llama.cpp calls scales."""
    moe = bool(ckpt.arch_field("expert_count"))
    return (transformers.GraniteMoeConfig if moe else transformers.GraniteConfig)(
        **_decoder_kwargs(ckpt),
        **_rope_kwargs(_rope(ckpt)),
        **(_moe_kwargs(ckpt, "num_local_experts", False) if moe else {}),
        embedding_multiplier=ckpt.arch_field("embedding_scale", 1.0),
        residual_multiplier=ckpt.arch_field("residual_scale", 1.0),
        attention_multiplier=ckpt.arch_field("attention.scale", 1.0),
        logits_scaling=ckpt.arch_field("logit_scale", 1.0),
        attention_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
    )


def exaone4_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """EXAONE 4.0: OLMo 2's keys, and where the file has a sliding window, which layers slide
    (`sliding_window_pattern`, one flag a layer; absent: three of every four, as transformers'
    default). llama.cpp applies the window to the 64-layer model only; llmserve follows the file."""
    kw = _decoder_kwargs(ckpt)
    window = ckpt.arch_field("attention.sliding_window")
    n = kw["num_hidden_layers"]
    pattern = ckpt.arch_field("attention.sliding_window_pattern")
    sliding = [bool(f) for f in pattern] if pattern is not None else [(i + 1) % 4 != 0 for i in range(n)]
    return transformers.Exaone4Config(
        **kw,
        **_rope_kwargs(_rope(ckpt)),
        sliding_window=window or None,
        layer_types=["sliding_attention" if window and s else "full_attention" for s in sliding],
    )


def starcoder2_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """StarCoder2: LayerNorm's epsilon, not RMSNorm's; llama.cpp writes no sliding window for it
    and attends over the whole context (so does llmserve, unless the file names a window)."""
    hidden, n_head = ckpt.require("embedding_length"), ckpt.require("attention.head_count")
    return transformers.Starcoder2Config(
        **_common_kwargs(ckpt),
        **_rope_kwargs(_rope(ckpt)),
        hidden_size=hidden,
        intermediate_size=ckpt.require("feed_forward_length"),
        num_hidden_layers=ckpt.require("block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=ckpt.arch_field("attention.head_count_kv", n_head),
        max_position_embeddings=ckpt.require("context_length"),
        norm_epsilon=ckpt.require("attention.layer_norm_epsilon"),
        sliding_window=ckpt.arch_field("attention.sliding_window") or None,
        use_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
    )


def olmo2_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """OLMo 2 (a file with a sliding window is OLMo 3's, whose per-layer RoPE is not read: refused)."""
    if ckpt.arch_field("attention.sliding_window"):
        raise ModelLoadError(
            f"{ckpt.parts[0]}: an OLMo 3 file (sliding-window layers); llmserve reads OLMo 2's"
        )
    return transformers.Olmo2Config(
        **_decoder_kwargs(ckpt),
        **_rope_kwargs(_rope(ckpt)),
        attention_bias=ckpt.has_tensor("blk.0.attn_q.bias"),
    )


def smollm3_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """SmolLM3: Llama with every fourth layer unrotated (NoPE); llama.cpp writes no key for it and
    hard-codes the interval of 4, as transformers' config defaults it."""
    return transformers.SmolLM3Config(
        **_decoder_kwargs(ckpt), **_rope_kwargs(_rope(ckpt)), no_rope_layer_interval=4
    )


def phi3_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini. `rope.dimension_count` is the rotary part of a
    head (Phi-4-mini's 3/4), not the head; the 128k models' LongRoPE factor sets are the tensors
    `rope_factors_long` / `_short`; a `sliding_window` of 0 means none (the converter's Phi-4)."""
    kw = _decoder_kwargs(ckpt)
    head_dim = ckpt.arch_field("attention.key_length") or kw["hidden_size"] // kw["num_attention_heads"]
    rotary_dims = ckpt.arch_field("rope.dimension_count") or head_dim
    original = ckpt.arch_field("rope.scaling.original_context_length") or kw["max_position_embeddings"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": ckpt.arch_field("rope.freq_base", 10000.0)}
    if ckpt.has_tensor("rope_factors_long.weight"):
        # the attention factor is transformers' (from max_position / original, as the converter's)
        rope |= {
            "rope_type": "longrope",
            "long_factor": [float(f) for f in ckpt.tensor_data("rope_factors_long.weight").reshape(-1)],
            "short_factor": [float(f) for f in ckpt.tensor_data("rope_factors_short.weight").reshape(-1)],
            "original_max_position_embeddings": original,
        }
    if rotary_dims != head_dim:
        rope["partial_rotary_factor"] = rotary_dims / head_dim
    return transformers.Phi3Config(
        **(kw | {"head_dim": head_dim}),
        **_rope_kwargs(rope),
        partial_rotary_factor=rotary_dims / head_dim,
        original_max_position_embeddings=original,
        sliding_window=ckpt.arch_field("attention.sliding_window") or None,
    )


def gpt2_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    return transformers.GPT2Config(
        **_common_kwargs(ckpt),
        n_positions=ckpt.require("context_length"),
        n_embd=ckpt.require("embedding_length"),
        n_layer=ckpt.require("block_count"),
        n_head=ckpt.require("attention.head_count"),
        n_inner=ckpt.arch_field("feed_forward_length"),  # None means 4 * n_embd
        layer_norm_epsilon=ckpt.require("attention.layer_norm_epsilon"),
    )


# llama.cpp's `pooling_type` values that mean a pooling llmserve has (0: none, 4: rank)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def bert_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """A BERT encoder (llama.cpp's `bert`: all-MiniLM, BGE, mxbai-embed-large as Ollama ships
    them). `gguf_pooling` carries the file's `pooling_type` to the engine's default pooling."""
    config = _bert_config(ckpt, hidden_act="gelu")
    if ckpt.has_tensor("cls.output.weight") and ckpt.has_tensor("cls.weight"):
        # an XLM-R reranker or classifier (bge-reranker-v2-m3): RoBERTa's head, dense + tanh + out_proj,
        # over a position table that starts at RoBERTa's first position
        _classifier(config, ckpt, "XLMRobertaForSequenceClassification")
        config.positions_from_zero = True
    elif ckpt.has_tensor("cls.output.weight") or ckpt.has_tensor("cls.weight"):
        raise ModelLoadError(
            f"{ckpt.parts[0]}: a BERT classifier in GGUF is not supported: llama.cpp's converter drops "
            "BERT's pooler, which its head reads, so no file of it gives the model's scores; serve its HF folder"
        )
    return config


def _classifier(config: Any, ckpt: GGUFCheckpoint, architecture: str) -> None:
    """An encoder file with a classifier head (`cls.output`): `architecture`, its labels (the
    file's `classifier.output_labels`, or transformers' LABEL_i)."""
    num_labels = int(ckpt.tensor_shape("cls.output.weight")[0])
    labels = ckpt.arch_field("classifier.output_labels") or [f"LABEL_{i}" for i in range(num_labels)]
    config.architectures = [architecture]
    config.num_labels = num_labels
    config.id2label, config.label2id = dict(enumerate(labels)), {v: i for i, v in enumerate(labels)}


def _bert_config(ckpt: GGUFCheckpoint, **extra: Any) -> transformers.PretrainedConfig:
    """The sizes every BERT-shaped encoder file gives alike, its `pooling_type` as `gguf_pooling`."""
    config = transformers.BertConfig(
        architectures=[ckpt.hf_architecture],
        vocab_size=ckpt.vocab_size(),
        pad_token_id=ckpt.field("tokenizer.ggml.padding_token_id", 0),
        hidden_size=ckpt.require("embedding_length"),
        num_hidden_layers=ckpt.require("block_count"),
        num_attention_heads=ckpt.require("attention.head_count"),
        intermediate_size=ckpt.require("feed_forward_length"),
        max_position_embeddings=ckpt.require("context_length"),
        type_vocab_size=int(ckpt.field("tokenizer.ggml.token_type_count", 2)),
        layer_norm_eps=ckpt.require("attention.layer_norm_epsilon"),
        **extra,
    )
    config.gguf_pooling = GGUF_POOLING.get(ckpt.arch_field("pooling_type"))
    return config


def nomic_bert_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """nomic-bert (nomic-embed-text as Ollama ships it): BERT's sizes, no position table (RoPE with
    the file's base instead), its `pooling_type` the default pooling."""
    config = _bert_config(ckpt)
    config.rotary_emb_base = float(ckpt.arch_field("rope.freq_base", 10000.0))
    return config


def modern_bert_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """ModernBERT (llama.cpp's `modern-bert`: modernbert-embed, granite-embedding R2): its window
    (llama.cpp masks |i - j| > window / 2, as transformers' `local_attention`), a global layer every
    `sliding_window_pattern` (3) from the first, each layer type's RoPE base, GeGLU unless the file
    names another activation; biases where the file has them."""
    hidden, n_layer = ckpt.require("embedding_length"), ckpt.require("block_count")
    every = int(ckpt.arch_field("attention.sliding_window_pattern") or 3)
    bias = ckpt.has_tensor("token_embd_norm.bias")
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": float(ckpt.arch_field("rope.freq_base", 160000.0))},
        "sliding_attention": {"rope_type": "default", "rope_theta": float(ckpt.arch_field("rope.freq_base_swa", 10000.0))},
    }  # fmt: skip
    config = transformers.ModernBertConfig(
        architectures=[ckpt.hf_architecture],
        vocab_size=ckpt.vocab_size(),
        hidden_size=hidden,
        num_hidden_layers=n_layer,
        num_attention_heads=ckpt.require("attention.head_count"),
        intermediate_size=ckpt.require("feed_forward_length"),
        max_position_embeddings=ckpt.require("context_length"),
        # (the converter writes LayerNorm's epsilon under the RMS norm's key)
        norm_eps=ckpt.arch_field("attention.layer_norm_rms_epsilon") or ckpt.require("attention.layer_norm_epsilon"),
        local_attention=int(ckpt.arch_field("attention.sliding_window") or ckpt.require("context_length")),
        layer_types=["sliding_attention" if i % every else "full_attention" for i in range(n_layer)],
        hidden_activation=ckpt.arch_field("hidden_activation") or "gelu",
        norm_bias=bias, attention_bias=ckpt.has_tensor("blk.0.attn_qkv.bias"), mlp_bias=ckpt.has_tensor("blk.0.ffn_up.bias"),
        pad_token_id=ckpt.field("tokenizer.ggml.padding_token_id", 0),
    )  # fmt: skip
    config.rope_parameters = rope
    config.gguf_pooling = GGUF_POOLING.get(ckpt.arch_field("pooling_type"))
    if ckpt.has_tensor("cls.output.weight"):  # a reranker (gte-reranker-modernbert-base) or classifier
        _classifier(config, ckpt, "ModernBertForSequenceClassification")
        # the head's pooling; llama.cpp reads a file without one as mean
        config.classifier_pooling = GGUF_POOLING.get(ckpt.arch_field("classifier.pooling_type"), "mean")
        config.classifier_bias = ckpt.has_tensor("cls.bias")
    return config


def clip_vision_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """A vision projector file (llama.cpp's mmproj, `clip.vision.*` keys) -> its vision tower's
    config, by `clip.projector_type` (gguf_clip.PROJECTORS); the projector's own sizes (pooling,
    text width, image tokens) are `gguf_mmproj.py`'s."""
    kind = gguf_clip.projector_type(ckpt)
    if not ckpt.field("clip.has_vision_encoder", False):
        raise ModelLoadError(f"{ckpt.parts[0]}: the projector file has no vision encoder")
    return _VISION_CONFIGS[kind](ckpt)


def _siglip_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Gemma 3's SigLIP tower."""
    return transformers.SiglipVisionConfig(
        hidden_size=ckpt.require("vision.embedding_length"),
        intermediate_size=ckpt.require("vision.feed_forward_length"),
        num_hidden_layers=ckpt.require("vision.block_count"),
        num_attention_heads=ckpt.require("vision.attention.head_count"),
        layer_norm_eps=ckpt.arch_field("vision.attention.layer_norm_epsilon", 1e-6),
        image_size=ckpt.require("vision.image_size"),
        patch_size=ckpt.require("vision.patch_size"),
        hidden_act="gelu_pytorch_tanh",  # clip.use_gelu: ggml's gelu is the tanh approximation
        vision_use_head=False,
    )


QWEN25VL_WINDOW = 112
"""Qwen2.5-VL's attention window in pixels: clip.cpp uses 112 (HF's value) for this projector type,
whose files do not store it."""


def _qwen25vl_vision_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Qwen2.5-VL's vision transformer. Every `n_wa_pattern`-th block attends over the whole
    image, the others within windows (clip.cpp's rule, from HF's `fullatt_block_indexes`); the
    Conv3d patch kernel spans 2 frames (the converter splits it in two and refuses other counts)."""
    depth, every = ckpt.require("vision.block_count"), ckpt.require("vision.n_wa_pattern")
    return transformers.Qwen2_5_VLVisionConfig(
        depth=depth,
        hidden_size=ckpt.require("vision.embedding_length"),
        intermediate_size=ckpt.require("vision.feed_forward_length"),
        num_heads=ckpt.require("vision.attention.head_count"),
        patch_size=ckpt.require("vision.patch_size"),
        temporal_patch_size=2,
        spatial_merge_size=ckpt.arch_field("vision.spatial_merge_size", 2),
        window_size=QWEN25VL_WINDOW,
        fullatt_block_indexes=[i for i in range(depth) if (i + 1) % every == 0],
        out_hidden_size=ckpt.require("vision.projection_dim"),
        hidden_act="silu",  # clip.use_silu
        in_channels=3,
    )


def _qwen2vl_vision_config(ckpt: GGUFCheckpoint) -> transformers.PretrainedConfig:
    """Qwen2-VL's vision transformer (no windows, quick-GELU as clip.cpp's default activation).
    Its MLP width is read off `v.blk.0.ffn_up`: the converter writes Qwen2-VL's
    `clip.vision.feed_forward_length` as the config's `hidden_size`, the language model's width."""
    width = ckpt.require("vision.embedding_length")
    ffn = int(ckpt.tensor_shape("v.blk.0.ffn_up.weight")[0])
    if ffn % width:
        raise ModelLoadError(
            f"{ckpt.parts[0]}: v.blk.0.ffn_up.weight has {ffn} rows, not a multiple of the tower's width "
            f"{width} (clip.vision.embedding_length)"
        )
    return transformers.Qwen2VLVisionConfig(
        depth=ckpt.require("vision.block_count"),
        embed_dim=width,
        hidden_size=ckpt.require("vision.projection_dim"),
        mlp_ratio=ffn // width,
        num_heads=ckpt.require("vision.attention.head_count"),
        patch_size=ckpt.require("vision.patch_size"),
        temporal_patch_size=2,
        spatial_merge_size=ckpt.arch_field("vision.spatial_merge_size", 2),
        hidden_act="quick_gelu",  # neither clip.use_gelu nor clip.use_silu: clip.cpp's gelu_quick
        in_channels=3,
    )


_VISION_CONFIGS = {
    "gemma3": _siglip_config,
    "qwen2.5vl_merger": _qwen25vl_vision_config,
    "qwen2vl_merger": _qwen2vl_vision_config,
}
"""`clip.projector_type` -> its vision tower's config."""

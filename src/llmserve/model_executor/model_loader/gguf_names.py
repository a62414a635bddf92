"""The GGUF architectures' tensor-name tables (llama.cpp's base names -> HF's) and the fixes that
undo what llama.cpp's converter changed in a tensor, for gguf_loader.py's `_ARCHS`."""

from __future__ import annotations

from typing import Any

import torch

from llmserve.model_executor.model_loader.errors import ModelLoadError
from llmserve.model_executor.model_loader.gguf_clip import Fix

LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}
# Mixture-of-experts layers. A `*_exps` tensor stacks every expert ([experts, out, in]); it becomes
# one HF tensor per expert ({xid}). llama.cpp writes Mixtral as `llama`, with Mixtral's HF names.
MIXTRAL_EXPERT_NAMES = {
    "blk.{bid}.ffn_gate_inp": "model.layers.{bid}.block_sparse_moe.gate",
    "blk.{bid}.ffn_gate_exps": "model.layers.{bid}.block_sparse_moe.experts.{xid}.w1",
    "blk.{bid}.ffn_down_exps": "model.layers.{bid}.block_sparse_moe.experts.{xid}.w2",
    "blk.{bid}.ffn_up_exps": "model.layers.{bid}.block_sparse_moe.experts.{xid}.w3",
}
LLAMA_NAMES |= MIXTRAL_EXPERT_NAMES
QWEN_EXPERT_NAMES = {
    "blk.{bid}.ffn_gate_inp": "model.layers.{bid}.mlp.gate",
    "blk.{bid}.ffn_gate_exps": "model.layers.{bid}.mlp.experts.{xid}.gate_proj",
    "blk.{bid}.ffn_up_exps": "model.layers.{bid}.mlp.experts.{xid}.up_proj",
    "blk.{bid}.ffn_down_exps": "model.layers.{bid}.mlp.experts.{xid}.down_proj",
    "blk.{bid}.ffn_gate_shexp": "model.layers.{bid}.mlp.shared_expert.gate_proj",
    "blk.{bid}.ffn_up_shexp": "model.layers.{bid}.mlp.shared_expert.up_proj",
    "blk.{bid}.ffn_down_shexp": "model.layers.{bid}.mlp.shared_expert.down_proj",
    "blk.{bid}.ffn_gate_inp_shexp": "model.layers.{bid}.mlp.shared_expert_gate",
}
QWEN3_NAMES = LLAMA_NAMES | {
    "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
    "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm",
    "cls.output": "score",  # a Qwen3-Reranker file's "yes" and "no" rows (QWEN3_FIXES)
}
# Gemma 3 has four norms per layer; GGUF's ffn_norm is the *pre*-feedforward one.
QWEN2MOE_NAMES = {k: v for k, v in LLAMA_NAMES.items() if k not in MIXTRAL_EXPERT_NAMES} | QWEN_EXPERT_NAMES
QWEN3MOE_NAMES = {k: v for k, v in QWEN3_NAMES.items() if k not in MIXTRAL_EXPERT_NAMES} | QWEN_EXPERT_NAMES
# gpt-oss: llama.cpp splits transformers' interleaved gate_up into gate and up, stores each stack
# [experts, out, in] (biases [experts, out]), and calls the MLP's input norm post_attention_norm.
GPT_OSS_NAMES = {
    k: v
    for k, v in LLAMA_NAMES.items()
    if k not in MIXTRAL_EXPERT_NAMES and not k.startswith("blk.{bid}.ffn")
} | {
    "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.attn_sinks": "model.layers.{bid}.self_attn.sinks",
    "blk.{bid}.ffn_gate_inp": "model.layers.{bid}.mlp.router",
    "blk.{bid}.ffn_gate_exps": "model.layers.{bid}.mlp.experts.{xid}.gate_proj",
    "blk.{bid}.ffn_up_exps": "model.layers.{bid}.mlp.experts.{xid}.up_proj",
    "blk.{bid}.ffn_down_exps": "model.layers.{bid}.mlp.experts.{xid}.down_proj",
}
GEMMA3_NAMES = QWEN3_NAMES | {
    "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.pre_feedforward_layernorm",
    "blk.{bid}.post_ffw_norm": "model.layers.{bid}.post_feedforward_layernorm",
}
# Phi-3: q, k and v in one `attn_qkv` (some files keep them apart), gate and up in one `ffn_up`
# (gate rows first), as transformers stores them; its rotation is GPT-NeoX's, so nothing permuted.
PHI3_NAMES = {
    k: v for k, v in LLAMA_NAMES.items() if k not in MIXTRAL_EXPERT_NAMES and k != "blk.{bid}.ffn_gate"
} | {
    "blk.{bid}.attn_qkv": "model.layers.{bid}.self_attn.qkv_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.gate_up_proj",
}
# OLMo 2: norms after the attention and the MLP, none before; q and k normalised over all heads
OLMO2_NAMES = {
    k: v
    for k, v in QWEN3_NAMES.items()
    if k not in MIXTRAL_EXPERT_NAMES and k not in ("blk.{bid}.attn_norm", "blk.{bid}.ffn_norm")
} | {
    "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.post_ffw_norm": "model.layers.{bid}.post_feedforward_layernorm",
}
GEMMA2_NAMES = {k: v for k, v in GEMMA3_NAMES.items() if not k.endswith(("attn_q_norm", "attn_k_norm"))}
GPT2_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "transformer.h.{bid}.ln_1",
    "blk.{bid}.attn_qkv": "transformer.h.{bid}.attn.c_attn",
    "blk.{bid}.attn_output": "transformer.h.{bid}.attn.c_proj",
    "blk.{bid}.ffn_norm": "transformer.h.{bid}.ln_2",
    "blk.{bid}.ffn_up": "transformer.h.{bid}.mlp.c_fc",
    "blk.{bid}.ffn_down": "transformer.h.{bid}.mlp.c_proj",
}


BERT_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
    "blk.{bid}.attn_q": "encoder.layer.{bid}.attention.self.query",
    "blk.{bid}.attn_k": "encoder.layer.{bid}.attention.self.key",
    "blk.{bid}.attn_v": "encoder.layer.{bid}.attention.self.value",
    "blk.{bid}.attn_output": "encoder.layer.{bid}.attention.output.dense",
    "blk.{bid}.attn_output_norm": "encoder.layer.{bid}.attention.output.LayerNorm",
    "blk.{bid}.ffn_up": "encoder.layer.{bid}.intermediate.dense",
    "blk.{bid}.ffn_down": "encoder.layer.{bid}.output.dense",
    "blk.{bid}.layer_output_norm": "encoder.layer.{bid}.output.LayerNorm",
    "cls": "classifier.dense",  # an XLM-R reranker's head (RobertaClassificationHead)
    "cls.output": "classifier.out_proj",
}

# nomic-bert: nomic's own checkpoint names (what llama.cpp's tensor map reads them from)
NOMIC_BERT_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "emb_ln",
    "blk.{bid}.attn_qkv": "encoder.layers.{bid}.attn.Wqkv",
    "blk.{bid}.attn_output": "encoder.layers.{bid}.attn.out_proj",
    "blk.{bid}.attn_output_norm": "encoder.layers.{bid}.norm1",
    "blk.{bid}.ffn_up": "encoder.layers.{bid}.mlp.fc11",
    "blk.{bid}.ffn_gate": "encoder.layers.{bid}.mlp.fc12",
    "blk.{bid}.ffn_down": "encoder.layers.{bid}.mlp.fc2",
    "blk.{bid}.layer_output_norm": "encoder.layers.{bid}.norm2",
}

# ModernBERT (llama.cpp's `modern-bert`): HF's names without the masked-LM checkpoint's `model.`
MODERN_BERT_NAMES = {
    "token_embd": "embeddings.tok_embeddings",
    "token_embd_norm": "embeddings.norm",
    "blk.{bid}.attn_norm": "layers.{bid}.attn_norm",
    "blk.{bid}.attn_qkv": "layers.{bid}.attn.Wqkv",
    "blk.{bid}.attn_output": "layers.{bid}.attn.Wo",
    "blk.{bid}.ffn_norm": "layers.{bid}.mlp_norm",
    "blk.{bid}.ffn_up": "layers.{bid}.mlp.Wi",
    "blk.{bid}.ffn_down": "layers.{bid}.mlp.Wo",
    "output_norm": "final_norm",
    "cls": "head.dense",  # a reranker's or classifier's head (ModernBertForSequenceClassification)
    "cls.norm": "head.norm",
    "cls.output": "classifier",
}


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's `permute`: within each head, rows (x0, x1, ..., y0, y1, ...) became
    (x0, y0, x1, y1, ...) so that ggml's RoPE rotates adjacent pairs. Works for weights and biases."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute a tensor of {rows} rows for {n_head} heads")
    # [n_head, half, 2, ...] (GGUF) -> [n_head, 2, half, ...] (HF)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


LLAMA_FIXES: dict[str, Fix] = {
    "blk.{bid}.attn_q": lambda w, c: unpermute(w, c.require("attention.head_count")),
    "blk.{bid}.attn_k": lambda w, c: unpermute(
        w, c.arch_field("attention.head_count_kv") or c.require("attention.head_count")
    ),
}


def _two_way_head(w: torch.Tensor, ckpt: Any) -> torch.Tensor:
    """A Qwen3-Reranker file's `cls.output` rows (its "yes" then its "no" row of the LM head; llama.cpp
    scores the softmax's first entry) as the one-label head whose sigmoid is that probability."""
    if w.dim() != 2 or w.shape[0] != 2:
        raise ModelLoadError(
            f"{ckpt.parts[0]}: cls.output has shape {list(w.shape)}; a reranker's is [2, hidden]"
        )
    return w[0:1] - w[1:2]


QWEN3_FIXES: dict[str, Fix] = {"cls.output": _two_way_head}
# Qwen2-MoE's shared-expert gate, nn.Linear(hidden, 1) in HF, is stored as a vector.
QWEN2MOE_FIXES: dict[str, Fix] = {"blk.{bid}.ffn_gate_inp_shexp": lambda w, c: w.reshape(1, -1)}
# Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w.
GEMMA3_FIXES: dict[str, Fix] = {key: lambda w, c: w - 1.0 for key in GEMMA3_NAMES if key.endswith("norm")}
# HF's Conv1D keeps [in, out]; llama.cpp stores the nn.Linear layout [out, in]. Biases stay as they are.
GPT2_FIXES: dict[str, Fix] = {
    f"blk.{{bid}}.{n}": lambda w, c: w.T.contiguous() if w.dim() == 2 else w
    for n in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
}
# Granite MoE: Llama's tensors (q / k permuted) with the experts stacked as the Qwen MoE files
# name them (the converter splits the checkpoint's gate-and-up tensor in two).
GRANITEMOE_NAMES = {k: v for k, v in LLAMA_NAMES.items() if k not in MIXTRAL_EXPERT_NAMES} | QWEN_EXPERT_NAMES
# StarCoder2: Llama's attention tensors (nothing permuted: GPT-NeoX rotation), LayerNorms with
# biases, and a plain MLP (c_fc, c_proj).
STARCODER2_NAMES = {
    k: v
    for k, v in LLAMA_NAMES.items()
    if k not in MIXTRAL_EXPERT_NAMES and not k.startswith("blk.{bid}.ffn_")
} | {
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.c_fc",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.c_proj",
}

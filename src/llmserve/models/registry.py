"""HF `architectures` names -> native model classes. Modules are imported on first use."""

from __future__ import annotations

import importlib

from llmserve.load_errors import UnsupportedArchitectureError
from llmserve.models.base import CausalLM

# architecture name -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "SmolLM3ForCausalLM": ("llama", "LlamaForCausalLM"),  # NoPE layers: llama.uses_rope
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("granite", "GraniteMoeForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma3", "Gemma2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "ModernBertModel": ("modernbert", "ModernBertModel"),
    "ModernBertForSequenceClassification": ("modernbert", "ModernBertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "Gemma3TextModel": ("gemma3_embedding", "Gemma3EmbeddingModel"),  # EmbeddingGemma (bidirectional)
    "NomicBertModel": ("nomic_bert", "NomicBertModel"),  # nomic-embed-text (GGUF files)
    # decoder backbones without an LM head (embedding models: gte-Qwen2, e5-mistral, Qwen3-Embedding
    # saved as its backbone): the causal LM's stack, serving embeddings only (`BACKBONES`)
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("llama", "LlamaForCausalLM"),
    "Qwen2Model": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "Qwen3ForCausalLM"),
    # decoder stacks with a classifier on the last token (reward models, rerankers), no LM head
    "LlamaForSequenceClassification": ("decoder_classifier", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("decoder_classifier", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("decoder_classifier", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("decoder_classifier", "Qwen3ForSequenceClassification"),
    "Gemma2ForSequenceClassification": ("decoder_classifier", "Gemma2ForSequenceClassification"),
    "Gemma3TextForSequenceClassification": ("decoder_classifier", "Gemma3TextForSequenceClassification"),
}
BACKBONES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
"""Architectures whose checkpoints hold a decoder stack alone (HF's `XModel`): loaded into the
causal LM's class with its head tied to the embedding and never used (`CausalLM.pooling_only`)."""
DECODER_CLASSIFIERS = frozenset(
    name for name, (module, _) in _MODELS.items() if module == "decoder_classifier"
)
HEADLESS = BACKBONES | DECODER_CLASSIFIERS
"""Decoder checkpoints without an LM head: the loader ties the (unused) head to the embedding."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None, source: str) -> type[CausalLM]:
    """The first supported class among `architectures`, else a clear error naming `source`."""
    for arch in architectures or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(f"llmserve.models.{module}"), cls)
    raise UnsupportedArchitectureError(
        f"{source}: architecture {architectures} is not supported; supported: {', '.join(supported_architectures())}"
    )


def is_supported(architectures: list[str] | None) -> bool:
    """Whether one of `architectures` has a native implementation."""
    return any(arch in _MODELS for arch in architectures or [])

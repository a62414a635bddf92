"""Native model architectures, one file each, built from `llmserve.layers`."""

from llmserve.models.base import CausalLM, KVCacheShape
from llmserve.models.registry import resolve_model_class, supported_architectures

__all__ = ["CausalLM", "KVCacheShape", "resolve_model_class", "supported_architectures"]

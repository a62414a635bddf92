"""llmserve: an LLM inference engine and OpenAI-compatible server with a real CPU path.

from llmserve import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from llmserve.engine.llm import LLM
    from llmserve.outputs import (
        ClassificationOutput,
        CompletionOutput,
        EmbeddingOutput,
        RequestOutput,
        ScoreOutput,
    )
    from llmserve.pooling_params import PoolingParams
    from llmserve.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "llmserve.engine.llm",
    "SamplingParams": "llmserve.sampling_params",
    "StructuredOutputsParams": "llmserve.sampling_params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "EmbeddingOutput": "llmserve.outputs",
    "ScoreOutput": "llmserve.outputs",
    "ClassificationOutput": "llmserve.outputs",
    "PoolingParams": "llmserve.pooling_params",
}
__all__ = [
    "LLM",
    "ClassificationOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoreOutput",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy: `llmserve --version` and the config classes should not pay for importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")

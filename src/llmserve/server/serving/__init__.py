"""Protocol <-> engine: request schemas to `SamplingParams`, engine outputs to OpenAI responses and
SSE chunks."""

from llmserve.server.serving.chat import ChatServing
from llmserve.server.serving.completions import CompletionServing
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.tokens import TokenServing

__all__ = ["ChatServing", "CompletionServing", "ServingContext", "TokenServing"]

"""llmserve: an LLM inference engine and OpenAI-compatible server with a real CPU path."""

__version__ = "0.1.0"

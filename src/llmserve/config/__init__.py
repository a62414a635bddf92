"""One frozen dataclass per domain; values discovered at run time live in result objects."""

from llmserve.config.model import ModelConfig

__all__ = ["ModelConfig"]

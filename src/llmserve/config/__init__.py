"""One frozen dataclass per domain; values discovered at run time live in result objects."""

from llmserve.config.cache import CacheConfig
from llmserve.config.model import ModelConfig
from llmserve.config.scheduler import SchedulerConfig
from llmserve.config.server import ServerConfig

__all__ = ["CacheConfig", "ModelConfig", "SchedulerConfig", "ServerConfig"]

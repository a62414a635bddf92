"""`LoRAConfig`: how many LoRA adapters an engine serves and how large they may be (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters on top of the base model (`enable_lora`); absent when LoRA is off."""

    max_loras: int = 4
    """Adapters one step may mix: a waiting request whose adapter would be one more waits until
    the running requests of another adapter end."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have; a larger one is refused when it loads."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded (least recently used dropped first, reloaded from their folder when
    asked again); default `max_loras`."""
    modules: tuple[tuple[str, str], ...] = ()
    """(name, PEFT folder) of the adapters the engine serves by name from the start (ids 1, 2, ...
    in this order; loaded and checked when the engine starts): `--lora-modules name=path ...`."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1; got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1; got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"lora_modules: names must be non-empty and distinct; got {names}")

    @property
    def num_cached(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def parse_lora_modules(text: str | None) -> tuple[tuple[str, str], ...]:
    """`name=path,name2=path2` (the command line's space-separated pairs joined by commas)."""
    if not text:
        return ()
    pairs = []
    for item in text.split(","):
        name, sep, path = item.strip().partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected name=path; got {item.strip()!r}")
        pairs.append((name.strip(), path.strip()))
    return tuple(pairs)


def lora_modules_text(value: list[Any] | dict[Any, Any]) -> str:
    """A models file's `lora_modules` as the command line's text: a mapping {name: path} or a
    list of "name=path" items."""
    items = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else value
    if not all(isinstance(i, str) and "," not in i for i in items):
        raise ValueError(f"lora_modules: expected name=path items or a {{name: path}} mapping; got {value!r}")
    text = ",".join(items)
    parse_lora_modules(text)  # the same checks as the command line's
    return text

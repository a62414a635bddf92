"""`LoRAConfig`: how many LoRA adapters an engine serves and how large they may be (vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    lora_dtype: str = "auto"
    """What adapters' weights are kept in: `auto` (the model's dtype: float32 on the CPU, exact),
    or `bfloat16` / `float16`, a 16-bit copy that the fused CPU decoder reads at half the bytes,
    each weight rounded to 8 (bfloat16) or 11 (float16) significant bits: outputs move by that
    rounding (vLLM's `--lora-dtype`)."""
    modules: tuple[tuple[str, str], ...] = ()
    """(name, PEFT folder or GGUF LoRA file) of the adapters the engine serves by name from the
    start (ids 1, 2, ... in this order; loaded and checked when the engine starts):
    `--lora-modules name=path ...`."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1; got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1; got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {sorted(LORA_DTYPES)}; got {self.lora_dtype!r}")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"lora_modules: names must be non-empty and distinct; got {names}")

    @property
    def num_cached(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def parse_lora_modules(text: str | None) -> tuple[tuple[str, str], ...]:
    """(name, path) of each adapter `lora_modules` names (any form `lora_module_entries` reads)."""
    return tuple((name, path) for name, path, _ in lora_module_entries(text))


def lora_module_entries(value: str | list[Any] | dict[Any, Any] | None) -> list[tuple[str, str, str | None]]:
    """(name, path, base_model_name or None) of each entry of `lora_modules`, in any of its forms:
    `name=path,name2=path2` (the command line's items joined), a JSON array (the canonical text),
    a list of `name=path` items or JSON objects {"name", "path"[, "base_model_name"]} (vLLM's
    `--lora-modules` forms), or a {name: path} mapping (a models file)."""
    if not value:
        return []
    if isinstance(value, dict):
        items: list[Any] = [{"name": k, "path": v} for k, v in value.items()]
    elif isinstance(value, str):
        items = _json(value) if value.lstrip().startswith("[") else value.split(",")
    else:
        items = list(value)
    return [_entry(item) for item in items]


def lora_modules_for(
    value: str | list[Any] | dict[Any, Any] | None, model_names: tuple[str, ...]
) -> str | None:
    """`lora_modules` as canonical text, keeping the entries without a base_model_name and those
    naming one of `model_names` (a server's CLI adapters go to the model they name)."""
    entries = [e for e in lora_module_entries(value) if e[2] is None or e[2] in model_names]
    return _text(entries) if entries else None


def lora_modules_text(value: str | list[Any] | dict[Any, Any]) -> str:
    """Any form of `lora_modules` as canonical text: a JSON array of {"name", "path"[, "base_model_name"]}."""
    return _text(lora_module_entries(value))


def _text(entries: list[tuple[str, str, str | None]]) -> str:
    return json.dumps(
        [{"name": n, "path": p, **({"base_model_name": b} if b else {})} for n, p, b in entries]
    )


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_modules: not valid JSON ({e}): {text!r}") from None


def _entry(item: Any) -> tuple[str, str, str | None]:
    if isinstance(item, str) and item.lstrip().startswith("{"):
        item = _json(item)
    if isinstance(item, dict):
        unknown = set(item) - {"name", "path", "base_model_name"}
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
        if (
            unknown
            or not isinstance(name, str)
            or not isinstance(path, str)
            or not isinstance(base, str | None)
        ):
            raise ValueError(
                f'lora_modules: expected {{"name": ..., "path": ...[, "base_model_name": ...]}}; got {item!r}'
            )
        name, path = name.strip(), path.strip()
    elif isinstance(item, str):
        name, sep, path = (part.strip() for part in item.partition("="))
        base = None
        if not sep:
            name = ""
    else:
        name = path = ""
        base = None
    if not name or not path:
        raise ValueError(f"lora_modules: expected name=path; got {item!r}")
    return name, path, base

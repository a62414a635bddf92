"""`LoRARequest`: which adapter a request runs with (vLLM's type and field names)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.config.lora import LoRAConfig


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    """The adapter's name (what a server request gives as `model`)."""
    lora_int_id: int
    """A positive id, unique per adapter: it keys the adapter cache and the prefix cache's hashes
    (0 is the base model)."""
    lora_path: str
    """A PEFT folder (adapter_config.json and adapter_model.safetensors), or a llama.cpp GGUF
    LoRA file (`*.gguf`)."""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_int_id must be >= 1; got {self.lora_int_id}"
            )


def module_requests(config: LoRAConfig) -> list[LoRARequest]:
    """The adapters `config.modules` names, with ids 1, 2, ... in order (the engine and the
    server's model manager both derive them here, so they agree)."""
    return [LoRARequest(name, i, path) for i, (name, path) in enumerate(config.modules, start=1)]

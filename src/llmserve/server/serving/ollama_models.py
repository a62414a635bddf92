"""The served models as Ollama's API describes them (the answers live in `ollama.py`):

GET  /api/tags     every model: `size` is its weight files' bytes on disk, as Ollama's clients read it
GET  /api/ps       the loaded ones, with expiry: `size` is memory (weights + KV cache, measured
                   at the load) and `size_vram` the part of it in GPU memory (0 on the CPU)
POST /api/show     a model's details, template and capabilities
GET  /api/version  the Ollama API version followed, and llmserve's own
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictStr
from starlette.requests import Request

from llmserve import __version__
from llmserve.server.errors import APIError
from llmserve.server.models import LOADED, ModelManager, ModelSlot
from llmserve.server.protocol import parse
from llmserve.server.serving.ollama import Lenient, timestamp
from llmserve.server.serving.pieces import thinks

OLLAMA_API_VERSION = "0.6.3"
"""The Ollama version whose API this follows (reported by /api/version with llmserve's own)."""


class OllamaShowRequest(Lenient):
    model: StrictStr | None = None
    name: StrictStr | None = None  # the older field name


def _details(slot: ModelSlot) -> dict[str, Any]:
    files = slot.files
    details: dict[str, Any] = {
        "parent_model": "",
        "format": "gguf" if files and files[0].suffix == ".gguf" else "safetensors" if files else slot.engine,
        "family": "",
        "families": [],
        "parameter_size": "",
        "quantization_level": "",
    }  # fmt: skip
    if slot.ctx is None:  # what is known without loading it
        return details
    loaded = slot.ctx.engine.engine.loaded
    fmt = loaded.checkpoint_format
    kinds = sorted({g.fmt for g in loaded.weight_groups if g.role != "other"})
    family = str(getattr(loaded.hf_config, "model_type", ""))
    details.update(
        family=family,
        families=[family],
        parameter_size=f"{loaded.num_params / 1e6:.0f}M" if loaded.num_params < 1e9 else f"{loaded.num_params / 1e9:.1f}B",
        quantization_level=fmt[fmt.find("(") + 1 : fmt.find(",")] if "(" in fmt else ",".join(kinds) or str(loaded.dtype).removeprefix("torch."),
    )  # fmt: skip
    return details


def _entry(slot: ModelSlot) -> dict[str, Any]:
    files = [p for p in slot.files if p.exists()]
    return {
        "name": slot.name,
        "model": slot.name,
        "modified_at": timestamp(max(p.stat().st_mtime for p in files)) if files else timestamp(),
        "size": slot.file_bytes,
        "digest": (slot.digest or "").removeprefix("sha256:"),
        "details": _details(slot),
    }


def _adapter_entry(name: str, slot: ModelSlot) -> dict[str, Any]:
    """A LoRA adapter in /api/tags: its base model's entry under its own name, `parent_model` set."""
    entry = _entry(slot)
    entry.update(name=name, model=name)
    entry["details"]["parent_model"] = slot.name
    return entry


class OllamaModels:
    def __init__(self, models: ModelManager) -> None:
        self.models = models

    def tags(self) -> dict[str, Any]:
        """Every model, then every LoRA adapter (named as a model, its base as `parent_model`)."""
        adapters = [_adapter_entry(name, slot) for name, (slot, _) in self.models.adapters.items()]
        return {"models": [_entry(slot) for slot in self.models.slots] + adapters}

    def ps(self) -> dict[str, Any]:
        entries = []
        for slot in self.models.slots:
            if slot.state != LOADED or slot.is_remote:
                continue
            entry = _entry(slot)
            entry.pop("modified_at")
            expires = slot.expires_at(self.models.config.keep_alive)
            entry.update(
                size=slot.estimate_bytes,  # what the loaded model takes, not its files
                size_vram=slot.vram_bytes,
                expires_at="9999-12-31T23:59:59Z" if expires is None else timestamp(expires),
            )
            entries.append(entry)
        return {"models": entries}

    async def show(self, raw: Request) -> dict[str, Any]:
        req: OllamaShowRequest = parse(OllamaShowRequest, await raw.json())
        name = req.model or req.name
        if not name:
            raise APIError(400, "model is required", param="model")
        slot = self.models.resolve_base(name)
        adapter = self.models.adapters.get(name)
        details = _details(slot)
        modelfile = f"FROM {slot.spec.source or slot.name}\n"
        if adapter is not None:  # Ollama's way of naming a model's adapter
            details["parent_model"] = slot.name
            modelfile += f"ADAPTER {adapter[1].lora_path}\n"
        info: dict[str, Any] = {"general.architecture": details["family"]}
        template = ""
        capabilities = ["completion"]
        if slot.ctx is not None:
            engine = slot.ctx.engine.engine
            info["general.parameter_count"] = engine.loaded.num_params
            info[f"{details['family'] or 'llama'}.context_length"] = engine.max_model_len
            template = engine.tokenizer.chat_template or ""
            if thinks(slot.ctx):  # clients ask before they send `think`
                capabilities.append("thinking")
        return {
            "license": "",
            "modelfile": f"# served by llmserve {__version__}\n{modelfile}",
            "parameters": "",
            "template": template,
            "details": details,
            "model_info": info,
            "capabilities": capabilities,
            "modified_at": _entry(slot)["modified_at"],
        }

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION, "llmserve_version": __version__}

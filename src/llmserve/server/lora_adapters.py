"""LoRA adapters loaded and unloaded while the server runs: vLLM's two routes and request bodies.

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"[, "base_model_name", "load_inplace"]}
    POST /v1/unload_lora_adapter  {"lora_name"[, "lora_int_id"]}

Both are off unless the server runs with `--allow-runtime-lora-updating` (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), and sit behind the API key like every route. A load checks the
folder against the base model in its engine (loading the base model first if it is not) and
answers 400 naming the file and the tensor when it is bad; then requests may name the adapter by
`model`, and /v1/models lists it with its `parent`. Each load takes a new id, never reused: the id
keys the prefix cache's blocks, so a folder loaded again under the same name never reads blocks
computed with the old weights.

Unloading is immediate for new requests (404 from then on) and deferred for the engine, as in
vLLM: requests already running or waiting with the adapter finish with it, and its weights are
dropped when the last of them ends. A request names its adapter's folder, so a base model that
was unloaded (keep-alive, eviction) and loads again picks its adapters up at their next request.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from llmserve.lora import LoRARequest
from llmserve.server.errors import APIError
from llmserve.server.models import ModelManager, ModelSlot


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_path: StrictStr
    base_model_name: StrictStr | None = None
    """The model the adapter runs on (llmserve's; vLLM serves one): needed only when several
    served models have LoRA enabled."""
    load_inplace: StrictBool = False
    """Replace an adapter already loaded under this name (its running requests keep the old one)."""


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None
    """When given, it must be the adapter's id (vLLM's field)."""


def check_allowed(models: ModelManager) -> None:
    if not models.config.allow_runtime_lora_updating:
        raise APIError(
            404, "loading and unloading LoRA adapters at run time is off; start the server with "
            "--allow-runtime-lora-updating", code="not_found",
        )  # fmt: skip


async def load_lora_adapter(models: ModelManager, req: LoadLoRAAdapterRequest) -> str:
    """Check and load the adapter in its base model's engine; register its name. vLLM's reply."""
    check_allowed(models)
    name = req.lora_name
    if not name.strip() or not req.lora_path.strip():
        raise APIError(400, "lora_name and lora_path must not be empty", param="lora_name")
    old = models.adapters.get(name)
    if old is not None and not req.load_inplace:
        raise APIError(
            400, f"the LoRA adapter {name!r} has already been loaded (load_inplace replaces it)",
            param="lora_name", code="lora_adapter_exists",
        )  # fmt: skip
    if old is None and _is_model_name(models, name):
        raise APIError(400, f"{name!r} is a served model's name; an adapter needs its own", param="lora_name")
    slot = _base_slot(models, req.base_model_name, old)
    request = LoRARequest(name, models.next_lora_id, req.lora_path)
    models.next_lora_id += 1  # taken before any await: two loads at once get two ids
    async with models.lease(slot.name) as leased:
        assert leased.ctx is not None, "a leased local model is loaded"
        try:
            await leased.ctx.engine.add_lora(request)
        except ValueError as e:
            raise APIError(400, f"cannot load LoRA adapter {name!r}: {e}", param="lora_path") from None
        models.adapters[name] = (slot, request)
        if old is not None and old[0].ctx is not None:  # replaced in place: the old id goes
            await old[0].ctx.engine.remove_lora(old[1].lora_int_id)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_lora_adapter(models: ModelManager, req: UnloadLoRAAdapterRequest) -> str:
    """Forget the adapter's name now; its engine drops the weights after its last request."""
    check_allowed(models)
    entry = models.adapters.get(req.lora_name)
    if entry is None or (req.lora_int_id is not None and req.lora_int_id != entry[1].lora_int_id):
        raise APIError(
            404, f"the LoRA adapter {req.lora_name!r}"
            + (f" with lora_int_id {req.lora_int_id}" if req.lora_int_id is not None else "")
            + " cannot be found", param="lora_name", code="model_not_found",
        )  # fmt: skip
    slot, request = models.adapters.pop(req.lora_name)
    if slot.ctx is not None:
        await slot.ctx.engine.remove_lora(request.lora_int_id)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


def _is_model_name(models: ModelManager, name: str) -> bool:
    try:
        models.resolve(name)
    except APIError:
        return False
    return True


def _base_slot(
    models: ModelManager, base_model_name: str | None, old: tuple[ModelSlot, Any] | None
) -> ModelSlot:
    """The model the adapter runs on: `base_model_name`, else the replaced adapter's, else the
    only served model with LoRA enabled."""
    if base_model_name is not None:
        slot = models.resolve(base_model_name)
    elif old is not None:
        slot = old[0]
    else:
        enabled = [s for s in models.slots if s.args is not None and s.args.enable_lora]
        if len(enabled) != 1:
            served = ", ".join(repr(s.name) for s in enabled) or "none"
            raise APIError(
                400, f"name the adapter's base model in base_model_name; models with LoRA enabled: {served}",
                param="base_model_name",
            )  # fmt: skip
        slot = enabled[0]
    if slot.args is None or not slot.args.enable_lora:
        raise APIError(
            400, f"the model {slot.name!r} does not serve LoRA adapters (start it with --enable-lora)",
            param="base_model_name",
        )  # fmt: skip
    return slot

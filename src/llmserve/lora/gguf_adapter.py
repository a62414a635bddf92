"""llama.cpp's GGUF LoRA adapters (what its `convert_lora_to_gguf.py` writes), read as PEFT tensors.

The file's metadata and tensors, as llama.cpp's loader (`llama-adapter.cpp`) reads them:

    general.type = "adapter", adapter.type = "lora", general.architecture = the base's
    adapter.lora.alpha   float32; scale = alpha / rank (rank = lora_a's rows), 1 when alpha is 0
    blk.N.attn_q.weight.lora_a   [r, in]    PEFT's lora_A, unchanged (numpy order)
    blk.N.attn_q.weight.lora_b   [out, r]   PEFT's lora_B, its rows moved as the base weight's were

The converter runs the base model's own tensor changes on the (A, B) pair, so llama's q/k
row permutation for ggml's RoPE lands on B's rows; the GGUF loader's fix for that tensor undoes
it here too, with the head counts of the base model (an adapter file carries no hyperparameters).
rsLoRA is not recorded: llama.cpp scales every adapter by alpha / rank, and so does this reader.
The tensors come back under PEFT's names, so `adapter.py` checks and stacks them as a folder's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint, row_order
from llmserve.models import CausalLM

_HALVES = {".lora_a": "lora_A", ".lora_b": "lora_B"}


class _BaseHeads:
    """The metadata the GGUF loader's fixes read (head counts), taken from the base model's config."""

    def __init__(self, config: Any) -> None:
        n_head = getattr(config, "num_attention_heads", None)
        self._fields = {
            "attention.head_count": n_head,
            "attention.head_count_kv": getattr(config, "num_key_value_heads", None) or n_head,
        }

    def require(self, key: str) -> Any:
        return self._fields[key]

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)


def read_gguf_adapter(path: Path, model: CausalLM) -> tuple[int, float, dict[str, torch.Tensor]]:
    """(rank, scale, PEFT-named float32 tensors) of a GGUF LoRA file; ValueError naming the file
    (and the tensor) for a file that is no LoRA adapter of `model`'s architecture."""
    try:
        ckpt = GGUFCheckpoint([path])
    except ValueError as e:
        raise ValueError(f"{path}: cannot read the GGUF LoRA adapter: {e}") from None
    except Exception as e:  # gguf's reader fails on a damaged file with struct / index errors
        raise ValueError(f"{path}: cannot read the GGUF LoRA adapter: {type(e).__name__}: {e}") from None
    kinds = (ckpt.field("general.type"), ckpt.field("adapter.type"))
    if kinds != ("adapter", "lora"):
        raise ValueError(
            f"{path}: not a GGUF LoRA adapter (general.type {kinds[0]!r}, adapter.type {kinds[1]!r}; "
            "expected 'adapter' and 'lora')"
        )
    base_arch = (getattr(model.config, "architectures", None) or ["?"])[0]
    try:
        adapter_arch = ckpt.hf_architecture
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if adapter_arch != base_arch:
        raise ValueError(
            f"{path}: the adapter is for {ckpt.architecture!r} ({adapter_arch}); the base model is {base_arch}"
        )
    heads = _BaseHeads(model.config)
    tensors: dict[str, torch.Tensor] = {}
    for name in ckpt.tensor_names():
        tensors.update(_peft_tensor(ckpt, name, heads, path))
    ranks = {t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight")}
    if len(ranks) > 1:
        raise ValueError(f"{path}: the adapter's tensors have different ranks {sorted(ranks)}")
    rank = ranks.pop() if ranks else 0
    alpha = float(ckpt.field("adapter.lora.alpha", 0.0) or 0.0)
    return rank, (alpha / rank if alpha and rank else 1.0), tensors


def _peft_tensor(ckpt: GGUFCheckpoint, name: str, heads: _BaseHeads, path: Path) -> dict[str, torch.Tensor]:
    """One GGUF tensor under its PEFT name, with llama.cpp's row changes undone on B."""
    suffix = next((s for s in _HALVES if name.endswith(s)), None)
    gguf_base = name[: -len(suffix)].removesuffix(".weight") if suffix else ""
    mapped = ckpt.hf_base_name(gguf_base) if suffix else None
    if suffix is None or mapped is None or not name[: -len(suffix)].endswith(".weight"):
        raise ValueError(
            f"{path}: tensor {name!r} is no LoRA half (.weight.lora_a / .weight.lora_b) of a "
            f"{ckpt.architecture} linear layer"
        )
    hf_base, fix = mapped
    try:
        tensor = torch.from_numpy(np.array(ckpt.tensor_data(name), dtype=np.float32))
    except Exception as e:
        raise ValueError(f"{path}: cannot read tensor {name!r}: {type(e).__name__}: {e}") from None
    if fix is not None and suffix == ".lora_b":
        tensor = _undo_rows(fix, tensor, heads, path, name)
    return {f"base_model.model.{hf_base}.{_HALVES[suffix]}.weight": tensor}


def _undo_rows(fix: Any, b: torch.Tensor, heads: _BaseHeads, path: Path, name: str) -> torch.Tensor:
    """The loader's fix applied to B's rows, when it is a reordering of rows (llama's q/k)."""
    try:
        order = row_order(fix, b.shape[0], heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: cannot place the rows of {name!r}: {e}") from None
    if order is None:
        raise ValueError(
            f"{path}: tensor {name!r}: llmserve cannot undo llama.cpp's conversion of it on a LoRA B"
        )
    return b.index_select(0, order)

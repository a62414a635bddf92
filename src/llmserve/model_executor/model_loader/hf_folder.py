"""Weights and config of an HF model folder.

Safetensors (one file, or shards listed by `model.safetensors.index.json`) are memory-mapped:
each tensor is read straight from the page cache into the model's own tensor, so no second full
copy of the checkpoint ever exists. `pytorch_model.bin` (and its sharded form) is read only with
`torch.load(weights_only=True)`, which refuses pickles that import or call anything.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from llmserve.model_executor.model_loader.errors import (
    ModelLoadError,
    ModelNotFoundError,
    UnsafeCheckpointError,
)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"


def load_hf_config(folder: Path) -> Any:
    """The folder's transformers config (local files only: nothing is fetched)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{folder / 'config.json'}: cannot read the model config: {e}") from e


def sentence_max_seq_length(folder: Path) -> int | None:
    """sentence-transformers' `max_seq_length` (sentence_bert_config.json): the longest input the
    embedding model was trained on, shorter than its position table (all-MiniLM-L6-v2: 256 of 512)."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{path}: not a valid sentence-transformers config ({e})") from e
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _files_from_index(folder: Path, index_name: str) -> list[Path]:
    index_path = folder / index_name
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index_path}: not a valid shard index ({e})") from e
    files = [folder / f for f in sorted(set(weight_map.values()))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelNotFoundError(f"{index_path} lists shard(s) that do not exist: {', '.join(missing)}")
    return files


def weight_files(folder: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "bin", files) for the folder, preferring safetensors."""
    if (folder / _SAFETENSORS_INDEX).is_file():
        return "safetensors", _files_from_index(folder, _SAFETENSORS_INDEX)
    single = sorted(folder.glob("*.safetensors"))
    if single:
        return "safetensors", single
    if (folder / _BIN_INDEX).is_file():
        return "bin", _files_from_index(folder, _BIN_INDEX)
    if (folder / "pytorch_model.bin").is_file():
        return "bin", [folder / "pytorch_model.bin"]
    raise ModelNotFoundError(
        f"model folder {folder} has no weights: expected *.safetensors, {_SAFETENSORS_INDEX}, "
        f"pytorch_model.bin or {_BIN_INDEX}"
    )


WeightCut = Callable[[str, Any], torch.Tensor]
"""(checkpoint name, tensor or safetensors slice) -> the part to load (tensor parallelism)."""


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"{path}: cannot read safetensors file: {e}") from e


def is_backbone_checkpoint(kind: str, files: list[Path], prefix: str = "model.") -> bool:
    """Whether a safetensors checkpoint holds a decoder stack saved on its own (HF's `XModel`:
    `layers.0...` and `embed_tokens...` without `prefix`, and no LM head), as Qwen3-Embedding's
    does under a `...ForCausalLM` config; False for other formats (not read cheaply)."""
    if kind != "safetensors":
        return False
    names: list[str] = []
    for f in files:
        with _open_safetensors(f) as sf:
            names.extend(sf.keys())
    return (
        any(n.startswith("layers.") for n in names)
        and any(n.startswith("embed_tokens.") for n in names)
        and not any(n.startswith((prefix, "lm_head.")) for n in names)
    )


def count_tensors(kind: str, files: list[Path]) -> int | None:
    """Number of tensors (for the progress bar) without reading data; None when unknown cheaply."""
    if kind != "safetensors":
        return None
    total = 0
    for f in files:
        with _open_safetensors(f) as sf:
            total += len(list(sf.keys()))
    return total


def load_bin_safely(path: Path) -> dict[str, torch.Tensor]:
    """`torch.load` restricted to tensors and plain containers; anything else is refused."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the pickle holds more than tensors (it may try to run code). "
            f"Only weights_only checkpoints are accepted; convert it to safetensors. Detail: {e}"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable PyTorch checkpoint: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{path}: expected a dict of tensor names to tensors")
    return state


def tensor_dtypes(files: list[Path]) -> dict[str, str]:
    """Safetensors tensor name -> its stored dtype ("F16", "I32", "F8_E4M3"...), headers only."""
    dtypes: dict[str, str] = {}
    for f in files:
        with _open_safetensors(f) as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                dtypes[name] = sf.get_slice(name).get_dtype()
    return dtypes


def iter_weights(
    kind: str, files: list[Path], dtype: torch.dtype | None, cut: WeightCut | None = None
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor in `dtype`, file) for every tensor of the checkpoint, one file at a time
    (dtype None: as stored, for pre-quantized checkpoints' integer and float8 tensors). `cut`:
    the part of each tensor to keep (a tensor-parallel rank's); safetensors files then read only
    that part (`cut` gets the file's lazy slice)."""
    for f in files:
        if kind == "safetensors":
            with _open_safetensors(f) as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                    t = sf.get_tensor(name) if cut is None else cut(name, sf.get_slice(name))
                    yield name, t if dtype is None else t.to(dtype), str(f)
        else:
            for name, tensor in load_bin_safely(f).items():
                if cut is not None:
                    tensor = cut(name, tensor)
                yield name, tensor if dtype is None else tensor.to(dtype), str(f)

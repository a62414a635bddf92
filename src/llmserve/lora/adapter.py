"""Loading a PEFT LoRA folder (or a GGUF LoRA file, gguf_adapter.py) into per-layer weight
pairs, checked against the base model.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules) and
`adapter_model.safetensors`, whose tensors are named after the base model's layers:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   A [r, in]    (the shrink)
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   B [out, r]   (the expand)

and delta(x) = scale * (x @ A.T) @ B.T, scale = alpha / r (alpha / sqrt(r) with rsLoRA).

Our fused layers (qkv_proj, gate_up_proj) take several checkpoint projections as shards. Their
adapters are stacked into one pair per layer, so a step runs one shrink and one expand per
adapter and layer, whatever the number of shards:

    A: [r_q + r_k + r_v, in]           the shards' A rows, one after another
    B: [out_q + out_k + out_v, r_q + r_k + r_v], block-diagonal:
         | B_q  0    0   |   shard q's output columns read only shard q's ranks
         | 0    B_k  0   |   (a shard the adapter leaves out has no rows in A and zero B)
         | 0    0    B_v |

The scale is folded into B. Pairs are stored transposed (A.T [in, r], B.T [r, out]) so both
matmuls read contiguous rows.

A tensor-parallel rank's model is its shard: each pair is cut to the rank's part as it is read
(distributed/sharding.py `shard_lora_pair`), then checked against the shard's layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from llmserve.lora.request import LoRARequest
from llmserve.models import CausalLM

if TYPE_CHECKING:
    from llmserve.distributed.sharding import TPShard

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass(frozen=True, slots=True)
class LayerLoRA:
    """One adapter's weights for one (possibly fused) linear layer."""

    a_t: torch.Tensor  # [in, r_total]: the shrink
    b_t: torch.Tensor  # [r_total, out]: the expand, scale folded in


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    lora_int_id: int
    name: str
    rank: int
    scale: float
    layers: dict[str, LayerLoRA]
    """Module path of a base linear layer (as `CausalLM.route_weight` names it) -> its pair."""


def read_adapter_config(folder: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scale) from `adapter_config.json`; ValueError naming the file for what we cannot run.
    `target_modules` is not read: the tensors present say which layers the adapter changes."""
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the LoRA adapter's config: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a LoRA adapter config (a JSON object)")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: not a LoRA adapter config (peft_type {config.get('peft_type')!r})")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise ValueError(
            f"{path}: r must be a positive integer and lora_alpha a number; got r={r!r}, lora_alpha={alpha!r}"
        )
    if r > max_rank:
        raise ValueError(f"{path}: rank {r} is above max_lora_rank {max_rank}")
    unsupported = [
        key
        for key, off in (
            ("rank_pattern", {}),
            ("alpha_pattern", {}),
            ("use_dora", False),
            ("modules_to_save", None),
        )
        if config.get(key) not in (off, None)
    ]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise ValueError(f"{path}: LoRA options llmserve does not run yet: {unsupported}")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scale)


def load_adapter(
    request: LoRARequest,
    model: CausalLM,
    max_rank: int,
    device: torch.device,
    dtype: torch.dtype,
    tp_shard: TPShard | None = None,
) -> LoRAAdapter:
    """The adapter of `request` (a PEFT folder, or a llama.cpp GGUF LoRA file), its tensors
    checked against `model`'s layers (shape, rank, both halves present); a bad one is a
    ValueError naming the file and the tensor. `tp_shard`: `model` is this tensor-parallel
    rank's shard, and the adapter is cut to it."""
    source = Path(request.lora_path)
    if source.suffix == ".gguf":
        from llmserve.lora.gguf_adapter import read_gguf_adapter

        path = source
        rank, scale, tensors = read_gguf_adapter(source, model)
    else:
        rank, scale = read_adapter_config(source, max_rank)
        path = source / WEIGHTS_FILE
        tensors = _read_safetensors(path)
    # (module path, shard) -> {"A": tensor, "B": tensor}
    halves: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module_path, shard, half = _route(model, key, path)
        halves.setdefault((module_path, shard), {})[half] = tensor
    if not halves:
        raise ValueError(f"{path}: no LoRA tensors (lora_A / lora_B) in the file")
    per_layer: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (module_path, shard), pair in halves.items():
        for part, part_pair in _parts(model, module_path, shard, pair):
            a, b = _checked_pair(model, module_path, part, part_pair, path, max_rank, tp_shard)
            per_layer.setdefault(module_path, {})[part] = (a, b)
    layers = {
        name: _stack(model.get_submodule(name).output_sizes, shards, scale, device, dtype)
        for name, shards in per_layer.items()
    }
    return LoRAAdapter(request.lora_int_id, request.lora_name, rank, scale, layers)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path}: cannot read the LoRA adapter's tensors: {e}") from None


WHOLE = -1
"""`_route`'s shard for an adapter of a whole fused layer (Phi-3's qkv_proj, gate_up_proj)."""


def _parts(
    model: CausalLM, module_path: str, shard: int, pair: dict[str, torch.Tensor]
) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """A pair of one shard as it is; a pair of a whole fused layer as one per shard, each with the
    whole A and its shard's rows of B: B x A = [B_q; B_k; B_v] A, block by block the same sums."""
    if shard != WHOLE:
        return [(shard, pair)]
    sizes = model.get_submodule(module_path).output_sizes
    b, start, out = pair.get("B"), 0, []
    for part, n in enumerate(sizes):
        out.append((part, {**pair, **({"B": b[start : start + n]} if b is not None else {})}))
        start += n
    if b is not None and b.dim() == 2 and b.shape[0] != start:  # rows left over or missing
        return [(0, pair)]  # _checked_pair names the shape against the first shard's
    return out


def _route(model: CausalLM, key: str, path: Path) -> tuple[str, int, str]:
    """(module path, shard, "A" or "B") of a PEFT tensor name; shard `WHOLE` for a fused layer
    the adapter targets as one (the checkpoint stores it fused)."""
    suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
    if suffix is None:
        raise ValueError(f"{path}: tensor {key!r} is not a lora_A / lora_B weight")
    base = key.removeprefix(_PEFT_PREFIX)[: -len(suffix)] + ".weight"
    route = model.route_weight(base)
    module = None
    if route is not None:
        try:
            module = model.get_submodule(route[0])
        except AttributeError:
            module = None
    if route is None or module is None or not hasattr(module, "output_sizes"):
        raise ValueError(
            f"{path}: tensor {key!r} targets {base!r}, which is no linear layer of the base model"
        )
    leaf = base.removesuffix(".weight").rpartition(".")[2]
    whole = len(module.output_sizes) > 1 and leaf == route[0].rpartition(".")[2]
    return route[0], WHOLE if whole else route[2], _SUFFIXES[suffix]


def _checked_pair(
    model: CausalLM,
    module_path: str,
    shard: int,
    pair: dict[str, torch.Tensor],
    path: Path,
    max_rank: int,
    tp_shard: TPShard | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    layer = model.get_submodule(module_path)
    where = f"{module_path}" + (f" (shard {shard})" if len(layer.output_sizes) > 1 else "")
    for half in ("A", "B"):
        if half not in pair:
            raise ValueError(f"{path}: the adapter of {where} lacks its lora_{half} tensor")
    a, b = pair["A"], pair["B"]
    if tp_shard is not None and a.dim() == 2 and b.dim() == 2:
        from llmserve.distributed.sharding import shard_lora_pair

        a, b = shard_lora_pair(module_path, a, b, tp_shard, f"{path}: {where}")
    r = a.shape[0]
    expected_a, expected_b = (r, layer.in_features), (layer.output_sizes[shard], r)
    if a.dim() != 2 or tuple(a.shape) != expected_a:
        raise ValueError(
            f"{path}: lora_A of {where} has shape {tuple(a.shape)}; the base model needs {expected_a}"
        )
    if b.dim() != 2 or tuple(b.shape) != expected_b:
        raise ValueError(
            f"{path}: lora_B of {where} has shape {tuple(b.shape)}; the base model needs {expected_b}"
        )
    if r > max_rank:
        raise ValueError(f"{path}: lora_A of {where} has rank {r}, above max_lora_rank {max_rank}")
    return a, b


def _stack(
    output_sizes: list[int],
    shards: dict[int, tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    device: torch.device,
    dtype: torch.dtype,
) -> LayerLoRA:
    """One layer's shards as one stacked A and one block-diagonal B (the module docstring)."""
    order = sorted(shards)
    a = torch.cat([shards[s][0] for s in order]).float()  # [r_total, in]
    b = torch.zeros(sum(output_sizes), a.shape[0])  # [out, r_total]
    rank_start = 0
    for s in order:
        shard_b = shards[s][1].float()
        out_start = sum(output_sizes[:s])
        b[out_start : out_start + shard_b.shape[0], rank_start : rank_start + shard_b.shape[1]] = (
            shard_b * scale
        )
        rank_start += shard_b.shape[1]
    return LayerLoRA(
        a.t().contiguous().to(device=device, dtype=dtype), b.t().contiguous().to(device=device, dtype=dtype)
    )

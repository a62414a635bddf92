"""sentence-transformers' `Dense` modules: linear layers an embedding model applies to its pooled
vector before the normalisation (EmbeddingGemma: 768 -> 3,072 -> 768, no biases; LaBSE: one with
tanh). Read from the folder's `modules.json` (the modules listed after the `Pooling` one, each
folder's `config.json` and `model.safetensors` or `pytorch_model.bin`), run in float32 on the pooled
rows (the runner calls the stack as `dense_head`, as it calls a classifier's `score_head`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmserve.model_executor.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "ReLU": torch.relu,
    "Sigmoid": torch.sigmoid,
}


class DenseStack(nn.Module):
    """The Dense modules in order: x -> act(x W^T + b), each in float32."""

    def __init__(
        self, layers: list[tuple[torch.Tensor, torch.Tensor | None, str]], device: torch.device
    ) -> None:
        super().__init__()
        self.weights = [w.to(device, torch.float32) for w, _, _ in layers]  # [out, in] each
        self.biases = [None if b is None else b.to(device, torch.float32) for _, b, _ in layers]
        self.activations = [_ACTIVATIONS[a] for _, _, a in layers]
        self.out_features = int(self.weights[-1].shape[0])

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [B, in] -> [B, out], float32
        x = rows.float()
        for w, b, act in zip(self.weights, self.biases, self.activations, strict=True):
            x = act(torch.nn.functional.linear(x, w, b))
        return x


def _read_layer(folder: Path, config_path: Path) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    try:
        config = json.loads(config_path.read_text())
        name = str(config.get("activation_function", "torch.nn.modules.linear.Identity")).rpartition(".")[2]
        in_features, out_features = int(config["in_features"]), int(config["out_features"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{config_path}: not a sentence-transformers Dense config ({e})") from None
    if name not in _ACTIVATIONS:
        raise ModelLoadError(
            f"{config_path}: the Dense activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})"
        )
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{folder}: a Dense module without model.safetensors or pytorch_model.bin")
    weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
    if weight is None or tuple(weight.shape) != (out_features, in_features):
        got = None if weight is None else list(weight.shape)
        raise ModelLoadError(
            f"{folder}: linear.weight is {got}, its config says [{out_features}, {in_features}]"
        )
    return weight, bias, name


def load_dense_stack(folder: Path, device: torch.device) -> DenseStack | None:
    """The folder's Dense modules after its Pooling module, or None when it lists none."""
    path = folder / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = sorted(json.loads(path.read_text()), key=lambda m: int(m.get("idx", 0)))
        types = [str(m.get("type", "")) for m in modules]
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # (pooler.model_pooling warns about an unreadable modules.json)
    pooled = next((i for i, t in enumerate(types) if t.endswith(".Pooling")), None)
    if pooled is None:
        return None
    layers = [
        _read_layer(folder / m["path"], folder / m["path"] / "config.json")
        for m, t in zip(modules[pooled + 1 :], types[pooled + 1 :], strict=True)
        if t.endswith(".Dense")
    ]
    if not layers:
        return None
    for (w, _, _), (nxt, _, _) in itertools.pairwise(layers):
        if w.shape[0] != nxt.shape[1]:
            raise ModelLoadError(
                f"{folder}: Dense layers of {list(w.shape)} then {list(nxt.shape)} do not chain"
            )
    return DenseStack(layers, device)


def gguf_dense_stack(ckpt: GGUFCheckpoint, device: torch.device) -> DenseStack | None:
    """A GGUF's Dense layers (llama.cpp's converter with `--sentence-transformers-dense-modules`
    writes EmbeddingGemma's as `dense_2`, `dense_3`, without biases or activations)."""
    names = [n for n in ("dense_2.weight", "dense_3.weight") if ckpt.has_tensor(n)]
    if not names:
        return None
    # tensor_data is row-major in GGUF's order reversed: [out, in], nn.Linear's layout
    return DenseStack(
        [(torch.from_numpy(ckpt.tensor_data(n).copy()), None, "Identity") for n in names], device
    )


def attach_dense_head(model: nn.Module, stack: DenseStack | None, hidden_size: int, where: str) -> None:
    """Give `model` a Dense stack as `dense_head` (and its output width as `embedding_size`);
    nothing when `stack` is None. Its first layer must take the pooled width."""
    if stack is None:
        return
    if stack.weights[0].shape[1] != hidden_size:
        raise ModelLoadError(
            f"{where}: the first Dense layer takes {stack.weights[0].shape[1]} features; the model pools "
            f"{hidden_size}"
        )
    model.dense_head = stack
    model.embedding_size = stack.out_features

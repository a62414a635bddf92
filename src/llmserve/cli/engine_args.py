"""Command-line flags for building an engine, shared by every subcommand that loads a model."""

from __future__ import annotations

import argparse
from typing import Any

from llmserve.config.cache import parse_bytes, parse_kv_cache_dtype
from llmserve.config.lora import LORA_DTYPES
from llmserve.config.parallel import RAY_PLACEMENTS


def _kv_cache_dtype(text: str) -> str:
    """`--kv-cache-dtype`, checked by the config's own parser (argparse shows its message)."""
    try:
        return parse_kv_cache_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default=None,
        help="model folder, .gguf file or bundled name (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--mmproj", default=None, metavar="GGUF",
        help="a GGUF vision projector (llama.cpp's mmproj-*.gguf) for a GGUF model: it then takes images",
    )  # fmt: skip
    g.add_argument(
        "--do-pan-and-scan", default=None, action=argparse.BooleanOptionalAction,
        help="Gemma 3 with images: also show the model crops of wide or tall images (transformers' "
        "pan-and-scan); default: the checkpoint's preprocessor_config.json",
    )  # fmt: skip
    g.add_argument(
        "--max-video-frames", type=int, default=768,
        help="Qwen2-VL / Qwen2.5-VL videos: the most frames one video may have (more: 400)",
    )  # fmt: skip
    g.add_argument(
        "--max-video-pixels", type=int, default=256 * 2**20,
        help="Qwen2-VL / Qwen2.5-VL videos: the most pixels a video's frames hold together, as given (more: 400)",
    )  # fmt: skip
    g.add_argument(
        "--model-impl", default="auto", choices=["auto", "native", "transformers"],
        help="whose modelling code runs the model: llmserve's (native) or transformers' (slower; no prefix "
        "caching); auto: native when the architecture has one, else transformers",
    )  # fmt: skip
    g.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (greedy outputs unchanged, sampled ones follow the same distribution)',
    )  # fmt: skip
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
        help="attention kernels: auto (cpu's numba kernel on the CPU, triton on CUDA), torch (the reference)",
    )  # fmt: skip
    g.add_argument(
        "--enforce-eager", action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (slower; no capture at start-up)",
    )  # fmt: skip
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9,
        help="GPU: fraction of the GPU's memory the engine may use; the KV cache takes what weights and a "
        "profiled step leave of it (default 0.9)",
    )  # fmt: skip
    g.add_argument(
        "--cpu-gemm",
        default="auto",
        choices=["auto", "onednn", "blas"],
        help="CPU matmul kernel: oneDNN on prepacked weights, or torch's bmm/MKL (auto: oneDNN when usable)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4", "fp8"],
        help="weight format: int8 / int4 (CPU) blocks of 32 (GGUF Q8_0 / Q4_1 math), none = float; auto: a "
        "quantized GGUF keeps its own quantization (Q4_x as int4, others int8), float checkpoints stay float; "
        "fp8 (GPU): e4m3 linear weights per channel, activations per token, torch._scaled_mm on compute "
        "capability >= 8.9 (a slow float32 reference path elsewhere)",
    )
    g.add_argument(
        "--cpu-offload-gb", type=float, default=0.0, metavar="GiB",
        help="CUDA: keep this many GiB of weights (whole decoder layers) in pinned host memory, copied to "
        "the GPU ahead of use every forward pass (frees GPU memory for the KV cache; costs PCIe time)",
    )  # fmt: skip
    g.add_argument(
        "--cpu-activations",
        default="auto",
        choices=["auto", "int16", "int8"],
        help="how the CPU kernels round activations for int4 weights: int16 per token (the float model's "
        "answers within rounding; auto, the default, means int16) or int8 per block of 32 (llama.cpp's "
        "arithmetic, AVX-512 VNNI only: faster prefill, batches and speculative verification, but it "
        "changes the model's answers)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=None,
        help="KV-cache budget, e.g. 2GiB (default: 2GiB on the CPU; on a GPU, what --gpu-memory-utilization leaves)",
    )  # fmt: skip
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV-cache size in blocks (overrides --kv-cache-memory)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        type=_kv_cache_dtype,
        help="what the KV cache stores K/V in: auto|float32|bfloat16|float16|int8, or K,V for keys "
        "and values apart (e.g. int8,float16; llama.cpp's f32, bf16, f16, q8_0 also read) "
        "(auto: the model's dtype, but float16 for quantized weights on the CPU, as llama.cpp); "
        "16 bits hold twice the float32 tokens, int8 (a float16 scale per 32 values) 3.6x",
    )
    g.add_argument(
        "--pooling", default="auto", choices=["auto", "last", "mean", "cls"],
        help="how embedding requests pool the prompt's final hidden states (auto: the model's "
        "sentence-transformers config, else the last token)",
    )  # fmt: skip
    g.add_argument(
        "--normalize-embeddings", default=None, action=argparse.BooleanOptionalAction,
        help="unit-length embeddings (default: as the model's sentence-transformers config says, else yes)",
    )  # fmt: skip
    g.add_argument(
        "--hf-overrides", default=None, metavar="JSON",
        help="config fields set over the checkpoint's, as a JSON object (vLLM's); e.g. the original "
        'Qwen3-Reranker as a reranker: \'{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'',
    )  # fmt: skip
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="token budget of one step (default: 256 where the fused CPU decoder runs the model, else 1024)",
    )  # fmt: skip
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument(
        "--stream-interval", type=int, default=1,
        help="send a stream's tokens every N (the first at once, and the last): the same text, "
        "fewer SSE events, less server work per token at large batches (default 1: every token)",
    )  # fmt: skip
    g.add_argument(
        "--admission-policy",
        default="optimistic",
        choices=["optimistic", "reserve"],
        help="optimistic: preempt when blocks run out; reserve: admit only when prompt + max_tokens fit",
    )
    g.add_argument(
        "--batching-mode",
        default="continuous",
        choices=["continuous", "static", "static-ragged"],
        help="continuous: in-flight batching; static: request-level batches (prompts padded to the "
        "longest, run until the longest member finishes), for comparison; static-ragged: the same "
        "without prompt padding",
    )

    g = p.add_argument_group("tensor parallelism")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="ranks that split the model (attention heads, MLP and vocabulary), one process each, joined "
        "by a gloo group; Llama, Mistral, Qwen2, Qwen3 models whose heads it divides (default 1)",
    )  # fmt: skip
    g.add_argument(
        "--distributed-executor-backend", default="mp", choices=["mp", "ray"],
        help="how the ranks start: mp, worker processes on this machine; ray, Ray actors on a Ray "
        "cluster's nodes (RAY_ADDRESS, else a local one; pip install 'llmserve[ray]')",
    )  # fmt: skip
    g.add_argument(
        "--threads-per-rank", type=int, default=None,
        help="torch threads of each rank (default: CPUs / --tensor-parallel-size; workers pinned to their own)",
    )  # fmt: skip
    g.add_argument(
        "--ray-placement-strategy", default="PACK", choices=list(RAY_PLACEMENTS),
        help="with --distributed-executor-backend ray: the workers' placement group strategy (STRICT_SPREAD: "
        "one rank per node; ranks on the engine's node use shared memory, others gloo)",
    )  # fmt: skip

    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT folders, llama.cpp GGUF LoRA files) on the base model",
    )
    g.add_argument("--max-loras", type=int, default=4, help="most adapters one step mixes (default 4)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded, least recently used dropped (default --max-loras)",
    )
    g.add_argument(
        "--lora-dtype", choices=LORA_DTYPES, default="auto",
        help="adapters' weights: auto (the model's dtype, exact) or a 16-bit copy (bfloat16, float16) "
        "the fused CPU decoder reads at half the bytes, rounding each weight (default auto)",
    )  # fmt: skip
    g.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH|JSON",
        help="adapters served by name: a request whose `model` is NAME runs on the base model with it; "
        'or vLLM\'s JSON, \'{"name": NAME, "path": PATH, "base_model_name": MODEL}\' (the served model it is for)',
    )  # fmt: skip


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "cpu_gemm": args.cpu_gemm,
        "quantization": args.quantization,
        "cpu_activations": args.cpu_activations,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "attention_backend": args.attention_backend,
        "enforce_eager": args.enforce_eager,
        "cpu_offload_gb": args.cpu_offload_gb,
        "num_kv_blocks": args.num_kv_blocks,
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduling_policy": args.scheduling_policy,
        "admission_policy": args.admission_policy,
        "batching_mode": args.batching_mode,
        "stream_interval": args.stream_interval,
        "model_impl": args.model_impl,
        "mmproj": args.mmproj,
        "do_pan_and_scan": args.do_pan_and_scan,
        "max_video_frames": args.max_video_frames,
        "max_video_pixels": args.max_video_pixels,
        "speculative_config": args.speculative_config,
        "pooling": args.pooling,
        "normalize_embeddings": args.normalize_embeddings,
        "hf_overrides": args.hf_overrides,
        "enable_lora": args.enable_lora,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
        "lora_dtype": args.lora_dtype,
        "lora_modules": list(args.lora_modules) if args.lora_modules else None,
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend,
        "threads_per_rank": args.threads_per_rank,
        "ray_placement_strategy": args.ray_placement_strategy,
    }

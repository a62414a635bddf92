"""What the model manager knows of a model from its files, before and after loading it: the
weight files, their sha256 digest (cached on disk), a memory estimate for a model never loaded,
the native engine's options checked, and memory handed back to the OS after an unload."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from llmserve.config.cache import DEFAULT_KV_CACHE_MEMORY, parse_kv_cache_dtype
from llmserve.config.engine_args import EngineArgs
from llmserve.config.lora import lora_modules_for
from llmserve.config.models import ModelSpec

DIGEST_CACHE = Path.home() / ".cache" / "llmserve" / "digests.json"


def engine_args(spec: ModelSpec, base: dict[str, Any]) -> EngineArgs | None:
    """The engine options of a local model: the command line's (`base`), then its models-file
    `options:` over them, read by the same `EngineArgs.from_options` as `LLM(...)`'s; an
    `engine: transformers` model runs transformers' modelling code. None for a remote model."""
    if spec.engine == "openai":
        return None
    options = {**base, **spec.options, "model": spec.source}
    if options.get("lora_modules") is not None:  # adapters that name another base model are its
        options["lora_modules"] = lora_modules_for(options["lora_modules"], spec.names)
    if spec.engine == "transformers":
        options["model_impl"] = "transformers"
    return EngineArgs.from_options(options, f"model {spec.name!r}")


def weight_files(source: str | None) -> list[Path]:
    """The files a native model's weights come from (empty when it cannot be resolved)."""
    from llmserve.model_executor.model_loader.source import resolve_model

    try:
        src = resolve_model(source)
    except Exception:
        return []
    if src.kind == "gguf":
        return list(src.gguf_files)
    return sorted(p for p in src.path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))


def files_digest(files: list[Path]) -> str | None:
    """sha256 over the weight files, in order (one file: its own sha256, as Ollama's blob digests);
    cached on disk by path, size and modification time."""
    if not files:
        return None
    key = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    try:
        cache = json.loads(DIGEST_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    for p in files:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = f"sha256:{h.hexdigest()}"
    cache[key] = digest
    with contextlib.suppress(OSError):  # written whole, then renamed: servers may share the file
        DIGEST_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = DIGEST_CACHE.with_name(f"{DIGEST_CACHE.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, DIGEST_CACHE)
    return digest


def estimate_size(source: str | None, file_bytes: int, args: EngineArgs) -> int:
    """A model's memory before it was ever loaded: its weight files (twice a 16-bit checkpoint's,
    which the CPU runs in float32) plus its KV cache (the budget, or `num_kv_blocks` blocks of the
    size an HF config implies; without either, 2 GiB, the most the CPU default takes). Measured
    sizes replace it after the first load."""
    config: dict[str, Any] = {}
    if source is not None and (Path(source) / "config.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            config = json.loads((Path(source) / "config.json").read_text())
    weights = file_bytes
    if config.get("torch_dtype") in ("bfloat16", "float16") and args.dtype in ("auto", "float32"):
        weights *= 2
    blocks = args.num_kv_blocks
    if blocks is None:
        return weights + int(args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    text = config.get("text_config", config)
    layers = text.get("num_hidden_layers") or text.get("n_layer") or 0
    heads = text.get("num_attention_heads") or text.get("n_head") or 1
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") or text.get("n_embd") or 0) // heads
    # bytes per value of K and of V (int8: a float16 scale per 32 values); `K,V` names each apart
    widths = {"float16": 2, "bfloat16": 2, "int8": 1.125}
    k, _, v = parse_kv_cache_dtype(args.kv_cache_dtype).partition(",")
    width = widths.get(k, 4) + widths.get(v or k, 4)
    return weights + int(blocks * args.block_size * layers * kv_heads * head_dim * width)


def release_memory() -> None:
    """Give freed memory back to the OS (glibc keeps freed heap otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)

"""`EngineArgs`: the engine's options as one flat record, and the one place they are read.

Options reach an engine from four places: the command line (`llmserve serve|generate|bench`),
`LLM(...)` / `build_engine(...)`, a models file's `options:` and the server's model manager
(a models file's options over the command line's). All four call `EngineArgs.from_options`, so a
value means the same wherever it is written: `kv_cache_memory="4GiB"` in Python, `4GiB` in YAML
and `--kv-cache-memory 4GiB` on the command line; `max_num_seqs: "16"` as `16`. A bad value or an
unknown name is a `ValueError` that names the option and where it came from.

`configs()` splits the record into the frozen per-domain configs the engine is built from.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from llmserve.config.cache import CacheConfig, parse_bytes
from llmserve.config.lora import LoRAConfig, lora_modules_text, parse_lora_modules
from llmserve.config.model import ModelConfig
from llmserve.config.parallel import ParallelConfig
from llmserve.config.scheduler import SchedulerConfig
from llmserve.config.speculative import SpeculativeConfig

_SIZES = frozenset({"kv_cache_memory"})
"""Options given in bytes: an int, or text such as "4GiB" / "512MiB" / "1.5GB"."""
_FALSE, _TRUE = ("false", "no", "off", "0"), ("true", "yes", "on", "1")


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Every engine option, flat; each is documented on the config it ends up in."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    cpu_gemm: str = "auto"
    quantization: str = "auto"
    cpu_activations: str = "auto"
    max_model_len: int | None = None
    show_progress: bool = True
    mmproj: str | None = None
    do_pan_and_scan: bool | None = None
    max_video_frames: int = 768
    max_video_pixels: int = 256 * 2**20
    model_impl: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cpu_offload_gb: float = 0.0
    pooling: str = "auto"
    normalize_embeddings: bool | None = None
    hf_overrides: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    scheduling_policy: str = "fcfs"
    admission_policy: str = "optimistic"
    batching_mode: str = "continuous"
    stream_interval: int = 1
    speculative_config: SpeculativeConfig | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    lora_modules: str | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    threads_per_rank: int | None = None
    ray_placement_strategy: str = "PACK"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str = "engine options") -> EngineArgs:
        """The options of any of the four sources, checked and converted; `where` names the source
        in errors ("LLM", "model 'qwen3:8b'", ...). The configs validate the values themselves
        (ranges, choices) when `configs()` builds them; this checks names and types."""
        known = cls.names()
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ValueError(f"{where}: unknown engine option(s) {unknown}; known: {sorted(known)}")
        hints = typing.get_type_hints(cls)
        values = {name: _convert(name, value, hints[name], where) for name, value in options.items()}
        args = cls(**values)
        args.configs()  # every range and choice checked now, not at the first load
        args.lora_config()
        args.parallel_config()
        return args

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    def configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, SpeculativeConfig | None]:
        """The per-domain configs (each validates its own fields in `__post_init__`)."""
        model = ModelConfig(
            model=self.model,
            dtype=self.dtype,  # type: ignore[arg-type]
            device=self.device,
            cpu_gemm=self.cpu_gemm,  # type: ignore[arg-type]
            quantization=self.quantization,  # type: ignore[arg-type]
            cpu_activations=self.cpu_activations,  # type: ignore[arg-type]
            max_model_len=self.max_model_len,
            show_progress=self.show_progress,
            mmproj=self.mmproj,
            do_pan_and_scan=self.do_pan_and_scan,
            max_video_frames=self.max_video_frames,
            max_video_pixels=self.max_video_pixels,
            model_impl=self.model_impl,  # type: ignore[arg-type]
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            cpu_offload_gb=self.cpu_offload_gb,
            pooling=self.pooling,  # type: ignore[arg-type]
            normalize_embeddings=self.normalize_embeddings,
            hf_overrides=self.hf_overrides,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        scheduler = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            policy=self.scheduling_policy,  # type: ignore[arg-type]
            admission=self.admission_policy,  # type: ignore[arg-type]
            mode=self.batching_mode,  # type: ignore[arg-type]
            stream_interval=self.stream_interval,
        )
        return model, cache, scheduler, self.speculative_config

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            self.tensor_parallel_size,
            self.distributed_executor_backend,  # type: ignore[arg-type]
            self.threads_per_rank,
            self.ray_placement_strategy,  # type: ignore[arg-type]
        )

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA config when `enable_lora`, else None."""
        modules = parse_lora_modules(self.lora_modules)
        if not self.enable_lora:
            if modules:
                raise ValueError("lora_modules needs enable_lora")
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype, modules)


def _convert(name: str, value: Any, hint: Any, where: str) -> Any:
    """`value` as the type `hint` names: numbers and booleans may be text, sizes may carry units."""
    if name == "speculative_config":
        try:
            return SpeculativeConfig.parse(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: speculative_config: {e}") from None
    if name == "hf_overrides" and value is not None:
        return _json_text(value)
    if name == "lora_modules" and value is not None:
        try:
            return lora_modules_text(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    optional = isinstance(hint, types.UnionType) and type(None) in hint.__args__
    if value is None:
        if optional:
            return None
        raise ValueError(f"{where}: {name} cannot be null")
    base = next(a for a in hint.__args__ if a is not type(None)) if optional else hint
    try:
        if name in _SIZES:
            return parse_bytes(value) if isinstance(value, str) else _as_int(value)
        if base is bool:
            return _as_bool(value)
        if base is int:
            return _as_int(value)
        if base is float:
            return _as_float(value)
        if base is str and isinstance(value, str):
            return value
    except ValueError as e:
        raise ValueError(f"{where}: {name}: {e}") from None
    raise ValueError(f"{where}: {name} must be a {base.__name__}; got {value!r}")


def _json_text(value: Any) -> str:
    """A JSON option as one canonical text, whether given as a mapping or as JSON text (text that is
    not JSON stays as it is, for the config to refuse by name)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


def _as_int(value: Any) -> int:
    if isinstance(value, bool):  # bool is an int in Python; never a count
        raise ValueError(f"expected an integer; got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"expected an integer; got {value!r}")


def _as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number; got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ValueError(f"expected a number; got {value!r}")


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false; got {value!r}")

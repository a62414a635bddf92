"""`CacheConfig`: the paged KV cache's block size and memory budget, and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_CACHE_MEMORY = 2 * 2**30
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8")
"""The names `kv_cache_dtype` takes besides `auto` (torch dtypes of the same names; config/ does
not import torch: model_executor resolves them)."""
KV_CACHE_DTYPE_ALIASES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "q8_0": "int8"}
"""llama.cpp's `--cache-type-k/-v` spellings of the same formats (our int8 rows are its q8_0
blocks: 32 int8 values and a float16 scale). Its other types (q4_0, q4_1, iq4_nl, q5_0, q5_1)
have no counterpart here and are refused."""


def parse_kv_cache_dtype(value: str) -> str:
    """`kv_cache_dtype` checked and spelled canonically: `auto`, one type, or `K,V` (two types,
    keys first; an alias becomes its full name, and `T,T` becomes `T`, the same cache)."""
    accepted = (
        f"'auto' or one of {', '.join(KV_CACHE_DTYPES)} (llama.cpp's {', '.join(KV_CACHE_DTYPE_ALIASES)} too), "
        "or two of them as K,V"
    )
    if value.strip() == "auto":
        return "auto"
    names = [KV_CACHE_DTYPE_ALIASES.get(p.strip(), p.strip()) for p in value.split(",")]
    if len(names) > 2 or not all(n in KV_CACHE_DTYPES for n in names):
        raise ValueError(f"kv_cache_dtype must be {accepted}; got {value!r}")
    return names[0] if len(names) == 1 or names[0] == names[1] else f"{names[0]},{names[1]}"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""

    kv_cache_memory: int | None = None
    """Bytes of memory for the KV cache (all layers, K and V). Default, unless `num_kv_blocks` is
    given: on a GPU what `gpu_memory_utilization` leaves; on the CPU room for `max_num_seqs`
    sequences at the model's full context, at most 2 GiB and a quarter of the machine's memory
    (`default_kv_cache_memory`). On the CPU the cache's pages are committed as blocks are first
    written, so a budget costs resident memory only as it is used."""

    num_kv_blocks: int | None = None
    """Number of KV-cache blocks; overrides `kv_cache_memory`."""

    enable_prefix_caching: bool = True
    """Reuse the KV blocks of earlier requests that share a prompt prefix."""

    kv_cache_dtype: str = "auto"
    """What the cache stores K/V in: `auto` (the model's dtype; float16 for a float32 model on the
    CPU whose linear layers run quantized, as llama.cpp keeps K/V), `float32`, `bfloat16`, `float16`
    or `int8`; or `K,V`, two of them, keys first, for keys and values apart (llama.cpp's
    `--cache-type-k/-v`; its names `f32`, `bf16`, `f16` and `q8_0` = `int8` are read too). A 16-bit
    cache under a float32 model holds twice the tokens in the same memory and halves what decode
    attention reads; `int8` keeps each token's K and V row per head as int8 with a float16 scale
    per 32 values (llama.cpp's q8_0 blocks), 3.6x the tokens of float32 for 64-dim heads;
    `int8,float16` 2.6x (K's and V's rows each at their own size). K/V are rounded once, when
    written (llama.cpp's default cache is float16). K and V apart run on the torch and cpu
    attention backends and in the fused CPU decoder; the triton backend refuses them."""

    gpu_memory_utilization: float = 0.9
    """GPU only, vLLM's meaning: the fraction of the GPU's memory this engine may use (weights,
    activations, KV cache). The KV cache gets what a profiling forward pass of the largest step
    leaves of it. Ignored when `kv_cache_memory` or `num_kv_blocks` is given, and on the CPU."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024]; got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes; got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1; got {self.num_kv_blocks}")
        # canonical spelling, so that every later reader sees `K,V` only when the types differ
        object.__setattr__(self, "kv_cache_dtype", parse_kv_cache_dtype(self.kv_cache_dtype))

    @property
    def sized_by_user(self) -> bool:
        """The budget is given (bytes or blocks), not measured on the device."""
        return self.kv_cache_memory is not None or self.num_kv_blocks is not None

    def num_blocks(self, kv_bytes_per_token: int, measured: int | None = None) -> int:
        """Blocks that fit the budget, given the model's KV bytes per token (all layers);
        `measured`: the bytes a GPU has left (used when the user gave no budget)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_memory if self.kv_cache_memory is not None else measured
        if budget is None:
            budget = DEFAULT_KV_CACHE_MEMORY
        n = budget // (kv_bytes_per_token * self.block_size)
        if n < 1:
            raise ValueError(
                f"kv_cache_memory {budget} bytes holds no block of {self.block_size} tokens "
                f"({kv_bytes_per_token * self.block_size} bytes per block)"
            )
        return n


def default_kv_cache_memory(
    bytes_per_token: int, max_num_seqs: int, max_model_len: int, block_size: int, total_memory: int
) -> tuple[int, str]:
    """The CPU's KV budget when none is given, and why: room for every running sequence at full
    context (`max_num_seqs` x `max_model_len` tokens, in whole blocks), at most 2 GiB and at
    most a quarter of the machine's memory."""
    blocks_per_seq = -(-max_model_len // block_size)
    need = bytes_per_token * block_size * blocks_per_seq * max_num_seqs
    cap = min(DEFAULT_KV_CACHE_MEMORY, total_memory // 4)
    if need <= cap:
        return need, f"room for {max_num_seqs} sequences of {max_model_len} tokens"
    why = "2 GiB" if cap == DEFAULT_KV_CACHE_MEMORY else "a quarter of this machine's memory"
    return (
        cap,
        f"{max_num_seqs} sequences of {max_model_len} tokens would take {need / 2**30:.1f} GiB; capped at {why}",
    )


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgib")
    unit = s[len(num) :]
    if unit not in units or not num:
        raise ValueError(f"cannot read {text!r} as a size in bytes (examples: 2GiB, 512MiB, 1000000)")
    try:
        return int(float(num) * units[unit])
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as a size in bytes (examples: 2GiB, 512MiB, 1000000)"
        ) from None

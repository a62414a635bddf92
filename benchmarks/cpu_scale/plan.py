"""What one run of bench_cpu_scale.py measures: the model sizes, the quants, the workload.

`SIZES` are issue 30's models (the 1B one is GPU.md's, `gpu.plan.ModelShape`'s defaults; the 3B
one is only built when asked); `SMOKE` is the same sequence of steps at tiny sizes, so CI checks
the script. Does not know how anything is built, run or printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu.plan import SMOKE_SHAPE, ModelShape

# Issue 30's models. transformers saves them in bfloat16 (half the disk and time of float32); the
# F16 GGUF llama-quantize reads holds those values exactly down to 2^-17 (below: 0.03% of weights of
# std 0.02, rounded at a step 4 and 8-bit blocks never resolve): llama.cpp's own recipe, f16 then quantize
SIZES: dict[str, ModelShape] = {
    # 1.074B parameters: 1.97 GiB of bf16 matrices, 1.14 GB as Q8_0
    "1b": ModelShape(),
    # 2.97B parameters (hidden 3072, 28 layers, 24 heads of 128, 8 KV heads); transformers builds it
    # in float32 first (12 GB), its F16 GGUF is 6 GB: it fits 24 GiB, at ~3x the 1B run's time
    "3b": ModelShape(
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        intermediate_size=8192,
    ),
    # Issue 29's MoE: a Mixtral of 8 experts, 2 per token (0.90B parameters, 0.29B active per token:
    # attention, embedding and two 2048-wide experts per layer); bench_moe.py's dense twin has those
    # 0.29B. llama.cpp's converter writes it as `llama` with stacked ffn_*_exps tensors
    "moe": ModelShape(
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2048,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # Gemma 3 1B's stack (hidden 1152, 26 layers, 4 heads of 256, 1 KV head, intermediate 6912,
    # windows of 512 in five layers of six) with SmolLM2's 49,152-token vocabulary instead of
    # Gemma's 262,144 (the tokenizer beside the weights must have the model's ids): 0.75B
    # parameters, where the real model's embedding adds 0.25B more
    "gemma3-1b": ModelShape(
        arch="gemma3",
        hidden_size=1152,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=6912,
    ),
}


@dataclass(frozen=True, slots=True)
class Quant:
    """One GGUF file type the servers are compared on."""

    name: str
    """the CLI's name (`--quants`) and the file's suffix"""
    ftype: str
    """`llama-quantize`'s type name (and `convert_hf_to_gguf.py --outtype`'s, lower-cased, where it has one)"""


QUANTS: dict[str, Quant] = {
    q.name: q
    for q in (
        Quant("q8_0", "Q8_0"),
        Quant("q4_0", "Q4_0"),
        Quant("q4_k_m", "Q4_K_M"),  # the quant most GGUF users download
    )
}


@dataclass(frozen=True, slots=True)
class Workload:
    """`llmserve bench serve --dataset random --ignore-eos` at each level, against each server."""

    input_len: int
    output_len: int
    levels: tuple[tuple[int, int], ...]
    """(max concurrency, prompts): the first is batch 1, the last the batched level the targets name."""
    max_num_seqs: int
    """llmserve's --max-num-seqs and llama-server's slots (-np)"""
    num_warmups: int = 1
    """unmeasured requests that open each level"""

    @property
    def concurrency(self) -> tuple[int, ...]:
        return tuple(c for c, _ in self.levels)

    def slot_len(self) -> int:
        """Tokens one sequence may hold: a whole request and 16 tokens of headroom, as
        benchmarks/compare.py gives each llama-server slot (272 here); llmserve's --max-model-len."""
        return self.input_len + self.output_len + 16

    def llama_ctx(self) -> int:
        """llama-server's -c: it splits the context evenly among its slots (4,352 here)."""
        return self.max_num_seqs * self.slot_len()


WORKLOAD = Workload(input_len=128, output_len=128, levels=((1, 4), (16, 32)), max_num_seqs=16)
# The same levels (c=1 and c=16, so the table and targets read the same), a few short requests
SMOKE_WORKLOAD = Workload(input_len=32, output_len=16, levels=((1, 2), (16, 16)), max_num_seqs=16)


@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    shapes: dict[str, ModelShape]
    """size name -> model"""
    quants: tuple[Quant, ...]
    workload: Workload
    dtype: str
    """what transformers saves the model in"""
    bandwidth_bytes: int
    """the streaming-read buffer (much larger than the 32 MiB L3 of the machines here)"""
    bandwidth_passes: int
    timeout_s: float
    """the most one subprocess may take (a conversion, a server's start, one bench run)"""


def make_plan(sizes: list[str], quants: list[str], smoke: bool) -> Plan:
    if smoke:
        # convert_hf_to_gguf writes Q8_0 itself (or the gguf package does): no llama-quantize needed
        return Plan("smoke", {"smoke": SMOKE_SHAPE}, (QUANTS["q8_0"],), SMOKE_WORKLOAD, "float32",
                    256 * 2**20, 3, 120)  # fmt: skip
    unknown = [s for s in sizes if s not in SIZES] + [q for q in quants if q not in QUANTS]
    if unknown:
        raise ValueError(f"unknown sizes/quants {unknown}: sizes {list(SIZES)}, quants {list(QUANTS)}")
    return Plan(
        "full",
        {s: SIZES[s] for s in sizes},
        tuple(QUANTS[q] for q in quants),
        WORKLOAD,
        "bfloat16",
        2 * 2**30,
        7,
        900,
    )

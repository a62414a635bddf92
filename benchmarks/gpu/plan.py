"""What one run of bench_gpu.py measures: the model's shape and every size, as one frozen `Plan`.

`GPU_PLAN` is issue 23's workload on GPU.md's model (the figures the targets are stated for);
`SMOKE_PLAN` is the same sequence of runs on the CPU at tiny sizes, so CI checks every part of the
script that does not need a GPU. Does not know how anything is run or printed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama built by transformers' `LlamaConfig` (GPU.md: 1.074B parameters, 2.00 GiB of bf16
    matrices at the default sizes)."""

    hidden_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    intermediate_size: int = 8192
    vocab_size: int = 49152
    """SmolLM2's vocabulary: the tokenizer written beside the weights has exactly this many ids."""
    rope_theta: float = 500000.0
    max_position_embeddings: int = 4096
    """Room for the prefill prompts (2,048 tokens + 1 output) and a decode's 256 positions."""
    num_local_experts: int = 0
    """> 0: a Mixtral (transformers' MixtralConfig) whose every MLP is this many experts of
    `intermediate_size`, `num_experts_per_tok` of them run per token."""
    num_experts_per_tok: int = 2
    arch: str = "llama"
    """"gemma3": a Gemma 3 text stack (transformers' Gemma3TextConfig: its sandwich norms, the tanh
    GELU, five sliding layers of `sliding_window` positions to one global, two RoPE bases)."""
    head_dim: int = 0
    """Gemma 3's (its heads are wider than hidden / heads); 0: hidden / heads."""
    sliding_window: int = 512

    def spec(self) -> dict[str, object]:
        """The shape as a model folder's marker records it (a dense shape without the expert
        fields, a Llama without the Gemma ones, so folders built before they existed are reused)."""
        fields = asdict(self)
        if not self.num_local_experts:
            del fields["num_local_experts"], fields["num_experts_per_tok"]
        if self.arch == "llama":
            del fields["arch"], fields["head_dim"], fields["sliding_window"]
        return fields

    def dense_twin(self) -> ModelShape:
        """The dense Llama with this MoE's active parameters: the same attention, embedding and
        layers, one MLP as wide as the experts a token runs (the router's few weights aside)."""
        return replace(
            self, num_local_experts=0, intermediate_size=self.num_experts_per_tok * self.intermediate_size
        )


@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    model: ModelShape
    device: str
    dtype: str
    """llmserve's --dtype for every engine run, and the dtype the checkpoint is saved in."""
    concurrency: tuple[int, ...]
    """`llmserve bench serve --max-concurrency` levels, one run each."""
    input_len: int
    output_len: int
    min_prompts: int
    """Prompts per level: max(min_prompts, prompts_per_slot * concurrency)."""
    prompts_per_slot: int
    prefill_prompts: int
    """The prefill run: this many prompts of `prefill_len` tokens at once, 1 output token each."""
    prefill_len: int
    latency_prompt_len: int
    """`bench latency`: ppN (one prompt of N tokens) and tgN (N tokens decoded at batch 1)."""
    latency_gen_len: int
    latency_repetitions: int
    throughput_prompts: int
    """`bench throughput`: every request at once, `input_len` in, `output_len` out."""
    max_num_seqs: int
    max_num_batched_tokens: int
    floor_replays: int
    """Replays of the matvec step per timed trial (5 trials; the median is reported)."""
    timeout_s: float
    """The most one subprocess may take (a server start, one benchmark run)."""
    engine_args: tuple[str, ...] = ()
    """More flags for every engine (`serve`, `bench latency`, `bench throughput`)."""

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_slot * concurrency)


GPU_PLAN = Plan(
    name="gpu",
    model=ModelShape(),
    device="cuda",
    dtype="bfloat16",
    concurrency=(1, 16, 64, 256),
    input_len=128,
    output_len=128,
    min_prompts=16,
    prompts_per_slot=4,
    prefill_prompts=8,
    prefill_len=2048,
    latency_prompt_len=128,
    latency_gen_len=128,
    latency_repetitions=3,
    throughput_prompts=1024,
    max_num_seqs=256,
    # 8 x 2,048-token prompts prefill in two steps; decode batches (<= 256 tokens) never hit it
    max_num_batched_tokens=8192,
    floor_replays=200,
    timeout_s=600,
)

# The smoke model keeps the real vocabulary (the tokenizer's), so only its body is tiny
SMOKE_SHAPE = ModelShape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=1024,
)
SMOKE_PLAN = replace(
    GPU_PLAN,
    name="smoke",
    model=SMOKE_SHAPE,
    device="cpu",
    dtype="float32",
    concurrency=(1, 2),
    input_len=32,
    output_len=16,
    min_prompts=4,
    prefill_prompts=2,
    prefill_len=256,
    latency_prompt_len=32,
    latency_gen_len=16,
    latency_repetitions=1,
    throughput_prompts=8,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    floor_replays=20,
    timeout_s=120,
    engine_args=("--kv-cache-memory", "256MiB"),  # the CPU default (2 GiB) is far more than needed
)

"""LoRA serving cost: c concurrent requests spread over several adapters against the same load on
the base model alone (the target: >= 0.8x the base's throughput), and how long an adapter takes
to load.

    python benchmarks/bench_lora.py [--model M] [--adapters DIR_OR_GGUF ...] [--concurrency 16]
                                    [--requests 64] [--prompt-len 128] [--output-len 64]
                                    [--lora-dtype auto|bfloat16|float16] [--repeat 1]
                                    [--step-cpu-time]

One engine (`LLM(enable_lora=True)`, in this process, no HTTP), closed loops of `--concurrency`
requests in flight until `--requests` have finished, on the same random prompts:
  - base:  every request on the base model (the fused CPU decoder runs it where the model
           is quantized on the CPU);
  - loras: request i on adapter i mod N (N = 4 by default): every step mixes the adapters; the
           fused CPU decoder adds their deltas where it runs the base (csrc/decoder_lora.cpp),
           else the model's layers do (no CUDA graph takes adapters);
  - where the fused decoder ran them, the loras loop again with it turned off: the layer path
           (`LoRALinear`'s masked matmul pair), what such steps ran before the fused deltas.
`--step-cpu-time` measures one decode step instead, in one thread's CPU time (`step_cpu_times`).
`--repeat` runs the base and loras loops that many times, alternating, and reports each pair's
ratio (a machine shared with other jobs drifts between runs; adjacent pairs drift least).
Greedy, EOS ignored: every loop produces exactly `--output-len` tokens per request. Reported:
output tokens/s of each, their ratio, which path ran each loop, and each adapter's load time
(`LLMEngine.add_lora`: read, check against the base, stack the shards).

Without `--adapters`, N random rank-`--rank` PEFT adapters on every attention and MLP projection
are written to a temporary folder (the values do not change the cost; only their shapes do).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def write_random_adapter(config, folder: Path, rank: int, seed: int) -> Path:
    """A PEFT folder with random A and B for every projection of a llama-family `config`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {  # projection -> (in, out)
        "self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config_json = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config_json))
    return folder


def closed_loop(engine, prompts: list[list[int]], concurrency: int, output_len: int, loras: list) -> float:
    """Output tokens per second with `concurrency` requests in flight; request i runs `loras[i]`."""
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pending = list(enumerate(prompts))
    produced = in_flight = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_request=loras[i])
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                produced += len(out.outputs[0].token_ids)
    return produced / (time.perf_counter() - start)


def step_cpu_times(
    engine, lora_ids: list[int], context: int, repeats: int
) -> tuple[float, float, float | None]:
    """One thread's CPU time (`time.thread_time`, min of `repeats`) of one decode step of
    `len(lora_ids)` sequences at `context` tokens (runner.execute: the forward and the logits),
    every sequence on the base, then sequence i on lora_ids[i], then that again with the fused
    decoder off (None without one). CPU time, not wall time: on a machine shared with other jobs
    the thread's own work is what stays comparable (run it with OMP_NUM_THREADS=1)."""
    from llmserve.model_executor.forward_runner import SequenceBatchEntry

    runner = engine.runner.runner
    blocks = -(-context // runner.block_size)
    assert len(lora_ids) * blocks <= runner.num_blocks, "the KV cache is too small for these sequences"
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(lora_ids))]

    def step(ids: list[int]) -> float:
        batch = [SequenceBatchEntry([5], context, t, lora_id=i) for t, i in zip(tables, ids, strict=True)]
        start = time.thread_time()
        runner.execute(batch)
        return time.thread_time() - start

    base_ids = [0] * len(lora_ids)
    for _ in range(3):  # warm-up: the adapters' capsules, the buffers
        step(base_ids), step(lora_ids)
    base = min(step(base_ids) for _ in range(repeats))
    loras = min(step(lora_ids) for _ in range(repeats))
    layered = None
    fused = runner.fused
    if fused is not None:
        runner.fused = None
        try:
            layered = min(step(lora_ids) for _ in range(repeats))
        finally:
            runner.fused = fused
    return base, loras, layered


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the base model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--adapters", nargs="*", default=None, help="PEFT folders or GGUF LoRA files")
    ap.add_argument("--num-adapters", type=int, default=4, help="random adapters made without --adapters")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-dtype", default="auto", help="the adapters' weights (auto, bfloat16, float16)")
    ap.add_argument("--repeat", type=int, default=1, help="alternating base / adapters pairs")
    ap.add_argument(
        "--step-cpu-time", action="store_true",
        help="instead of the closed loops: one thread's CPU time of a decode step of --concurrency "
        "sequences at --prompt-len tokens (step_cpu_times; with OMP_NUM_THREADS=1)",
    )  # fmt: skip
    args = ap.parse_args()

    from llmserve.engine.llm import build_engine
    from llmserve.lora import LoRARequest

    engine = build_engine(
        args.model, enable_lora=True, max_loras=max(4, args.num_adapters), max_lora_rank=max(16, args.rank),
        max_num_seqs=args.concurrency, enable_prefix_caching=False, show_progress=False,
        lora_dtype=args.lora_dtype,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.adapters or [
            write_random_adapter(engine.loaded.hf_config, Path(tmp) / f"lora{i}", args.rank, args.seed + i)
            for i in range(args.num_adapters)
        ]
        requests = [LoRARequest(f"lora{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        for request in requests:
            start = time.perf_counter()
            engine.add_lora(request)
            print(
                f"adapter {request.lora_name} ({request.lora_path}): loaded in {time.perf_counter() - start:.3f} s"
            )
        if args.step_cpu_time:
            ids = [requests[i % len(requests)].lora_int_id for i in range(args.concurrency)]
            base, loras, layered = step_cpu_times(engine, ids, args.prompt_len, repeats=15)
            print(f"decode step of {args.concurrency} at {args.prompt_len} tokens, one thread's CPU time "
                  f"(lora_dtype {args.lora_dtype}): base {base * 1e3:.1f} ms, {len(requests)} adapters "
                  f"{loras * 1e3:.1f} ms ({base / loras:.2f}x the base's speed)"
                  + ("" if layered is None else f", layer path {layered * 1e3:.1f} ms ({base / layered:.2f}x)"))  # fmt: skip
            return
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(100, engine.vocab_size - 100) for _ in range(args.prompt_len)]
                   for _ in range(args.requests)]  # fmt: skip
        n = len(requests)
        lora_of = [requests[i % n] for i in range(len(prompts))]
        closed_loop(
            engine, prompts[: args.concurrency], args.concurrency, 4, [None] * args.concurrency
        )  # warm-up
        runner = engine.runner.runner
        fused = getattr(runner, "fused", None)
        pairs = []
        for _ in range(args.repeat):
            base = closed_loop(engine, prompts, args.concurrency, args.output_len, [None] * len(prompts))
            loras = closed_loop(engine, prompts, args.concurrency, args.output_len, lora_of)
            pairs.append((base, loras))
        layered = None
        if fused is not None:  # the layer path's adapters: the loras loop with the fused decoder off
            runner.fused = None
            try:
                layered = closed_loop(engine, prompts, args.concurrency, args.output_len, lora_of)
            finally:
                runner.fused = fused
    lora_path = "layer path"
    if fused is not None and all(
        runner.fused_lora().unsupported_reason(a) is None for a in _adapters(engine)
    ):
        lora_path = "fused CPU decoder"
    print(f"c={args.concurrency}, {args.requests} requests of {args.prompt_len}+{args.output_len} tokens, "
          f"{n} adapters (lora_dtype {args.lora_dtype}):")  # fmt: skip
    for base, loras in pairs:
        print(f"  base {base:.1f} tok/s ({'fused CPU decoder' if fused is not None else 'layer path'}), "
              f"adapters {loras:.1f} tok/s ({lora_path}): {loras / base:.2f}x the base")  # fmt: skip
    if len(pairs) > 1:
        print(f"  median ratio {statistics.median(lo / b for b, lo in pairs):.2f}x over {len(pairs)} pairs")
    if layered is not None:
        base = statistics.median(b for b, _ in pairs)
        print(
            f"  the adapters on the layer path (fused decoder off): {layered:.1f} tok/s ({layered / base:.2f}x)"
        )


def _adapters(engine) -> list:
    """The adapters the engine has loaded."""
    manager = engine.runner.runner.lora
    return [manager.loaded(i) for i in manager.loaded_ids]


if __name__ == "__main__":
    main()

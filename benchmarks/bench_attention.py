"""Decode attention over the paged KV cache: the torch reference backend next to the numba "cpu"
backend, same caches, same metadata, interleaved in one run.

    python benchmarks/bench_attention.py [--batch 1 16 64] [--repeats 9] [--model]

The shapes are SmolLM2-135M's (30 layers, 9 query heads sharing 3 KV heads, head_dim 64, fp32,
blocks of 16 tokens). Each batch decodes one token per sequence; context lengths are drawn from
--min-context..--max-context with a fixed seed and every sequence's blocks are scattered over
the cache (a shuffled block pool, as after many requests come and go). One timed step is a
forward of the attention backend in every layer (K/V write included) with a fresh
`AttentionMetadata`, as the model runner does. GB/s is the KV bytes of all contexts (K and V,
all layers) over the step time: the rate at which the backend streams the cache.

--model also times a whole decode step of the embedded SmolLM2 (`ForwardRunner.execute`: weights,
attention, LM head) at the same batches with each backend; the caches hold random values, which
costs attention the same as real ones.

--kv-dtypes float32 float16 bfloat16 then times the "cpu" backend over caches stored in each
dtype (the `kv_cache_dtype` option; queries and outputs stay float32), interleaved, the first
dtype as the baseline; with --model, whole decode steps of SmolLM2 too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from llmserve.layers.attention import Attention, AttentionMetadata, get_attention_backend
from llmserve.layers.attention.backend import AttentionBackend, AttentionParams

H, H_KV, D, BLOCK = 9, 3, 64, 16
BACKENDS = ("torch", "cpu")


def make_batch(batch: int, seed: int, min_ctx: int, max_ctx: int) -> tuple[list[int], list[list[int]], int]:
    """Context lengths, shuffled block tables and the number of blocks they use."""
    rng = np.random.default_rng(seed)
    seq_lens = [int(n) for n in rng.integers(min_ctx, max_ctx + 1, batch)]
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    pool = rng.permutation(num_blocks).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(pool[used : used + n])
        used += n
    return seq_lens, tables, num_blocks


def interleaved_medians(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median of `repeats` calls of each fn (each returns its own ms), run in turn after 2 warm-ups."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 2):
        for name, fn in fns.items():
            ms = fn()
            if i >= 2:
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def attention_step_ms(
    backend: AttentionBackend,
    params: AttentionParams,
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    caches: list[torch.Tensor],
    seq_lens: list[int],
    tables: list[list[int]],
) -> float:
    md = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK)
    start = time.perf_counter()
    for (q, k, v), cache in zip(qkv, caches, strict=True):
        backend.forward(params, q, k, v, cache, md)
    return (time.perf_counter() - start) * 1e3


def bench_attention(args: argparse.Namespace) -> None:
    params = AttentionParams(H, H_KV, D, D**-0.5)
    backends = {name: get_attention_backend(name) for name in BACKENDS}
    print(
        f"SmolLM2 decode attention: {args.layers} layers, {H} heads / {H_KV} KV heads, D {D}, block "
        f"{BLOCK}, fp32, {torch.get_num_threads()} threads, contexts {args.min_context}-"
        f"{args.max_context} (seed {args.seed}), median of {args.repeats} interleaved steps"
    )
    print(f"{'batch':>5} {'KV MB':>7} {'torch':>20} {'cpu (numba)':>20} {'speedup':>8} {'max |diff|':>10}")
    for B in args.batch:
        seq_lens, tables, num_blocks = make_batch(B, args.seed, args.min_context, args.max_context)
        caches = [torch.randn(2, H_KV, num_blocks, BLOCK, D) for _ in range(args.layers)]
        qkv = [(torch.randn(B, H, D), torch.randn(B, H_KV, D), torch.randn(B, H_KV, D)) for _ in caches]
        kv_bytes = sum(seq_lens) * 2 * H_KV * D * 4 * args.layers

        outs = []
        for name in BACKENDS:
            md = AttentionMetadata.build([1] * B, seq_lens, tables, BLOCK)
            outs.append(backends[name].forward(params, *qkv[0], caches[0], md))
        diff = (outs[0] - outs[1]).abs().max().item()

        steps = {
            n: partial(attention_step_ms, be, params, qkv, caches, seq_lens, tables)
            for n, be in backends.items()
        }
        med = interleaved_medians(steps, args.repeats)
        cells = [f"{med[n]:7.2f} ms {kv_bytes / med[n] / 1e6:5.1f} GB/s" for n in BACKENDS]
        print(
            f"{B:>5} {kv_bytes / 1e6:>7.0f} {cells[0]:>20} {cells[1]:>20} "
            f"{med['torch'] / med['cpu']:>7.2f}x {diff:>10.1e}"
        )


def bench_model_step(args: argparse.Namespace) -> None:
    from llmserve.config import ModelConfig
    from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
    from llmserve.model_executor.model_loader import load_model

    model = load_model(ModelConfig(quantization="none", show_progress=False)).model
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    backends = {name: get_attention_backend(name) for name in BACKENDS}

    def step_ms(name: str, runner: ForwardRunner, batch: list[SequenceBatchEntry]) -> float:
        for m in layers:
            m.backend = backends[name]
        start = time.perf_counter()
        runner.execute(batch)
        return (time.perf_counter() - start) * 1e3

    print(f"\nwhole decode step of the embedded SmolLM2 (ForwardRunner.execute), median of {args.repeats}")
    print(f"{'batch':>5} {'torch':>10} {'cpu (numba)':>12} {'speedup':>8}")
    for B in args.batch:
        seq_lens, tables, num_blocks = make_batch(B, args.seed, args.min_context, args.max_context)
        runner = ForwardRunner(model, num_blocks=num_blocks, block_size=BLOCK)
        for cache in runner.kv_caches:
            cache.normal_()
        batch = [SequenceBatchEntry([7], n, t) for n, t in zip(seq_lens, tables, strict=True)]
        med = interleaved_medians({n: partial(step_ms, n, runner, batch) for n in BACKENDS}, args.repeats)
        print(f"{B:>5} {med['torch']:>7.1f} ms {med['cpu']:>9.1f} ms {med['torch'] / med['cpu']:>7.2f}x")


def bench_kv_dtypes(args: argparse.Namespace) -> None:
    params = AttentionParams(H, H_KV, D, D**-0.5)
    backend = get_attention_backend("cpu")
    dtypes = {name: getattr(torch, name) for name in args.kv_dtypes}
    for dt in dtypes.values():
        backend.prepare(dt)
    base = args.kv_dtypes[0]
    print(f'\n"cpu" decode attention by KV-cache dtype, median of {args.repeats} interleaved steps')
    print(f"{'batch':>5} " + " ".join(f"{n:>22}" for n in dtypes) + f" {'max |diff| vs ' + base:>22}")
    for B in args.batch:
        seq_lens, tables, num_blocks = make_batch(B, args.seed, args.min_context, args.max_context)
        ref = [torch.randn(2, H_KV, num_blocks, BLOCK, D) for _ in range(args.layers)]
        caches = {n: [c.to(dt) for c in ref] for n, dt in dtypes.items()}
        qkv = [(torch.randn(B, H, D), torch.randn(B, H_KV, D), torch.randn(B, H_KV, D)) for _ in ref]
        outs = {}
        for n in dtypes:
            md = AttentionMetadata.build([1] * B, seq_lens, tables, BLOCK)
            outs[n] = backend.forward(params, *qkv[0], caches[n][0].clone(), md)
        diff = max((outs[n] - outs[base]).abs().max().item() for n in dtypes)
        steps = {
            n: partial(attention_step_ms, backend, params, qkv, caches[n], seq_lens, tables) for n in dtypes
        }
        med = interleaved_medians(steps, args.repeats)
        cells = []
        for n, dt in dtypes.items():
            gb = sum(seq_lens) * 2 * H_KV * D * dt.itemsize * args.layers / med[n] / 1e6
            cells.append(f"{med[n]:6.2f} ms {gb:4.1f} GB/s {med[base] / med[n]:4.2f}x")
        print(f"{B:>5} " + " ".join(f"{c:>22}" for c in cells) + f" {diff:>22.1e}")
    if not args.model:
        return

    from llmserve.config import ModelConfig
    from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
    from llmserve.model_executor.model_loader import load_model

    model = load_model(ModelConfig(quantization="none", show_progress=False)).model

    def step_ms(runner: ForwardRunner, batch: list[SequenceBatchEntry]) -> float:
        start = time.perf_counter()
        runner.execute(batch)
        return (time.perf_counter() - start) * 1e3

    print(f"\nwhole decode step of the embedded SmolLM2 by KV-cache dtype, median of {args.repeats}")
    print(f"{'batch':>5} " + " ".join(f"{n:>16}" for n in dtypes))
    for B in args.batch:
        seq_lens, tables, num_blocks = make_batch(B, args.seed, args.min_context, args.max_context)
        batch = [SequenceBatchEntry([7], n, t) for n, t in zip(seq_lens, tables, strict=True)]
        runners = {}
        for n, dt in dtypes.items():
            runners[n] = ForwardRunner(model, num_blocks=num_blocks, block_size=BLOCK, kv_cache_dtype=dt)
            for cache in runners[n].kv_caches:
                cache.normal_()
        med = interleaved_medians({n: partial(step_ms, r, batch) for n, r in runners.items()}, args.repeats)
        print(f"{B:>5} " + " ".join(f"{med[n]:6.1f} ms {med[base] / med[n]:4.2f}x" for n in dtypes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--min-context", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", action="store_true", help="also time whole decode steps of SmolLM2")
    ap.add_argument(
        "--kv-dtypes",
        nargs="+",
        choices=["float32", "float16", "bfloat16"],
        help="instead: the cpu backend over caches of these dtypes (the first is the baseline)",
    )
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    with torch.inference_mode():
        if args.kv_dtypes:
            bench_kv_dtypes(args)
            return
        bench_attention(args)
        if args.model:
            bench_model_step(args)


if __name__ == "__main__":
    main()

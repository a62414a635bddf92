"""Batch-1 (and small-batch) matmul over a whole model's worth of weights, per weight layout.

    python benchmarks/bench_linear.py [--repeats 15]

The shapes are SmolLM2-135M's (30 layers of qkv 576x960, o 576x576, gate_up 576x3072,
down 1536x576, plus the 576x49152 LM head): 538 MB of fp32, far more than the caches, so each
figure is a memory-streaming rate. Layouts, all computing x @ W:
  - F.linear    weight [out, in] (PyTorch's usual layout)
  - x @ W       weight [in, out]
  - chunked     weight [C, in, out / C], one bmm; C = number of threads (llmserve's layout)
A plain sum over the same bytes gives the machine's streaming ceiling. Medians of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmserve.layers.linear import chunked_matmul

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()

    torch.manual_seed(0)
    C = torch.get_num_threads()
    w_in_out = [torch.randn(k, n) for k, n in SHAPES]
    w_out_in = [w.t().contiguous() for w in w_in_out]
    w_chunked = [w.view(w.shape[0], C, -1).permute(1, 0, 2).contiguous() for w in w_in_out]
    total_bytes = sum(k * n for k, n in SHAPES) * 4
    flat = torch.randn(total_bytes // 4)

    print(f"{total_bytes / 1e6:.0f} MB of fp32 weights, {C} threads, median of {args.repeats}")
    ceiling = median_ms(lambda: flat.sum(), args.repeats)
    print(f"streaming ceiling (sum): {ceiling:.1f} ms = {total_bytes / ceiling / 1e6:.1f} GB/s")
    print(f"{'batch':>5} {'F.linear':>16} {'x @ W':>16} {'chunked':>16}  chunked vs x@W")
    for M in args.batch:
        xs = {k: torch.randn(M, k) for k in (576, 1536)}
        lin = median_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in w_out_in], args.repeats)
        mm = median_ms(lambda xs=xs: [xs[w.shape[0]] @ w for w in w_in_out], args.repeats)
        ch = median_ms(lambda xs=xs: [chunked_matmul(xs[w.shape[1]], w) for w in w_chunked], args.repeats)
        row = [f"{t:6.1f} ms {total_bytes / t / 1e6:4.1f} GB/s" for t in (lin, mm, ch)]
        print(f"{M:>5} {row[0]:>16} {row[1]:>16} {row[2]:>16}  {mm / ch:.2f}x")


if __name__ == "__main__":
    main()

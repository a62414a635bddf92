"""Matmul over a whole model's worth of weights, per weight layout and kernel, at small and large batch.

    python benchmarks/bench_linear.py [--repeats 15] [--batch 1 4 16 64 256]

The shapes are SmolLM2-135M's (30 layers of qkv 576x960, o 576x576, gate_up 576x3072,
down 1536x576, plus the 576x49152 LM head): 538 MB of fp32, far more than the caches, so at batch 1
each figure is a memory-streaming rate; from batch 16 up the matmuls are compute-bound and the
GFLOP/s column is the one to read. Layouts, all computing x @ W:
  - F.linear    weight [out, in] (PyTorch's usual layout; MKL)
  - x @ W       weight [in, out] (MKL)
  - chunked     weight [C, in, out / C], one bmm (MKL); C = number of threads (llmserve's `blas` kernel)
  - onednn      weight [out, in] reordered once into oneDNN's blocked layout (llmserve's default)
A plain sum over the same bytes gives the machine's streaming ceiling. Medians of --repeats, the
layouts interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmserve.layers import onednn
from llmserve.layers.linear import chunked_matmul

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return interleaved_medians({"fn": fn}, repeats)["fn"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = ap.parse_args()

    torch.manual_seed(0)
    C = torch.get_num_threads()
    w_in_out = [torch.randn(k, n) for k, n in SHAPES]
    w_out_in = [w.t().contiguous() for w in w_in_out]
    w_chunked = [w.view(w.shape[0], C, -1).permute(1, 0, 2).contiguous() for w in w_in_out]
    w_packed = [onednn.pack(w) for w in w_out_in] if onednn.available() else []
    total_bytes = sum(k * n for k, n in SHAPES) * 4
    flat = torch.randn(total_bytes // 4)

    print(f"{total_bytes / 1e6:.0f} MB of fp32 weights, {C} threads, median of {args.repeats}")
    ceiling = median_ms(lambda: flat.sum(), args.repeats)
    print(f"streaming ceiling (sum): {ceiling:.1f} ms = {total_bytes / ceiling / 1e6:.1f} GB/s")
    if not w_packed:
        print("oneDNN is not available in this torch build: its column is skipped")
    flops_per_row = 2 * sum(k * n for k, n in SHAPES)
    names = ["F.linear", "x @ W", "chunked"] + (["onednn"] if w_packed else [])
    print(
        f"{'batch':>5} "
        + " ".join(f"{n:>26}" for n in names)
        + "  chunked/x@W"
        + ("  onednn/chunked" if w_packed else "")
    )
    for M in args.batch:
        xs = {k: torch.randn(M, k) for k in (576, 1536)}
        fns = {
            "F.linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in w_out_in],
            "x @ W": lambda xs=xs: [xs[w.shape[0]] @ w for w in w_in_out],
            "chunked": lambda xs=xs: [chunked_matmul(xs[w.shape[1]], w) for w in w_chunked],
        }
        if w_packed:
            fns["onednn"] = lambda xs=xs: [onednn.linear(xs[w.shape[1]], w) for w in w_packed]
        med = interleaved_medians(fns, args.repeats)
        row = [
            f"{t:7.1f} ms {total_bytes / t / 1e6:4.1f} GB/s {M * flops_per_row / t / 1e6:4.0f} GF/s"
            for t in med.values()
        ]
        ratios = f"  {med['x @ W'] / med['chunked']:10.2f}x"
        if w_packed:
            ratios += f"  {med['chunked'] / med['onednn']:14.2f}x"
        print(f"{M:>5} " + " ".join(f"{r:>26}" for r in row) + ratios)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1
) -> dict[str, float]:
    """Median ms per call of each function, the functions taking turns (`inner` calls a turn) so
    that machine noise hits them alike."""
    for fn in fns.values():
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t) / inner)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


if __name__ == "__main__":
    main()

"""Batch-1 matvec on a Q6_K tensor: held in its own 6-bit blocks (q6) against today's requantized q8.

    python benchmarks/bench_q6.py [--repeats 21] [--batch 1]

Two shapes of a 1B Llama (hidden 2048, intermediate 8192, vocabulary 49152), the tensors that
llama-quantize stores as Q6_K: the tied LM head (49,152 x 2,048) and ffn_down (2,048 x 8,192).
Each is made of random valid Q6_K blocks, read into q6 as the loader does (gguf_quant.py) and,
for the baseline, dequantized and quantized to q8 (what the loader did before q6). The two are
called in turn so that noise hits them alike, `--inner` calls a turn; the figures are the minimum
and the median of --repeats turns (on a shared machine other processes only slow a turn down, so
the minimum is the kernel's own), as GB/s of each format's own bytes (data + scales): a
memory-streaming rate at batch 1, and the time, which q6 cuts by reading 6.56 bits a weight
instead of 8.5.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.formats import pack, quantize
from llmserve.model_executor.model_loader.gguf_quant import read_rows

sys.path.insert(0, str(Path(__file__).parent))
from bench_linear import interleaved_times

SHAPES = {"lm_head": (49152, 2048), "ffn_down": (2048, 8192)}  # (out, in)


def random_q6_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row bytes] of random Q6_K super-blocks with finite scales (|w| ~ 0.05)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    raw[:, 208:210] = (rng.uniform(0.5, 1.0, size=(len(raw), 1)) * 3e-5).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--inner", type=int, default=5, help="calls a turn")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"kernel set {cpu_kernels.kernels()}, {torch.get_num_threads()} threads, batch {args.batch}")
    for name, (n, k) in SHAPES.items():
        raw = random_q6_k(n, k)
        q6 = pack(read_rows(raw, Q.Q6_K, k))  # type: ignore[arg-type]
        q8 = pack(quantize(torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K)), "q8"))
        x = torch.randn(args.batch, k)
        calls = {f: functools.partial(cpu_kernels.linear, x, w) for f, w in (("q6", q6), ("q8", q8))}
        times = interleaved_times(calls, args.repeats, args.inner)
        best = {f: min(ts) for f, ts in times.items()}
        for fmt, w in (("q6", q6), ("q8", q8)):
            mb, med = w.nbytes() / 1e6, statistics.median(times[fmt])
            print(f"{name:9s} {n}x{k} {fmt}: {mb:7.1f} MB  min {best[fmt]:7.3f} ms {mb / best[fmt]:6.1f} GB/s"
                  f"  median {med:7.3f} ms {mb / med:6.1f} GB/s")  # fmt: skip
        print(f"{name:9s} q6 / q8 time (min): {best['q6'] / best['q8']:.3f}")


if __name__ == "__main__":
    main()

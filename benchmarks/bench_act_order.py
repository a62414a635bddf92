"""The cost of GPTQ act-order on the CPU: one q4 `QuantizedLinear` with and without its input
permutation (the same packed weight; the permuted layer gathers its input columns first),
interleaved in one run.

    python benchmarks/bench_act_order.py [--shape 2048 2048] [--batch 1 16] [--repeats 200]

The default shape is a 1B-class model's attention projection (K = N = 2048); an 8192-wide MLP's
down projection is `--shape 8192 2048`. Reports the median time of a forward and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.layers.quantization import QuantizedLinear
from llmserve.layers.quantization.formats import PermutedRows, quantize


def _median_us(layer: QuantizedLinear, x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[2048, 2048], metavar=("K_IN", "N_OUT"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    K, N = args.shape
    rows = quantize(torch.randn(N, K) * 0.02, "q4")
    plain, permuted = QuantizedLinear(K, [N], False, "q4"), QuantizedLinear(K, [N], False, "q4")
    plain.load_shard("w", rows)
    permuted.load_shard("w", PermutedRows(rows, torch.randperm(K)))
    print(f"q4 linear {K} -> {N}, {torch.get_num_threads()} threads")
    for B in args.batch:
        x = torch.randn(B, K)
        for layer in (plain, permuted):
            layer(x)  # warm up
        a, b = [], []
        for _ in range(5):  # interleaved rounds
            a.append(_median_us(plain, x, args.repeats // 5))
            b.append(_median_us(permuted, x, args.repeats // 5))
        ta, tb = statistics.median(a), statistics.median(b)
        print(f"batch {B:4d}: natural order {ta:8.1f} us, act-order {tb:8.1f} us ({tb / ta:.3f}x)")


if __name__ == "__main__":
    main()

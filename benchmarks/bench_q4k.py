"""q4k against q4 on a 1B Llama's Q4_K matrices: the same bits from fewer bytes, at what speed?

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_q4k.py [--layers 8] [--batch 1 16 128]
        [--repeats 5] [--threads 1]

The matrices a Q4_K_M 1B model (hidden 2048, 16 layers, 8 KV heads of 64, intermediate 8192)
holds as Q4_K, per layer: q|k 2560 x 2048 (where v is Q6_K), o 2048 x 2048, gate|up 16384 x 2048,
and every other layer's down 2048 x 8192; --layers of them (8: ~410M weights, far past the
caches, so batch 1 streams them from memory). Random 4-bit values and Q4_K fields (d, dmin not
powers of two); the q4 copy is what the loader made of them before (`QuantizedRows.as_q4`). Each
pass multiplies every matrix once; passes alternate q4, q4k, q4, ... so that a shared machine's
noise hits both alike; per batch size the median pass time, the kernel's own bytes per second
(batch 1) and GFLOP/s, and whether the outputs are the same bits. On one thread the time is the
process's CPU time (a time-sliced core does not inflate it); with more, wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.formats import PackedWeight, QuantizedRows, pack

SHAPES_PER_LAYER = [(2560, 2048), (2048, 2048), (16384, 2048)]  # (N, K): q|k, o, gate|up
DOWN = (2048, 8192)  # Q4_K in every other layer (Q6_K in the rest)


def random_q4k(n: int, k: int, g: torch.Generator) -> QuantizedRows:
    S, nb = k // 256, k // 32
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, S, generator=g) * 1e-3 + 1e-5).half()
    dmin = (torch.rand(n, S, generator=g) * 1e-3).half()
    sub = torch.randint(0, 64, (n, nb, 2), generator=g, dtype=torch.uint8)
    return QuantizedRows("q4k", q, d, dmin, k, sub)


def one_pass(weights: list[PackedWeight], xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [cpu_kernels.linear(xs[w.in_features], w) for w in weights]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    shapes = [s for i in range(args.layers) for s in SHAPES_PER_LAYER + ([DOWN] if i % 2 == 0 else [])]
    q4k, q4 = [], []
    for n, k in shapes:
        rows = random_q4k(n, k, g)
        q4k.append(pack(rows))
        q4.append(pack(rows.as_q4()))
    built = {"q4": q4, "q4k": q4k}
    num_bytes = {name: sum(w.nbytes() for w in ws) for name, ws in built.items()}
    num_weights = sum(n * k for n, k in shapes)
    print(f"kernel set {cpu_kernels.kernels()}, {args.threads} thread(s), {num_weights / 1e6:.0f}M weights: "
          + ", ".join(f"{name} {b / 1e6:.1f} MB" for name, b in num_bytes.items()))  # fmt: skip
    for M in args.batch:
        xs = {k: torch.randn(M, k, generator=g) for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {name: [] for name in built}
        outs: dict[str, list[torch.Tensor]] = {}
        for i in range(args.repeats + 1):
            for name, ws in built.items():
                t = clock()
                outs[name] = one_pass(ws, xs)
                if i:  # the first pass warms up
                    times[name].append(clock() - t)
        same = all(torch.equal(a, b) for a, b in zip(outs["q4"], outs["q4k"], strict=True))
        cells = []
        for name in built:
            t = statistics.median(times[name])
            cells.append(
                f"{name} {t * 1e3:7.1f} ms {num_bytes[name] / t / 1e9:5.1f} GB/s {2 * M * num_weights / t / 1e9:6.1f} GFLOP/s"
            )
        ratio = statistics.median(times["q4k"]) / statistics.median(times["q4"])
        print(f"M {M:4}: " + " | ".join(cells) + f" | q4k/q4 time {ratio:.3f}, same bits: {same}", flush=True)


if __name__ == "__main__":
    main()

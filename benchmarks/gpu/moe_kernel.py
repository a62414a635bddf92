"""Issue 29's grouped MoE kernel on a GPU: one MoE block at Mixtral-8x7B's width run three ways,
same machine, one run.

    python benchmarks/gpu/moe_kernel.py [--tokens 1 16 64 256 2048] [--out DIR] [--smoke]

1. block     a `SparseMoE` (hidden 4096, 8 experts of 14336, top-2, SiLU, bf16: 2.8 GB of expert
             weights) with random weights, on CUDA;
2. kernels   per token count T, the block's forward (router included) with its experts run by
             `triton` (layers/triton_moe.py, the CUDA default), `dense` (every expert over every
             token: the fallback it replaces) and `grouped` (the CPU's host-synced grouping, run on
             the GPU for comparison); the sync-free two also replayed from a CUDA graph, as decode
             steps run; median of 20 timed calls after 3 warm-ups, by CUDA events;
3. check     triton's output against grouped's (max abs difference; bf16 rounding is ~1e-2);
4. report    ms per call and the triton/dense speedup per T, and at T = 1 the GB/s of the two
             chosen experts' weights (the decode floor); printed and written to OUT/moe_kernel.json.

--smoke: hidden 64, 4 experts of 96, float32, T 1 and 5, on the CPU under Triton's interpreter
(set before triton is imported), eager only: checks the script; its figures say nothing of speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreted (CI)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from llmserve.layers.moe import SparseMoE

    if args.smoke:
        device, dtype, (hidden, experts, inter), tokens = "cpu", torch.float32, (64, 4, 96), [1, 5]
    elif torch.cuda.is_available():
        device, dtype, (hidden, experts, inter), tokens = (
            "cuda",
            torch.bfloat16,
            (4096, 8, 14336),
            args.tokens,
        )
    else:
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with torch.device(device):
        moe = SparseMoE(hidden, experts, 2, inter, "silu", renormalize=True)
    for p in moe.parameters():
        p.data.normal_(0, 0.02)
    moe = moe.to(dtype).eval()
    assert moe.use_kernel("triton") == "triton"
    rows: list[dict[str, Any]] = []
    for T in tokens:
        x = torch.randn(T, hidden, device=device).to(dtype)
        row: dict[str, Any] = {"tokens": T}
        outs = {}
        for kernel in ("triton", "dense", "grouped"):
            moe.kernel = kernel
            with torch.no_grad():
                outs[kernel] = moe(x)
                row[f"{kernel}_ms"] = time_ms(functools.partial(moe, x), device)
                if device == "cuda" and kernel != "grouped":
                    row[f"{kernel}_graph_ms"] = graph_ms(functools.partial(moe, x))
        row["max_abs_diff"] = (outs["triton"].float() - outs["grouped"].float()).abs().max().item()
        row["speedup_vs_dense"] = row["dense_ms"] / row["triton_ms"]
        if T == 1:  # two experts' gate_up and down weights read once
            row["expert_gb_per_s"] = 2 * 3 * hidden * inter * x.element_size() / (row["triton_ms"] * 1e6)
        rows.append(row)
        print(
            " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True,
        )
    moe.kernel = "triton"
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted: smoke)",
        "shape": {
            "hidden": hidden,
            "experts": experts,
            "intermediate": inter,
            "top_k": 2,
            "dtype": str(dtype),
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_kernel.json").write_text(json.dumps(report, indent=1))
    return 0


def time_ms(fn: Any, device: str, warmup: int = 3, iters: int = 20) -> float:
    import time

    import torch

    for _ in range(warmup):
        fn()
    if device != "cuda":
        iters = 2
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn: Any) -> float:
    """fn captured once in a CUDA graph (it must not sync), then its replays timed."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, "cuda")


if __name__ == "__main__":
    sys.exit(main())

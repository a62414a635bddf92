"""Where fp8's time goes in one linear layer on the GPU: the 1.07B Llama's four matmul shapes (GPU.md)
at 1, 16 and 256 tokens, each op replayed from a CUDA graph (20 calls per graph, median of 5
trials of 10 replays), microseconds per call:

    bf16        F.linear(x, W) with W in bfloat16 (cuBLAS)
    quant torch fp8.py's `quantize_fp8` of the activations (eight torch ops)
    quant fused triton_ops.py's `quantize_fp8_rows` (one kernel, the same bits)
    scaled_mm   torch._scaled_mm of the e4m3 activations and weights alone
    fp8 layer   quant fused + scaled_mm, what `Fp8Linear` runs on CUDA

    python benchmarks/gpu/fp8_matmul.py [--json OUT.json]     (CUDA, compute capability >= 8.9)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}
"""(in, out) of each linear layer of GPU.md's model (hidden 2048, 32 heads + 2 x 8 KV heads of 64,
intermediate 8192)."""
TOKENS = (1, 16, 256)


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Microseconds per call of `fn`: `calls` calls captured in one CUDA graph, timed by floor.py's
    `_time_graph` (median of its trials of `replays` replays)."""
    from floor import _time_graph  # benchmarks/gpu, this script's folder

    def step() -> None:
        for _ in range(calls):
            fn()

    return statistics.median(_time_graph(step, torch.device("cuda"), replays)) * 1e3 / calls


def measure(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """Each column of the table for activations x [T, K] and weight w [N, K] (bfloat16)."""
    from llmserve.layers import triton_ops
    from llmserve.layers.quantization.fp8 import FP8_INV_MAX, FP8_MAX, MIN_SCALE, fp8_matmul, quantize_fp8

    w_q, w_s = quantize_fp8(w)
    x_q, x_s = quantize_fp8(x)
    fused_q, fused_s = triton_ops.quantize_fp8_rows(x, FP8_MAX, FP8_INV_MAX, MIN_SCALE)
    assert torch.equal(fused_q.view(torch.uint8), x_q.view(torch.uint8)) and torch.equal(fused_s, x_s)

    def layer() -> torch.Tensor:
        q, s = triton_ops.quantize_fp8_rows(x, FP8_MAX, FP8_INV_MAX, MIN_SCALE)
        return fp8_matmul(q, s, w_q, w_s, "scaled_mm")

    return {
        "bf16": graph_us(lambda: F.linear(x, w)),
        "quant_torch": graph_us(lambda: quantize_fp8(x)),
        "quant_fused": graph_us(lambda: triton_ops.quantize_fp8_rows(x, FP8_MAX, FP8_INV_MAX, MIN_SCALE)),
        "scaled_mm": graph_us(lambda: fp8_matmul(x_q, x_s, w_q, w_s, "scaled_mm")),
        "fp8_layer": graph_us(layer),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("fp8_matmul: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # llmserve from this checkout
    torch.manual_seed(0)
    rows = []
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; microseconds per call (CUDA graphs)")
    print("| layer | tokens | bf16 | quant torch | quant fused | scaled_mm | fp8 layer | fp8 / bf16 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for t in TOKENS:
            row = {
                "layer": name,
                "tokens": t,
                **measure(torch.randn(t, k, device="cuda", dtype=torch.bfloat16), w),
            }
            rows.append(row)
            cells = [
                f"{row[c]:.1f}" for c in ("bf16", "quant_torch", "quant_fused", "scaled_mm", "fp8_layer")
            ]
            print(f"| {name} | {t} | " + " | ".join(cells) + f" | {row['fp8_layer'] / row['bf16']:.2f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fused CPU norm kernels (layers/cpu_fused.py) next to torch's ops, alone and in a whole step.

    python benchmarks/bench_fused.py [--repeats 15]

1. Per call, hidden size 576 (SmolLM2's), rows M: torch's residual add + `F.rms_norm` against the
   fused `add_rms_norm`, interleaved, medians in µs.
2. A whole forward of the embedded model (`ForwardRunner.execute`), with the fused kernels and with
   torch's ops (the layers' fallback path, switched in the same process): decode steps at batch
   1, 16 and 64 (contexts 128-256) and a 512-token prefill, interleaved, medians in ms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve.config import ModelConfig
from llmserve.layers import cpu_fused, layernorm
from llmserve.model_executor.cpu_memory import keep_freed_memory
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import BLOCK, make_batch
from bench_linear import interleaved_medians


def bench_calls(repeats: int) -> None:
    keep_freed_memory()  # as in the engine: measure the kernels, not page faults on fresh buffers
    print("residual add + RMSNorm, hidden 576: µs per call")
    print(f"{'rows':>6} {'torch':>10} {'fused':>10} {'speedup':>8}")
    w = torch.randn(576)
    with torch.inference_mode():
        for M in (1, 16, 64, 512, 1024):
            x, r = torch.randn(M, 576), torch.randn(M, 576)
            med = interleaved_medians(
                {
                    "torch": lambda x=x, r=r: F.rms_norm(x + r, (576,), w, 1e-5),
                    "fused": lambda x=x, r=r: cpu_fused.add_rms_norm(x, r.clone(), w, 1e-5),
                },
                repeats,
                inner=50,
            )
            t, f = med["torch"] * 1e3, med["fused"] * 1e3  # ms -> µs
            print(f"{M:>6} {t:>10.1f} {f:>10.1f} {t / f:>7.2f}x")
    print("(the fused figure includes a clone of the residual, which it writes in place)")


def bench_model(repeats: int) -> None:
    model = load_model(ModelConfig(quantization="none", show_progress=False)).model
    kernels = layernorm.cpu_fused

    def step(fused: bool, runner: ForwardRunner, batch: list[SequenceBatchEntry]) -> None:
        layernorm.cpu_fused = kernels if fused else None
        runner.execute(batch)

    cases: list[tuple[str, ForwardRunner, list[SequenceBatchEntry]]] = []
    for B in (1, 16, 64):
        seq_lens, tables, num_blocks = make_batch(B, 0, 128, 256)
        runner = ForwardRunner(model, num_blocks=num_blocks, block_size=BLOCK)
        cases.append(
            (
                f"decode, batch {B}",
                runner,
                [SequenceBatchEntry([7], n, t) for n, t in zip(seq_lens, tables, strict=True)],
            )
        )
    T = 512
    runner = ForwardRunner(model, num_blocks=T // BLOCK + 1, block_size=BLOCK)
    cases.append(
        (
            f"prefill, {T} tokens",
            runner,
            [SequenceBatchEntry(list(range(5, 5 + T)), T, list(range(T // BLOCK)))],
        )
    )
    print(f"\nwhole forward of the embedded model: ms, median of {repeats}")
    print(f"{'case':<20} {'torch ops':>10} {'fused':>10} {'speedup':>8}")
    for name, runner, batch in cases:
        med = interleaved_medians(
            {
                "torch": lambda r=runner, b=batch: step(False, r, b),
                "fused": lambda r=runner, b=batch: step(True, r, b),
            },
            repeats,
        )
        t, f = med["torch"], med["fused"]
        print(f"{name:<20} {t:>10.1f} {f:>10.1f} {t / f:>7.2f}x")
    layernorm.cpu_fused = kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    bench_calls(args.repeats)
    bench_model(args.repeats)


if __name__ == "__main__":
    main()

"""glibc's allocator with and without `keep_freed_memory` (model_executor/cpu_memory.py): whole
forwards of the embedded model, each setting in its own process, the processes alternating.

    python benchmarks/bench_malloc.py [--rounds 2] [--repeats 10]

Cases: decode steps at batch 1, 16 and 64 (contexts 128-256) and prefills of 256 and 1024 tokens;
medians in ms per round, then the median over rounds. The setting is process-wide and cannot be
undone, hence one process per measurement (LLMSERVE_KEEP_FREED_MEMORY=0 gives glibc's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(repeats: int) -> dict[str, float]:
    """In this process: median ms of each case."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_attention import BLOCK, make_batch
    from llmserve.config import ModelConfig
    from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
    from llmserve.model_executor.model_loader import load_model

    model = load_model(ModelConfig(quantization="none", show_progress=False)).model
    cases = {}
    for B in (1, 16, 64):
        seq_lens, tables, num_blocks = make_batch(B, 0, 128, 256)
        runner = ForwardRunner(model, num_blocks=num_blocks, block_size=BLOCK)
        batch = [SequenceBatchEntry([7], n, t) for n, t in zip(seq_lens, tables, strict=True)]
        cases[f"decode, batch {B}"] = (runner, batch)
    for T in (256, 1024):
        runner = ForwardRunner(model, num_blocks=T // BLOCK + 1, block_size=BLOCK)
        cases[f"prefill, {T} tokens"] = (
            runner,
            [SequenceBatchEntry(list(range(5, 5 + T)), T, list(range(T // BLOCK)))],
        )
    out = {}
    for name, (runner, batch) in cases.items():
        runner.execute(batch)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            runner.execute(batch)
            times.append((time.perf_counter() - t) * 1e3)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    runs: dict[str, list[dict[str, float]]] = {"glibc defaults": [], "keep freed memory": []}
    for _ in range(args.rounds):
        for name, flag in (("glibc defaults", "0"), ("keep freed memory", "1")):
            env = dict(os.environ, LLMSERVE_KEEP_FREED_MEMORY=flag)
            cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(
        f"whole forwards of the embedded model, ms: median over {args.rounds} rounds of medians of {args.repeats}"
    )
    print(f"{'case':<20} {'glibc defaults':>15} {'keep freed':>12} {'speedup':>8}")
    for case in runs["glibc defaults"][0]:
        base = statistics.median(r[case] for r in runs["glibc defaults"])
        kept = statistics.median(r[case] for r in runs["keep freed memory"])
        print(f"{case:<20} {base:>15.1f} {kept:>12.1f} {base / kept:>7.2f}x")


if __name__ == "__main__":
    main()

"""One forward step of a GGUF file through the fused CPU decoder: prints one JSON line.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 PYTHONPATH=<tree>/src \\
        python benchmarks/bench_step_gguf.py FILE [--repeats 4] [--threads 1]

`ForwardRunner.execute` (the decoder's layers, the final norm and the LM head on each sequence's
last token; no sampling, no scheduler: bench_batch1_overhead.py times those beside it) on three
batches: a decode step of 1 and of 16 sequences (contexts 128-256, shuffled block tables) and a
128-token prefill (its LM head: one row, where decode_16 has 16). The KV cache holds what the
server's `--kv-cache-dtype` (default auto: float16 under these quantized weights) makes it hold.
Reports the minimum and median ms of --repeats steps after one warm-up, and the
weight bytes a decode step streams (`step_bytes`: every packed matrix once, the LM head's included,
and the float parameters) next to the file's tensor bytes: a format wider than the file's (Q6_K
held as q8, Q4_K's half scales) lowers the ceiling of decode / streaming floor before any kernel
runs (docs/benchmarks.md, issue 30). --bytes-only stops after the accounting. On one
thread the time is the main thread's CPU time, which a shared, time-sliced core does not inflate
(the kernels run on the calling thread); with more threads, wall time. Two builds are compared as
bench_decode_gguf.py does: alternating processes with PYTHONPATH at each tree's `src`.
--huge-pages-ab loads the file twice, one copy's runner with LLMSERVE_HUGE_PAGES=0 (weights in
4 KiB pages) and one with it on (cpu_memory.back_with_huge_pages), and alternates their steps in
the one process (two processes differ by more than that on a shared machine); it reports both
and whether their outputs are the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGUFReader

from llmserve.config import ModelConfig
from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.layers import packed_weights
from llmserve.model_executor.cpu_memory import keep_freed_memory
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import BLOCK, make_batch


def step_bytes(model: torch.nn.Module, file: str) -> dict[str, object]:
    """Weight bytes one decode step reads, by kernel format, against the GGUF's tensor bytes: every
    quantized linear layer's packed matrix and the LM head's (a tied head is the embedding's table,
    counted once; an untied embedding's table is not counted: a step reads only its tokens' rows),
    and the float parameters (norms)."""
    by_fmt: dict[str, int] = {}
    for w in packed_weights(model):
        by_fmt[w.fmt] = by_fmt.get(w.fmt, 0) + w.nbytes()
    by_fmt["float"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_floating_point())
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(file).tensors)
    total = sum(by_fmt.values())
    return {
        "step_bytes": total,
        "by_format": by_fmt,
        "file_tensor_bytes": file_bytes,
        "ratio": round(total / file_bytes, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bytes-only", action="store_true", help="print the byte accounting and stop")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the cache's K/V type, as the server's option (auto: float16 here)",
    )
    ap.add_argument("--huge-pages-ab", action="store_true", help="weights in 4 KiB pages against huge pages")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    loaded = load_model(ModelConfig(model=args.file, show_progress=False))
    model, kv_dtype = loaded.model, loaded.kv_cache_dtype(args.kv_cache_dtype)
    result: dict[str, object] = {"extension": cpu_kernels._ext.__file__ if cpu_kernels._ext else None}
    result["kv_cache_dtype"] = kv_dtype.name
    result["bytes"] = step_bytes(model, args.file)
    if args.bytes_only:
        print(json.dumps(result))
        return
    seq_lens, tables, num_blocks = make_batch(16, 0, 128, 256)
    T = 128
    # one runner, or (--huge-pages-ab) a second copy of the model whose runner leaves 4 KiB pages
    variants = {"": model}
    if args.huge_pages_ab:
        variants = {"huge_pages_off": load_model(ModelConfig(model=args.file, show_progress=False)).model}
        variants["huge_pages_on"] = model
    runners = {}
    for label, m in variants.items():
        if label:  # else the environment's own setting
            os.environ["LLMSERVE_HUGE_PAGES"] = "0" if label == "huge_pages_off" else "1"
        runners[label] = ForwardRunner(
            m, num_blocks=max(num_blocks, T // BLOCK + 1), block_size=BLOCK, kv_cache_dtype=kv_dtype
        )
        if runners[label].fused is None:
            raise SystemExit(
                f"the fused decoder does not take this model: {runners[label].fused_unsupported}"
            )
    decode = [
        SequenceBatchEntry([7 + i], n, t) for i, (n, t) in enumerate(zip(seq_lens, tables, strict=True))
    ]
    prefill = [SequenceBatchEntry(list(range(5, 5 + T)), T, list(range(T // BLOCK)))]
    with torch.inference_mode():
        for name, batch in (("decode_1", decode[:1]), ("decode_16", decode), (f"prefill_{T}", prefill)):
            times: dict[str, list[float]] = {label: [] for label in runners}
            outs = {}
            for i in range(args.repeats + 1):
                for label, runner in runners.items():  # alternating, step by step
                    t = clock()
                    outs[label] = runner.execute(batch)
                    if i:  # the first is a warm-up
                        times[label].append((clock() - t) * 1e3)
            for label, ts in times.items():
                cell = {"min_ms": round(min(ts), 1), "median_ms": round(statistics.median(ts), 1)}
                if label:
                    result.setdefault(label, {})[name] = cell  # type: ignore[index]
                else:
                    result[name] = cell
            if len(outs) > 1:
                result[f"{name}_same_bits"] = torch.equal(*outs.values())
    print(json.dumps(result))


if __name__ == "__main__":
    main()

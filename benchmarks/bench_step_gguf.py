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
--bare-matmuls adds, alternating with the step, the step's matrices alone: every packed matrix
the model multiplies by, called straight through the extension on rows of random activations (a
row a token; the LM head a row a sequence): the step's time over theirs is what surrounds the
matmuls (attention, norms, serial work, barriers).
--busy F runs a process beside the steps that keeps one core busy a fraction F of each 8 ms (as the
server's own Python takes the cores between and during steps): a matmul whose threads split
the work statically waits for the one the host slowed.
--builds BASE.so NEW.so [...] does the same for builds of the C++ kernels (each a copy of
src/llmserve/_cpu_kernels*.so, as bench_kernel_ab.py takes them): one runner per build over the
one loaded model, its fused decoder made and run by that build, steps alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from llmserve.config import ModelConfig
from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.layers import QuantizedLMHead, packed_weights
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


class BareMatmuls:
    """The step's matrices alone (--bare-matmuls): `execute(batch)` calls the extension's gemm on
    every packed matrix the model multiplies by, a row of random activations a token (the LM head a
    row a sequence), as the fused decoder calls them but without what lies between."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights = packed_weights(model)
        heads = [m.packed_weight for m in model.modules() if isinstance(m, QuantizedLMHead)]
        self.head = heads[0] if heads else None
        g = torch.Generator().manual_seed(0)
        width = max(w.in_features for w in self.weights)
        self.x = torch.randn(256, width, generator=g)
        self.out = torch.empty(256 * max(w.out_features for w in self.weights))

    def execute(self, batch: list[SequenceBatchEntry]) -> torch.Tensor:
        ext = cpu_kernels._ext
        tokens = sum(len(e.new_token_ids) for e in batch)
        if tokens > self.x.shape[0]:
            raise ValueError(f"--bare-matmuls holds 256 rows of activations, not {tokens}")
        for w in self.weights:
            rows, m = (len(batch) if w is self.head else tokens), 0 if w.m is None else w.m.data_ptr()
            ext.gemm(w.code, self.x.data_ptr(), self.x.shape[1], rows, w.in_features, w.out_features,  # type: ignore[union-attr]
                     w.data.data_ptr(), w.d.data_ptr(), m, 0, self.out.data_ptr(), w.out_features, 16)  # fmt: skip
        return self.out


BUSY_LOOP = """
import sys, time
busy = float(sys.argv[1]) * 0.008
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(0.008 - busy)
"""


def start_busy(fraction: float) -> subprocess.Popen[bytes] | None:
    """--busy: a process that spins `fraction` of every 8 ms on one core (None for 0)."""
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(fraction)]) if fraction else None


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
    ap.add_argument("--bare-matmuls", action="store_true", help="also time the step's matrices alone")
    ap.add_argument(
        "--busy", type=float, default=0.0, help="a fraction of one core kept busy beside the steps"
    )
    ap.add_argument(
        "--builds", nargs="+", default=[], help="extension .so builds to alternate (the first the baseline)"
    )
    args = ap.parse_args()
    if not 0 <= args.busy < 1:
        ap.error(f"--busy is a fraction of a core in [0, 1), not {args.busy}")
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
    exts = {}  # label -> the build that makes and runs that runner's decoder (--builds)
    if args.builds:
        from bench_kernel_ab import load_build

        exts = {path: load_build(path) for path in args.builds}
        variants = dict.fromkeys(args.builds, model)
    if args.huge_pages_ab:
        variants = {"huge_pages_off": load_model(ModelConfig(model=args.file, show_progress=False)).model}
        variants["huge_pages_on"] = model
    runners = {}
    for label, m in variants.items():
        if label in exts:
            cpu_kernels._ext = exts[label]
        elif label:  # else the environment's own setting
            os.environ["LLMSERVE_HUGE_PAGES"] = "0" if label == "huge_pages_off" else "1"
        runners[label] = ForwardRunner(
            m, num_blocks=max(num_blocks, T // BLOCK + 1), block_size=BLOCK, kv_cache_dtype=kv_dtype
        )
        if runners[label].fused is None:
            raise SystemExit(
                f"the fused decoder does not take this model: {runners[label].fused_unsupported}"
            )
    if args.bare_matmuls:
        runners["bare_matmuls"] = BareMatmuls(model)  # type: ignore[assignment]
    decode = [
        SequenceBatchEntry([7 + i], n, t) for i, (n, t) in enumerate(zip(seq_lens, tables, strict=True))
    ]
    prefill = [SequenceBatchEntry(list(range(5, 5 + T)), T, list(range(T // BLOCK)))]
    busy = start_busy(args.busy)
    if busy:
        result["busy"] = args.busy
    try:
        run_batches(args, runners, exts, decode, prefill, T, clock, result)
    finally:
        if busy:
            busy.kill()
    print(json.dumps(result))


def run_batches(
    args: argparse.Namespace,
    runners: dict[str, Any],
    exts: dict[str, Any],
    decode: list[SequenceBatchEntry],
    prefill: list[SequenceBatchEntry],
    T: int,
    clock: Callable[[], float],
    result: dict[str, object],
) -> None:
    """Each batch's steps (decode of 1, 4 and 16 sequences, a T-token prefill), the runners
    alternating step by step, into `result`."""
    with torch.inference_mode():
        batches = (
            ("decode_1", decode[:1]),
            ("decode_4", decode[:4]),
            ("decode_16", decode),
            (f"prefill_{T}", prefill),
        )
        for name, batch in batches:
            times: dict[str, list[float]] = {label: [] for label in runners}
            outs = {}
            for i in range(args.repeats + 1):
                for label, runner in runners.items():  # alternating, step by step
                    if label in exts:
                        cpu_kernels._ext = exts[label]
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
            steps = [o for label, o in outs.items() if label != "bare_matmuls"]
            if len(steps) > 1:
                result[f"{name}_same_bits"] = all(torch.equal(steps[0], o) for o in steps)


if __name__ == "__main__":
    main()

"""Two or more builds of llmserve's C++ kernels on the same matrices, in one process, in turn.

    PYTHONPATH=src python benchmarks/bench_kernel_ab.py BASE.so NEW.so [...] [--threads 2]
        [--batch 1] [--layers 8] [--format q4] [--rounds 15]

Each .so is a copy of `src/llmserve/_cpu_kernels*.so` from one build (`python setup.py build_ext
--inplace`, then copy it away). All are loaded side by side and called in turn, pass by pass, on
the same weights in transparent huge pages (as the server holds them) and the same activations:
a machine whose memory bandwidth drifts by minutes hits every build alike, which two processes
one after the other do not get. Weights: --layers layers of a 1B Llama's q4/q4k matrices
(bench_q4k.py's shapes), or for q8 the same shapes quantized from random floats, or for q6 the
LM head and 16 ffn_down matrices of random Q6_K blocks (bench_q6.py's). Prints whether every
build gives the first one's bits, then each build's median and minimum pass time and GB/s of the
formats' own bytes. The figures of docs/benchmarks.md's "One weight stream a thread" came from it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from llmserve.layers.quantization.formats import PackedWeight, pack, quantize
from llmserve.model_executor.cpu_memory import back_with_huge_pages

sys.path.insert(0, str(Path(__file__).parent))
from bench_q4k import DOWN, SHAPES_PER_LAYER, random_q4k


def load_build(path: str) -> object:
    """One build's extension module, loaded from its file under the extension's own name."""
    spec = importlib.util.spec_from_file_location("_cpu_kernels", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"not an extension module: {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(fmt: str, layers: int) -> list[PackedWeight]:
    g = torch.Generator().manual_seed(0)
    if fmt == "q6":
        from gguf import GGMLQuantizationType as Q

        from bench_q6 import random_q6_k
        from llmserve.model_executor.model_loader.gguf_quant import read_rows

        shapes = [(49152, 2048)] + [(2048, 8192)] * 16
        return [pack(read_rows(random_q6_k(n, k, i), Q.Q6_K, k)) for i, (n, k) in enumerate(shapes)]  # type: ignore[arg-type]
    shapes = [s for i in range(layers) for s in SHAPES_PER_LAYER + ([DOWN] if i % 2 == 0 else [])]
    if fmt == "q8":
        return [pack(quantize(torch.randn(n, k, generator=g) * 0.02, "q8")) for n, k in shapes]
    rows = [random_q4k(n, k, g) for n, k in shapes]
    return [pack(r if fmt == "q4k" else r.as_q4()) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="extension .so files, the first the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--format", choices=["q4", "q4k", "q8", "q6"], default="q4")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    exts = [load_build(p) for p in args.builds]
    ws = weights(args.format, args.layers)
    huge = back_with_huge_pages(t for w in ws for t in w.tensors())
    nbytes = sum(w.nbytes() for w in ws)
    xs = {k: torch.randn(args.batch, k) for k in {w.in_features for w in ws}}
    outs = [torch.empty(args.batch, w.out_features) for w in ws]

    def run(ext: object) -> list[torch.Tensor]:
        for w, o in zip(ws, outs, strict=True):
            x, m = xs[w.in_features], 0 if w.m is None else w.m.data_ptr()
            ext.gemm(w.code, x.data_ptr(), w.in_features, args.batch, w.in_features, w.out_features,  # type: ignore[attr-defined]
                     w.data.data_ptr(), w.d.data_ptr(), m, 0, o.data_ptr(), w.out_features, 16)  # fmt: skip
        return [o.clone() for o in outs]

    first = run(exts[0])
    for path, ext in zip(args.builds[1:], exts[1:], strict=True):
        same = all(torch.equal(a, b) for a, b in zip(first, run(ext), strict=True))
        print(f"{path}: the same bits as {args.builds[0]}: {same}")
    times: list[list[float]] = [[] for _ in exts]
    for _ in range(args.rounds):
        for i, ext in enumerate(exts):
            start = time.perf_counter()
            run(ext)
            times[i].append(time.perf_counter() - start)
    print(f"{args.format}, batch {args.batch}, {args.threads} thread(s), {nbytes / 1e6:.0f} MB, "
          f"{huge / 2**20:.0f} MiB in huge pages, {args.rounds} rounds")  # fmt: skip
    base = statistics.median(times[0])
    for path, ts in zip(args.builds, times, strict=True):
        med = statistics.median(ts)
        print(f"  {path}: median {med * 1e3:.2f} ms ({nbytes / med / 1e9:.1f} GB/s, {med / base:.3f}x the first), "
              f"min {min(ts) * 1e3:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

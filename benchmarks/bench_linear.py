"""Matmul over a whole model's worth of weights, per kernel and weight format, at small and large batch.

    python benchmarks/bench_linear.py [--repeats 9] [--batch 1 4 16 64 256] [--only q8 q4 onednn ...]

The shapes are SmolLM2-135M's (30 layers of qkv 576x960, o 576x576, gate_up 576x3072,
down 1536x576, plus the 576x49152 LM head): 135M weights, far more than the caches, so at batch 1
each figure is a memory-streaming rate (GB/s of the kernel's own weight bytes); from batch 16 up
the matmuls are compute-bound and GOP/s is the figure to read. Every column computes y = x @ W.T
for float32 x (or the kernel's activation type, converted outside the timed region):

  float weights
    F.linear       fp32 [out, in] (PyTorch's usual layout; MKL)
    chunked        fp32 [C, in, out / C], one bmm (MKL); llmserve's `--cpu-gemm blas`
    onednn         fp32 reordered into oneDNN's blocked layout; llmserve's float default
    onednn-bf16    the same in bfloat16 (activations bf16), where oneDNN supports it
  torch's quantized kernels (candidates the issue named)
    int8pack-bf16  torch._weight_int8pack_mm: int8 per-channel weights, bf16 activations
    int4pack-bf16  torch._weight_int4pack_mm_for_cpu: int4 groups of 32, bf16 activations
    fbgemm-dyn     torch.ops.quantized.linear_dynamic: int8 per-channel, activations quantized
                   per tensor inside the op
    onednn-qlinear torch.ops.onednn.qlinear_pointwise: int8 per-channel weights, u8 activations
                   (quantized per tensor with torch ops, inside the timed region)
    int_mm         torch._int_mm: int8 x int8 -> int32 with per-token activation and per-channel
                   weight scales applied with torch ops
  llmserve's kernels (csrc/qgemm_*.cpp; int16 activations per token, blocks of 32)
    q8, q4         on the best kernel set of this CPU;  q8-avx2, q4-avx2: forced to AVX2
    q4-i8          q4 with int8 activations per block of 32 (--cpu-activations int8; AVX-512 VNNI)

A plain sum over the fp32 bytes gives the machine's streaming ceiling. Medians of --repeats, the
columns interleaved so noise hits them alike. Writes benchmarks/results/bench_linear.json.

    python benchmarks/bench_linear.py --gflops [--batch 16 128] [--threads 1 2] [--baseline OLD.so]

instead times llmserve's kernels alone on a 1B Llama's matrices (K x N: 2048 x 2048, 2048 x 8192,
8192 x 2048), one matrix at a time (they fit the L2/L3: the compute-bound case of prefill and
batches), as GFLOP/s (2 M N K / time) at each OpenMP thread count: q8, q4 (stored minimums,
GGUF Q4_K's), q4-sym (Q4_0's), all with int16 activations, and q4-i8 (int8 activations). The
minimum of --repeats short runs, since other processes' noise only slows a run down; on one
thread the time is the process's CPU time, which a time-sliced (shared) core does not inflate.
--baseline
loads another build of the extension (a copy of an earlier `_cpu_kernels*.so`) beside this one,
alternates the two call for call and checks that their outputs are the same bits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.layers import onednn
from llmserve.layers.linear import chunked_matmul
from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.formats import pack, quantize

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (in, out)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1
) -> dict[str, float]:
    """Median ms per call of each function, the functions taking turns (`inner` calls a turn) so
    that machine noise hits them alike."""
    times = interleaved_times(fns, repeats, inner)
    return {name: statistics.median(ts) for name, ts in times.items()}


def interleaved_times(
    fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1
) -> dict[str, list[float]]:
    """Each turn's ms per call of each function (`interleaved_medians`, every turn kept)."""
    for fn in fns.values():
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t) / inner * 1e3)
    return times


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return interleaved_medians({"fn": fn}, repeats)["fn"]


# -- candidates: prepare(weights [out, in] fp32) -> (state, bytes); run(state, xs) for xs[in] --------


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def prep_int4pack(w: torch.Tensor) -> tuple[Any, int]:
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    # torch's int4 formula: w = (q - 8) * scale + zero, so zero = min + 8 * scale
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).contiguous().bfloat16()
    return (packed, sz), _nbytes(packed, sz)


def prep_fbgemm(w: torch.Tensor) -> tuple[Any, int]:
    q, scale = _per_channel_int8(w)
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13, still shipped
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            q, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0
        )
    return torch.ops.quantized.linear_prepack(qw, None), _nbytes(q, scale)


def prep_qlinear(w: torch.Tensor) -> tuple[Any, int]:
    q, scale = _per_channel_int8(w)
    return (
        torch.ops.onednn.qlinear_prepack(q, None),
        scale,
        torch.zeros(w.shape[0], dtype=torch.long),
    ), _nbytes(q, scale)


def run_qlinear(state: Any, x: torch.Tensor) -> torch.Tensor:
    packed, w_scale, w_zp = state
    x_scale = float(x.abs().max()) / 127 or 1.0
    qx = (torch.round(x / x_scale) + 128).clamp(0, 255).to(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(
        qx, x_scale, 128, packed, w_scale, w_zp, None, 1.0, 0, torch.float32, "none", [], ""
    )


def prep_int_mm(w: torch.Tensor) -> tuple[Any, int]:
    q, scale = _per_channel_int8(w)
    return (q.t().contiguous(), scale), _nbytes(q, scale)


def run_int_mm(state: Any, x: torch.Tensor) -> torch.Tensor:
    qt, w_scale = state
    x_scale = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
    qx = torch.round(x / x_scale).to(torch.int8)
    if qx.shape[0] <= 16:  # _int_mm wants more than 16 rows
        qx = torch.cat([qx, qx.new_zeros(17 - qx.shape[0], qx.shape[1])])
    return torch._int_mm(qx, qt)[: x.shape[0]] * x_scale * w_scale


def prep_ours(fmt: str) -> Callable[[torch.Tensor], tuple[Any, int]]:
    def prep(w: torch.Tensor) -> tuple[Any, int]:
        p = pack(quantize(w, fmt))  # type: ignore[arg-type]
        return p, p.nbytes()

    return prep


CANDIDATES: dict[
    str, tuple[Callable[[torch.Tensor], tuple[Any, int]], Callable[[Any, torch.Tensor], Any], str | None]
] = {
    # name: (prepare, run, what the activations are: None = float32, "bf16")
    "F.linear": (lambda w: (w, _nbytes(w)), lambda w, x: F.linear(x, w), None),
    "chunked": (
        lambda w: (
            w.t().contiguous().view(w.shape[1], torch.get_num_threads(), -1).permute(1, 0, 2).contiguous(),
            _nbytes(w),
        ),
        lambda w, x: chunked_matmul(x, w),
        None,
    ),
    "onednn": (lambda w: (onednn.pack(w), _nbytes(w)), lambda p, x: onednn.linear(x, p), None),
    "onednn-bf16": (
        lambda w: (onednn.pack(w.bfloat16()), _nbytes(w) // 2),
        lambda p, x: onednn.linear(x, p),
        "bf16",
    ),
    "int8pack-bf16": (
        lambda w: (lambda q, s: ((q, s.bfloat16()), _nbytes(q, s)))(*_per_channel_int8(w)),
        lambda st, x: torch._weight_int8pack_mm(x, st[0], st[1]),
        "bf16",
    ),
    "int4pack-bf16": (
        prep_int4pack,
        lambda st, x: torch._weight_int4pack_mm_for_cpu(x, st[0], 32, st[1]),
        "bf16",
    ),
    "fbgemm-dyn": (prep_fbgemm, lambda p, x: torch.ops.quantized.linear_dynamic(x, p, True), None),
    "onednn-qlinear": (prep_qlinear, run_qlinear, None),
    "int_mm": (prep_int_mm, run_int_mm, None),
    "q8": (prep_ours("q8"), lambda p, x: cpu_kernels.linear(x, p), None),
    "q4": (prep_ours("q4"), lambda p, x: cpu_kernels.linear(x, p), None),
    "q4-i8": (prep_ours("q4"), lambda p, x: cpu_kernels.linear(x, p, act_bits=8), None),
}


GEMM_SHAPES_1B = [(2048, 2048), (2048, 8192), (8192, 2048)]  # (K, N): attention, gate/up, down


def _load_extension(path: Path) -> Any:
    """Another build of llmserve._cpu_kernels, loaded beside the package's own."""
    spec = importlib.util.spec_from_file_location("_cpu_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _best_times(
    builds: dict[str, Any],
    p: Any,
    x: torch.Tensor,
    N: int,
    act_bits: int,
    repeats: int,
    clock: Callable[[], float],
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The fastest of `repeats` calls of each build's gemm (taking turns), and each build's output."""
    M, K = x.shape
    outs = {b: torch.empty(M, N) for b in builds}
    best = {b: float("inf") for b in builds}
    for _ in range(repeats):
        for b, ext in builds.items():
            t = clock()
            ext.gemm(p.code, x.data_ptr(), K, M, K, N, p.data.data_ptr(), p.d.data_ptr(),
                     cpu_kernels._addr(p.m), 0, outs[b].data_ptr(), N, act_bits)  # fmt: skip
            best[b] = min(best[b], clock() - t)
    return best, outs


def gflops_table(batches: list[int], threads: list[int], repeats: int, baseline: Path | None) -> None:
    """GFLOP/s of llmserve's kernels on the 1B shapes (see the module docstring's --gflops)."""
    ext = cpu_kernels._ext
    if ext is None:
        raise SystemExit("llmserve's C++ kernels are not built")
    builds = {"new": ext} | ({"old": _load_extension(baseline)} if baseline else {})
    torch.manual_seed(0)
    print(f"kernel set {ext.isa()}; min of {repeats}; GFLOP/s" + (f"; old = {baseline}" if baseline else ""))
    for K, N in GEMM_SHAPES_1B:
        w = torch.randn(N, K)
        packed = {"q8": pack(quantize(w, "q8")), "q4": pack(quantize(w, "q4"))}
        rows = quantize(w, "q4")
        rows.m = None  # symmetric blocks (GGUF Q4_0): m = -8 d
        packed["q4-sym"] = pack(rows)
        for M in batches:
            x = torch.randn(M, K)
            for nt in threads:
                torch.set_num_threads(nt)
                clock = time.process_time if nt == 1 else time.perf_counter
                line = []
                for name, act_bits in [("q8", 16), ("q4", 16), ("q4-sym", 16), ("q4", 8)]:
                    best, outs = _best_times(builds, packed[name], x, N, act_bits, repeats, clock)
                    cell = f"{name if act_bits == 16 else 'q4-i8'} {2 * M * N * K / best['new'] / 1e9:6.1f}"
                    if "old" in builds:
                        same = "" if torch.equal(outs["new"], outs["old"]) else " DIFFERENT BITS"
                        cell += f" (old {2 * M * N * K / best['old'] / 1e9:6.1f}{same})"
                    line.append(cell)
                print(f"K {K:5} N {N:5} M {M:4} threads {nt}: " + "  ".join(line), flush=True)
    torch.set_num_threads(max(threads))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help=f"columns to run (default all): {' '.join(CANDIDATES)}, q8-avx2, q4-avx2",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_linear.json"))
    ap.add_argument("--gflops", action="store_true", help="llmserve's kernels alone on the 1B shapes")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="with --gflops")
    ap.add_argument("--baseline", type=Path, default=None, help="with --gflops: an earlier build's .so")
    args = ap.parse_args()
    if args.gflops:
        gflops_table(args.batch, args.threads, args.repeats, args.baseline)
        return

    torch.manual_seed(0)
    weights = [torch.randn(n, k) for k, n in SHAPES]
    num_weights = sum(k * n for k, n in SHAPES)
    names = list(CANDIDATES)
    if cpu_kernels.best_kernels() == "avx512_vnni":
        names += ["q8-avx2", "q4-avx2"]
    if not cpu_kernels.has_native_kernels():
        names = [n for n in names if not n.startswith(("q8", "q4"))]
        print("llmserve's C++ kernels are not built: their columns are skipped")
    if not onednn.available(torch.bfloat16):
        names.remove("onednn-bf16")
    if args.only:
        names = [n for n in names if n in args.only]

    prepared: dict[str, tuple[list[Any], int]] = {}
    for name in names:
        prep = CANDIDATES[name.removesuffix("-avx2")][0]
        try:
            states = [prep(w) for w in weights]
        except (RuntimeError, NotImplementedError) as e:  # a kernel this torch build lacks
            print(f"{name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            continue
        prepared[name] = ([s for s, _ in states], sum(b for _, b in states))
    flat = torch.randn(num_weights)
    ceiling = median_ms(lambda: flat.sum(), args.repeats)
    print(f"{num_weights / 1e6:.0f}M weights, {torch.get_num_threads()} threads, median of {args.repeats}; "
          f"streaming ceiling (sum over fp32): {4 * num_weights / ceiling / 1e6:.1f} GB/s; "
          f"llmserve kernel set: {cpu_kernels.kernels()}")  # fmt: skip
    print("weight bytes: " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, (_, b) in prepared.items()))

    results: dict[str, dict[str, dict[str, float]]] = {}
    for M in args.batch:
        xs = {k: torch.randn(M, k) for k in (576, 1536)}
        xs_bf16 = {k: x.bfloat16() for k, x in xs.items()}
        fns = {}
        for name, (states, _) in prepared.items():
            base = name.removesuffix("-avx2")
            run, act = CANDIDATES[base][1], CANDIDATES[base][2]
            inputs = xs_bf16 if act == "bf16" else xs
            kernel_set = "avx2" if name.endswith("-avx2") else "auto"

            def fn(
                states=states, run=run, inputs=inputs, kernel_set=kernel_set, ours=base in ("q8", "q4")
            ) -> None:
                if ours:
                    cpu_kernels.set_kernels(kernel_set)
                for s, (k, _) in zip(states, SHAPES, strict=True):
                    run(s, inputs[k])

            fns[name] = fn
        med = interleaved_medians(fns, args.repeats)
        cpu_kernels.set_kernels("auto")
        results[str(M)] = {
            name: {"ms": t, "gb_s": prepared[name][1] / t / 1e6, "gop_s": 2 * M * num_weights / t / 1e6}
            for name, t in med.items()
        }
        print(f"batch {M}:")
        for name, r in results[str(M)].items():
            print(f"  {name:<15} {r['ms']:8.2f} ms {r['gb_s']:6.1f} GB/s {r['gop_s']:6.0f} GOP/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"ceiling_gb_s": 4 * num_weights / ceiling / 1e6, "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()

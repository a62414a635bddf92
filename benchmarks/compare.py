"""Side by side: llmserve against transformers and llama.cpp's llama-server, same workload, and for
the two servers the same GGUF file.

    python benchmarks/compare.py [--peers llmserve transformers llama-server] [--concurrency 1 4 16 32]
        [--weights q4_1 q8_0 f32] [--input-len 128] [--output-len 128] [--requests-per-level N]
        [--llama-server PATH] [--llmserve-arg=--kv-cache-dtype=float16 ...] [--out benchmarks/results/compare]

`--weights` names the files both servers load, one pair of runs each (default: f32 only):
  - q4_1: the embedded SmolLM2-135M-Instruct.Q4_1.gguf itself (token_embd in Q8_0);
  - q8_0: the F32 copy quantized to Q8_0 by llama.cpp's `llama-quantize` (built beside llama-server);
  - f32:  every tensor of the embedded file dequantized to F32 (benchmarks/peers/gguf_to_f32.py);
  - or any GGUF path.
llmserve serves each with its default `--quantization auto` (a quantized file keeps its blocks:
Q4_1 as int4, Q8_0 as int8; F32 stays float32) unless `--llmserve-arg` says otherwise;
llama-server computes on the file's own types.

Workload, per concurrency level c: `--requests-per-level` (default max(8, 2c)) prompts of exactly
`--input-len` tokens of random text (`llmserve.bench.datasets.random_requests`, one seed), each
asking for `--output-len` tokens, greedy, EOS ignored. Every peer gets the very same prompts. A
per-run, per-level salt opens each prompt, so no prompt shares a prefix with one sent before it:
prefix caches stay cold.
  - llmserve:     `llmserve serve MODEL` in a subprocess, driven by
                  `llmserve.bench.serve.benchmark_serving` at c in flight.
  - llama-server: llama.cpp's server (benchmarks/peers/build_llama_server.sh) on the same file,
                  `--llama-slots` slots (`--parallel`, default 16 as in the issue's reference
                  figures; requests beyond them queue in the server), the same load generator.
  - transformers: offline `generate` in batches of c (left padded, fp32, greedy); TTFT = one
                  batch's prefill (generate with max_new_tokens=1), throughput = output tokens /
                  wall time of the full generate calls. No server, no HTTP.
Servers run one at a time (each is stopped before the next starts), and each level opens with one
warm-up request that is not measured. Prints a table (output tok/s, median TTFT, ratios
llmserve / peer) and writes `--out`/compare.json with every figure plus PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from llmserve.bench.datasets import BenchRequest, load_bench_tokenizer, random_requests
from llmserve.bench.serve import benchmark_serving
from llmserve.tokenizer import Tokenizer
from peers.gguf_to_f32 import ensure_f32_gguf, ensure_quantized_gguf, peers_dir

MODEL_NAME = "bench"  # the name both servers answer to
LLAMA_CPP_VERSION = "0.3.36"  # keep in step with build_llama_server.sh
SANITY_PROMPT = "The capital of France is"


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests of every level, shared by every peer."""

    levels: dict[int, list[BenchRequest]]
    """concurrency -> the measured requests"""
    tokenizer: Tokenizer
    """counts output tokens when a server's stream carries no usage"""
    threads: int


def build_workload(args: argparse.Namespace) -> Workload:
    tokenizer = load_bench_tokenizer(None)
    run = secrets.token_hex(4)  # with the level in the salt: no prompt shares a prefix with another
    levels = {}
    for c in args.concurrency:
        n = args.requests_per_level or max(8, 2 * c)
        levels[c] = random_requests(
            tokenizer, n, args.input_len, args.output_len, seed=args.seed + c, salt=f"{run}-c{c}"
        )
    return Workload(levels, tokenizer, args.threads)


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""


@contextmanager
def server_process(
    cmd: list[str], port: int, log: Path, timeout: float = 300
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run a server until /health answers 200; yield its base URL and process; SIGTERM it and wait
    on exit. An exit, or a 503 that reports a failed load, ends the wait at once."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}:\n{_tail(log)}")
                try:
                    resp = httpx.get(f"{base_url}/health", timeout=5)
                    if resp.status_code == 200:
                        break
                    if "failed" in resp.text:
                        raise RuntimeError(f"{cmd[0]} did not load the model: {resp.text}\n{_tail(log)}")
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[0]} not healthy after {timeout:.0f} s; see {log}")
                time.sleep(0.5)
            yield base_url, proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def sanity_text(base_url: str) -> str:
    """A short greedy completion: a misloaded model shows here before it shows in a figure."""
    body = {"model": MODEL_NAME, "prompt": SANITY_PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def serve_levels(base_url: str, work: Workload) -> dict[int, dict[str, Any]]:
    """Every level against one running server, c requests in flight; each level opens with one
    unmeasured warm-up request (benchmark_serving salts it, so it primes no prefix cache)."""

    async def run() -> dict[int, dict[str, Any]]:
        out = {}
        for c, requests in work.levels.items():
            result = await benchmark_serving(
                base_url, MODEL_NAME, requests, max_concurrency=c, progress=False, num_warmups=1,
                tokenizer=work.tokenizer,
            )  # fmt: skip
            out[c] = result.to_dict()
            print(f"  c={c:3d}  {fmt_level(out[c])}", flush=True)
        return out

    return asyncio.run(run())


def fmt_level(r: dict[str, Any]) -> str:
    return (
        f"{r['output_throughput']:8.1f} tok/s  median TTFT {r['median_ttft_ms']:8.1f} ms  "
        f"({r['completed']} done, {r['failed']} failed)"
    )


def run_server_peer(name: str, cmd: list[str], port: int, work: Workload, out_dir: Path) -> dict[str, Any]:
    print(f"{name}: {' '.join(cmd)}", flush=True)
    with server_process(cmd, port, out_dir / f"{name}.log") as (base_url, proc):
        text = sanity_text(base_url)
        print(f"  greedy {SANITY_PROMPT!r} -> {text!r}", flush=True)
        levels = serve_levels(base_url, work)
        memory = resident_memory(proc.pid)
    print(
        f"  resident memory {memory.get('VmRSS', 0) / 2**20:.0f} MiB, peak {memory.get('VmHWM', 0) / 2**20:.0f} MiB"
    )
    return {
        "command": cmd,
        "sanity": {"prompt": SANITY_PROMPT, "text": text},
        "levels": levels,
        "memory": memory,
    }


def resident_memory(pid: int) -> dict[str, int]:
    """The server's resident set after its last level (VmRSS) and at its peak (VmHWM), in bytes,
    from /proc (Linux; empty elsewhere)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (ln.split(":", 1) for ln in lines if ln.startswith(("VmRSS", "VmHWM")))
    return {key: int(value.split()[0]) * 1024 for key, value in fields}


def weights_file(args: argparse.Namespace, name: str) -> Path:
    """A `--weights` entry as a GGUF path (converting or quantizing the embedded model once)."""
    if name == "f32":
        return ensure_f32_gguf()
    if name == "q4_1":
        from llmserve.model_executor.model_loader.source import DEFAULT_MODEL, resolve_model

        return resolve_model(DEFAULT_MODEL).path
    if name in ("q8_0", "q4_0", "q4_k_m", "q5_0", "q6_k"):
        return ensure_quantized_gguf(name.upper(), args.llama_server.with_name("llama-quantize"))
    return Path(name)


def run_llmserve(args: argparse.Namespace, work: Workload, gguf: Path, name: str) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve.cli.main", "--log-level", "WARNING", "serve", str(gguf),
           "--port", str(port), "--served-model-name", MODEL_NAME,
           "--max-num-seqs", str(max(64, *work.levels)), *args.llmserve_arg]  # fmt: skip
    return run_server_peer(name, cmd, port, work, args.out)


def run_llama_server(args: argparse.Namespace, work: Workload, gguf: Path, name: str) -> dict[str, Any]:
    slots = args.llama_slots
    # llama-server splits -c evenly among its slots: each one must hold a whole request
    per_slot = args.input_len + args.output_len + 16
    port = free_port()
    cmd = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--alias", MODEL_NAME, "--parallel", str(slots), "-c", str(slots * per_slot),
           "--threads", str(work.threads), "--threads-batch", str(work.threads), "--no-webui"]  # fmt: skip
    return run_server_peer(name, cmd, port, work, args.out)


# ---------------------------------------------------------------- transformers


def run_transformers(args: argparse.Namespace, work: Workload, gguf: Path, name: str) -> dict[str, Any]:
    import torch
    import transformers

    from bench_throughput import hf_generate, load_transformers
    from bench_throughput import run_transformers as hf_throughput
    from llmserve.model_executor.model_loader.source import DEFAULT_MODEL, resolve_model

    tokenizer = work.tokenizer
    gguf = resolve_model(DEFAULT_MODEL).path  # transformers dequantizes any GGUF to float
    print(f"{name}: AutoModelForCausalLM.from_pretrained({gguf.name}) fp32, generate", flush=True)
    transformers.utils.logging.disable_progress_bar()
    model = load_transformers(gguf)
    pad = tokenizer.pad_token_id or 0
    levels = {}
    for c, requests in work.levels.items():
        ids = [tokenizer.encode(r.prompt) if isinstance(r.prompt, str) else r.prompt for r in requests]
        hf_generate(model, ids[:1], 2, pad)  # warm-up: transformers has no cache to prime
        ttft = []
        for b in range(0, len(ids), c):
            start = time.perf_counter()
            hf_generate(model, ids[b : b + c], 1, pad)
            ttft.append(1e3 * (time.perf_counter() - start))
        tp = hf_throughput(model, [(p, r.output_len) for p, r in zip(ids, requests, strict=True)], c, pad)
        levels[c] = {
            "max_concurrency": c,
            "output_throughput": tp["output_tok_s"],
            "duration_s": tp["seconds"],
            "completed": len(requests),
            "failed": 0,
            "total_output_tokens": sum(r.output_len for r in requests),
            "median_ttft_ms": statistics.median(ttft),
            "mean_ttft_ms": statistics.fmean(ttft),
            "ttft_kind": "prefill of one batch of c (generate, max_new_tokens=1)",
        }
        print(f"  c={c:3d}  {fmt_level(levels[c])}", flush=True)
    threads = torch.get_num_threads()
    return {"command": f"transformers {transformers.__version__}, torch threads {threads}", "levels": levels}


# ---------------------------------------------------------------- report

PEERS: dict[str, Callable[[argparse.Namespace, Workload, Path, str], dict[str, Any]]] = {
    "llmserve": run_llmserve,
    "transformers": run_transformers,
    "llama-server": run_llama_server,
}


def ratios(results: dict[str, dict[str, Any]], c: int) -> dict[str, dict[str, float]]:
    """llmserve / peer for tok/s (above 1: llmserve faster) and median TTFT (below 1: llmserve
    faster): each "llama-server (w)" against "llmserve (w)" on the same file w, transformers
    against llmserve on the first file."""
    out = {}
    for name, res in results.items():
        peer, _, weights = name.partition(" ")
        ours = results.get(f"llmserve {weights}") if peer != "transformers" else None
        if ours is None and peer == "transformers":
            ours = next((r for n, r in results.items() if n.startswith("llmserve")), None)
        theirs = res["levels"][c]
        if (
            peer == "llmserve"
            or ours is None
            or not theirs["output_throughput"]
            or not theirs["median_ttft_ms"]
        ):
            continue
        mine = ours["levels"][c]
        out[name] = {
            "output_throughput": mine["output_throughput"] / theirs["output_throughput"],
            "median_ttft_ms": mine["median_ttft_ms"] / theirs["median_ttft_ms"],
        }
    return out


def print_table(results: dict[str, dict[str, Any]], concurrency: list[int]) -> None:
    print("\nratios are llmserve / peer: tok/s above 1 = llmserve faster; TTFT below 1 = llmserve faster")
    print(
        "| c | peer | output tok/s | median TTFT ms | tok/s llmserve/peer | TTFT llmserve/peer | peak RSS |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for c in concurrency:
        rel = ratios(results, c)
        for name, res in results.items():
            r = res["levels"][c]
            q = rel.get(name)
            tail = f"{q['output_throughput']:.2f}x | {q['median_ttft_ms']:.2f}x" if q else "- | -"
            peak = res.get("memory", {}).get("VmHWM")
            rss = f"{peak / 2**20:.0f} MiB" if peak else "-"
            print(
                f"| {c} | {name} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.1f} | {tail} | {rss} |"
            )


def write_plots(results: dict[str, dict[str, Any]], out: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from llmserve.bench.plots import plot_sweep_series
    except ImportError as e:
        print(f"plots skipped ({e}); pip install 'llmserve[bench]'")
        return
    for key, label, name in (("output_throughput", "output tok/s", "throughput"),
                             ("median_ttft_ms", "median TTFT (ms)", "ttft")):  # fmt: skip
        fig = Figure(figsize=(6, 4), dpi=120, layout="constrained")
        FigureCanvasAgg(fig)  # object API only: no global pyplot backend switched
        ax = fig.subplots()
        for peer, res in results.items():
            cs = sorted(res["levels"])
            ax.plot(cs, [res["levels"][c][key] for c in cs], marker="o", label=peer)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency", ylabel=label, title=f"{label} vs concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.savefig(out / f"{name}_vs_concurrency.png")
    series = {peer: [res["levels"][c] for c in sorted(res["levels"])] for peer, res in results.items()}
    plot_sweep_series(series, out / "sweep.png")


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "?"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS))
    ap.add_argument("--weights", nargs="+", default=["f32"], help="q4_1, q8_0, f32 or GGUF paths")
    ap.add_argument("--llmserve-arg", action="append", default=[], help="an extra `llmserve serve` flag")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: max(8, 2c)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-slots", type=int, default=16, help="llama-server's --parallel")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server's")
    ap.add_argument("--llama-server", type=Path,
                    default=peers_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}-build/bin/llama-server")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compare"))
    args = ap.parse_args()

    peers = list(args.peers)
    if "llama-server" in peers and not os.access(args.llama_server, os.X_OK):
        print(f"llama-server: skipped, no binary at {args.llama_server}; "
              "build it with benchmarks/peers/build_llama_server.sh (~6 min) or pass --llama-server PATH")  # fmt: skip
        peers.remove("llama-server")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    work = build_workload(args)
    results = {}
    for w in args.weights:  # one server at a time, in order
        gguf = weights_file(args, w)
        for peer in peers:
            if peer == "transformers" and any(n.startswith("transformers") for n in results):
                continue  # the float model once
            name = f"{peer} ({Path(w).name})"  # a GGUF path by its file name (the plots' legends)
            results[name] = PEERS[peer](args, work, gguf, name)
    print_table(results, args.concurrency)
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "results": results,
        "ratios_llmserve_over_peer": {c: ratios(results, c) for c in args.concurrency},
        "seconds": time.perf_counter() - start,
    }
    (args.out / "compare.json").write_text(json.dumps(report, indent=1))
    write_plots(results, args.out)
    print(f"wrote {args.out}/compare.json and plots in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()

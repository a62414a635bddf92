"""Embedding throughput against prefill throughput, through a real server (issue 27's target:
embeddings at >= 0.8x the prefill rate of the same tokens through /v1/completions).

    python benchmarks/bench_embeddings.py [--model PATH] [--num-inputs 64] [--input-len 128]
                                          [--rounds 3] [--pooling last|mean|cls] [--gen-tokens 64]

Starts `llmserve serve` in a subprocess, then per round, alternating so both see the same machine:
  - completions: one POST /v1/completions with `--num-inputs` prompts of `--input-len` random
    token ids, `max_tokens: 1` (the prefill, plus one sampled token per prompt);
  - embeddings:  one POST /v1/embeddings with as many inputs of the same length.
Each request uses fresh random ids, so the prefix cache never serves one from another's blocks.
Reported: prompt tokens/s of each (median over rounds) and their ratio. Then the share check: a
greedy generation of `--gen-tokens` tokens alone, beside an embedding request of that size, and
beside a completions request prefilling as many tokens: embeddings should slow a generation no
more than prompts of the same length do (both take chunks of each step's token budget, so the
decode steps they share last longer). Writes benchmarks/results/bench_embeddings.json.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench_serving import wait_healthy  # benchmarks/ is the script's folder, on sys.path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmserve.cli.main", "serve", "--port", str(port), "--pooling", args.pooling]
    cmd += ["--model", args.model] if args.model else []
    return wait_healthy(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)


def random_inputs(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def timed_post(client: httpx.Client, path: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = client.post(path, json=body)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or file (default: the embedded SmolLM2)")
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pooling", default="last", choices=["last", "mean", "cls"])
    p.add_argument("--gen-tokens", type=int, default=64, help="0: skip the share check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_embeddings.json")
    args = p.parse_args()

    port = free_port()
    proc = start_server(args, port)
    rng = random.Random(args.seed)
    num_tokens = args.num_inputs * args.input_len
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            vocab = client.get("/tokenizer_info").json().get("vocab_size", 32000)
            timed_post(client, "/v1/embeddings", {"input": random_inputs(rng, 2, 8, vocab)})  # warm-up
            prefill, embed = [], []
            for _ in range(args.rounds):
                prompts = random_inputs(rng, args.num_inputs, args.input_len, vocab)
                body = {"prompt": prompts, "max_tokens": 1, "temperature": 0}
                prefill.append(num_tokens / timed_post(client, "/v1/completions", body))
                inputs = random_inputs(rng, args.num_inputs, args.input_len, vocab)
                embed.append(num_tokens / timed_post(client, "/v1/embeddings", {"input": inputs}))
                print(f"completions {prefill[-1]:.0f} tok/s, embeddings {embed[-1]:.0f} tok/s", flush=True)
            result = {
                "model": args.model or "embedded SmolLM2-135M-Instruct",
                "pooling": args.pooling,
                "num_inputs": args.num_inputs,
                "input_len": args.input_len,
                "completions_prefill_tok_s": statistics.median(prefill),
                "embeddings_tok_s": statistics.median(embed),
                "ratio": statistics.median(embed) / statistics.median(prefill),
                "rounds": {"completions": prefill, "embeddings": embed},
            }
            if args.gen_tokens:
                result["share"] = share_check(client, args, rng, vocab)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


def share_check(client: httpx.Client, args: argparse.Namespace, rng: random.Random, vocab: int) -> dict:
    """A generation's time alone, beside an embedding request, and beside a completions request
    that prefills as many tokens (`max_tokens: 1`): the baseline its "share" is measured against,
    since both kinds of prompt take the same chunks of each step's token budget."""
    body = {"max_tokens": args.gen_tokens, "temperature": 0, "ignore_eos": True}

    def gen() -> float:
        return timed_post(client, "/v1/completions", {**body, "prompt": random_inputs(rng, 1, 16, vocab)[0]})

    def batch(path: str) -> float:
        prompts = random_inputs(rng, args.num_inputs, args.input_len, vocab)
        if path == "/v1/embeddings":
            return timed_post(client, path, {"input": prompts})
        return timed_post(client, path, {"prompt": prompts, "max_tokens": 1, "temperature": 0})

    def beside(path: str) -> tuple[float, float]:
        with ThreadPoolExecutor(2) as pool:
            g = pool.submit(gen)
            time.sleep(0.05)  # the generation decodes when the batch arrives
            b = pool.submit(batch, path)
            return g.result(), b.result()

    result = {"generation_alone_s": gen()}
    for name, path in (("embeddings", "/v1/embeddings"), ("completions_prefill", "/v1/completions")):
        g, b = beside(path)
        result[f"generation_beside_{name}_s"], result[f"{name}_beside_generation_s"] = g, b
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

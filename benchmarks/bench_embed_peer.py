"""Embedding throughput of llmserve next to llama-server on the same GGUF file.

    python benchmarks/bench_embed_peer.py FILE.gguf [FILE.gguf ...] [--inputs 64] [--words 100]
                                          [--rounds 5] [--concurrency 1 4] [--threads 2]

Each file is served by `llmserve serve FILE` and then by `llama-server -m FILE --embedding` (as
benchmarks/peers/build_llama_server.sh builds it; `-t`/`-tb` `--threads`, `-c` and `-ub` large
enough for a whole batch of inputs), one server at a time. Per round, every level sends the same
`--inputs` texts of `--words` random words (from the script's fixed word list, new texts each round
so no cache serves them) to `/v1/embeddings`, split over `--concurrency` client threads, each
request holding an equal share of the texts. Reported: texts per second (median of the rounds,
after one unmeasured round), and the two servers' vectors compared (the smallest cosine over the
last round's texts): the same model should give the same embeddings. Writes
benchmarks/results/bench_embed_peer.json.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from bench_serving import wait_healthy  # benchmarks/ is the script's folder, on sys.path
from cpu_scale.files import llama_cpp_binary

WORDS = re.findall(
    r"\w+",
    "the of and to in is was for on that with as by at from his her they this which be are an "
    "have not had were but all their one there what so up out if about who get when make can like "
    "time just him know take people into year your good some could them see other than then now "
    "look only come its over think also back after use two how our work first well way even new "
    "want because any these give day most us river stone garden engine model token vector server",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def texts(rng: random.Random, n: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def start(server: str, file: Path, port: int, args: argparse.Namespace) -> subprocess.Popen:
    if server == "llmserve":
        cmd = [sys.executable, "-m", "llmserve.cli.main", "serve", str(file), "--port", str(port)]
    else:
        ctx = args.inputs * (args.words * 2 + 16)
        cmd = [str(llama_cpp_binary("llama-server")), "-m", str(file), "--embedding", "--port", str(port),
               "-t", str(args.threads), "-tb", str(args.threads), "-c", str(ctx), "-b", str(ctx),
               "-ub", str(ctx), "-np", str(max(args.concurrency))]  # fmt: skip
    return wait_healthy(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)


def embed_all(url: str, batch: list[str], concurrency: int, model: str) -> tuple[float, list[list[float]]]:
    """(seconds, vectors in order) for `batch` sent as `concurrency` equal requests at once."""
    parts = [batch[i::concurrency] for i in range(concurrency)]

    def post(part: list[str]) -> list[list[float]]:
        with httpx.Client(timeout=600) as client:
            r = client.post(f"{url}/v1/embeddings", json={"input": part, "model": model})
            r.raise_for_status()
            return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(post, parts))
    elapsed = time.perf_counter() - t0
    vectors: list[list[float]] = [[] for _ in batch]
    for i, part in enumerate(results):
        for j, v in enumerate(part):
            vectors[i + j * concurrency] = v
    return elapsed, vectors


def run_server(server: str, file: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    proc = start(server, file, port, args)
    out: dict = {"levels": {}}
    url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for c in args.concurrency:
            rng = random.Random(1000 + c)
            embed_all(url, texts(rng, args.inputs, args.words), c, model)  # warm-up
            rates, last = [], None
            for _ in range(args.rounds):
                batch = texts(rng, args.inputs, args.words)
                seconds, vectors = embed_all(url, batch, c, model)
                rates.append(len(batch) / seconds)
                last = (batch, vectors)
            out["levels"][str(c)] = {"texts_per_s": statistics.median(rates), "rounds": rates}
            out.setdefault("last", {})[str(c)] = last
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--words", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_embed_peer.json"))
    args = ap.parse_args()
    report: dict = {}
    for file in args.files:
        runs = {s: run_server(s, file, args) for s in ("llmserve", "llama-server")}
        print(f"\n{file.name}: {args.inputs} texts of {args.words} words a round, median of {args.rounds}")
        print(
            "| concurrency | llmserve texts/s | llama-server texts/s | llmserve / llama-server | min cosine |"
        )
        print("| ---: | ---: | ---: | ---: | ---: |")
        entry = {}
        for c in map(str, args.concurrency):
            ours, theirs = (runs[s]["levels"][c]["texts_per_s"] for s in ("llmserve", "llama-server"))
            a = np.array(runs["llmserve"]["last"][c][1])
            b = np.array(runs["llama-server"]["last"][c][1])
            cosine = float(np.min(np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))
            print(f"| {c} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {cosine:.6f} |")
            entry[c] = {"llmserve": runs["llmserve"]["levels"][c], "llama-server": runs["llama-server"]["levels"][c],
                        "ratio": ours / theirs, "min_cosine": cosine}  # fmt: skip
        report[str(file)] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "files": report}, indent=1)
    )


if __name__ == "__main__":
    main()

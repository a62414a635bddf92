"""The engine's Python around the model, side by side for two checkouts: offline throughput and
served throughput on a tiny model whose own compute is small (the tests' tiny Llama: hidden 64, 2
layers), so a step's time is the engine's scheduling, input building and output handling, as on
a GPU at large batches.

    python benchmarks/bench_host_overhead.py BASE_SRC [NEW_SRC] [--pairs 3] [--concurrency 64 256 4] [--whole 256]
        [--new-serve-args='--stream-interval 8']

BASE_SRC and NEW_SRC are `src` folders of two checkouts (NEW_SRC defaults to this one's); each
measurement runs in a fresh process with PYTHONPATH at one of them, the two alternating pair by
pair so that drift hits both alike:

    offline  `llmserve bench throughput`: 512 prompts of 24 tokens, 200 output tokens each, EOS
             ignored, 256 sequences at a time; output tok/s
    served   `llmserve serve` (256 sequences) driven by `llmserve bench serve` at each concurrency
             c (4c prompts, the same lengths, streamed); output tok/s. The client runs on the same
             machine, as it would in a one-host setup.
    whole    (`--whole c ...`) the same server and lengths (prompts of 24 random token ids), each
             request answered whole (no `stream`), c at a time from this script's aiohttp client;
             output tok/s from the responses' usage.

Prints every figure, then each level's medians and their ratio (new / base).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
INPUT_LEN, OUTPUT_LEN = 24, 200
LENGTHS = ["--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)]
CLI = "import sys; from llmserve.cli.main import main; sys.exit(main())"


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def _output_tok_s(text: str) -> float:
    match = re.search(r"Output token throughput \(tok/s\):\s*([\d.]+)|([\d.]+) output tokens/s", text)
    if match is None:
        raise RuntimeError(f"no throughput in:\n{text[-2000:]}")
    return float(match.group(1) or match.group(2))


def offline(src: Path, model: Path) -> float:
    cmd = [sys.executable, "-c", CLI, "bench", "throughput", "--model", str(model), *LENGTHS,
           "--num-prompts", "512", "--max-num-seqs", "256", "--num-kv-blocks", "4096", "--disable-tqdm"]  # fmt: skip
    return _output_tok_s(
        subprocess.run(cmd, env=_env(src), capture_output=True, text=True, check=True).stdout
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(src: Path, model: Path, extra: list[str]) -> Iterator[int]:
    """`llmserve serve` from `src` (with the flags `extra`) on a free port, ready; yields the port."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", CLI, "serve", str(model), "--max-num-seqs", "256", "--num-kv-blocks", "4096",
         "--port", str(port), *extra],
        env=_env(src), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _ready(port):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the server from {src} did not start")
            time.sleep(0.5)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=60)


def served(src: Path, model: Path, concurrency: int, results: Path, extra: list[str]) -> float:
    with _server(src, model, extra) as port:
        cmd = [sys.executable, "-c", CLI, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
               "--dataset", "random", *LENGTHS, "--ignore-eos", "--num-prompts", str(4 * concurrency),
               "--max-concurrency", str(concurrency), "--tokenizer", str(model), "--result-dir", str(results)]  # fmt: skip
        run = subprocess.run(cmd, env=_env(src), capture_output=True, text=True, check=True)
        return _output_tok_s(run.stdout + run.stderr)


def served_whole(src: Path, model: Path, concurrency: int, extra: list[str]) -> float:
    """Output tok/s of 4c non-streamed completions, c at a time (one warm-up round first). The
    client is aiohttp's, as `llmserve bench serve`'s: httpx's pool capped this level near 9k tok/s
    here whatever the server did."""
    import aiohttp

    rng = random.Random(0)
    body = {"model": str(model), "max_tokens": OUTPUT_LEN, "ignore_eos": True, "temperature": 0}

    async def run(port: int, count: int) -> tuple[int, float]:
        limit = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(
            f"http://127.0.0.1:{port}", connector=aiohttp.TCPConnector(limit=concurrency),
            timeout=aiohttp.ClientTimeout(total=600),
        ) as session:  # fmt: skip

            async def one() -> int:
                prompt = [rng.randrange(10, 500) for _ in range(INPUT_LEN)]
                async with limit, session.post("/v1/completions", json={**body, "prompt": prompt}) as r:
                    r.raise_for_status()
                    return (await r.json())["usage"]["completion_tokens"]

            start = time.perf_counter()
            tokens = await asyncio.gather(*(one() for _ in range(count)))
            return sum(tokens), time.perf_counter() - start

    with _server(src, model, extra) as port:
        asyncio.run(run(port, concurrency))
        tokens, seconds = asyncio.run(run(port, 4 * concurrency))
        return tokens / seconds


def _ready(port: int) -> bool:
    """/health answers 200 (503 while the model loads)."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path, help="the baseline checkout's src folder")
    ap.add_argument("new", type=Path, nargs="?", default=REPO / "src", help="default: this checkout's src")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[64, 256, 4])
    ap.add_argument("--whole", type=int, nargs="*", default=[], help="non-streamed levels (concurrency)")
    ap.add_argument("--new-serve-args", default="", help="flags for the new side's server only, as one string "
                    "(the same src twice then compares a flag: --new-serve-args='--stream-interval 8')")  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        sys.path.insert(0, str(REPO))
        from tests.models.tiny import make_tiny_model

        make_tiny_model("llama", model)
        results = Path(tmp) / "results"
        # each level: (name, its output tok/s from a src folder and the server's extra flags)
        levels: list[tuple[str, Callable[[Path, list[str]], float]]] = [
            ("offline", lambda src, _: offline(src, model))
        ]
        levels += [(f"served c={c}", lambda src, extra, c=c: served(src, model, c, results, extra))
                   for c in args.concurrency]  # fmt: skip
        levels += [
            (f"whole c={c}", lambda src, extra, c=c: served_whole(src, model, c, extra)) for c in args.whole
        ]
        figures: dict[str, list[list[float]]] = {name: [[], []] for name, _ in levels}
        for pair in range(args.pairs):
            for name, measure in levels:
                for side, src in enumerate((args.base, args.new)):
                    tok_s = measure(src, args.new_serve_args.split() if side == 1 else [])
                    figures[name][side].append(tok_s)
                    print(f"pair {pair + 1} {name} {'base' if side == 0 else 'new'}: {tok_s:,.0f} output tok/s",
                          flush=True)  # fmt: skip
    print("\n| level | base output tok/s | new output tok/s | median ratio |\n| --- | --- | --- | ---: |")
    for name, (base, new) in figures.items():
        ratio = statistics.median(new) / statistics.median(base)
        print(f"| {name} | {' / '.join(f'{v:,.0f}' for v in base)} | {' / '.join(f'{v:,.0f}' for v in new)} "
              f"| {ratio:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

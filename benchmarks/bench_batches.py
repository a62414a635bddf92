"""An online request's time to first token (TTFT) on an idle server and while a large batch runs
(the Batches API's target: within 1.5x of idle), and how fast the batch goes meanwhile.

    python benchmarks/bench_batches.py [--model M] [--lines 1000] [--requests 20] [--concurrency 2 8]

For each `--batch-max-concurrency` value in `--concurrency`: a fresh server (its own temporary
--batch-dir), `--requests` streamed chat requests one after another on the idle server, then a
batch of `--lines` chat lines is created and the same requests are sent again while it runs;
reports median and p90 TTFT of both, their ratio, and the batch lines finished per second.
The batch is cancelled at the end (pass --wait to let it complete and report its total time).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    args: argparse.Namespace, concurrency: int, batch_dir: str, log: Path
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "llmserve.cli.main", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--batch-dir", batch_dir, "--batch-max-concurrency", str(concurrency),
           *args.server_args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=os.environ)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start; see {log}")


def _ttft(client: httpx.Client, i: int, max_tokens: int) -> float:
    body = {"messages": [{"role": "user", "content": f"Write a short poem about the number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - start
    raise RuntimeError("no token came back")


def _summary(ttfts: list[float]) -> tuple[float, float]:
    ttfts = sorted(ttfts)
    return statistics.median(ttfts), ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]


def _one(args: argparse.Namespace, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as batch_dir:
        proc, url = _start(args, concurrency, batch_dir, Path(batch_dir) / "server.log")
        try:
            client = httpx.Client(base_url=url, timeout=600)
            _ttft(client, -1, 4)  # warm up
            idle = [_ttft(client, i, args.max_tokens) for i in range(args.requests)]
            lines = [
                {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": f"Tell me a fact about the number {i}."}],
                          "max_tokens": args.line_tokens, "temperature": 0}}
                for i in range(args.lines)
            ]  # fmt: skip
            data = "".join(json.dumps(x) + "\n" for x in lines).encode()
            file = client.post(
                "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}
            ).json()
            batch = client.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                     "completion_window": "24h"}).json()  # fmt: skip
            while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 1:
                time.sleep(0.2)
            start = time.monotonic()
            done_before = client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"]
            busy = [_ttft(client, i, args.max_tokens) for i in range(args.requests)]
            state = client.get(f"/v1/batches/{batch['id']}").json()
            rate = (state["request_counts"]["completed"] - done_before) / (time.monotonic() - start)
            if args.wait:
                while state["status"] not in ("completed", "failed", "cancelled", "expired"):
                    time.sleep(1)
                    state = client.get(f"/v1/batches/{batch['id']}").json()
                print(f"  batch {state['status']} in {state['completed_at'] - state['in_progress_at']} s")
            else:
                client.post(f"/v1/batches/{batch['id']}/cancel")
            (im, ip), (bm, bp) = _summary(idle), _summary(busy)
            print(f"batch-max-concurrency {concurrency}: TTFT idle median {im * 1e3:.0f} ms p90 {ip * 1e3:.0f} ms; "
                  f"during the batch median {bm * 1e3:.0f} ms p90 {bp * 1e3:.0f} ms ({bm / im:.2f}x median, "
                  f"{bp / ip:.2f}x p90); batch {rate:.2f} lines/s meanwhile")  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the server's MODEL (default: the embedded SmolLM2-135M)")
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--line-tokens", type=int, default=64, help="max_tokens of each batch line")
    ap.add_argument("--requests", type=int, default=20, help="online requests measured, idle and busy")
    ap.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each online request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[2], help="--batch-max-concurrency values")
    ap.add_argument("--wait", action="store_true", help="let the batch complete (else cancel it)")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `serve` flags (last)")
    args = ap.parse_args()
    for concurrency in args.concurrency:
        _one(args, concurrency)


if __name__ == "__main__":
    main()

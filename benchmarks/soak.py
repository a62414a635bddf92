"""Soak: a server under mixed traffic for a long time, watched for leaks, errors and drift.

    python benchmarks/soak.py [--minutes 30] [--model MODEL] [--concurrency 8]
        [--kv-cache-memory 48MiB] [--idle-every 5] [--out benchmarks/results/soak]

Starts `llmserve serve` (the embedded model by default) with a small KV cache, so that long
prompts run it short and requests are preempted, and keeps `--concurrency` clients busy with a mix:

    stream   chat, streamed to the end (16-128 tokens)             TTFT and time per token recorded
    full     completions, not streamed, n = 2 or 3, sampled
    drop     streamed, the client hangs up after 1-5 chunks        must leave nothing behind
    long     a ~1,500-token prompt, 32-64 tokens                   KV pressure, preemption
    json     response_format json_object
    bad      one of a set of invalid requests                      must be a 4xx, OpenAI-shaped

Every `--idle-every` minutes the clients pause until the server is idle (no request accepted,
none running or waiting in the engine); then /stats must show 0 KV blocks in use, and the resident memory (VmRSS) is taken. A sampler records VmRSS and /stats
every 5 s throughout. The report (JSON and a PNG in --out, a summary on stdout):

  - errors: 5xx, transport failures of requests that were not dropped on purpose, invalid requests
    answered otherwise than with an OpenAI-shaped 4xx, valid ones refused;
  - RSS growth: the last idle VmRSS against the first idle one after warm-up (the first pause);
  - KV blocks in use at each idle point;
  - latency drift: median TTFT and time per output token of `stream` requests per window between
    pauses, last window against the first.

Goals (hardening issue): 0 errors other than the intended 4xx, RSS growth <= 5% after warm-up,
0 blocks used when idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from compare import free_port, resident_memory, server_process

WORDS = ["river", "stone", "garden", "lamp", "winter", "market", "silver", "candle", "harbor", "violin", "meadow", "forest", "copper", "thunder", "pillow", "orchard", "lantern", "compass", "marble", "feather"]  # fmt: skip
KINDS = {"stream": 40, "full": 15, "drop": 15, "long": 12, "json": 8, "bad": 10}


def bad_requests(model: str) -> list[tuple[str, dict[str, Any] | str]]:
    """(path, body) pairs every one of which must be refused with a 4xx."""
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (chat, "{not json"),
        (chat, {"model": "no-such-model", "messages": msgs}),
        (chat, {"model": model, "messages": msgs, "max_tokens": -1}),
        (chat, {"model": model, "messages": msgs, "temperature": "hot"}),
        (chat, {"model": model, "messages": []}),
        (chat, {"model": model, "messages": msgs, "n": 10_000}),
        (chat, {"model": model, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
        (chat, {"model": model, "messages": msgs, "tool_choice": "required"}),
        ("/v1/completions", {"model": model, "prompt": "x " * 20_000, "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": [10**9], "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": "x", "logprobs": 99}),
    ]  # fmt: skip


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Soak:
    base: str
    model: str
    rng: random.Random
    kinds: list[str]
    start: float = field(default_factory=time.monotonic)
    records: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    paused: asyncio.Event = field(default_factory=asyncio.Event)  # set: clients may send

    def t(self) -> float:
        return time.monotonic() - self.start

    def fail(self, kind: str, what: str) -> None:
        self.errors.append(f"{self.t():.0f}s {kind}: {what[:300]}")

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(self.kinds, weights=[KINDS[k] for k in self.kinds])[0]
        rng = self.rng
        if kind == "bad":
            path, body = rng.choice(bad_requests(self.model))
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}  # fmt: skip
            r = await client.post(path, **kw)
            shape_ok = False
            try:
                err = r.json().get("error")
                shape_ok = isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err
            except ValueError:
                pass
            if not (400 <= r.status_code < 500 and shape_ok):
                self.fail(kind, f"{path} {str(body)[:80]} -> {r.status_code} {r.text[:200]}")
            self.records.append({"t": self.t(), "kind": kind, "status": r.status_code})
            return
        if kind == "full":
            body = {"model": self.model, "prompt": words(rng, rng.randint(5, 60)), "max_tokens": rng.randint(8, 48),
                    "n": rng.choice([2, 3]), "temperature": 0.8, "seed": rng.randint(0, 10**6)}  # fmt: skip
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200 or len(r.json().get("choices", [])) != body["n"]:
                self.fail(kind, f"{r.status_code} {r.text[:200]}")
            self.records.append(
                {"t": self.t(), "kind": kind, "status": r.status_code, "e2e": time.monotonic() - t0}
            )
            return
        body = {"model": self.model, "stream": True, "messages": [{"role": "user", "content": words(rng, rng.randint(5, 80))}],
                "max_tokens": rng.randint(16, 128), "temperature": 0.7, "seed": rng.randint(0, 10**6)}  # fmt: skip
        if kind == "long":
            body["messages"][0]["content"] = words(rng, rng.randint(1200, 1500))
            body["max_tokens"] = rng.randint(32, 64)
        if kind == "json":
            body["response_format"] = {"type": "json_object"}
            body["stream"] = False
        drop_after = rng.randint(1, 5) if kind == "drop" else None
        t0 = time.monotonic()
        ttft, chunks, done = None, 0, False
        try:
            if not body["stream"]:
                r = await client.post("/v1/chat/completions", json=body)
                ok = r.status_code == 200
                choice = r.json()["choices"][0] if ok else {}
                if ok and kind == "json" and choice["finish_reason"] == "stop":
                    json.loads(choice["message"]["content"])  # must parse unless cut short by max_tokens
                if not ok:
                    self.fail(kind, f"{r.status_code} {r.text[:200]}")
                self.records.append(
                    {"t": self.t(), "kind": kind, "status": r.status_code, "e2e": time.monotonic() - t0}
                )
                return
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    self.fail(kind, f"{r.status_code} {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.fail(kind, f"stream error {chunk['error']}")
                        return
                    delta = (chunk.get("choices") or [{}])[0].get("delta", {})
                    if delta.get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.monotonic() - t0
                    if drop_after is not None and chunks >= drop_after:
                        break  # hang up mid-stream
        except (httpx.HTTPError, ValueError) as e:
            self.fail(kind, repr(e))
            return
        if drop_after is None and not done:
            self.fail(kind, "stream ended without [DONE]")
        e2e = time.monotonic() - t0
        tpot = (e2e - ttft) / (chunks - 1) if ttft is not None and chunks > 1 else None
        self.records.append({"t": self.t(), "kind": kind, "status": 200, "ttft": ttft, "tpot": tpot, "e2e": e2e,
                             "chunks": chunks})  # fmt: skip

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=600) as client:
            while time.monotonic() < deadline:
                await self.paused.wait()
                try:
                    await self.one(client)
                except Exception as e:  # a bug in the soak or the server: counted, never fatal
                    self.fail("client", repr(e))


def sampler(base: str, pid: int, samples: list[dict[str, Any]], stop: threading.Event, start: float) -> None:
    while not stop.wait(5.0):
        try:
            stats = httpx.get(f"{base}/stats", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            stats = {}
        samples.append({"t": time.monotonic() - start, "rss": resident_memory(pid).get("VmRSS", 0), **stats})


async def run(args: argparse.Namespace, base: str, pid: int) -> dict[str, Any]:
    soak = Soak(base, args.served_name, random.Random(args.seed), args.kinds)
    soak.paused.set()
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    threading.Thread(target=sampler, args=(base, pid, samples, stop, soak.start), daemon=True).start()
    end = soak.start + 60 * args.minutes
    idle_points: list[dict[str, Any]] = []
    clients = [asyncio.create_task(soak.client_loop(end)) for _ in range(args.concurrency)]
    next_idle = soak.start + 60 * args.idle_every
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while time.monotonic() < end:
            await asyncio.sleep(min(5.0, max(0.0, min(next_idle, end) - time.monotonic())))
            if time.monotonic() >= next_idle and time.monotonic() < end:
                soak.paused.clear()  # clients finish what they have in flight, then wait
                # idle: no request accepted, and the engine thread has applied every abort (an
                # abort waits for the step in flight, which a long prefill can make seconds long)
                while True:
                    st = (await http.get("/stats")).json()
                    if not (st["num_active_requests"] or st["num_running"] or st["num_waiting"]):
                        break
                    await asyncio.sleep(0.5)
                await asyncio.sleep(1.0)
                stats = (await http.get("/stats")).json()
                point = {"t": soak.t(), "kv_blocks_used": stats["kv_blocks_used"], "rss": resident_memory(pid).get("VmRSS", 0),
                         "num_preemptions": stats["num_preemptions"]}  # fmt: skip
                idle_points.append(point)
                print(f"  idle at {point['t'] / 60:.1f} min: {point['kv_blocks_used']} KV blocks in use, "
                      f"RSS {point['rss'] / 2**20:.0f} MiB, {len(soak.records)} requests, {len(soak.errors)} errors, "
                      f"{point['num_preemptions']} preemptions so far", flush=True)  # fmt: skip
                soak.paused.set()
                next_idle += 60 * args.idle_every
    await asyncio.gather(*clients)
    stop.set()
    return {"records": soak.records, "errors": soak.errors, "samples": samples, "idle": idle_points}


def windows(records: list[dict[str, Any]], idle: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median TTFT / TPOT of completed `stream` requests between consecutive idle points."""
    edges = [0.0] + [p["t"] for p in idle] + [float("inf")]
    out = []
    for lo, hi in itertools.pairwise(edges):
        rs = [r for r in records if r["kind"] == "stream" and lo <= r["t"] < hi and r.get("ttft") is not None]
        tpots = [r["tpot"] for r in rs if r.get("tpot") is not None]
        if rs:
            out.append({"from_s": lo, "requests": len(rs), "median_ttft_ms": 1e3 * statistics.median(r["ttft"] for r in rs),
                        "median_tpot_ms": 1e3 * statistics.median(tpots) if tpots else None})  # fmt: skip
    return out


def report(result: dict[str, Any], out: Path) -> dict[str, Any]:
    idle, records = result["idle"], result["records"]
    wins = windows(records, idle)
    base_rss = idle[0]["rss"] if idle else 0
    growth = (idle[-1]["rss"] / base_rss - 1) if len(idle) >= 2 and base_rss else None
    by_kind: dict[str, int] = {}
    for r in records:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    summary = {
        "requests": len(records),
        "by_kind": by_kind,
        "errors": len(result["errors"]),
        "error_samples": result["errors"][:20],
        "idle_kv_blocks_used": [p["kv_blocks_used"] for p in idle],
        "idle_rss_mib": [round(p["rss"] / 2**20, 1) for p in idle],
        "rss_growth_after_warmup": growth,
        "preemptions": idle[-1]["num_preemptions"] if idle else None,
        "windows": wins,
        "ttft_drift": wins[-1]["median_ttft_ms"] / wins[0]["median_ttft_ms"] if len(wins) >= 2 else None,
        "tpot_drift": (
            wins[-1]["median_tpot_ms"] / wins[0]["median_tpot_ms"]
            if len(wins) >= 2 and wins[0]["median_tpot_ms"] and wins[-1]["median_tpot_ms"]
            else None
        ),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({"summary": summary, **result}, indent=1))
    plot(result, wins, out / "soak.png")
    return summary


def plot(result: dict[str, Any], wins: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    s = result["samples"]
    a.plot([x["t"] / 60 for x in s], [x["rss"] / 2**20 for x in s], label="VmRSS (every 5 s)")
    a.scatter([p["t"] / 60 for p in result["idle"]], [p["rss"] / 2**20 for p in result["idle"]], color="red", zorder=3,
              label="idle points")  # fmt: skip
    a.set_ylabel("server RSS (MiB)")
    a.legend()
    ax2 = a.twinx()
    ax2.plot(
        [x["t"] / 60 for x in s], [x.get("kv_blocks_used", 0) for x in s], color="gray", alpha=0.4, lw=0.8
    )
    ax2.set_ylabel("KV blocks in use", color="gray")
    streams = [r for r in result["records"] if r["kind"] == "stream" and r.get("ttft") is not None]
    b.scatter(
        [r["t"] / 60 for r in streams],
        [1e3 * r["ttft"] for r in streams],
        s=3,
        alpha=0.3,
        label="TTFT per stream",
    )
    b.step([w["from_s"] / 60 for w in wins], [w["median_ttft_ms"] for w in wins], where="post", color="red",
           label="median per window")  # fmt: skip
    b.set_yscale("log")
    b.set_ylabel("TTFT (ms)")
    b.set_xlabel("minutes")
    b.legend()
    fig.suptitle("llmserve soak: mixed traffic, small KV cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--model", default=None, help="model to serve (default: the embedded one)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="48MiB")
    ap.add_argument("--idle-every", type=float, default=5, help="minutes between idle checks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="the traffic mix (default: all)"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    args = ap.parse_args()
    args.served_name = "soak"
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve.cli.main", "--log-level", "WARNING", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--served-model-name", args.served_name, "--kv-cache-memory", args.kv_cache_memory,
           "--max-num-seqs", "16"]  # fmt: skip
    with server_process(cmd, port, args.out / "server.log") as (base, proc):
        print(f"soak: {' '.join(cmd[2:])}; {args.minutes:g} min, {args.concurrency} clients", flush=True)
        result = asyncio.run(run(args, base, proc.pid))
        alive = httpx.get(f"{base}/health", timeout=30).status_code
    summary = report(result, args.out)
    summary["health_after"] = alive
    print(json.dumps({k: v for k, v in summary.items() if k != "error_samples"}, indent=1))
    for e in summary["error_samples"]:
        print("  error:", e)
    ok = (summary["errors"] == 0 and all(b == 0 for b in summary["idle_kv_blocks_used"]) and alive == 200
          and (summary["rss_growth_after_warmup"] is None or summary["rss_growth_after_warmup"] <= 0.05))  # fmt: skip
    print("goals met" if ok else "goals NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

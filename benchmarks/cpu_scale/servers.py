"""The two servers on one GGUF file, one at a time, each driven by `llmserve bench serve`.

    llmserve       `llmserve serve FILE --max-num-seqs 16 --max-model-len 272`: the same context and
                   parallelism as llama-server's (issue 30 compares memory there; the KV cache's
                   default is then 16 x 272 tokens, llama-server's -c), every other flag its
                   default (what the targets are about); INFO logs for its load report
    llama-server   as benchmarks/compare.py starts it: 16 slots (-np), -c 16 x (128 + 128 + 16),
                   2 threads for decode and batches, plus --cont-batching (its default, said aloud)

Each server runs in a subprocess (compare.server_process: up when /health answers 200, SIGTERM
after), its memory watched (memory.RssWatch) while `llmserve bench serve --dataset random
--ignore-eos` runs each level in its own subprocess, with one unmeasured warm-up request first and
a fresh salt opening every prompt (cold prefix caches). Memory bandwidth is measured just before
and just after the c=1 level, the server idle meanwhile: that server's c=1 floor (`floor`). Every
command and its log are kept.
Does not know the targets or the table.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compare import server_process
from cpu_scale.cpu_time import NOISY, other_load
from cpu_scale.memory import RssWatch, floor_around
from cpu_scale.plan import Workload
from gpu.runs import MODEL_NAME, SUMMARY_KEYS, llmserve, run_command, shown, startup_lines

SERVERS = ("llmserve", "llama-server")


@dataclass(frozen=True, slots=True)
class Setup:
    """What one server run needs besides its command."""

    tokenizer_dir: Path
    """`bench serve --tokenizer`: the model folder, whose tokenizer the GGUF carries too"""
    out: Path
    """this file's results folder"""
    workload: Workload
    timeout_s: float
    bandwidth: Callable[[], dict[str, Any]] | None = None
    """measures memory bandwidth (memory.measure_bandwidth), run just before and just after the
    first level (c=1): that level's streaming floor comes from these two passes"""
    tensor_bytes: int = 0
    """the file's tensor bytes, which one decode step at batch 1 reads"""


def llmserve_command(gguf: Path, port: int, w: Workload) -> list[str]:
    return llmserve(
        "serve", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--max-num-seqs", str(w.max_num_seqs), "--max-model-len", str(w.slot_len()), log_level="INFO",
    )  # fmt: skip


def llama_server_command(binary: Path, gguf: Path, port: int, w: Workload, threads: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL_NAME,
            "-np", str(w.max_num_seqs), "-c", str(w.llama_ctx()), "-t", str(threads), "-tb", str(threads),
            "--cont-batching", "--no-webui"]  # fmt: skip


def run_server(name: str, cmd: list[str], port: int, t: Setup) -> dict[str, Any]:
    """Every level of the workload against one server; its memory; its start-up lines."""
    log = t.out / "logs" / f"{name}.log"
    result: dict[str, Any] = {"command": shown(cmd), "log": str(log), "levels": {}}
    if name == "llmserve":
        result["source"] = source_state()  # an editable install: this start imports src/ as it is now
    print(f"  $ {result['command']}", flush=True)
    start = time.perf_counter()
    with server_process(cmd, port, log, timeout=t.timeout_s) as (base_url, proc):
        result["startup_seconds"] = time.perf_counter() - start
        watch = RssWatch(proc.pid).start()
        try:
            for i, (c, num_prompts) in enumerate(t.workload.levels):
                before = _guarded_bandwidth("before", t) if i == 0 else {}
                result["levels"][str(c)] = _guarded(
                    f"c={c}", bench_serve, base_url, proc.pid, name, c, num_prompts, t
                )
                if i == 0 and t.bandwidth is not None:
                    result["floor"] = floor_around(before, _guarded_bandwidth("after", t), t.tensor_bytes)
        finally:
            result["memory"] = watch.stop()
    if name == "llmserve":
        result["startup_log"] = startup_lines(log)
    peak = result["memory"].get("peak_rss")
    print(
        f"  up in {result['startup_seconds']:.1f} s; peak RSS {peak / 2**30:.2f} GiB" if peak else "",
        flush=True,
    )
    return result


def bench_serve(base_url: str, pid: int, server: str, c: int, num_prompts: int, t: Setup) -> dict[str, Any]:
    """One level: its summary figures, command and result file, and the CPU time spent around it."""
    w = t.workload
    path = t.out / f"{server}-c{c}.json"
    cmd = llmserve(
        "bench", "serve", "--base-url", base_url, "--model", MODEL_NAME, "--tokenizer", str(t.tokenizer_dir),
        "--dataset", "random", "--input-len", str(w.input_len), "--output-len", str(w.output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(c), "--ignore-eos",
        "--num-warmups", str(w.num_warmups), "--disable-tqdm", "--no-plot", "--result-file", str(path),
    )  # fmt: skip
    cpu: dict[str, Any] = {}
    with other_load(pid, cpu):
        run_command(cmd, t.out / "logs" / f"{server}-bench-c{c}.log", t.timeout_s)
    result = json.loads(path.read_text())
    summary = {k: result[k] for k in SUMMARY_KEYS if k in result}
    return {"command": shown(cmd), "max_concurrency": c, "num_prompts": num_prompts, **summary,
            "cpu": cpu, "result_file": str(path)}  # fmt: skip


def _guarded(label: str, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)`, one level's figures, or its error: a failed level must not lose the others."""
    try:
        out = fn(*args)
    except Exception as e:  # a subprocess failure or a malformed result: record it, go on
        print(f"    {label}: FAILED: {e}", flush=True)
        return {"error": str(e)}
    print(
        f"    {label}: {out['output_throughput']:,.1f} output tok/s, median TPOT {out['median_tpot_ms']:.1f} ms, "
        f"median TTFT {out['median_ttft_ms']:,.0f} ms ({out['completed']} done, {out['failed']} failed)",
        flush=True,
    )
    other = out["cpu"].get("other_cpu_fraction", 0.0)
    if other > NOISY:
        print(
            f"    {label}: DISTURBED: other processes used {other:.0%} of the machine meanwhile", flush=True
        )
    return out


def _guarded_bandwidth(when: str, t: Setup) -> dict[str, Any]:
    """A bandwidth pass beside the c=1 level (the server idle meanwhile), or its error."""
    if t.bandwidth is None:
        return {}
    try:
        bw = t.bandwidth()
    except Exception as e:  # a failed pass loses this floor, never the level
        print(f"    bandwidth {when} c=1: FAILED: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}
    print(f"    bandwidth {when} c=1: {bw['gb_s']:.1f} GB/s ({bw['reader']})", flush=True)
    return bw


def source_state() -> dict[str, Any]:
    """The commit and whether src/ differs from it (and a digest of the difference, so two runs can
    tell whether they measured the same code)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                             cwd=Path(__file__).resolve().parents[2])  # fmt: skip
        return out.stdout.strip() if out.returncode == 0 else ""

    diff = git("diff", "HEAD", "--", "src")
    untracked = git("ls-files", "--others", "--exclude-standard", "--", "src")
    return {
        "commit": git("log", "-1", "--format=%h %s")[:120],
        "src_dirty": bool(diff or untracked),
        "src_diff_sha1": hashlib.sha1((diff + untracked).encode()).hexdigest()[:12]
        if diff or untracked
        else None,
        "src_untracked": untracked.splitlines(),
    }

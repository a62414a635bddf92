"""llmserve's own benchmark commands on the model folder, each a subprocess, each one's JSON read back.

    offline_latency     `llmserve bench latency FOLDER`: ppN and tgN at batch 1
    offline_throughput  `llmserve bench throughput FOLDER`: every request at once
    served              `llmserve serve FOLDER` until /health answers 200, then `llmserve bench serve`
                        once per concurrency level and once for the prefill run; the server's
                        start-up log lines (device, KV cache, CUDA graph capture) are kept

Subprocesses, not in-process calls: each engine gives its GPU memory back when it exits, the
server sizes its KV cache from what is free, and every figure comes with the exact command that a
person can run again. Each command's output goes to a log under `out/logs/`. Does not know the
table, the targets or the model's construction.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compare import server_process
from gpu.plan import Plan

MODEL_NAME = "bench"
# A served run's figures kept in the report (the per-request records stay in its own JSON file)
SUMMARY_KEYS = (
    "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
    "median_e2el_ms",
)  # fmt: skip
# Start-up log lines worth keeping: what the engine decided and how long it took
STARTUP_PATTERN = re.compile(
    r"(?i)cuda graph|captur|kv cache|gpu memory|compil|loaded|attention|triton|ready"
)
MAX_STARTUP_LINES = 40
READY = re.compile(r"\bready\b")  # the server's last start-up line: "ready: 'bench' loaded in ..."


@dataclass(frozen=True, slots=True)
class Setup:
    """What every run shares."""

    plan: Plan
    model_dir: Path
    out: Path
    engine_args: tuple[str, ...] = ()
    """The user's extra engine flags (`--engine-arg`), after the plan's."""

    def engine(self) -> list[str]:
        """MODEL and the engine flags every `serve`/`bench latency`/`bench throughput` gets."""
        p = self.plan
        return [
            str(self.model_dir),
            "--dtype",
            p.dtype,
            "--device",
            p.device,
            *p.engine_args,
            *self.engine_args,
        ]


def llmserve(*args: str, log_level: str = "WARNING") -> list[str]:
    return [sys.executable, "-m", "llmserve.cli.main", "--log-level", log_level, *args]


def shown(cmd: list[str]) -> str:
    """A command as a person would type it (`llmserve ...` for the CLI)."""
    head = [sys.executable, "-m", "llmserve.cli.main"]
    return shlex.join(["llmserve", *cmd[len(head) :]] if cmd[: len(head)] == head else cmd)


def log_tail(log: Path, num_lines: int = 15) -> str:
    lines = log.read_text(errors="replace").replace("\r", "\n").splitlines() if log.is_file() else []
    return "\n".join(lines[-num_lines:])


def run_command(cmd: list[str], log: Path, timeout: float) -> None:
    """Run `cmd` with its output in `log`; RuntimeError (with the log's tail) unless it exits 0."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  $ {shown(cmd)}", flush=True)
    with log.open("w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout:.0f} s; see {log}") from None
    if rc != 0:
        raise RuntimeError(f"exited with {rc}; see {log}:\n{log_tail(log)}")


# ---------------------------------------------------------------- offline


def offline_latency(s: Setup) -> dict[str, Any]:
    p = s.plan
    path = s.out / "offline" / "latency.json"
    cmd = llmserve(
        "bench", "latency", *s.engine(), "--prompt-lens", str(p.latency_prompt_len),
        "--gen-lens", str(p.latency_gen_len), "--repetitions", str(p.latency_repetitions),
        "--disable-tqdm", "--result-file", str(path),
    )  # fmt: skip
    run_command(cmd, s.out / "logs" / "bench-latency.log", p.timeout_s)
    rows = json.loads(path.read_text())["tests"]
    by_kind = {r["kind"]: r for r in rows}
    return {
        "command": shown(cmd),
        "pp_tok_s": by_kind["pp"]["mean_tps"],
        "tg_tok_s": by_kind["tg"]["mean_tps"],
        "tests": rows,
        "result_file": str(path),
    }


def offline_throughput(s: Setup) -> dict[str, Any]:
    p = s.plan
    path = s.out / "offline" / "throughput.json"
    cmd = llmserve(
        "bench", "throughput", *s.engine(), "--dataset", "random", "--num-prompts", str(p.throughput_prompts),
        "--input-len", str(p.input_len), "--output-len", str(p.output_len),
        "--max-num-seqs", str(p.max_num_seqs), "--max-num-batched-tokens", str(p.max_num_batched_tokens),
        "--disable-tqdm", "--result-file", str(path),
    )  # fmt: skip
    run_command(cmd, s.out / "logs" / "bench-throughput.log", p.timeout_s)
    result = json.loads(path.read_text())
    result.pop("config", None)
    return {"command": shown(cmd), **result, "result_file": str(path)}


# ---------------------------------------------------------------- served


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_serve(
    s: Setup, base_url: str, name: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
    num_warmups: int, log_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """One `llmserve bench serve` run: random prompts of exactly `input_len` tokens (a fresh salt
    opens each, so nothing hits the prefix cache), `output_len` tokens each with EOS ignored."""
    path = log_dir / f"{name}.json"
    cmd = llmserve(
        "bench", "serve", "--base-url", base_url, "--model", MODEL_NAME, "--tokenizer", str(s.model_dir),
        "--dataset", "random", "--input-len", str(input_len), "--output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--num-warmups", str(num_warmups), "--disable-tqdm", "--no-plot", "--result-file", str(path),
    )  # fmt: skip
    run_command(cmd, s.out / "logs" / f"{log_dir.name}-{name}.log", s.plan.timeout_s)
    result = json.loads(path.read_text())
    summary = {k: result[k] for k in SUMMARY_KEYS if k in result}
    return {"command": shown(cmd), "max_concurrency": concurrency, **summary, "result_file": str(path)}


def served(s: Setup, enforce_eager: bool) -> dict[str, Any]:
    """Every concurrency level, then the prefill run, against one server."""
    p = s.plan
    label = "enforce-eager" if enforce_eager else "default"
    log_dir = s.out / f"served-{label}"
    port = free_port()
    cmd = llmserve(
        "serve", *s.engine(), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--max-num-seqs", str(p.max_num_seqs), "--max-num-batched-tokens", str(p.max_num_batched_tokens),
        "--max-queued-requests", "-1", *(["--enforce-eager"] if enforce_eager else []),
        log_level="INFO",  # the start-up lines about the KV cache and CUDA graphs are INFO
    )  # fmt: skip
    log = s.out / "logs" / f"serve-{label}.log"
    result: dict[str, Any] = {"command": shown(cmd), "log": str(log), "levels": {}}
    start = time.perf_counter()
    print(f"  $ {shown(cmd)}", flush=True)
    with server_process(cmd, port, log, p.timeout_s) as (base_url, _):
        result["startup_seconds"] = time.perf_counter() - start
        print(f"  healthy after {result['startup_seconds']:.1f} s", flush=True)
        for c in p.concurrency:
            result["levels"][str(c)] = _guarded(
                f"c={c}",
                lambda c=c: bench_serve(
                    s, base_url, f"c{c}", c, p.num_prompts(c), p.input_len, p.output_len, 1, log_dir
                ),
            )
        result["prefill"] = _guarded("prefill", lambda: prefill_run(s, base_url, log_dir))
        result["gpu_memory_in_use_bytes"] = _gpu_memory_in_use(p.device)
    result["startup_log"] = startup_lines(log)
    return result


def prefill_run(s: Setup, base_url: str, log_dir: Path) -> dict[str, Any]:
    """`prefill_prompts` prompts of `prefill_len` tokens at once, 1 output token each: prompt
    tokens / duration. The warm-up is one full batch of the same shape (kernels tuned, memory settled)."""
    p = s.plan
    n = p.prefill_prompts
    result = bench_serve(s, base_url, "prefill", n, n, p.prefill_len, 1, n, log_dir)
    result["prefill_tok_s"] = result["total_input_tokens"] / result["duration_s"]
    return result


def _guarded(name: str, fn: Any) -> dict[str, Any]:
    """One run's figures, or its error: a failed level must not lose the others."""
    try:
        out = fn()
    except Exception as e:  # a subprocess failure or a malformed result: record it, go on
        print(f"  {name}: FAILED: {e}", flush=True)
        return {"error": str(e)}
    speed = (
        f"{out['prefill_tok_s']:,.1f} prompt tok/s"
        if "prefill_tok_s" in out
        else f"{out['output_throughput']:,.1f} output tok/s, median TPOT {out['median_tpot_ms']:.2f} ms"
    )
    print(
        f"  {name}: {speed}, median TTFT {out['median_ttft_ms']:.1f} ms "
        f"({out['completed']} done, {out['failed']} failed)",
        flush=True,
    )
    return out


def _gpu_memory_in_use(device: str) -> int | None:
    """The whole GPU's memory in use while the server holds its KV cache (every process)."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total - free


def startup_lines(log: Path) -> list[str]:
    """The server's log lines up to "ready" that say what it decided at start-up; a progress bar's
    carriage-return updates collapse to their last state."""
    if not log.is_file():
        return []
    kept = []
    for raw in log.read_text(errors="replace").splitlines():
        line = next((part for part in reversed(raw.split("\r")) if part.strip()), "").strip()
        if STARTUP_PATTERN.search(line):
            kept.append(line)
        if READY.search(line) or len(kept) >= MAX_STARTUP_LINES:
            break
    return kept

"""`llmserve bench` end to end: `bench serve` as a subprocess against a real server on the tiny
model, its JSON checked against the server's own Prometheus counters; `bench throughput` and
`bench latency` in-process on the same model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.cli.main import main
from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COUNTERS = ("request_success", "generation_tokens", "prompt_tokens", "prefix_cache_hits")


def counters(server: ServerProcess) -> dict[str, float]:
    """The server's llmserve counters for our model, summed over their other labels."""
    resp = httpx.get(f"{server.url}/metrics", timeout=10)
    assert resp.status_code == 200, f"GET /metrics answered {resp.status_code}"
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            name = sample.name.removeprefix("llmserve:").removesuffix("_total")
            if sample.name.endswith("_total") and name in totals:
                assert sample.labels.get("model_name") == MODEL_NAME
                totals[name] += sample.value
    return totals


def bench_serve(server: ServerProcess, model_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "llmserve.cli.main", "--log-level", "WARNING", "bench", "serve",
        "--base-url", server.url, "--model", MODEL_NAME, "--tokenizer", str(model_dir),
        "--disable-tqdm", "--result-dir", str(out), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def read_result(path: Path) -> dict[str, Any]:
    assert path.is_file(), f"no result file {path}"
    return json.loads(path.read_text())


def assert_png(path: Path) -> None:
    assert path.is_file(), f"no plot {path}"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_bench_serve_random_matches_server_counters(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
):
    before = counters(server)
    proc = bench_serve(
        server, tiny_model_dir, tmp_path, "--num-prompts", "12", "--max-concurrency", "4",
        "--input-len", "16", "--output-len", "8", "--result-file", "run.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    r = read_result(tmp_path / "run.json")
    assert r["completed"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == 12 * 8
    # each prompt is exactly 16 tokens of the tiny tokenizer (no BOS), and the server says so too
    assert all(rec["prompt_len"] == 16 and rec["output_tokens"] == 8 for rec in r["requests"])
    assert r["total_input_tokens"] == sum(rec["prompt_len"] for rec in r["requests"]) == 12 * 16
    assert r["model"] == MODEL_NAME and r["max_concurrency"] == 4 and r["config"]["cache"] == "cold"
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_itl_ms", "median_e2el_ms"):
        assert r[key] > 0, key
    assert r["p99_e2el_ms"] >= r["median_e2el_ms"] >= r["median_ttft_ms"]
    assert_png(tmp_path / "run-latency.png")

    after = counters(server)
    assert after["request_success"] - before["request_success"] == 12
    assert after["generation_tokens"] - before["generation_tokens"] == r["total_output_tokens"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == r["total_input_tokens"]


def test_bench_serve_sweep_writes_levels_and_sweep_plot(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
):
    proc = bench_serve(
        server, tiny_model_dir, tmp_path, "--num-prompts", "4", "--max-concurrency", "1", "2",
        "--input-len", "16", "--output-len", "4", "--num-warmups", "1", "--result-file", "sweep.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = read_result(tmp_path / "sweep.json")
    assert r["levels"] == [1, 2] and [x["max_concurrency"] for x in r["results"]] == [1, 2]
    for level in r["results"]:
        assert level["completed"] == 4 and level["total_output_tokens"] == 16 and level["num_warmups"] == 1
    # cold cache: each level is a run with its own salt
    salts = [x["config"]["salt"] for x in r["results"]]
    assert len(set(salts)) == 2 and all(salts)
    assert_png(tmp_path / "sweep-sweep.png")
    assert_png(tmp_path / "sweep-c1-latency.png")
    assert_png(tmp_path / "sweep-c2-latency.png")


def test_bench_serve_chat_endpoint(server: ServerProcess, tiny_model_dir: Path, tmp_path: Path):
    before = counters(server)
    proc = bench_serve(
        server, tiny_model_dir, tmp_path, "--endpoint", "chat", "--num-prompts", "2",
        "--input-len", "16", "--output-len", "6", "--result-file", "chat.json", "--no-plot",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = read_result(tmp_path / "chat.json")
    assert r["endpoint"] == "chat" and r["completed"] == 2 and r["total_output_tokens"] == 12
    # the chat template wraps the 16-token text, and the server's count is the one reported
    assert all(rec["prompt_len"] > 16 for rec in r["requests"])
    assert not list(tmp_path.glob("*.png"))
    after = counters(server)
    assert after["prompt_tokens"] - before["prompt_tokens"] == r["total_input_tokens"]
    assert after["request_success"] - before["request_success"] == 2


def test_bench_serve_wrong_model_records_failures_and_exits_1(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
):
    proc = bench_serve(
        server, tiny_model_dir, tmp_path, "--model", "no-such-model", "--num-prompts", "3",
        "--input-len", "8", "--output-len", "4", "--result-file", "fail.json", "--no-plot",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "every request failed" in proc.stderr and "HTTP 404" in proc.stderr
    r = read_result(tmp_path / "fail.json")  # written all the same, with every error
    assert r["completed"] == 0 and r["failed"] == 3
    assert all(not rec["success"] and rec["error"].startswith("HTTP 404") for rec in r["requests"])


def test_bench_serve_cache_cold_misses_warm_hits(server: ServerProcess, tiny_model_dir: Path, tmp_path: Path):
    # 48-token prompts = 3 full blocks of 16: a re-run of the same prompts reuses them
    common = ["--num-prompts", "2", "--input-len", "48", "--output-len", "2", "--seed", "4242", "--no-plot"]

    def hits_of(*args: str) -> float:
        before = counters(server)["prefix_cache_hits"]
        proc = bench_serve(server, tiny_model_dir, tmp_path, *common, *args)
        assert proc.returncode == 0, proc.stderr
        return counters(server)["prefix_cache_hits"] - before

    hits_of("--cache", "warm")  # fills the cache with the seed's prompts
    assert hits_of("--cache", "cold") == 0  # the same prompts behind a fresh salt: nothing reused
    assert hits_of("--cache", "warm") > 0  # the seed's prompts again


def test_bench_throughput_on_tiny_model(tiny_model_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "tp.json"
    args = ["--num-prompts", "6", "--input-len", "16", "--output-len", "5", "--result-file", str(out)]
    assert main(["bench", "throughput", str(tiny_model_dir), *args, "--disable-tqdm"]) == 0
    assert "requests/s" in capsys.readouterr().out
    r = read_result(out)
    assert r["num_requests"] == 6
    assert r["total_output_tokens"] == 30 and r["total_input_tokens"] == 96
    assert r["output_tokens_per_second"] == pytest.approx(30 / r["elapsed_time"])


def test_bench_latency_on_tiny_model(tiny_model_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", str(tiny_model_dir), "--prompt-lens", "32", "--gen-lens", "8"]
    assert main([*argv, "--batch-size", "2", "--repetitions", "2", "--result-file", str(out)]) == 0
    table = capsys.readouterr().out
    assert "test |" in table and "pp32" in table and "tg8 @ b2" in table
    rows = read_result(out)["tests"]
    assert [row["test"] for row in rows] == ["pp32", "tg8 @ b2"]
    for row in rows:
        assert len(row["samples_tps"]) == 2 and row["mean_tps"] > 0 and row["std_tps"] >= 0

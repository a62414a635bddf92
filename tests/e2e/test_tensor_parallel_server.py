"""The server with --tensor-parallel-size 2: answers like the single-process engine (with n-gram
speculation too, its counters in /metrics), refuses bad input with a 400, takes its worker
process down with it at shutdown, and stops with an error naming a worker that died."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from llmserve import LLM
from llmserve.sampling_params import SamplingParams
from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.e2e.test_models import metric

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, "--tensor-parallel-size", "2", "--threads-per-rank", "1").start()
    yield proc
    proc.stop()


def test_tp_server_answers_as_tp1(tp_server, tiny_model_dir):
    got = tp_server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    llm = LLM(str(tiny_model_dir), show_progress=False)
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert got.choices[0].text == ref.text
    assert got.usage.completion_tokens == len(ref.token_ids)


def test_tp_server_refuses_bad_input(tp_server):
    with pytest.raises(openai.BadRequestError):
        tp_server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=100_000)
    ok = tp_server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_tp_server_shutdown_stops_the_worker(tp_server):
    """Last in the module: it stops the shared server."""
    proc = tp_server
    workers = [
        p for p in psutil.Process(proc.proc.pid).children(recursive=True) if "spawn" in " ".join(p.cmdline())
    ]
    assert len(workers) == 1
    assert proc.stop() == 0
    psutil.wait_procs(workers, timeout=15)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    assert "terminate called" not in proc.log()


def test_tp_server_with_ngram_speculation(tiny_model_dir):
    """--speculative-config beside --tensor-parallel-size 2: a prompt that repeats itself (the
    tiny Llama's greedy answer loops, so proposals are accepted) answers TP=1's plain tokens."""
    spec = ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}')
    proc = ServerProcess(
        tiny_model_dir, "--tensor-parallel-size", "2", "--threads-per-rank", "1", *spec
    ).start()
    try:
        prompt = [300, 301] * 3
        got = proc.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        llm = LLM(str(tiny_model_dir), show_progress=False)
        params = SamplingParams(max_tokens=24, temperature=0.0)
        ref = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert got.choices[0].text == ref.text
        assert got.usage.completion_tokens == len(ref.token_ids)
        assert metric(proc, "llmserve:spec_decode_num_accepted_tokens_total") > 0
    finally:
        proc.stop()


def test_tp_worker_death_fails_requests_and_exits(tiny_model_dir):
    """A killed worker: the next request ends with the engine's error naming the rank (not a
    hang), and the server exits with status 3 for a supervisor to restart it."""
    proc = ServerProcess(tiny_model_dir, "--tensor-parallel-size", "2", "--threads-per-rank", "1").start()
    try:
        (worker,) = [p for p in psutil.Process(proc.proc.pid).children() if "spawn" in " ".join(p.cmdline())]
        worker.kill()  # SIGKILL: a zombie until the server reaps it (psutil's wait() would not return)
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5}
        r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500, r.text
        assert (
            f"tensor-parallel worker rank 1 (pid {worker.pid}, exit code -9) died"
            in r.json()["error"]["message"]
        )
        assert proc.proc.wait(60) == 3
    finally:
        proc.stop()

"""benchmarks/bench_batch1_overhead.py on the embedded SmolLM2 GGUF: one short round of the bare
step, the engine's loop (with its breakdown) and a served stream, each with a per-token figure.
The figures of a 135M model on a shared machine say nothing of speed; the shape of the JSON does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 8


def test_one_round_times_step_engine_and_stream(tmp_path: Path) -> None:
    from llmserve.model_executor.model_loader.errors import ModelNotFoundError
    from llmserve.model_executor.model_loader.source import DEFAULT_MODEL, resolve_model

    try:
        model = resolve_model(DEFAULT_MODEL).path
    except ModelNotFoundError as e:
        pytest.skip(f"no embedded SmolLM2: {e}")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_batch1_overhead.py"), str(model), "--rounds", "1",
           "--tokens", str(TOKENS), "--prompt-len", "16", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "bench_batch1_overhead.json").read_text())
    (row,) = result["rounds"]
    assert set(row) == {"step", "engine", "served"}
    assert all(row[name]["per_token_ms"] > 0 for name in row)
    parts = row["engine"]["parts_ms"]
    assert set(parts) == {"schedule", "forward", "lm_head", "sampler", "update_from_output",
                          "output_processing", "rest"}  # fmt: skip
    assert all(parts[k] > 0 for k in parts if k != "rest")
    # the parts are inside the step: together no more than it (rest is what no timer covered)
    assert sum(v for k, v in parts.items() if k != "rest") <= row["engine"]["per_token_ms"] * 1.25
    assert 1 <= row["served"]["num_chunks"] <= TOKENS and row["served"]["ttft_ms"] > 0
    assert set(result["median_per_token_ms"]) == {"step", "engine", "served"}
    assert "median per-token ms over rounds: step " in proc.stdout

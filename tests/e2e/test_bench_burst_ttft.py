"""benchmarks/bench_burst_ttft.py on the embedded SmolLM2 GGUF: a smaller step budget cuts the burst
into more steps and spreads the first tokens over them, and the greedy outputs stay the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def test_budgets_spread_the_burst_with_the_same_outputs() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_burst_ttft.py"), "--budgets", "1024", "32"]
    cmd += ["--prompts", "4", "--input-len", "32", "--output-len", "3"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    whole, split = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert (whole["budget"], split["budget"]) == (1024, 32)
    # 1024 tokens take the four 32-token prompts in one step: one first-token time for all
    assert len(set(whole["ttft_s"]["all"])) == 1
    # 32 tokens a step: one prompt a step (the decodes of the earlier ones come first, so later
    # prompts are chunked), each first token in a later step than the one before
    assert len(set(split["ttft_s"]["all"])) == 4
    assert split["steps"] > whole["steps"]
    assert split["ids_sha"] == whole["ids_sha"]

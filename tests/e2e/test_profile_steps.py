"""benchmarks/gpu/profile_steps.py (where the GPU engine's time goes) checked on the CPU: the batch
and steady-state cases run on a tiny model, and the report holds each case's figures, the profiler
tables and the host's cProfile. On the CPU there are no kernel times (GPU busy 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.tiny import make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_profile_steps_on_a_tiny_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    make_tiny_model("llama", model)  # max_position_embeddings 256: 128 + 128 tokens fit
    out = tmp_path / "out"
    cases = ["decode1", "decode64", "steady256"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/profile_steps.py"), str(model), "--device", "cpu",
         "--dtype", "float32", "--out", str(out), "--repeats", "1", "--cases", *cases],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads((out / "profile.json").read_text())
    assert list(figures) == cases
    for name, f in figures.items():
        assert f["tok_s"] > 0 and f["median_wall_s"] > 0 and f["first_wall_s"] > 0, name
        assert f["gpu_busy_s"] == 0, name  # the CPU has no kernel timeline
        assert f"{name}: " in proc.stdout
    # 128 output tokens of every request: 1 and 64 at once, 1,024 through 256 slots
    assert figures["decode1"]["prompts"] == 1 and figures["decode64"]["prompts"] == 64
    assert figures["steady256"]["tok_s"] == pytest.approx(
        256 * 4 * 128 / figures["steady256"]["median_wall_s"]
    )
    assert "admitted new requests" in proc.stdout
    report = (out / "profile.txt").read_text()
    assert report.count("cProfile of the first run") == 3
    assert "cProfile, decode64 with 32 output tokens" in report and "steady256 with 32" in report

"""benchmarks/bench_gpu.py (issue 23's GPU benchmark) checked on the CPU, where CI runs.

`--smoke --baseline-eager` runs every part of the script - the model folder, the matvec floor,
`llmserve bench latency|throughput`, `llmserve serve` + `llmserve bench serve` at c = 1 and 2 and the
prefill run, twice (CUDA-graph default and --enforce-eager) - on a tiny model with the real SmolLM2
vocabulary; its JSON and table are checked section by section. The GPU plan's table and targets
are checked on a hand-made report with H100-like figures, since no run here can produce them.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# SMOKE_PLAN's sizes (benchmarks/gpu/plan.py)
LEVELS = {"1": 4, "2": 8}  # concurrency -> prompts: max(4, 4c)
OUTPUT_LEN = 16
PREFILL_PROMPTS, PREFILL_LEN = 2, 256
# hidden 64, 2 layers, 4 heads of 16, 2 KV heads, intermediate 256, vocab 49152, tied embeddings
MATRICES = 2 * 7 + 1
NUM_PARAMETERS = 49152 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 256 + 2 * 64) + 64


@pytest.fixture(scope="module")
def smoke(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench-gpu")
    cmd = [sys.executable, str(BENCHMARKS / "bench_gpu.py"), "--smoke", "--baseline-eager", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, json.loads((out / "bench_gpu.json").read_text()), out


@pytest.fixture
def bench_gpu(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/gpu, importable as the script imports it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gpu")


@pytest.fixture
def gpu_report(bench_gpu: ModuleType) -> ModuleType:
    return importlib.import_module("gpu.report")


def test_smoke_prints_the_table_and_targets(smoke):
    proc, _, out = smoke
    assert "| what | c=1 | c=2 |" in proc.stdout
    for row in ("| served: output tok/s |", "| served: median TPOT ms |", "| served: median TTFT ms |",
                "| served --enforce-eager: output tok/s |", "| served / --enforce-eager, output tok/s |",
                "| floor: eager matvecs on cpu (no CUDA graph), tok/s |", "| served c=1 / floor |"):  # fmt: skip
        assert row in proc.stdout, row
    assert "prefill (served, 2 x 256-token prompts" in proc.stdout
    assert "offline: bench latency pp32" in proc.stdout
    assert "c=256 output tok/s: - tok/s (>= 30,000 tok/s): not measured" in proc.stdout
    assert (out / "bench_gpu.png").read_bytes().startswith(PNG_MAGIC)


def test_smoke_model_and_environment(smoke):
    _, r, _ = smoke
    assert r["errors"] == {}
    assert r["plan"]["name"] == "smoke" and r["plan"]["device"] == "cpu"
    assert r["environment"]["device"] == "cpu" and r["environment"]["torch"]
    assert r["model"]["num_parameters"] == NUM_PARAMETERS
    folder = Path(r["model"]["folder"])
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["vocab_size"] == 49152
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and (folder / "tokenizer.json").is_file()


def test_smoke_floor(smoke):
    _, r, _ = smoke
    f = r["floor"]
    assert f["num_matrices"] == MATRICES
    assert f["weight_bytes"] == r["model"]["matrix_bytes"]  # every matrix once, the tied one once
    assert f["mode"].startswith("eager") and len(f["trials_ms"]) == 5
    assert f["ms_per_step"] > 0 and f["tok_s"] == pytest.approx(1e3 / f["ms_per_step"])
    assert f["gb_s"] == pytest.approx(f["weight_bytes"] / f["ms_per_step"] / 1e6)


def test_smoke_offline(smoke):
    _, r, _ = smoke
    latency, throughput = r["offline"]["latency"], r["offline"]["throughput"]
    assert latency["pp_tok_s"] > 0 and latency["tg_tok_s"] > 0
    assert {t["test"] for t in latency["tests"]} == {"pp32", "tg16"}
    assert latency["command"].startswith("llmserve ") and "--device cpu" in latency["command"]
    assert throughput["num_requests"] == 8 and throughput["total_output_tokens"] == 8 * OUTPUT_LEN
    assert throughput["output_tokens_per_second"] > 0


@pytest.mark.parametrize("variant", ["default", "enforce-eager"])
def test_smoke_served(smoke, variant):
    _, r, _ = smoke
    served = r["served"][variant]
    assert ("--enforce-eager" in served["command"]) == (variant == "enforce-eager")
    assert served["startup_seconds"] > 0
    assert any("KV cache" in line for line in served["startup_log"]), served["startup_log"]
    for c, num_prompts in LEVELS.items():
        level = served["levels"][c]
        assert level["max_concurrency"] == int(c)
        assert level["completed"] == num_prompts and level["failed"] == 0
        assert level["total_output_tokens"] == num_prompts * OUTPUT_LEN  # EOS ignored
        assert level["output_throughput"] > 0 and level["median_tpot_ms"] > 0 and level["median_ttft_ms"] > 0
        assert Path(level["result_file"]).is_file()
    prefill = served["prefill"]
    assert (
        prefill["completed"] == PREFILL_PROMPTS
        and prefill["total_input_tokens"] == PREFILL_PROMPTS * PREFILL_LEN
    )
    assert prefill["prefill_tok_s"] == pytest.approx(prefill["total_input_tokens"] / prefill["duration_s"])


def test_smoke_targets(smoke):
    _, r, _ = smoke
    targets = {t["target"]: t for t in r["targets"]}
    assert len(targets) == 6
    c1 = r["served"]["default"]["levels"]["1"]["output_throughput"]
    assert targets["c=1 output tok/s"]["value"] == c1
    assert targets["c=1 / floor"]["value"] == pytest.approx(c1 / r["floor"]["tok_s"])
    assert targets["c=64 output tok/s"]["met"] is None and targets["c=256 output tok/s"]["met"] is None


def _level(tok_s: float, tpot: float, ttft: float) -> dict[str, float]:
    return {"output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft}


def test_gpu_plan_table_and_targets(gpu_report):
    """The H100 plan's shape: c = 1, 16, 64, 256 as columns; one target met, one missed, per kind."""
    report = {
        "plan": {
            "name": "gpu",
            "dtype": "bfloat16",
            "input_len": 128,
            "output_len": 128,
            "prefill_prompts": 8,
            "prefill_len": 2048,
            "latency_prompt_len": 128,
            "latency_gen_len": 128,
        },
        "environment": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11"},
        "model": {"num_parameters": 1_073_809_408},
        "floor": {
            "mode": "CUDA graph replay of cuBLAS matvecs",
            "tok_s": 867.0,
            "ms_per_step": 1.153,
            "gb_s": 1862.0,
            "num_matrices": 113,
            "weight_bytes": 2**31,
        },
        "served": {
            "default": {
                "levels": {
                    "1": _level(700, 1.4, 8),
                    "16": _level(9000, 1.7, 20),
                    "64": _level(11000, 5, 40),
                    "256": _level(31000, 8, 90),
                },
                "prefill": {"prefill_tok_s": 120_000.0, "median_ttft_ms": 130.0},
            },
            "enforce-eager": {"levels": {"1": _level(350, 2.8, 12)}},
        },
    }
    met = {t["target"]: t["met"] for t in gpu_report.check_targets(report)}
    assert met == {
        "c=1 output tok/s": True,  # 700 >= 650
        "c=1 / floor": True,  # 700 / 867 = 0.81 >= 0.75
        "c=1 median TTFT": True,  # 8 <= 10 ms
        "c=64 output tok/s": False,  # 11,000 < 12,000
        "c=256 output tok/s": True,
        "prefill tok/s (8 x 2,048-token prompts)": True,
    }
    table = gpu_report.format_table(report, (1, 16, 64, 256))
    assert "on NVIDIA H100 80GB HBM3" in table and "1.074B parameters" in table
    assert "| what | c=1 | c=16 | c=64 | c=256 |" in table
    assert "| served: output tok/s | 700.0 | 9,000.0 | 11,000.0 | 31,000.0 |" in table
    assert "| served --enforce-eager: output tok/s | 350.0 | - | - | - |" in table
    assert "| served / --enforce-eager, output tok/s | 2.00x | - | - | - |" in table
    assert "| floor: CUDA graph replay of cuBLAS matvecs, tok/s | 867.0 (1.153 ms) |  |  |  |" in table
    assert "| served c=1 / floor | 0.81 |  |  |  |" in table
    assert "8 x 2048-token prompts, 1 output token): 120,000.0 tok/s" in table


def test_synthetic_tokenizer_fallback(bench_gpu, tmp_path):
    """Without the embedded SmolLM2 (a bare CUDA image), the folder gets a synthetic vocabulary of
    the model's size that llmserve loads and that gives random prompts their exact lengths."""
    from llmserve.bench.datasets import load_bench_tokenizer, random_requests

    model = importlib.import_module("gpu.model")
    plan = importlib.import_module("gpu.plan")
    info = model.build_model(tmp_path, plan.SMOKE_SHAPE, "float32", tokenizer="synthetic")
    assert info["tokenizer"].startswith("synthetic") and not info["reused"]
    assert model.build_model(tmp_path, plan.SMOKE_SHAPE, "float32", tokenizer="synthetic")["reused"]
    tokenizer = load_bench_tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == 49152 and tokenizer.eos_token_id == 2 and not tokenizer.add_bos_token
    requests = random_requests(tokenizer, 4, 128, 8, seed=1, salt="abcd1234")
    assert [len(tokenizer.encode(r.prompt)) for r in requests] == [128] * 4
    assert len({tuple(tokenizer.encode(r.prompt)) for r in requests}) == 4


def test_a_gemma3_shape_builds_a_gemma3_folder(bench_gpu, tmp_path):
    """bench_cpu_scale's `gemma3-1b` size builds through the same code: a Gemma 3 text model of the
    shape (its head width, windows, query scale), which llmserve serves as transformers runs it."""
    import torch
    import transformers

    from gpu import model as bench_model
    from gpu.plan import ModelShape
    from llmserve.config import ModelConfig
    from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
    from llmserve.model_executor.model_loader import load_model

    shape = ModelShape(
        arch="gemma3", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=48, intermediate_size=128, sliding_window=8,
    )  # fmt: skip
    assert shape.spec()["arch"] == "gemma3" and "arch" not in ModelShape().spec()  # Llama folders reused
    bench_model.build_model(tmp_path, shape, "float32", 0, "synthetic")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["head_dim"], config["query_pre_attn_scalar"], config["sliding_window"]) == (48, 48, 8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(ModelConfig(model=str(tmp_path), quantization="none", show_progress=False))
    prompt = list(range(100, 120))
    runner = ForwardRunner(ours.model, num_blocks=8, block_size=4)
    logits = runner.execute([SequenceBatchEntry(prompt, len(prompt), list(range(5)))], all_logits=True)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)

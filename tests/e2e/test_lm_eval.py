"""lm-eval's `local-completions` model against the real server, fully offline.

lm-eval reaches the server three ways, and each is checked here:

    GET  /tokenizer_info   -> {"eos_token", "bos_token", ...}   (remote tokenizer: special tokens)
    POST /tokenize         {"prompt", "add_special_tokens": false} -> {"tokens": [...]}
    POST /detokenize       {"tokens": [...]} -> {"prompt": "..."}
    POST /v1/completions   loglikelihood: {"prompt": [[ids]], "max_tokens": 1, "echo": true,
                           "logprobs": 1, "temperature": 0}; it sums token_logprobs[ctxlen:-1]
                           generation:    {"prompt": [[ids]], "max_tokens", "stop", "temperature": 0}

The tasks (tests/e2e/lmeval_tasks) are local JSONL files: a multiple choice task (loglikelihood)
and a generation task (greedy, cut at stop strings). The CLI runs them at concurrency 1 and 8; the
scores must not change, and the loglikelihoods and generations must match transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

# 0.4.10 added the remote tokenizer; `local-completions` needs the `api` extra (tenacity, aiohttp).
lm_eval = pytest.importorskip(
    "lm_eval", minversion="0.4.10", reason="lm-eval>=0.4.10 is not installed (pip install 'lm-eval[api]')"
)
pytest.importorskip("tenacity", reason="lm-eval's API models need its `api` extra (tenacity)")

TASKS_DIR = Path(__file__).parent / "lmeval_tasks"
TASKS = ("llmserve_tiny_mc", "llmserve_tiny_gen")
CONCURRENCY = (1, 8)
STOP = (".", "\n")  # tiny_gen.yaml's `until`
MAX_GEN_TOKS = 8  # tiny_gen.yaml's `max_gen_toks`


def run_lm_eval(server: ServerProcess, num_concurrent: int, out: Path) -> dict[str, Any]:
    """`lm-eval run --model local-completions` in a subprocess; returns its results and samples.

    A subprocess, because the offline switches are read when `datasets` and `huggingface_hub` are
    imported, and because this is the command a user types. The working directory is the task
    folder: lm-eval hands `data_files` to `datasets`, which resolves them against it.
    """
    model_args = ",".join(
        [
            f"base_url={server.url}/v1/completions",
            f"model={MODEL_NAME}",
            "tokenizer_backend=remote",  # no HF tokenizer download: the server's own endpoints
            f"num_concurrent={num_concurrent}",
            "max_length=256",  # the tiny model's max_model_len
            "max_retries=1",  # a failed request fails the run instead of backing off
        ]
    )
    cmd = [
        sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
        "--model_args", model_args, "--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR),
        "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    offline = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(out / "hf-home"),  # nothing read from or written to the user's caches
        "HF_DATASETS_CACHE": str(out / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        cmd, cwd=TASKS_DIR, env={**os.environ, **offline}, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, f"lm-eval failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    (results_path,) = out.glob("**/results_*.json")
    samples = {}
    for task in TASKS:
        (path,) = out.glob(f"**/samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = {row["doc_id"]: row for row in rows}
    return {"results": json.loads(results_path.read_text()), "samples": samples}


@pytest.fixture(scope="module")
def runs(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return {n: run_lm_eval(server, n, tmp_path_factory.mktemp(f"lm-eval-c{n}")) for n in CONCURRENCY}


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):
    """The transformers model and tokenizer of the served folder: the outside reference."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, tokenizer


def loglikelihoods(row: dict[str, Any]) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) per choice of one logged multiple choice sample."""
    return [(float(ll), is_greedy == "True") for ((ll, is_greedy),) in row["resps"]]


def test_remote_tokenizer_speaks_the_server_endpoints(server: ServerProcess, hf) -> None:
    """lm-eval's own client for /tokenizer_info, /tokenize and /detokenize, against transformers."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    base_url = f"{server.url}/v1/completions"
    # the probe `tokenizer_backend=auto` runs: without it lm-eval falls back to an HF download
    assert check_remote_tokenizer_support(base_url)
    remote = RemoteTokenizer(base_url)
    _, tokenizer = hf
    for text in ["The quick brown fox", " naïve café.", "0123456789", "<|endoftext|>"]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert remote.encode(text) == ids
        assert remote.decode(ids) == text
    dog = tokenizer("dog.", add_special_tokens=False).input_ids
    assert remote.batch_decode([[], dog]) == ["", "dog."]
    assert remote.eos_token == tokenizer.eos_token == "<|endoftext|>"
    assert remote.eos_token_id == tokenizer.eos_token_id
    assert remote.tokenizer_info["chat_template"]  # conftest sets one


def test_tasks_complete_with_identical_scores_at_concurrency_1_and_8(runs: dict[int, dict[str, Any]]) -> None:
    docs = {
        "llmserve_tiny_mc": len((TASKS_DIR / "tiny_mc.jsonl").read_text().splitlines()),
        "llmserve_tiny_gen": len((TASKS_DIR / "tiny_gen.jsonl").read_text().splitlines()),
    }
    for run in runs.values():
        for task, num_docs in docs.items():
            assert run["results"]["n-samples"][task]["effective"] == num_docs
            samples = run["samples"][task]
            assert sorted(samples) == list(range(num_docs)), f"{task}: a doc has no logged sample"
            for row in samples.values():
                assert len(row["resps"]) == len(row["arguments"]), f"{task}: a request got no response"
        for row in run["samples"]["llmserve_tiny_mc"].values():
            assert all(ll < 0 for ll, _ in loglikelihoods(row))

    serial, concurrent = runs[1], runs[8]
    for task in TASKS:
        metrics = {k: v for k, v in serial["results"]["results"][task].items() if "," in k}
        assert metrics  # acc,none / exact_match,none and their stderr
        assert metrics == {k: concurrent["results"]["results"][task][k] for k in metrics}
    for doc_id, row in serial["samples"]["llmserve_tiny_gen"].items():
        assert row["resps"] == concurrent["samples"]["llmserve_tiny_gen"][doc_id]["resps"]
    # Not bitwise: at concurrency 8 the prompts share forward passes with others, and a float32
    # matmul over more rows may block its sums differently (about 1e-7 relative on CPU).
    for doc_id, row in serial["samples"]["llmserve_tiny_mc"].items():
        other = loglikelihoods(concurrent["samples"]["llmserve_tiny_mc"][doc_id])
        for (ll, greedy), (ll8, greedy8) in zip(loglikelihoods(row), other, strict=True):
            assert ll8 == pytest.approx(ll, rel=1e-5, abs=1e-5)
            assert greedy8 == greedy


def test_loglikelihoods_match_transformers(runs: dict[int, dict[str, Any]], hf) -> None:
    """Every choice's loglikelihood, split into context and continuation as lm-eval splits it."""
    import torch

    model, tokenizer = hf
    for row in runs[1]["samples"]["llmserve_tiny_mc"].values():
        args = list(row["arguments"].values())
        for arg, (ll, is_greedy) in zip(args, loglikelihoods(row), strict=True):
            context, continuation = arg["arg_0"], arg["arg_1"]
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            num_context = len(tokenizer(context, add_special_tokens=False).input_ids)
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].double()  # [T, V]
            # position t predicts token t + 1
            logprobs = torch.log_softmax(logits[num_context - 1 : -1], dim=-1)
            target = torch.tensor(whole[num_context:])
            ref = logprobs.gather(-1, target[:, None]).sum().item()
            assert ll == pytest.approx(ref, abs=1e-3), (context, continuation)
            assert is_greedy == bool((logprobs.argmax(-1) == target).all())


def test_generations_match_transformers_greedy(runs: dict[int, dict[str, Any]], hf) -> None:
    import torch

    model, tokenizer = hf
    eos = {tokenizer.eos_token_id, model.generation_config.eos_token_id}
    for row in runs[1]["samples"]["llmserve_tiny_gen"].values():
        ids = tokenizer(row["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False).input_ids
        out: list[int] = []
        for _ in range(MAX_GEN_TOKS):
            with torch.no_grad():
                token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if token in eos:
                break
            out.append(token)
        text = tokenizer.decode(out)
        for stop in STOP:
            text = text.split(stop)[0]
        assert row["resps"] == [[text]]

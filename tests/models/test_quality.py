"""`llmserve eval perplexity` and `llmserve.bench.quality.evaluate`: perplexity against the one
transformers computes on the same chunks, the KL divergence's edge cases (a model against itself,
a quantized model against its float self), llama-perplexity's chunking, bad values, and the CLI
end to end with its JSON report."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from llmserve.bench.quality import evaluate
from llmserve.config import ModelConfig
from llmserve.layers.attention import KVDtypes
from llmserve.layers.quantization import cpu_kernels
from llmserve.model_executor.model_loader import load_model
from tests.models.tiny import make_tiny_model

N_CTX = 32
TEXT_IDS = [
    int(x) for x in torch.randint(1, 512, (3 * N_CTX + 7,), generator=torch.Generator().manual_seed(7))
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quality-llama")
    hf = make_tiny_model("llama", folder)
    return folder, hf


def _load(folder, **kw):
    return load_model(ModelConfig(model=str(folder), show_progress=False, **kw))


def hf_scored_nll(hf, ids: list[int], n_ctx: int) -> torch.Tensor:
    """llama-perplexity's scoring with transformers' logits: each full chunk on its own, positions
    n_ctx/2 .. n_ctx-2 predicting the next token."""
    first, out = n_ctx // 2, []
    for c in range(len(ids) // n_ctx):
        chunk = torch.tensor(ids[c * n_ctx : (c + 1) * n_ctx])
        with torch.no_grad():
            logits = hf(chunk[None]).logits[0].double()
        logp = torch.log_softmax(logits[first:-1], dim=-1)
        out.append(-logp.gather(1, chunk[first + 1 :, None])[:, 0])
    return torch.cat(out)


def test_perplexity_matches_transformers_on_the_same_chunks(tiny):
    folder, hf = tiny
    result = evaluate(_load(folder, quantization="none"), TEXT_IDS, N_CTX)
    nll = hf_scored_nll(hf, TEXT_IDS, N_CTX)
    assert result.num_chunks == 3  # the 7-token remainder is dropped
    assert result.num_scored == nll.numel() == 3 * (N_CTX // 2 - 1)
    assert result.ppl == pytest.approx(math.exp(float(nll.mean())), rel=1e-4)
    assert result.kld is None and "KLD" not in result.summary()


def test_a_model_against_itself_has_zero_divergence(tiny):
    model = _load(tiny[0], quantization="none")
    result = evaluate(model, TEXT_IDS, N_CTX, reference=model)
    assert result.kld == pytest.approx(0.0, abs=1e-9)
    assert result.top1 == 1.0
    assert result.ref_ppl == pytest.approx(result.ppl, rel=1e-9)


def test_quantized_divergence_is_small_and_ordered_by_bits(tiny):
    """int4 rounds weights 16x coarser than int8: its KLD from the float model must be larger,
    and both positive (the quantized path really ran)."""
    reference = _load(tiny[0], quantization="none")
    int8 = evaluate(_load(tiny[0], quantization="int8"), TEXT_IDS, N_CTX, reference=reference)
    int4 = evaluate(_load(tiny[0], quantization="int4"), TEXT_IDS, N_CTX, reference=reference)
    assert 0 < int8.kld < int4.kld < 0.5
    assert int8.top1 >= 0.9
    assert int8.ref_ppl == pytest.approx(int4.ref_ppl)
    assert int8.kld_p99 >= int8.kld


@pytest.mark.skipif(cpu_kernels.best_kernels() != "avx512_vnni", reason="int8 activations need AVX-512 VNNI")
def test_int8_activations_cost_divergence(tiny):
    """`cpu_activations="int8"` (llama.cpp's rounding) moves the int4 model further from the float
    one than int16 does; `auto` (the default) is int16, the float model's answers; `eval perplexity`
    takes the flag."""
    reference = _load(tiny[0], quantization="none")
    int16 = evaluate(
        _load(tiny[0], quantization="int4", cpu_activations="int16"), TEXT_IDS, N_CTX, reference=reference
    )
    auto = evaluate(_load(tiny[0], quantization="int4"), TEXT_IDS, N_CTX, reference=reference)
    int8 = evaluate(
        _load(tiny[0], quantization="int4", cpu_activations="int8"), TEXT_IDS, N_CTX, reference=reference
    )
    assert 0 < int16.kld < int8.kld < 0.5
    assert auto.kld == int16.kld


@pytest.mark.parametrize("kv_cache_dtype", [torch.int8, KVDtypes(torch.int8, torch.float16)])
def test_int8_kv_cache_is_measured_too(tiny, kv_cache_dtype):
    model = _load(tiny[0], quantization="none")
    result = evaluate(model, TEXT_IDS, N_CTX, reference=model, kv_cache_dtype=kv_cache_dtype)
    assert 0 < result.kld < 0.05  # only the cache is rounded


@pytest.mark.parametrize(
    ("ids", "n_ctx", "match"),
    [(TEXT_IDS, 3, "n_ctx must be between 4"), (TEXT_IDS, 10**6, "n_ctx must be between"),
     (TEXT_IDS[:20], N_CTX, "fewer than one chunk")],
)  # fmt: skip
def test_bad_values_are_refused(tiny, ids, n_ctx, match):
    with pytest.raises(ValueError, match=match):
        evaluate(_load(tiny[0], quantization="none"), ids, n_ctx)


def test_cli_writes_its_report(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    report = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "llmserve.cli.main", "eval", "perplexity", "--model", str(tiny[0]),
           "--quantization", "int8", "--kv-cache-dtype", "q8_0,f16", "--cpu-activations", "int8", "--text", str(text), "--ctx", "64",
           "--json", str(report)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "PPL" in run.stdout and "mean KLD" in run.stdout
    data = json.loads(report.read_text())
    assert (
        data["quantization"] == "int8" and data["kv_cache_dtype"] == "int8,float16"
    )  # llama.cpp's names read
    assert data["n_ctx"] == 64 and data["text_tokens"] >= 64
    assert data["kld"] > 0 and data["ppl"] > 1
    assert "warning" not in run.stderr  # the tiny tokenizer knows these words


def test_a_text_the_tokenizer_does_not_know_is_named():
    """Most of the text one id (a word-level vocabulary's unknown token for English text: every
    logit then comes from the same row) is warned about; ordinary text is not."""
    from llmserve.cli.eval import repeated_id_warning

    assert repeated_id_warning([0] * 60 + list(range(1, 41))) is not None
    assert "token id 0 is 60 of the text's 100 tokens" in repeated_id_warning([0] * 60 + [1] * 40)
    assert repeated_id_warning(list(range(100))) is None and repeated_id_warning([]) is None
    assert repeated_id_warning([5] * 50 + list(range(100, 150))) is None  # half is not more than half

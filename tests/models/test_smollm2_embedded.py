"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32) against
llama.cpp's greedy continuations computed with the same float32 weights."""

from __future__ import annotations

import pytest
import torch

from llmserve.model_executor.greedy import generate_greedy
from llmserve.model_executor.model_runner import ModelRunner


def _f32_cases(reference: dict) -> list[dict]:
    return [g for g in reference["greedy"] if g["weights"] == "f32"]


def test_embedded_model_config(smollm2):
    c = smollm2.hf_config
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert c.vocab_size == 49152 and c.tie_word_embeddings
    assert 134e6 < smollm2.num_params < 135e6
    assert "Q4_1" in smollm2.checkpoint_format


@pytest.mark.parametrize(
    "batched,kv_cache_dtype",
    [(False, torch.float32), (True, torch.float32), (True, torch.float16)],
    ids=["alone", "batched", "batched-f16-kv"],
)
def test_greedy_matches_llamacpp_f32(smollm2, llamacpp_reference, batched, kv_cache_dtype):
    """float16 K/V is also what llama.cpp's own cache holds by default."""
    cases = _f32_cases(llamacpp_reference)
    assert len(cases) == 5
    eos = frozenset({llamacpp_reference_eos(smollm2)})
    runner = ModelRunner(smollm2.model, num_blocks=64, block_size=16, kv_cache_dtype=kv_cache_dtype)
    assert runner.kv_caches[0].dtype == kv_cache_dtype
    prompts = [c["prompt_ids"] for c in cases]
    if batched:
        outputs = generate_greedy(runner, prompts, 32, stop_token_ids=eos)
    else:
        outputs = [generate_greedy(runner, [p], 32, stop_token_ids=eos)[0] for p in prompts]
    for case, out in zip(cases, outputs, strict=True):
        assert out == case["greedy_ids"], f"prompt {case['prompt']!r}"


def llamacpp_reference_eos(loaded) -> int:
    return int(loaded.hf_config.eos_token_id)


def test_kv_cache_size_per_token(smollm2):
    """2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes."""
    runner = ModelRunner(smollm2.model, num_blocks=2, block_size=16)
    assert runner.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4
    assert runner.kv_caches[0].shape == (2, 3, 2, 16, 64) and len(runner.kv_caches) == 30

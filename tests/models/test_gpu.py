"""The same parity checks on CUDA, in the GPU dtypes (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from llmserve.config import ModelConfig
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from tests.models.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPT = [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_logits_match_transformers(tmp_path, arch, dtype):
    hf = make_tiny_model(arch, tmp_path)
    ours = load_model(ModelConfig(model=str(tmp_path), device="cuda", dtype=dtype, show_progress=False))
    assert ours.device.type == "cuda" and str(ours.dtype) == f"torch.{dtype}"
    runner = ForwardRunner(ours.model, num_blocks=8, block_size=4)
    logits = runner.execute([SequenceBatchEntry(PROMPT, len(PROMPT), list(range(5)))], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    tol = 1e-3 if dtype == "float32" else 0.15
    torch.testing.assert_close(logits.float().cpu(), ref, rtol=tol, atol=tol)

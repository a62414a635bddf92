"""Shared test fixtures: the reference vectors in ../shared/testdata and the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTDATA = REPO.parent / "shared" / "testdata" / "smollm2-135m-llamacpp.json"


@pytest.fixture(scope="session")
def llamacpp_reference() -> dict:
    """llama.cpp's token ids and greedy continuations for the embedded SmolLM2 model."""
    if not TESTDATA.is_file():
        pytest.fail(f"reference vectors missing: {TESTDATA} (the repo expects ../shared beside it)")
    return json.loads(TESTDATA.read_text())


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model on the float path (its Q4_1 weights dequantized to float32),
    loaded once per test session."""
    from llmserve.config import ModelConfig
    from llmserve.model_executor.model_loader import load_model

    return load_model(ModelConfig(quantization="none", show_progress=False))


@pytest.fixture(scope="session")
def smollm2_quantized():
    """The embedded default model with its Q4_1 blocks kept (quantization auto), activations
    rounded to int16 per token: the float model's results within rounding, on any CPU (the
    default, `auto`, takes int8 activations where the CPU has AVX-512 VNNI)."""
    from llmserve.config import ModelConfig
    from llmserve.model_executor.model_loader import load_model

    return load_model(ModelConfig(cpu_activations="int16", show_progress=False))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only where CUDA is available (CI has none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

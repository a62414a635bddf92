"""Shared test fixtures: the reference vectors in ../shared/testdata and the embedded model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Triton decides at `@triton.jit` time whether a kernel runs under its interpreter, from
# TRITON_INTERPRET as it is then. Without CUDA the kernel tests set it before importing llmserve's
# kernels, but a test module collected earlier that imports triton (peft does) would have fixed
# the mode first: so it is set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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

"""Fixtures of the unit tests of the quantized CPU kernels (test_quantization.py, test_q6.py)."""

from __future__ import annotations

import pytest

from llmserve.layers.quantization import cpu_kernels

# Every kernel set this machine runs, best first; "torch" is the fallback that runs anywhere.
_ORDER = ["avx512_vnni", "avx2", "torch"]
KERNEL_SETS = _ORDER[_ORDER.index(cpu_kernels.best_kernels()) :]


@pytest.fixture(params=KERNEL_SETS)
def kernels(request):
    cpu_kernels.set_kernels(request.param)
    yield request.param
    cpu_kernels.set_kernels("auto")

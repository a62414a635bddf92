"""keep_freed_memory: glibc's mallopt applied once, and the opt-out; back_with_huge_pages: a
tensor's whole 2 MiB extents advised into transparent huge pages, its bytes and address kept, and
the fused decoder's runner doing it for the model's packed weights."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import pytest
import torch

from llmserve.config import ModelConfig
from llmserve.layers.quantization.layers import packed_weights
from llmserve.model_executor import cpu_memory, forward_runner
from llmserve.model_executor.model_loader import load_model
from tests.models.tiny import make_tiny_model


def _glibc() -> bool:
    try:
        return sys.platform == "linux" and hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


def test_opt_out_leaves_glibc_alone(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_applied", False)
    monkeypatch.setenv("LLMSERVE_KEEP_FREED_MEMORY", "0")
    assert cpu_memory.keep_freed_memory() is False
    assert cpu_memory._applied is False


@pytest.mark.skipif(not _glibc(), reason="needs glibc on Linux")
def test_applies_on_glibc_once(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_applied", False)
    monkeypatch.delenv("LLMSERVE_KEEP_FREED_MEMORY", raising=False)
    assert cpu_memory.keep_freed_memory() is True
    assert cpu_memory._applied is True
    assert cpu_memory.keep_freed_memory() is True  # idempotent


def _thp_on() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform == "linux" and path.exists() and "[never]" not in path.read_text()


def _anon_huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


def test_huge_pages_keep_the_bytes_and_the_address(monkeypatch):
    monkeypatch.delenv("LLMSERVE_HUGE_PAGES", raising=False)
    t = torch.randint(-128, 128, (9 << 20,), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    before, ptr = t.clone(), t.data_ptr()
    collapsed = cpu_memory.back_with_huge_pages([t, t])  # a tensor named twice is advised once
    assert t.data_ptr() == ptr and torch.equal(t, before)
    HUGE = cpu_memory.HUGE_PAGE
    assert collapsed % HUGE == 0 and collapsed <= t.numel() // HUGE * HUGE
    if collapsed:  # the kernel took them (THP on, Linux 6.1+): the process now holds huge pages
        assert _anon_huge_kib() * 1024 >= collapsed
    elif _thp_on():
        pytest.skip("this kernel does not collapse on request (MADV_COLLAPSE: Linux 6.1+)")


def test_huge_pages_opt_out_and_small_tensors(monkeypatch):
    t = torch.zeros(8 << 20, dtype=torch.uint8)
    monkeypatch.setenv("LLMSERVE_HUGE_PAGES", "0")
    assert cpu_memory.back_with_huge_pages([t]) == 0
    monkeypatch.delenv("LLMSERVE_HUGE_PAGES")
    assert cpu_memory.back_with_huge_pages([torch.zeros(1000)]) == 0  # no whole huge page inside


def test_the_runner_advises_the_packed_weights(monkeypatch, tmp_path):
    """A tiny Llama quantized at load (int4: q4 packs): the runner hands every packed matrix's
    data to back_with_huge_pages."""
    make_tiny_model("llama", tmp_path)
    model = load_model(ModelConfig(model=str(tmp_path), quantization="int4", show_progress=False)).model
    seen: list[int] = []
    monkeypatch.setattr(
        forward_runner, "back_with_huge_pages", lambda ts: seen.extend(t.data_ptr() for t in ts)
    )
    forward_runner.ForwardRunner(model, num_blocks=4)
    want = [w.data.data_ptr() for w in packed_weights(model)]
    assert len(want) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate_up, down; the LM head
    assert seen == want

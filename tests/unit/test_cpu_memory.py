"""keep_freed_memory: glibc's mallopt applied once, and the opt-out."""

from __future__ import annotations

import ctypes
import sys

import pytest

from llmserve.model_executor import cpu_memory


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

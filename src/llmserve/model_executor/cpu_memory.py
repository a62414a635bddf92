"""Host memory on Linux/glibc: freed activation memory kept in the process, so the next step
reuses it; the quantized weights held in transparent huge pages.

Every forward allocates activations from ~100 KB to tens of MB and frees them by the end of the
step. glibc serves blocks above its mmap threshold with fresh pages from the kernel and gives
freed memory at the top of the heap back (trims it); the next step's buffer of the same size then
pays a page fault per 4 KiB page on first touch. At decode batch 64 on the embedded model that
was ~17% of the step (benchmarks/bench_malloc.py, docs/benchmarks.md); tcmalloc/jemalloc, which
CPU inference servers often preload for this reason, keep freed memory by default.

`keep_freed_memory()` raises the mmap threshold to glibc's maximum (32 MiB) and stops trimming,
through `mallopt`. The process's resident memory then stays at its peak working set instead of
shrinking between steps. Set LLMSERVE_KEEP_FREED_MEMORY=0 to leave glibc's defaults.

`back_with_huge_pages(tensors)` asks the kernel to hold the tensors' whole 2 MiB extents as
transparent huge pages (madvise MADV_HUGEPAGE, then MADV_COLLAPSE, Linux 6.1+, which does it at
once instead of waiting for khugepaged). A decode step streams every weight once; in 4 KiB pages
that is a TLB miss (a page walk, two-level in a VM) and a restart of the hardware prefetcher every
4 KiB. Where THP is `madvise` (the common default) nothing else gives them huge pages. Measured on a
1B Llama's q4k matrices, one thread, alternating in one process: batch 1 0.84-0.89x the time,
batch 16 0.93-0.95x; whole decode steps 0.90-0.97x at batch 1, 0.97-1.00x at 16
(bench_step_gguf.py --huge-pages-ab, docs/benchmarks.md). The bytes and the addresses stay as
they are (the fused decoder's pointers too); a refusal (no THP, an older kernel) leaves them in
small pages. Set LLMSERVE_HUGE_PAGES=0 to leave them alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger("llmserve")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only above 2 GiB of free heap top

_applied = False


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in effect (glibc on Linux, not
    switched off by LLMSERVE_KEEP_FREED_MEMORY=0)."""
    global _applied
    if _applied:
        return True
    if sys.platform != "linux" or os.environ.get("LLMSERVE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        logger.debug("mallopt refused the allocator settings; glibc's defaults stay")
        return False
    _applied = True
    logger.info("glibc malloc: freed memory stays in the process (mmap threshold 32 MiB, no trimming)")
    return True


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Advise the whole 2 MiB extents inside each CPU tensor's memory (each distinct tensor once)
    into transparent huge pages; returns the bytes the kernel collapsed at once (0: none, e.g. THP
    off, not Linux, or switched off by LLMSERVE_HUGE_PAGES=0)."""
    if sys.platform != "linux" or os.environ.get("LLMSERVE_HUGE_PAGES", "1") == "0":
        return 0
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return 0
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    collapsed, seen = 0, set()
    for t in tensors:
        if t.device.type != "cpu" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the first whole huge page
        end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        madvise(start, end - start, _MADV_HUGEPAGE)
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed += end - start
    if collapsed:
        logger.info("weights: %.0f MiB in transparent huge pages", collapsed / 2**20)
    return collapsed

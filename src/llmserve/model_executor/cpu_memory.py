"""Keep freed activation memory in the process on Linux/glibc, so the next step reuses it.

Every forward allocates activations from ~100 KB to tens of MB and frees them by the end of the
step. glibc serves blocks above its mmap threshold with fresh pages from the kernel and gives
freed memory at the top of the heap back (trims it); the next step's buffer of the same size then
pays a page fault per 4 KiB page on first touch. At decode batch 64 on the embedded model that
was ~17% of the step (benchmarks/bench_malloc.py, docs/benchmarks.md); tcmalloc/jemalloc, which
CPU inference servers often preload for this reason, keep freed memory by default.

`keep_freed_memory()` raises the mmap threshold to glibc's maximum (32 MiB) and stops trimming,
through `mallopt`. The process's resident memory then stays at its peak working set instead of
shrinking between steps. Set LLMSERVE_KEEP_FREED_MEMORY=0 to leave glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

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

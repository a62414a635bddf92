"""numba compilation settings shared by llmserve's CPU kernels (attention, fused norms)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numba
import torch

# IEEE-safe fast math: reassociation lets LLVM vectorise the dot products and sums; no
# "no-NaN/no-Inf" assumptions, so a bad input still shows up as NaN instead of garbage.
FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}


def jit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """numba.njit with an on-disk cache beside the calling module (compiling takes seconds,
    loading the cache a few hundred ms), or without one where no cache location is writable."""

    def wrap(fn: Callable[..., Any]) -> Any:
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # numba found no writable cache directory
            return numba.njit(**options)(fn)

    return wrap


def limit_threads(n: int) -> bool:
    """Make numba's thread pool `n` threads when it starts (at the first parallel kernel);
    False when it already runs with more. A tensor-parallel rank needs this: numba's default pool
    has a thread per core, and its OpenMP threads spin while idle, so on a 2-core machine two
    ranks of one thread each had four busy threads and decode steps were 20x slower (3 s instead
    of 0.1 s on a 30-layer model; `numba.set_num_threads` limits the work, not the pool)."""
    from numba.np.ufunc import parallel

    if not parallel._is_initialized:
        # numba reads the pool's size from NUMBA_NUM_THREADS once, at import, into both places;
        # the launch (lazy) uses the module's copy, the range checks of set_num_threads the config
        numba.config.NUMBA_NUM_THREADS = n
        parallel.NUM_THREADS = n
    return n >= parallel.NUM_THREADS


@contextmanager
def keep_torch_threads() -> Iterator[None]:
    """Run a block that may start numba's thread pool (its first parallel kernel) without it
    changing the process's thread count: the pool is made no larger than torch's intra-op threads,
    and those are set back afterwards. numba's OpenMP layer, starting, sets the calling thread's
    OpenMP thread count to the pool's size, and torch and the fused C++ decoder run on the same
    libgomp: `OMP_NUM_THREADS=1` or `torch.set_num_threads(1)` before an engine loaded became 2
    threads on a 2-core machine (one-thread benchmarks timed the main thread of two, its barrier
    waits included; docs/benchmarks.md, the burst TTFT section)."""
    n = torch.get_num_threads()
    limit_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(n)

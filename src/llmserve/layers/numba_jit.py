"""numba compilation settings shared by llmserve's CPU kernels (attention, fused norms)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba

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

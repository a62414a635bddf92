"""Token bitmasks: bit t of a row is 1 when token t may be sampled next.

    mask [B, W] int32, W = ceil(vocab / 32):  word w, bit b  <->  token 32 w + b

Applying a mask writes -inf into the forbidden logits. torch's `masked_fill_` over a [16, 49k]
batch takes ~1.5 ms on this project's CPU, as long as a batch-16 step's every other sampling op;
the numba loop below skips all-allowed words (most of a JSON string's) and takes a fraction of that.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.layers.numba_jit import jit


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@jit()
def _fill_forbidden(logits: np.ndarray, mask: np.ndarray) -> None:  # pragma: no cover (compiled)
    B, V = logits.shape
    for i in range(B):
        for w in range(mask.shape[1]):
            word = mask[i, w]
            if word == -1:  # all 32 allowed
                continue
            base = 32 * w
            for b in range(32):
                t = base + b
                if t < V and (word >> b) & 1 == 0:
                    logits[i, t] = -np.inf


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device: staged in pinned memory
    and copied asynchronously on CUDA (a copy from pageable memory would wait for the forward
    pass queued before it)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Set logits[i, t] = -inf wherever bit t of mask[i] is 0 (in place). logits [B, V], mask
    [B, W] int32 on the CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        _fill_forbidden(logits.numpy(), mask.numpy())
        return
    B, V = logits.shape
    # the compact mask goes to the device, and is expanded to [B, V] there
    words = to_device_async(mask, logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(B, -1)[:, :V]  # [B, 32 W] -> [B, V]
    logits.masked_fill_(allowed == 0, float("-inf"))

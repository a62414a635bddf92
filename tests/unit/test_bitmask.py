"""`apply_bitmask`: the numba loop (float32 on the CPU) and the torch path that every other dtype
and device takes (the compact mask copied to the device, expanded there) forbid the same tokens."""

from __future__ import annotations

import torch

from llmserve.structured_output import apply_bitmask, bitmask_words


def test_torch_path_forbids_what_the_numba_loop_forbids() -> None:
    g = torch.Generator().manual_seed(0)
    B, V = 5, 1000  # V not a multiple of 32: the last word's high bits are past the vocabulary
    mask = torch.randint(-(2**31), 2**31 - 1, (B, bitmask_words(V)), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[0] = -1  # a row with everything allowed
    logits = torch.randn(B, V, generator=g)
    fast = logits.clone()
    apply_bitmask(fast, mask)
    other = logits.to(torch.bfloat16)  # not float32: the torch path
    apply_bitmask(other, mask)
    assert torch.equal(fast.isinf(), other.isinf())
    assert not fast[0].isinf().any() and fast.isinf().any()
    bit = (mask[1, 3] >> 7) & 1  # token 3 * 32 + 7
    assert bool(fast[1, 103].isinf()) == (bit == 0)

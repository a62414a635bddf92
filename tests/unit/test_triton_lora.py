"""The LoRA Triton kernels (lora/triton_lora.py) against the torch path they replace (layers.py's
masked matmul pair) and a per-row loop: rows of three adapters of different ranks, base rows, and
an adapter without the layer, in float32 and float16. Without CUDA they run under Triton's
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from llmserve.lora.adapter import LayerLoRA, LoRAAdapter
from llmserve.lora.layers import LoRABatch, LoRALinear, LoRAStep

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IN, OUT = 48, 200  # OUT not a multiple of the kernel's 128-column block


def make_adapter(lora_id: int, rank: int | None, dtype: torch.dtype) -> LoRAAdapter:
    """rank None: the adapter leaves the layer alone."""
    layers = {}
    if rank is not None:
        a_t = torch.randn(IN, rank, device=DEVICE).to(dtype)
        b_t = (torch.randn(rank, OUT, device=DEVICE) * 0.1).to(dtype)
        layers["proj"] = LayerLoRA(a_t, b_t)
    return LoRAAdapter(lora_id, f"a{lora_id}", rank or 1, 1.0, layers)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("every_row", [False, True])
def test_kernels_equal_the_torch_path(dtype, tol, every_row):
    torch.manual_seed(0)
    adapters = (make_adapter(1, 8, dtype), make_adapter(2, None, dtype), make_adapter(3, 16, dtype),
                make_adapter(4, 72, dtype))  # fmt: skip
    slots = [0] * 11 if every_row else [0, 2, -1, 3, 1, 0, 3, -1, 2, 2, 0]
    row_slots = None if every_row else torch.tensor(slots, device=DEVICE)
    if every_row:  # one adapter for every row: no row slots
        adapters = adapters[:1]
    x = torch.randn(len(slots), IN, device=DEVICE).to(dtype)
    base = torch.nn.Linear(IN, OUT, device=DEVICE, dtype=dtype)
    outs = {}
    for use_triton in (False, True):
        step = LoRAStep(use_triton=use_triton)
        layer = LoRALinear(base, "proj", step)  # type: ignore[arg-type]
        step.batch = LoRABatch(adapters, row_slots)
        with torch.no_grad():
            outs[use_triton] = layer(x).float()
    with torch.no_grad():
        expected = base(x).float()
    for t, slot in enumerate(slots):
        lora = adapters[slot].layers.get("proj") if slot >= 0 else None
        if lora is not None:
            expected[t] += (x[t].float() @ lora.a_t.float()) @ lora.b_t.float()
    torch.testing.assert_close(outs[False], expected, rtol=tol, atol=tol)
    torch.testing.assert_close(outs[True], expected, rtol=tol, atol=tol)
    base_rows = [t for t, s in enumerate(slots) if s in (-1, 1)]
    assert torch.equal(outs[True][base_rows], base(x).float()[base_rows])  # base rows untouched
